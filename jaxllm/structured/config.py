"""``--structured-outputs-config``: the engine-wide structured-output settings (vLLM's
``StructuredOutputsConfig`` names).  Kept apart from the grammar code so that the engine
configuration does not import the grammar engine."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, fields, replace

log = logging.getLogger("jaxllm.structured")

BACKENDS = ("auto", "guidance")
"""Grammar backends this engine has: llguidance (``auto`` picks it).  vLLM's ``xgrammar``,
``outlines`` and ``lm-format-enforcer`` are refused by name."""


@dataclass(frozen=True)
class StructuredOutputsConfig:
    backend: str = "auto"
    """``auto`` or ``guidance`` (llguidance)."""
    disable_any_whitespace: bool = True
    """JSON grammars allow no whitespace between tokens (compact output), the default: sampled
    outputs of a small model complete within ``max_tokens`` more often than with flexible
    whitespace (bench/structured_whitespace.py, docs/BENCHMARKS.md).  ``False``: any run of
    whitespace between tokens (vLLM's default); a request's own ``disable_any_whitespace``
    then makes it compact."""
    disable_additional_properties: bool = False
    """JSON schemas that do not say otherwise get ``additionalProperties: false``."""
    enable_in_reasoning: bool = False
    """With reasoning end tokens set on the engine, apply the grammar from the first output
    token instead of after the reasoning ends."""
    reasoning_end_token_ids: tuple[int, ...] = ()
    """Token ids that end a reasoning section (``</think>``); until one is in the request's
    prompt or output a constrained request is not masked (unless ``enable_in_reasoning``).
    Empty: no reasoning."""
    reasoning_end_tag: str = ""
    """The same as text (``jaxllm serve --reasoning-parser`` sets its parser's end tag): the
    engine adds the tag's token id to ``reasoning_end_token_ids`` when the tokenizer has it
    as one token, and says so when it does not."""
    cache_size: int = 256
    """Compiled grammars kept (least recently used dropped), shared by all requests."""

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise ValueError(f"--structured-outputs-config: backend {self.backend!r} is not available here; "
                             f"expected one of {', '.join(BACKENDS)} (xgrammar needs torch, which jaxllm does "
                             f"not use)")
        for name in ("disable_any_whitespace", "disable_additional_properties", "enable_in_reasoning"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"--structured-outputs-config: {name} must be true or false")
        ids = self.reasoning_end_token_ids
        if not isinstance(ids, (list, tuple)) or any(not isinstance(t, int) or isinstance(t, bool) or t < 0
                                                      for t in ids):
            raise ValueError("--structured-outputs-config: reasoning_end_token_ids must be a list of token ids")
        object.__setattr__(self, "reasoning_end_token_ids", tuple(ids))
        if not isinstance(self.reasoning_end_tag, str):
            raise ValueError("--structured-outputs-config: reasoning_end_tag must be a string")
        if not isinstance(self.cache_size, int) or self.cache_size < 1:
            raise ValueError("--structured-outputs-config: cache_size must be a positive integer")

    @classmethod
    def parse(cls, value) -> "StructuredOutputsConfig":
        """A config from itself, a dict or JSON text (the CLI flag); unknown keys are refused."""
        if isinstance(value, cls):
            return value
        if value is None:
            return cls()
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"--structured-outputs-config: not valid JSON ({e})") from None
        if not isinstance(value, dict):
            raise ValueError("--structured-outputs-config must be a JSON object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"--structured-outputs-config: unknown key(s) {unknown}; known: {sorted(known)}")
        return cls(**value)

    def with_tag_resolved(self, tokenizer) -> "StructuredOutputsConfig":
        """``reasoning_end_tag`` turned into its token id, added to ``reasoning_end_token_ids``."""
        if not self.reasoning_end_tag or tokenizer is None:
            return self
        vocab = tokenizer.get_vocab()
        tag = self.reasoning_end_tag
        if tag not in vocab:
            log.warning("reasoning end tag %r is not one token of this tokenizer: structured outputs apply from "
                        "the first output token", tag)
            return replace(self, reasoning_end_tag="")
        ids = tuple(dict.fromkeys((*self.reasoning_end_token_ids, int(vocab[tag]))))
        return replace(self, reasoning_end_token_ids=ids, reasoning_end_tag="")
