"""The engine end to end on GGUF checkpoints whose matrices stay in their blocks.

A tiny Llama is written as a GGUF whose three layers and output matrix take block types
quantized by the gguf package (the embedding in Q8_0): two files hold the seven types, one
type per layer, as llama.cpp's mixed files (Q4_K_M) hold several.  Served packed (the default)
it must compute the function the same file computes dequantized (``dequantize=True``): the
dequantization is exact (tests/quant/test_gguf_blocks.py), so what differs is only the order of
float32 sums in the matmul (the native kernel scales a block's partial sum once; XLA's dot
sums the dequantized products).  Greedy tokens must be equal and the logprobs of the tokens
chosen within 1e-3 (float32 rounding of 64- and 160-term dot products over weights of magnitude
~0.2, amplified through 3 layers; measured: under 1e-4).  A type whose kernel or layout is
wrong breaks its layer, so every type is checked although it shares its engine.
"""

from __future__ import annotations

import gguf
import jax
import numpy as np
import pytest

from jaxllm import LLM, SamplingParams
from jaxllm.cpu import native
from jaxllm.models.loader import load_model
from jaxllm.quant import PackedWeight
from jaxllm.quant.native_matmul import NATIVE_TYPES

from support.engines import SMALL_ENGINE
from support.gguf_mix import requantize_gguf
from support.log_lines import log_lines
from support.tiny_models import paged_logits, write_gguf

# The gguf package quantizes these; the K types come as llama.cpp-made fixtures
# (tests/quant/test_k_fixtures.py).  name -> (types of layers 0, 1, 2, type of the output
# matrix): each type is one layer's (its q/k/v and gate/up fused), BF16 the second file's output.
# The first file's types are the int8-activation kernel's, each with its interleaved layout
# (test_int8_activations_engine runs it).  One engine per file: a file per type compiled 7.
MIXES = {"Q8_0-Q4_0-Q4_1": (("Q8_0", "Q4_0", "Q4_1"), "Q8_0"),
         "Q5_0-Q5_1-F16-BF16": (("Q5_0", "Q5_1", "F16"), "BF16")}
INT8_MIX = "Q8_0-Q4_0-Q4_1"
PROMPTS = [[1, 400, 401, 402], [1, 9, 8, 7, 6, 5, 4, 3, 2], [1] + list(range(1000, 1040))]
# Step 1 prefills the first two prompts and 19 of the third's 41 tokens (three rows: the decode
# bucket compiled beside it is T=4, the one every later decode runs); the third's first token
# comes a step later, so it asks for one token less and all three end in one step: (32, 4) and
# (4, 4) are the only buckets compiled (no 1-row tail bucket).
PARAMS = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=1) for n in (12, 12, 11)]


def _type_of(layers, output):
    """GGUF tensor name -> the block type ``MIXES`` gives it."""
    def pick(name):
        if name == "output.weight":
            return output
        return layers[int(name.split(".")[1])]   # blk.<layer>.<matrix>
    return pick


@pytest.fixture(scope="module")
def ggufs(tiny_llama, tmp_path_factory):
    """name -> GGUF path: the ``MIXES`` files, and "Q4_1" with every matrix in Q4_1 (layers of
    one type stack for scan: test_packed_logits_every_backend)."""
    root = tmp_path_factory.mktemp("packed")
    out = {"Q4_1": str(root / "tiny-Q4_1.gguf")}
    write_gguf(tiny_llama, out["Q4_1"], matrix_type=gguf.GGMLQuantizationType.Q4_1)
    float32 = str(root / "tiny-F32.gguf")
    write_gguf(tiny_llama, float32)
    for name, (layers, output) in MIXES.items():
        out[name] = str(root / f"tiny-{name}.gguf")
        requantize_gguf(float32, out[name], _type_of(layers, output))
    return out


# (engine, tokens, logprobs) per (file, engine options): the tests below ask for some runs twice
# (the first mix with float32 activations); an engine's greedy run is deterministic, so the
# second ask reads the first run instead of building the same engine again.
_RUNS: dict = {}


_WEIGHTS_LINE: dict = {}   # _run's key -> its engine's "weights on the device" log line


def _weights_line(path, **kw) -> str:
    _run(path, **kw)
    return _WEIGHTS_LINE[(path, tuple(sorted(kw.items())))]


