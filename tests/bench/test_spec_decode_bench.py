"""``jaxllm bench spec-decode``'s draft checkpoint: the first layers of a GGUF, cut by
``truncated_gguf``, are a checkpoint jaxllm loads and a draft whose speculation returns plain
decoding's tokens."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from bench.spec_decode import truncated_gguf
from support.engines import SMALL_ENGINE
from support.tiny_models import write_gguf


def test_a_truncated_gguf_is_the_first_layers_and_drafts_exactly(tiny_llama, tmp_path):
    from jaxllm import LLM, SamplingParams
    from jaxllm.models.loader import load_model
    src = str(tmp_path / "target.gguf")
    write_gguf(tiny_llama, src)
    r = gguf.GGUFReader(src)
    layers = r.fields["llama.block_count"].contents()
    assert layers >= 2
    dst = truncated_gguf(src, 1, str(tmp_path / "draft.gguf"))
    t = gguf.GGUFReader(dst)
    assert t.fields["llama.block_count"].contents() == 1
    want = {x.name: x for x in r.tensors if not x.name.startswith("blk.") or x.name.startswith("blk.0.")}
    assert sorted(x.name for x in t.tensors) == sorted(want)
    for x in t.tensors:
        assert x.tensor_type == want[x.name].tensor_type
        np.testing.assert_array_equal(x.data, want[x.name].data, err_msg=x.name)
    for name in ("tokenizer.ggml.tokens", "llama.embedding_length", "llama.attention.head_count"):
        if name in r.fields:
            assert t.fields[name].contents() == r.fields[name].contents(), name
    assert load_model(dst).arch.num_layers == 1
    with pytest.raises(SystemExit, match="--draft-layers"):
        truncated_gguf(src, layers, str(tmp_path / "no.gguf"))

    # One request: its prefill, decodes and verifications of up to 1 + 3 tokens compile the
    # (1, 1), (2, 2), (4, 4) and (8, 4) buckets (three requests added the 16- and 32-token ones
    # to both engines; a draft model verifying a batch: tests/spec_decode/
    # test_spec_identity_draft.py::test_other_draft_model_batch_equals_plain_decoding).
    prompts = [{"prompt_token_ids": [5, 9, 13, 5, 9, 13, 5]}]
    params = SamplingParams(temperature=0.8, seed=7, max_tokens=12, ignore_eos=True)
    engine = {**SMALL_ENGINE, "precompile": "on-demand", "tokenizer": tiny_llama}   # the tiny GGUF has none
    plain = LLM(src, **engine).generate(prompts, params, use_tqdm=False)
    spec = LLM(src, **engine, speculative_config={"model": dst, "num_speculative_tokens": 3,
                                                  "min_acceptance_rate": 0.0, "cost_model": False})
    outs = spec.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    assert spec.llm_engine.core.scheduler.spec_stats.num_drafts > 0
    print(f"buckets compiled: {sorted(spec.llm_engine.core.runner.compiler.steps)}")
