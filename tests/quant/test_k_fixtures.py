"""The K-quant GGUF files llama.cpp's llama-quantize wrote (tests/fixtures/gguf_k): read by
``read_gguf``, they hold the K types llama.cpp picks for each preset, and every matrix of a
natively supported type, multiplied by the native kernel straight from the file's blocks,
matches the float64 product with gguf's dequantization of the same bytes."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.packed_matmul_bounds import bound

from jaxllm.cpu import native
from jaxllm.models.gguf_file import read_gguf
from jaxllm.quant import matmul_reference, pack
from jaxllm.quant.native_matmul import NATIVE_TYPES, linear_packed

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures", "gguf_k")
# preset -> the K types llama.cpp's mixture must put in it (the M presets keep some tensors,
# the output one among them, at Q6_K)
PRESETS = {"Q4_K_M": {"Q4_K", "Q6_K"}, "Q5_K_M": {"Q5_K", "Q6_K"}, "Q6_K": {"Q6_K"}}

_linear_jit = jax.jit(linear_packed)


def _path(preset: str) -> str:
    path = os.path.join(FIXTURES, f"tiny-llama-{preset}.gguf")
    if not os.path.isfile(path):
        pytest.skip(f"{path} missing: run tests/fixtures/gguf_k/make_fixtures.py (needs llama-quantize)")
    return path


@pytest.mark.parametrize("preset", PRESETS)
def test_fixture_holds_the_presets_k_types(preset):
    g = read_gguf(_path(preset))
    types = {t.name: t.tensor_type.name for t in g.tensors}
    print(preset, sorted(set(types.values())), types)
    k_types = {t for t in types.values() if t.endswith("_K")}
    assert k_types == PRESETS[preset]
    # llama.cpp keeps the 1-D norms in F32 and quantizes every matrix
    for t in g.tensors:
        assert (t.tensor_type.name == "F32") == (len(t.shape) == 1), (t.name, t.tensor_type.name, t.shape)


@pytest.mark.parametrize("preset", PRESETS)
def test_every_native_matrix_matches_the_float64_reference(preset):
    if not native.quant_available():
        pytest.skip("native packed-block matmul unavailable here: not a CPU backend, the CPU "
                    "lacks AVX2/FMA/F16C, or no C++ compiler (reason in the jaxllm.cpu log)")
    g = read_gguf(_path(preset))
    rng = np.random.default_rng(0)
    checked = []
    for t in g.tensors:
        if t.tensor_type.name not in NATIVE_TYPES:
            continue
        shape = (t.shape[1], t.shape[0])   # GGUF lists the contiguous (in) dimension first
        pw = pack(t.data, t.tensor_type, shape)
        x = rng.standard_normal((3, shape[1]), dtype=np.float32)   # [3, in]
        got = np.asarray(_linear_jit(jnp.asarray(x), pw))           # [3, out]
        want = matmul_reference(x, t.data, t.tensor_type, shape)
        err = np.abs(got - want)
        b = bound(x, pw)
        assert np.all(err <= b), f"{t.name} ({t.tensor_type.name}): worst error / bound {np.max(err / b):.3f}"
        checked.append((t.name, t.tensor_type.name))
    print(preset, "checked natively:", checked)
    # every matrix of the file (2 layers x 7, token_embd, output) is of a native type
    assert len(checked) == 16


# Served end to end: the two M presets, which between them run every K type of the fixtures
# (Q4_K, Q5_K, and Q6_K in each: their output matrix and some layers) through the engine.  The
# all-Q6_K file adds no kernel: its matrices are checked one by one above, and it is served
# end to end (through the CLI) by tests/engine/test_disposable_caches.py.
@pytest.mark.parametrize("preset", ["Q4_K_M", "Q5_K_M"])
def test_engine_serves_the_file_as_shipped(preset):
    """The engine end to end on the llama.cpp-made file, its K blocks kept packed (the layers
    unrolled: the M presets quantize a weight differently in different layers), equal to the
    same file dequantized: greedy tokens equal, the chosen tokens' logprobs within 1e-3
    (float32 summation order, as tests/quant/test_packed_engine.py)."""
    from jaxllm import LLM, SamplingParams
    from jaxllm.quant import PackedWeight
    from support.engines import SMALL_ENGINE
    # 28 prompt tokens in four requests: one prefill step (32, 4), then every decode step (4, 4):
    # two step programs and one sampler program (4 rows) per engine, and the dequantized engine's
    # are the same for both presets (hits in the persistent cache).  The kernel's tiles of fewer
    # than 4 rows run on every matrix of the files in the test above (3 rows).
    prompts = [{"prompt_token_ids": ids} for ids in ([1, 17, 40, 300, 7], list(range(2, 14)),
                                                      list(range(100, 107)), [5, 6, 7, 8])]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1)
    out = {}
    for deq in (False, True):
        # The buckets this generate runs, compiled when first needed, under the strict guard.
        # float32 activations (auto rounds Q4_1's to int16 on a CPU without AVX-512)
        llm = LLM(_path(preset), **{**SMALL_ENGINE, "precompile": "auto", "max_model_len": 128}, skip_tokenizer_init=True,
                  dequantize=deq,
                  cpu_matmul="native")
        runner = llm.llm_engine.core.runner
        types = {w.type_name for lp in runner.params["layers"] for w in lp.values() if isinstance(w, PackedWeight)}
        assert types == (set() if deq else PRESETS[preset]), types
        res = llm.generate(prompts, params, use_tqdm=False)
        print(f"{preset} dequantize={deq}: buckets compiled: {sorted(runner.compiler.steps)}")
        assert sorted(runner.compiler.steps) == [(4, 4), (32, 4)]
        out[deq] = [(o.outputs[0].token_ids, [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs,
                                                                              o.outputs[0].token_ids)]) for o in res]
    for (t, lp), (rt, rlp) in zip(out[False], out[True]):
        assert t == rt
        assert max(abs(a - b) for a, b in zip(lp, rlp)) < 1e-3
