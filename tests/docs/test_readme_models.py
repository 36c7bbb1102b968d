"""The README's model table names exactly the architectures the registry serves, and says
GGUF only where the loader maps a GGUF architecture; the converted decoder names (pooling) map
onto registered causal ones."""

from __future__ import annotations

import os
import re

from jaxllm.models.registry import gguf_hf_architectures, supported_architectures
from jaxllm.pooling.decoder import causal_name, is_causal

README = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "README.md")


def test_readme_model_table_is_the_registry():
    text = open(README, encoding="utf-8").read()
    section = text[text.index("## Models"):]
    section = section[:section.index("\n## ", 1)]
    arch_name = r"`(\w+(?:ForCausalLM|ForConditionalGeneration|Model|ForMaskedLM|ForSequenceClassification))`"  # + VLMs
    rows = [ln for ln in section.splitlines() if ln.startswith("|") and re.search(arch_name, ln)]
    named, with_gguf = set(), set()
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        archs = set(re.findall(arch_name, cells[1]))
        named |= archs
        if cells[2] == "yes":
            with_gguf |= archs
    # The pooling runner's converted names (a causal family's `*ForSequenceClassification` and base
    # `*Model`, pooling/decoder.py) are not registry entries: each must map onto a causal one.
    registered = set(supported_architectures())
    converted = {a for a in named - registered if is_causal(a) and causal_name(a) in registered}
    assert named - converted == registered
    assert with_gguf == gguf_hf_architectures()