def _run(path, **kw):
    key = (path, tuple(sorted(kw.items())))
    if key not in _RUNS:
        # The buckets this generate runs, compiled when first needed (the offline default) under
        # the strict compile guard: a packed type's programs are its own, and the unused buckets'
        # compiles would prove nothing the used ones do not.  The longest prompt and its tokens
        # (41 + 11) fit max_model_len 64: a smaller cache and block table than SMALL_ENGINE's.
        # float32 activations unless asked: auto rounds Q4_1's to int16 on a CPU without AVX-512
        with log_lines("jaxllm.runner") as lines:
            llm = LLM(path, **{**SMALL_ENGINE, "precompile": "auto", "max_model_len": 64, "cpu_matmul": "native", **kw},
                      skip_tokenizer_init=True)
        _WEIGHTS_LINE[key] = next(ln for ln in lines if ln.startswith("weights on the device"))
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS, use_tqdm=False)
        tokens = [o.outputs[0].token_ids for o in outs]
        lps = [[lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] for o in outs]
        print(f"buckets compiled: {sorted(llm.llm_engine.core.runner.compiler.steps)}")
        _RUNS[key] = (llm, tokens, lps)
    return _RUNS[key]


@pytest.mark.parametrize("mix", MIXES)
def test_packed_engine_equals_dequantized(ggufs, mix):
    layer_types, output_type = MIXES[mix]
    packed, tokens, lps = _run(ggufs[mix])
    _, ref_tokens, ref_lps = _run(ggufs[mix], dequantize=True)
    runner = packed.llm_engine.core.runner
    for layer, type_name in zip(runner.params["layers"], layer_types, strict=True):
        weights = [w for w in layer.values() if isinstance(w, PackedWeight)]
        # q/k/v and gate/up fuse into one packed weight each for the native kernel
        assert {w.type_name for w in weights} == {type_name} and len(weights) >= 4, layer.keys()
    packed_types = {w.type_name for w in jax.tree.leaves(runner.params, is_leaf=lambda w: isinstance(w, PackedWeight))
                    if isinstance(w, PackedWeight)}
    assert packed_types == {*layer_types, output_type, "Q8_0"}, packed_types   # Q8_0: the embedding
    print(mix, "matmul:", runner.cfg.kernels.matmul, "native kernel:", [t in NATIVE_TYPES for t in packed_types])
    assert tokens == ref_tokens
    err = max(abs(a - b) for x, y in zip(lps, ref_lps) for a, b in zip(x, y))
    print(f"{mix}: max |logprob packed - dequantized| = {err:.2e}")
    assert err < 1e-3


# Two chunks of 19 (split=19): one program serves both.
LOGIT_IDS = list(range(3, 41))


@pytest.fixture(scope="module")
def q4_1_dequantized_logits(ggufs):
    """The Q4_1 file's logits dequantized (XLA matmul, float32): one reference for every backend."""
    return paged_logits(load_model(ggufs["Q4_1"], dequantize=True), LOGIT_IDS, scan_layers=False, split=19)


# (the native matmul runs only with unrolled layers: engine/resolve.py)
@pytest.mark.parametrize("matmul, scan", [("native", False), ("xla", False), ("xla", True)])
def test_packed_logits_every_backend(ggufs, q4_1_dequantized_logits, matmul, scan):
    """The forward on packed Q4_1 weights, unrolled and scanned (the layers' blocks stacked),
    native and XLA matmuls, against the dequantized weights' logits (XLA matmul, float32)."""
    ref = q4_1_dequantized_logits
    got = paged_logits(ggufs["Q4_1"], LOGIT_IDS, scan_layers=scan, split=19, matmul=matmul)
    err = np.abs(got - ref).max()
    print(f"Q4_1 {matmul} scan={scan}: max |logit error| = {err:.2e} (logits up to {np.abs(ref).max():.1f})")
    assert err < 1e-3 * max(1.0, np.abs(ref).max())


