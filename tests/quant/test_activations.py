"""``--cpu-matmul native-int8-split`` (quant/activations.py): every GGUF projection through the
int8-activation kernel twice, on the input rounded to int8 and on its remainder
(``native_matmul.linear_packed_split``).  What it costs and saves on the built-in model:
docs/BENCHMARKS.md, "Perplexity".

Here: that the mode marks every weight and the others clear the mark (auto keeps float32
activations), that the split product is within its documented bound of the float64 reference
(and far inside int8's error), and that a token's logits stay the same bits whatever step shape
computes them.
"""

from __future__ import annotations

import dataclasses

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.config import EngineConfig
from jaxllm.cpu import native
from jaxllm.engine.resolve import resolve_config
from jaxllm.quant import PackedWeight, activations, dequantize_reference, matmul_reference, pack
from jaxllm.quant import ops as qops
from jaxllm.quant.native_matmul import INTERLEAVED_TYPES, int8_split, interleave_rows, linear_packed, linear_packed_split
from jaxllm.runner.weights import host_params

from support.tiny_models import paged_logits

pytestmark = pytest.mark.skipif(not native.quant_available(), reason="the native packed-block matmul did not build")


@pytest.fixture(scope="module")
def builtin_model():
    from jaxllm.models.loader import load_model
    return load_model(None)


def _packed(tree) -> list[PackedWeight]:
    return [w for w in jax.tree.leaves(tree, is_leaf=lambda w: isinstance(w, PackedWeight))
            if isinstance(w, PackedWeight)]


def test_split_mode_marks_every_weight_and_auto_none(builtin_model):
    model = builtin_model
    step = resolve_config(EngineConfig.from_kwargs(cpu_matmul="native-int8-split"), model).step
    assert step.kernels.matmul == "native" and step.kernels.int8_activations
    assert {w.activations for w in _packed([model.globals, model.layers])} == {"split"}
    # laid out as the runner lays them (model_runner.py): in the VNNI kernel's interleaved
    # groups where the CPU has it, the mark kept through fusing and interleaving
    params = host_params(model, jnp.float32, scan_layers=False, packed_bf16=False, native=True,
                         interleave=INTERLEAVED_TYPES if native.quant_dot_vnni() else ())
    assert {(w.activations, w.interleaved) for w in _packed(params)} == \
        {("split", 16 if native.quant_dot_vnni() else 0)}

    # auto (the default) and the named modes clear it: float32 activations, or int8 everywhere
    for mode, int8 in (("auto", False), ("native-int8", True), ("native", False)):
        step = resolve_config(EngineConfig.from_kwargs(cpu_matmul=mode), model).step
        assert step.kernels.int8_activations == int8, mode
        assert {w.activations for w in _packed([model.globals, model.layers])} == {""}, mode


@pytest.mark.parametrize("type_name, interleaved", [("Q4_1", True), ("Q8_0", False)])
def test_split_product_is_within_its_bound(type_name, interleaved):
    """x = x1 + r, x1 on the int8 grid of each 32-value block (which the kernel rounds to
    itself) and r the remainder: the kernel's error is r's rounding, at most half a step of
    r's own grid (max|r| / 254) per value, so |y - ref| <= sum over blocks of
    max|r_b| / 254 * sum|w| (plus float32 summation), ~250x inside one int8 call's error."""
    if interleaved and not native.quant_dot_vnni():
        pytest.skip("the CPU lacks AVX512F/BW/VNNI: no interleaved kernel")
    rng = np.random.default_rng(1)
    n, k = 64, 1536                                      # the built-in model's down projection's width
    w = rng.standard_normal((n, k)).astype(np.float32)
    raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType[type_name])
    pw = pack(raw, type_name, (n, k))
    if interleaved:
        pw = interleave_rows(pw)
    marked = dataclasses.replace(pw, activations="split")
    wq = np.abs(dequantize_reference(raw, type_name, (n, k)).astype(np.float64))    # [N, K]
    for m in (1, 32):
        x = rng.standard_normal((m, k)).astype(np.float32)
        x[:, ::97] *= 40                                 # outlier channels, as after SwiGLU
        ref = matmul_reference(x, raw, type_name, (n, k))                               # [M, N]
        got = np.asarray(jax.jit(linear_packed_split)(jnp.asarray(x), pw), np.float64)
        # what a linear map of the model runs on a marked weight (layers/linear.py -> quant/ops.py)
        via = jax.jit(lambda x, w: qops.matmul(x, w, "native-int8"))(jnp.asarray(x), marked)
        assert np.array_equal(np.asarray(via, np.float64), got)
        one = np.asarray(linear_packed(jnp.asarray(x), pw, int8_activations=True), np.float64)
        # one kernel call over the stacked halves: the same bits as a call per half
        def two_calls(x, pw):
            x1, r = int8_split(x)
            return linear_packed(x1, pw, int8_activations=True) + linear_packed(r, pw, int8_activations=True)

        two = jax.jit(two_calls)(jnp.asarray(x), pw)
        assert np.array_equal(np.asarray(two, np.float64), got)
        _, r = (np.asarray(a, np.float64) for a in int8_split(jnp.asarray(x)))
        step = np.repeat(np.abs(r).reshape(m, k // 32, 32).max(-1) / 254, 32, axis=1)  # [M, K]
        bound = step @ wq.T + 1e-6 * (np.abs(x).astype(np.float64) @ wq.T)            # [M, N]
        err = np.abs(got - ref)
        print(f"{type_name} M={m}: split max err {err.max():.2e} (worst err/bound "
              f"{(err / bound).max():.2f}), one int8 call {np.abs(one - ref).max():.2e}")
        assert (err <= bound).all()
        assert err.max() * 50 < np.abs(one - ref).max()


def test_split_logits_do_not_depend_on_the_step_shape(builtin_model):
    """The built-in model on native-int8-split: the same positions computed one token per step
    and eight per step give bit-identical logits, and so does the last position on those
    caches (speculation's exactness and the chunked prefill's rest on it).  Steps of 8 and 1
    tokens only: two programs of the 30-layer model (XLA's norm sums some rows of an 8-row
    step in another order than a 1-row step's, of a 5-row step in the same one)."""
    model = builtin_model
    for tensors in (model.globals, *model.layers):
        activations.mark(tensors, split=True)
    ids = [1] + list(range(300, 316))                    # 17 tokens
    one = paged_logits(model, ids, scan_layers=False, split=tuple(range(8, 17)), matmul="native-int8",
                       attention="native")               # 8, 1 x 8, 1
    eight = paged_logits(model, ids, scan_layers=False, split=(8, 16), matmul="native-int8",
                         attention="native")             # 8, 8, 1
    rows = np.nonzero(np.abs(one - eight).max(-1))[0].tolist()
    print(f"native-int8-split: positions whose logits differ between the two step shapes: {rows}")
    assert rows == []
