"""The engine end to end with the Pallas kernels (interpret mode on CPU) equals the XLA path.

One engine runs the ragged paged attention kernel (with the fused KV write) and the
sampler's Pallas reduction, with layers under ``lax.scan`` (the stacked cache, as on a
GPU); its outputs must equal the shared XLA-path engine's on a workload that batches
prefill chunks with decodes, for greedy and for seeded random requests.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from support.engines import ONE_SHOT_ENGINE, SMALL_ENGINE
from support.batch_workload import record_schedules

from jaxllm import LLM, SamplingParams
from jaxllm.runner.inputs import input_spec, sampling_spec
from jaxllm.sample.bitmask import mask_words


@pytest.fixture(scope="module")
def pallas_llm(tiny_llama):
    # Only the buckets the workload runs are compiled (each is slow in interpret mode); the strict
    # guard still fails a step that compiles twice.  Every-bucket warm-up: tests/runner/test_compile.py.
    return LLM(tiny_llama, **ONE_SHOT_ENGINE, attention_backend="pallas", sampler_backend="pallas", scan_layers=True)


def workload(seed):
    """Four prompts whose steps land in two buckets of the one-shot engine (each Pallas program
    is slow to compile in interpret mode): step 1 prefills 3 and 5 tokens and 24 of the 40-token
    prompt (three rows: its decode bucket is T=4); step 2 decodes two beside the rest of that
    prompt and 14 of the 15-token one (prefill chunks batched with decodes, asserted below);
    step 3 decodes three beside its last token; then four rows decode, across page boundaries
    (16-token pages).  Prompt i's first token comes 0, 0, 1, 2 steps after the first's: asking
    for that many tokens less ends all four in one step (no 1- or 2-row tail buckets).  Each
    test draws its own prompt tokens (``seed``): the prefix cache would skip another's prefills."""
    rng = np.random.default_rng(seed)
    prompts = [{"prompt_token_ids": rng.integers(3, 5000, size=n).tolist()} for n in (3, 5, 40, 15)]
    params = [SamplingParams(temperature=0, max_tokens=16 - s, ignore_eos=True) for s in (0, 0, 1, 2)]
    return prompts, params


def random_params(params):
    # Seeded draws with every truncation kind; the tokens depend only on (seed, position, logits).
    kinds = [dict(temperature=0.8), dict(temperature=1.0, top_k=20), dict(temperature=0.7, top_p=0.9),
             dict(temperature=1.2, min_p=0.05)]
    return [SamplingParams(**kinds[i % 4], seed=1000 + i, max_tokens=p.max_tokens, ignore_eos=True)
            for i, p in enumerate(params)]


def test_pallas_engine_resolves_to_the_kernels(pallas_llm):
    r = pallas_llm.llm_engine.core.resolved.step
    assert (r.kernels.attention, r.sampler_backend, r.scan_layers) == ("pallas", "pallas", True)


@pytest.mark.parametrize("kind", ["greedy", "seeded"])
def test_pallas_engine_equals_the_xla_engine(tiny_llm, pallas_llm, kind):
    prompts, params = workload(seed=3 if kind == "greedy" else 4)
    if kind == "seeded":
        params = random_params(params)
    expected = [o.outputs[0].token_ids for o in tiny_llm.generate(prompts, params, use_tqdm=False)]
    seen, restore = record_schedules(pallas_llm)
    try:
        got = [o.outputs[0].token_ids for o in pallas_llm.generate(prompts, params, use_tqdm=False)]
    finally:
        restore()
    assert got == expected
    print(f"buckets compiled: {sorted(pallas_llm.llm_engine.core.runner.compiler.steps)}")
    # The kernels met the cases that matter: prefill chunks batched with decodes.
    assert any(any(n == 1 for n in so.num_scheduled_tokens.values()) and
               any(n > 1 for n in so.num_scheduled_tokens.values()) for so in seen)


def test_backend_is_part_of_the_compiled_step(tiny_llm, pallas_llm):
    """The persistent cache is keyed by the step's HLO: the two backends lower to different
    programs, so a cached XLA-path executable can never be served for the Pallas one."""
    jaxprs, hlos = {}, {}
    for name, llm in (("xla", tiny_llm), ("pallas", pallas_llm)):
        runner = llm.llm_engine.core.runner
        spec = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)  # noqa: E731
        T, S = runner.buckets[0]
        c = runner.compiler
        args = (jax.tree.map(spec, runner.params), jax.tree.map(spec, runner.kv),
                jax.tree.map(spec, runner.sampler_rows.state), input_spec(runner.cfg, T, S, None))
        # The sampler is its own program (runner/step.py): its arguments are the state, the
        # logits, the sampling metadata and the grammar bitmask.
        V = runner.arch.vocab_size
        sample_args = (args[2], jax.ShapeDtypeStruct((S, V), jnp.float32), sampling_spec(S, None),
                       jax.ShapeDtypeStruct((S, mask_words(V)), jnp.uint32))
        jaxprs[name] = str(jax.make_jaxpr(c.step_fn)(*args)) + str(jax.make_jaxpr(c.sample_fn)(*sample_args))
        hlos[name] = jax.jit(c.step_fn).lower(*args).as_text() + jax.jit(c.sample_fn).lower(*sample_args).as_text()
    kernels = set(re.findall(r"name=(ragged_paged_attention|gumbel_argmax)", jaxprs["pallas"]))
    assert kernels == {"ragged_paged_attention", "gumbel_argmax"}
    assert "pallas_call" not in jaxprs["xla"]
    assert hlos["xla"] != hlos["pallas"]


def test_bad_backend_names_the_flag(tiny_llama):
    with pytest.raises(ValueError, match="--attention-backend"):
        LLM(tiny_llama, **SMALL_ENGINE, attention_backend="triton")
    with pytest.raises(ValueError, match="--sampler-backend"):
        LLM(tiny_llama, **SMALL_ENGINE, sampler_backend="cuda")
    with pytest.raises(ValueError, match="--use-fp64-gumbel"):
        LLM(tiny_llama, **SMALL_ENGINE, sampler_backend="pallas", use_fp64_gumbel=True)
    with pytest.raises(ValueError, match="--dtype float32"):
        LLM(tiny_llama, **{**SMALL_ENGINE, "dtype": "bfloat16"}, attention_backend="pallas")
