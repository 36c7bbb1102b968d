"""The hybrid Gated-DeltaNet models served by the engine (models/qwen3_next.py wired in):
Qwen3-Next / Qwen3.5 / Qwen3.5-MoE through the paged K/V cache of their full-attention layers
and the per-sequence GDN states in slots keyed by request id (runner/state_slots.py).

Tiny random-weight checkpoints of tests/models/test_qwen3_next.py (5 layers: GDN, full, GDN,
GDN, full).  Float32 prompt logits of the engine's forward over a 150-token prompt in three
prefill chunks of 50 (the GDN chunk at 16, so each call spans several chunks and a ragged tail)
within 1e-4 of transformers on the XLA path, the native CPU kernels and the Pallas attention
kernel; through ``LLM``: 32 greedy tokens equal to transformers' ``generate`` with prompts
longer than one GDN chunk prefilled over several steps, on the XLA path and with the Pallas
kernels (the GDN decode steps through pallas/gated_delta.py); 10 requests batched under a small token budget equal to each
alone, with preemption; the cache arrays the runner allocated read back within a byte budget
for a layout of 3 full-attention and 6 GDN layers; the AOT warm-up with the strict guard
(every bucket compiled up front, none compiled while serving); prefix caching off and
speculative decoding refused by name.
"""

from __future__ import annotations

import dataclasses
import logging
import os

import numpy as np
import pytest
import torch
import transformers
from support.tiny_hybrid import VARIANTS, VOCAB, build

from jaxllm import LLM, SamplingParams
from jaxllm.models import qwen3_next as qn
from jaxllm.models.loader import load_model

ENGINE = {"max_num_seqs": 8, "max_num_batched_tokens": 24, "max_model_len": 192, "dtype": "float32",
          "strict_compile_guard": True, "show_progress": False, "skip_tokenizer_init": True}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("hybrid")
    return {a: build(a, str(root / a)) for a in VARIANTS}


@pytest.fixture(scope="module")
def hf_models(ckpts):
    return {a: getattr(transformers, a).from_pretrained(p, dtype=torch.float32).eval() for a, p in ckpts.items()}


def _ids(n, seed):
    return np.random.default_rng(seed).integers(0, VOCAB, n).tolist()


def _hf_greedy(model, prompt, n=32):
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()


# Qwen3-Next: fused projections, MoE with a dense layer; Qwen3.5: split projections, dense, tied
# head; Qwen3.5-MoE (MoE everywhere) on the Pallas attention kernel.
CASES = [("Qwen3NextForCausalLM", "xla"), ("Qwen3_5ForCausalLM", "xla"), ("Qwen3NextForCausalLM", "native"),
         ("Qwen3_5MoeForCausalLM", "pallas")]


@pytest.mark.parametrize("arch,kernels", CASES, ids=[f"{a}-{k}" for a, k in CASES])
def test_prompt_logits_match_transformers(arch, kernels, ckpts, hf_models, monkeypatch):
    from support.tiny_models import paged_logits

    from jaxllm.cpu import native
    if kernels == "native" and not native.available():
        pytest.skip("the native CPU kernels are unavailable")
    # The model module's constant, which the forward reads (the package's re-export is a copy).
    monkeypatch.setattr(qn.model, "CHUNK_SIZE", 16)
    ids = _ids(150, seed=3)
    # Three equal chunks of 50 (3 GDN chunks of 16 and a ragged tail each, every later one
    # starting mid-chunk): one program per cell instead of one per chunk length.
    matmul = "xla" if kernels == "pallas" else kernels     # pallas: the attention kernel (interpret mode)
    ours = paged_logits(ckpts[arch], ids, False, split=(50, 100), matmul=matmul, attention=kernels)
    with torch.no_grad():
        ref = hf_models[arch](torch.tensor([ids])).logits[0].numpy()
    err = np.abs(ours - ref).max()
    assert err < 1e-4, f"{arch} ({kernels}): max logit error {err:.2e}"


@pytest.fixture(scope="module")
def engine(ckpts):
    # 24 tokens a step: the prompts below are prefilled over several steps.  14 blocks of 16
    # (one reserved): one 192-token sequence fits, 16 running at once do not (preemption).
    return LLM(ckpts["Qwen3NextForCausalLM"], **ENGINE, num_blocks_override=14, precompile="all")