def test_auto_never_rounds_activations_to_int8(ggufs):
    """``--cpu-matmul auto`` (the default) never rounds activations to int8, VNNI or not (it cost
    the built-in model over 1% of perplexity: docs/BENCHMARKS.md, "Perplexity"): float32
    activations, or int16 ones for Q4_1 blocks (the perplexity of float32's) where the CPU lacks
    AVX-512 or has VNNI without AMX (there in 16-row groups, jaxllm_dot16_i16_q4_1, and Q8_0
    too, jaxllm_dot16_i16_q8_0); and what it runs is exactly what the named mode runs."""
    llm, tokens, lps = _run(ggufs[INT8_MIX], cpu_matmul="auto")
    runner = llm.llm_engine.core.runner
    kernels = runner.cfg.kernels
    print(f"AVX-512: {native.cpu_avx512()}, VNNI: {native.quant_dot_vnni()}, AMX: {native.quant_dot_amx()}; "
          f"auto -> linear maps {kernels.linear}")
    grouped = kernels.int16_activations and native.quant_dot_vnni()   # Q4_1, Q8_0 in 16-row groups
    assert not kernels.int8_activations
    assert kernels.int16_activations == (not native.cpu_avx512() or native.cpu_vnni_without_amx())
    packed = [w for w in jax.tree.leaves(runner.params, is_leaf=lambda w: isinstance(w, PackedWeight))
              if isinstance(w, PackedWeight)]
    assert packed and all(bool(w.interleaved) == (grouped and w.type_name in ("Q4_1", "Q8_0")
                                                  and w.shape[0] % 16 == 0)
                          for w in packed), [(w.type_name, w.shape, w.interleaved) for w in packed]
    assert {w.type_name for w in packed if w.interleaved} == ({"Q4_1", "Q8_0"} if grouped else set())
    programs = " ".join(p.compiled.as_text() for p in runner.compiler.steps.values())
    kernel = "jaxllm_dot16_i16_q4_1" if grouped else "jaxllm_dot_i16_q4_1"   # the Q4_1 layers' kernel
    assert (kernel in programs) == kernels.int16_activations
    # Q8_0 by int16 in 16-row groups only (no row-major int16 kernel for it): float32 elsewhere
    assert ("jaxllm_dot16_i16_q8_0" in programs) == grouped
    assert ("jaxllm_linear_q8_0" in programs) == (not grouped)
    named = "native-int16" if kernels.int16_activations else "native"
    _, named_tokens, named_lps = _run(ggufs[INT8_MIX], cpu_matmul=named)
    assert tokens == named_tokens and lps == named_lps
    # the start-up log says so, where a user comparing outputs with another engine looks first
    line = _weights_line(ggufs[INT8_MIX], cpu_matmul="auto")
    print(line)
    rounded = "Q4_1/Q8_0" if grouped else "Q4_1"
    assert (f"{rounded} by activations rounded to int16" in line) == kernels.int16_activations, line
    assert "int8" not in line and "rounded" not in _weights_line(ggufs[INT8_MIX]), line


def test_int8_activations_engine(ggufs):
    """``--cpu-matmul native-int8``: the blocks meet activations rounded to int8 per 32 values
    (cpu/quant_dot.cc, tested against an exact emulation in tests/kernels/test_cpu_quant_dot.py).
    The flag reaches the kernel: the first token's logprob moves off the float engine's by the
    rounding (more than float32 summation order could), by less than the 0.5 nats the
    tiny random model's amplification of a ~1% activation error allows."""
    llm, tokens, lps = _run(ggufs[INT8_MIX], cpu_matmul="native-int8")
    runner = llm.llm_engine.core.runner
    assert runner.cfg.kernels.int8_activations
    assert "activations rounded to int8 per 32 values" in _weights_line(ggufs[INT8_MIX], cpu_matmul="native-int8")
    # where the CPU has AVX-512 VNNI, the int8 kernel reads its weights in 16-row groups, the
    # tied embedding (gathered by rows) included
    packed = [w for w in jax.tree.leaves(runner.params, is_leaf=lambda w: isinstance(w, PackedWeight))
              if isinstance(w, PackedWeight)]
    assert {w.interleaved for w in packed} == ({16} if native.quant_dot_vnni() else {0}), \
        [(w.type_name, w.shape, w.interleaved) for w in packed]
    _, ref_tokens, ref_lps = _run(ggufs[INT8_MIX])
    first = [abs(x[0] - y[0]) for x, y in zip(lps, ref_lps)]
    agree = [next((i for i, (a, b) in enumerate(zip(t, r)) if a != b), len(r)) for t, r in zip(tokens, ref_tokens)]
    print(f"{INT8_MIX}, int8 activations: first-token |logprob - float| {max(first):.2e}; tokens equal before "
          f"the first difference: {agree} of {len(ref_tokens[0])}")
    assert [t[0] for t in tokens] == [r[0] for r in ref_tokens]
    assert 1e-4 < max(first) < 0.5