def test_greedy_tokens_match_transformers(engine, hf_models):
    prompts = [_ids(n, seed=n) for n in (5, 70, 130)]
    outs = engine.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(temperature=0, max_tokens=32, ignore_eos=True), use_tqdm=False)
    for p, out in zip(prompts, outs):
        want = _hf_greedy(hf_models["Qwen3NextForCausalLM"], p)
        assert len(set(want)) > 3, "degenerate greedy run"
        assert out.outputs[0].token_ids == want, f"prompt of {len(p)} tokens"


def test_pallas_decode_in_the_engine_matches_transformers(ckpts, hf_models):
    """--attention-backend pallas (interpret mode on CPU): the full-attention layers through
    the ragged paged kernel and every GDN decode step through the Pallas recurrent kernel."""
    llm = LLM(ckpts["Qwen3_5ForCausalLM"], **ENGINE, attention_backend="pallas", precompile="auto")
    prompt = _ids(70, seed=7)
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=32, ignore_eos=True),
                       use_tqdm=False)[0]
    assert out.outputs[0].token_ids == _hf_greedy(hf_models["Qwen3_5ForCausalLM"], prompt)


def test_batching_equals_solo_and_preemption_keeps_outputs_equal(engine):
    # 10 requests of 3..90 tokens and 16 new ones each: 8 running need ~30 blocks of the 13,
    # so preemption is certain (asserted below).
    rng = np.random.default_rng(4)
    prompts = [{"prompt_token_ids": rng.integers(0, VOCAB, size=int(n)).tolist()} for n in rng.integers(3, 90, 10)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    solo = [engine.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    core = engine.llm_engine.core
    before = core.scheduler.num_preemptions
    outs = engine.generate(prompts, params, use_tqdm=False)
    assert core.scheduler.num_preemptions > before, "precondition: the pool is too small for all of them"
    assert [o.outputs[0].token_ids for o in outs] == solo
    assert core.kv_manager.num_free_blocks == core.kv_manager.num_blocks
    # The runner hears of the last step's finished requests with the next step: slots track
    # the requests it holds, never more.
    runner = core.runner
    assert len(runner.state_slots) == len(runner.requests._states) < len(prompts)


def test_warmup_compiles_every_bucket_up_front(engine):
    # precompile="all" with the strict guard: the tests above ran every step without a compile.
    assert engine.llm_engine.core.runner.all_compiled


def test_prefix_caching_off_and_speculative_refused(ckpts, caplog):
    from jaxllm.config import EngineConfig
    from jaxllm.engine.core import _check_per_sequence_state
    model = load_model(ckpts["Qwen3_5ForCausalLM"])
    with caplog.at_level(logging.INFO, logger="jaxllm.engine"):
        assert _check_per_sequence_state(EngineConfig.from_kwargs(enable_prefix_caching=True), model) is False
    assert "prefix caching off" in caplog.text and "recurrent state" in caplog.text
    with pytest.raises(ValueError, match="--speculative-config is not supported for Qwen3_5ForCausalLM"):
        LLM(ckpts["Qwen3_5ForCausalLM"], **ENGINE, speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="--kv-cache-dtype int8 is not supported for Qwen3_5ForCausalLM"):
        LLM(ckpts["Qwen3_5ForCausalLM"], **ENGINE, kv_cache_dtype="int8")


@pytest.mark.parametrize("budget", [1 << 20, 3 * (1 << 20) + 12345])
def test_cache_bytes_stay_within_the_budget(tmp_path, budget, caplog):
    """3 full-attention and 6 GDN layers: every array the runner allocated (K/V pages, conv
    and delta states) read back from the device, within the budget; a kind counted for one
    layer of its group would allocate past it.  max_num_seqs is clamped to the state slots
    the budget seats beside one full sequence."""
    from jaxllm.config import EngineConfig
    from jaxllm.engine.resolve import resolve_config
    from jaxllm.runner.model_runner import ModelRunner
    kinds = ["linear_attention", "linear_attention", "full_attention"] * 3
    path = build("Qwen3_5ForCausalLM", str(tmp_path / "deep"), num_hidden_layers=9, layer_types=kinds,
                 linear_key_head_dim=32, linear_value_head_dim=32)
    model = load_model(path)
    h = model.arch.hybrid
    cfg = EngineConfig.from_kwargs(kv_cache_memory_bytes=budget, max_model_len=256, max_num_seqs=256,
                                   dtype="float32")
    with caplog.at_level(logging.INFO, logger="jaxllm"):
        r = resolve_config(cfg, model)
    runner = ModelRunner(model, dataclasses.replace(r.step, max_logprobs=2), num_blocks=r.kv.num_blocks,
                         show_progress=False)
    leaves = [a for group in runner.kv for a in group]
    nbytes = sum(int(a.nbytes) for a in leaves)
    assert nbytes == runner.kv_cache_bytes() == r.kv.total_bytes and nbytes <= budget
    assert len(leaves) == 2 * 3 + 2 * 6
    k_pages, _, convs, deltas = runner.kv
    assert len(k_pages) == 3 and len(convs) == len(deltas) == 6
    slots = r.kv.seq_slots
    assert 1 <= slots < 256 and r.step.max_num_seqs == slots == convs[0].shape[0] == deltas[0].shape[0]
    assert f"max_num_seqs 256 clamped to {slots}" in caplog.text
    state = (h.conv_kernel - 1) * h.conv_dim + h.linear_num_value_heads * 32 * 32
    assert r.kv.bytes_per_slot == 6 * state * 4
    assert r.kv.bytes_per_block == 3 * r.kv.block_size * 2 * h.num_kv_heads * h.head_dim * 4
    assert "recurrent state 6 layers" in r.kv.describe(256) and "K/V 3 layers" in r.kv.describe(256)


def test_device_sizing_clamps_max_num_seqs_and_rebuilds_the_runner(ckpts, engine, monkeypatch, caplog):
    """--gpu-memory-utilization on an accelerator sizes the cache once the weights are on the
    device, after the runner was built for max_num_seqs state slots: a budget that seats
    fewer builds the runner again for them (a runner kept would index slots past its
    arrays), the log says so, and outputs are those of the 8-slot engine.  On CPU the device's
    free memory is stood in for by a fixed budget."""
    from jaxllm.engine import core
    path = ckpts["Qwen3NextForCausalLM"]
    state = 3 * 4 * ((4 - 1) * 96 + 4 * 16 * 8)          # 3 GDN layers' conv + delta, float32
    block = 2 * 16 * 2 * 2 * 16 * 4                        # 2 full-attention layers' K and V
    budget = (1 + 192 // 16) * block + 3 * state + 100    # one full sequence and 3 slots
    real = core.resolve_config
    monkeypatch.setattr(core, "resolve_config", lambda *a, **k: dataclasses.replace(real(*a, **k), kv=None))
    monkeypatch.setattr(core.EngineCore, "_size_kv_from_device", lambda self, sizing: sizing.plan(budget))
    with caplog.at_level(logging.INFO, logger="jaxllm"):
        llm = LLM(path, **{**ENGINE, "max_num_seqs": 8}, precompile="on-demand")
    c = llm.llm_engine.core
    assert c.resolved.kv.seq_slots == 3 and c.resolved.kv.seqs_asked == 8, "precondition: fewer slots than asked"
    assert c.resolved.step.max_num_seqs == c.runner.cfg.max_num_seqs == c.scheduler.max_num_seqs == 3
    assert "max_num_seqs 8 clamped to 3" in caplog.text
    convs = c.runner.kv[2]
    assert convs[0].shape[0] == 3 and c.runner.kv_cache_bytes() <= budget
    # 4 requests for 3 slots, sized so the clamped engine compiles two step buckets only:
    # A, B, C prefill in one 24-token step, then decode as 3 rows (bucket 4); the 4th waits
    # for a slot (the 8-slot engine runs it at once), takes A's freed slot with a 20-token
    # prefill (bucket 24 again) and finishes with B and C (no lone-row tail bucket).
    prompts = [{"prompt_token_ids": _ids(n, seed=n)} for n in (8, 8, 8, 20)]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (4, 8, 8, 4)]
    assert ([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
            == [o.outputs[0].token_ids for o in engine.generate(prompts, params, use_tqdm=False)])   # 8 slots


def test_registered_and_config_read(ckpts):
    from jaxllm.models.registry import supported_architectures
    assert set(VARIANTS) <= set(supported_architectures())
    a = load_model(ckpts["Qwen3NextForCausalLM"]).arch
    assert isinstance(a, qn.HybridArch) and a.fused_projections and a.key_dim == 32
    assert not a.uniform_layers and a.rope_dim == a.hybrid.rotary_dim
    assert os.path.isdir(ckpts["Qwen3NextForCausalLM"])


def test_hybrid_draft_model_refused(ckpts, tiny_llama):
    with pytest.raises(ValueError, match="the draft model .* keeps a recurrent state per sequence"):
        LLM(tiny_llama, dtype="float32", show_progress=False, precompile="on-demand",
            speculative_config={"model": ckpts["Qwen3_5ForCausalLM"], "num_speculative_tokens": 2})
