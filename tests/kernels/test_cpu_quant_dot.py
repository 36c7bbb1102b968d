"""The 8-bit-activation packed-block matmul (``jaxllm/cpu/quant_dot.cc``) and its 16-bit one
for Q4_1 (``jaxllm_dot_i16_q4_1``, ``--cpu-matmul native-int16``; in interleaved rows also
Q8_0) against two oracles.

1. A numpy emulation of what it computes: each 32-value block of x quantized to int8 with
   scale max|x| / 127 (int16: / 32767; round half to even), the integer dot with the weight's quants, the
   two scales, plus ``m * sum(x)`` for the types with a min.  The kernel must equal it to
   float32 rounding of its block sums (it adds ~K/32 scaled partial sums).
2. The float64 ``x @ W^T`` on the dequantized weight (``matmul_reference``): the error the
   activations' rounding makes is at most ``dx / 2`` per value, and it multiplies only the
   scaled quants ``d * q`` (the min's term takes the exact ``sum(x)``), so per output it is at
   most ``sum over blocks of dx_b / 2 * sum |d * q|``; the kernel must stay within it.
"""

from __future__ import annotations

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.cpu import native
from jaxllm.quant import dequantize_reference, matmul_reference, pack
from jaxllm.quant.native_matmul import INTERLEAVED_TYPES, deinterleave_rows, interleave_rows, linear_packed

TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")
# (N, K): the built-in model's shapes (q/k/v/o, gate/up, down, the LM head's width) and a tail
SHAPES = [(576, 576), (1536, 576), (576, 1536), (37, 96)]
ROWS = (1, 2, 3, 5, 17, 64)

pytestmark = pytest.mark.skipif(not native.quant_available(), reason="the native packed-block matmul did not build")


def _quants(raw, type_name, shape):
    """The weight's integer quants q [N, K] and per-block d, m [N, nb] (m = 0 without a min)."""
    n, k = shape
    w = dequantize_reference(raw, type_name, shape).astype(np.float64)
    pw = pack(raw, type_name, shape)
    d = pw.d.view(np.float16).astype(np.float64)
    m = pw.m.view(np.float16).astype(np.float64) if pw.m is not None else np.zeros_like(d)
    db = np.repeat(d, 32, axis=1)
    mb = np.repeat(m, 32, axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(db != 0, np.rint((w - mb) / db), 0)
    return q, d, m


def emulate(x, raw, type_name, shape, levels=127):
    n, k = shape
    nb = k // 32
    q, d, m = _quants(raw, type_name, shape)
    xb = x.astype(np.float32).reshape(len(x), nb, 32)
    dx = (np.abs(xb).max(-1) / np.float32(levels)).astype(np.float32)     # [M, nb]
    inv = np.where(dx > 0, np.float32(1) / np.where(dx > 0, dx, 1), 0).astype(np.float32)
    qx = np.rint(xb * inv[..., None])                                    # [M, nb, 32]
    isum = np.einsum("mbj,nbj->mnb", qx, q.reshape(n, nb, 32))            # exact integers
    sx = xb.astype(np.float64).sum(-1)                                   # [M, nb]
    return (isum * d[None] * dx[:, None, :]).sum(-1) + sx @ m.T, dx


@pytest.fixture(params=["vnni", "avx2"])
def isa(request):
    """The kernel's two tile paths, chosen at run time (AVX-512 VNNI where the CPU has it,
    the AVX2 maddubs tiles otherwise): each test runs on both."""
    got = native.set_quant_dot_vnni(request.param == "vnni")
    if request.param == "vnni" and not got:
        pytest.skip("the CPU lacks AVX512F/BW/VNNI: only the AVX2 tiles can run here")
    yield request.param
    native.set_quant_dot_vnni(True)


@pytest.mark.parametrize("type_name", TYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_int8_activation_matmul(type_name, shape, isa):
    rng = np.random.default_rng(hash((type_name, shape)) % 2**32)
    w = (rng.standard_normal(shape) * 0.05).astype(np.float32)
    raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType[type_name])
    pw = jax.device_put(pack(raw, type_name, shape))
    fn = jax.jit(lambda x, pw: linear_packed(x, pw, int8_activations=True))
    wd = np.abs(dequantize_reference(raw, type_name, shape).astype(np.float64))
    q, d, _ = _quants(raw, type_name, shape)
    dq = np.abs(q * np.repeat(d, 32, axis=1))                                # |d * q| [N, K]
    for M in ROWS:
        x = rng.standard_normal((M, shape[1])).astype(np.float32)
        x[:, :32] *= 40.0   # one block with outliers: its scale is coarse, the others' are not
        y = np.asarray(fn(x, pw), np.float64)
        emu, dx = emulate(x, raw, type_name, shape)
        mag = np.abs(x).astype(np.float64) @ wd.T                            # sum |x| |w| per output
        np.testing.assert_allclose(y, emu, rtol=0, atol=float(2e-6 * mag.max()),
                                   err_msg=f"{type_name} {shape} M={M}: not the int8 computation")
        ref = matmul_reference(x, raw, type_name, shape)
        bound = np.einsum("mb,nb->mn", dx / 2, dq.reshape(shape[0], -1, 32).sum(-1)) + 2e-6 * mag
        err = np.abs(y - ref)
        assert (err <= bound).all(), f"{type_name} {shape} M={M}: error {err.max():.3g} over the rounding bound"
        if M == 1 and shape == (576, 1536):
            print(f"{type_name}: max |error| {err.max():.2e} = {(err / bound).max():.2f} of the bound, "
                  f"{err.max() / np.abs(ref).max():.1e} of max |y|")


@pytest.mark.parametrize("type_name", TYPES)
@pytest.mark.parametrize("shape", [(576, 576), (1539, 576), (37, 96)])
def test_a_row_is_the_same_bits_whatever_rows_share_the_call(type_name, shape, isa):
    """A decode's one row of x (M = 1: on AVX2, Q4_1's four-rows walk for K >= 256) gives the
    bits that row gets in a call of 2, 3, 5 or 17 rows (the row tiles): a token's logits do not
    depend on the batch it runs in.  1539 weight rows: passes of four and a remainder."""
    rng = np.random.default_rng(hash((type_name, shape, "bits")) % 2**32)
    w = (rng.standard_normal(shape) * 0.05).astype(np.float32)
    raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType[type_name])
    pw = jax.device_put(pack(raw, type_name, shape))
    fn = jax.jit(lambda x, pw: linear_packed(x, pw, int8_activations=True))
    x = rng.standard_normal((17, shape[1])).astype(np.float32)
    alone = np.stack([np.asarray(fn(x[i:i + 1], pw))[0] for i in range(5)])
    for M in (2, 3, 5, 17):
        got = np.asarray(fn(x[:M], pw))
        np.testing.assert_array_equal(got[:5], alone[:M], err_msg=f"{type_name} {shape} M={M}: a row's bits depend on M")


# The interleaved layout (quant_dot.cc's jaxllm_dot16_*): N a multiple of 16; (48, 96) has an
# odd number of blocks per row.
INTERLEAVED_SHAPES = [(576, 576), (960, 576), (576, 1536), (48, 96)]


@pytest.mark.parametrize("type_name", INTERLEAVED_TYPES)
@pytest.mark.parametrize("shape", INTERLEAVED_SHAPES)
def test_interleaved_rows_compute_the_int8_matmul(type_name, shape):
    """The 16-row interleaved kernel computes the same integer block sums as the row-major
    tiles: it equals the emulation to float32 rounding of its sums, for every row count."""
    if not native.quant_dot_vnni():
        pytest.skip("the CPU lacks AVX512F/BW/VNNI: the interleaved kernel cannot run here")
    rng = np.random.default_rng(hash((type_name, shape, "interleaved")) % 2**32)
    w = (rng.standard_normal(shape) * 0.05).astype(np.float32)
    raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType[type_name])
    pw = pack(raw, type_name, shape)
    iw = jax.device_put(interleave_rows(pw))
    assert iw.interleaved == 16 and iw.nbytes == pw.nbytes
    fn = jax.jit(lambda x, w: linear_packed(x, w, int8_activations=True))
    wd = np.abs(dequantize_reference(raw, type_name, shape).astype(np.float64))
    for M in ROWS:
        x = rng.standard_normal((M, shape[1])).astype(np.float32)
        x[:, :32] *= 40.0
        y = np.asarray(fn(x, iw), np.float64)
        emu, _ = emulate(x, raw, type_name, shape)
        mag = np.abs(x).astype(np.float64) @ wd.T
        np.testing.assert_allclose(y, emu, rtol=0, atol=float(2e-6 * mag.max()),
                                   err_msg=f"{type_name} {shape} M={M}: not the int8 computation")


@pytest.mark.parametrize("type_name", INTERLEAVED_TYPES)
@pytest.mark.parametrize("shape", [(960, 576), (48, 96)])
def test_amx_gives_the_vnni_tiles_bits_at_every_row_count(type_name, shape):
    """Where the CPU has AMX, calls of 32 rows or more (prefill) run on it: one TDPBSSD per
    block for 16 rows of x and 16 weight rows.  Its integer sums and float scaling are the
    VNNI tile's, so every row's output is the same bits as on VNNI and as the row computed
    alone: a token's logits do not depend on the step's row count, which speculation's
    exactness relies on."""
    if not native.quant_dot_amx():
        pytest.skip("the CPU lacks AMX-INT8 (or the OS refused its tile state): only VNNI runs here")
    rng = np.random.default_rng(hash((type_name, shape, "amx")) % 2**32)
    w = (rng.standard_normal(shape) * 0.05).astype(np.float32)
    raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType[type_name])
    iw = jax.device_put(interleave_rows(pack(raw, type_name, shape)))
    fn = jax.jit(lambda x, w: linear_packed(x, w, int8_activations=True))
    x = rng.standard_normal((100, shape[1])).astype(np.float32)
    x[:, :32] *= 40.0
    try:
        assert native.set_quant_dot_amx(False) is False
        alone = np.concatenate([np.asarray(fn(x[i:i + 1], iw)) for i in range(len(x))])
        vnni = {M: np.asarray(fn(x[:M], iw)) for M in (5, 32, 33, 48, 100)}
        assert native.set_quant_dot_amx(True) is True
        for M, want in vnni.items():
            got = np.asarray(fn(x[:M], iw))
            np.testing.assert_array_equal(got, want, err_msg=f"{type_name} {shape} M={M}: AMX is not VNNI's bits")
            np.testing.assert_array_equal(got, alone[:M], err_msg=f"{type_name} {shape} M={M}: rows depend on M")
    finally:
        native.set_quant_dot_amx(True)


@pytest.mark.parametrize("type_name", INTERLEAVED_TYPES)
def test_interleaved_rows_are_read_back_exactly(type_name):
    """Every other reader of an interleaved weight sees the row-major weight: the embedding's
    row gather, the XLA dequantize path, and deinterleave_rows (bit-exact)."""
    from jaxllm.quant import ops
    shape = (64, 96)
    rng = np.random.default_rng(1)
    raw = gguf.quants.quantize((rng.standard_normal(shape) * 0.05).astype(np.float32),
                               gguf.GGMLQuantizationType[type_name])
    pw = pack(raw, type_name, shape)
    iw = interleave_rows(pw)
    assert not np.array_equal(np.asarray(iw.qs), np.asarray(pw.qs))   # the layout did change
    back = deinterleave_rows(jax.device_put(iw))
    for f in ("d", "m", "qs"):
        if getattr(pw, f) is not None:
            np.testing.assert_array_equal(np.asarray(getattr(back, f)), np.asarray(getattr(pw, f)), err_msg=f)
    ids = jnp.asarray([0, 17, 5, 63, 16, 5], jnp.int32)
    np.testing.assert_array_equal(np.asarray(ops.take_rows(iw, ids)), np.asarray(ops.take_rows(pw, ids)))
    x = jnp.asarray(rng.standard_normal((3, 96)), jnp.float32)
    np.testing.assert_array_equal(np.asarray(ops.matmul(x, iw, "xla")), np.asarray(ops.matmul(x, pw, "xla")))
    with pytest.raises(ValueError, match="interleaved"):
        ops.concat_rows([iw, iw])


# ---- int16 activations, Q4_1 (jaxllm_dot_i16_q4_1): (41, 288) has a chunk of 8 blocks and a
# last chunk of one, (37, 96) a row shorter than a chunk ----
I16_SHAPES = [(576, 576), (960, 576), (576, 1536), (41, 288), (37, 96)]


def _random_packed(shape, seed, type_name="Q4_1"):
    rng = np.random.default_rng(seed)
    raw = gguf.quants.quantize((rng.standard_normal(shape) * 0.05).astype(np.float32),
                               gguf.GGMLQuantizationType[type_name])
    return rng, raw, jax.device_put(pack(raw, type_name, shape))


@pytest.mark.parametrize("shape", I16_SHAPES)
def test_int16_activation_matmul(shape):
    """Equal to the int16 emulation to float32 rounding, and within the rounding's bound of the
    float64 product: 1/258 of int8's step, so far inside int8's error."""
    rng, raw, pw = _random_packed(shape, hash(("i16", shape)) % 2**32)
    fn = jax.jit(lambda x, pw: linear_packed(x, pw, int16_activations=True))
    fn8 = jax.jit(lambda x, pw: linear_packed(x, pw, int8_activations=True))
    wd = np.abs(dequantize_reference(raw, "Q4_1", shape).astype(np.float64))
    q, d, _ = _quants(raw, "Q4_1", shape)
    dq = np.abs(q * np.repeat(d, 32, axis=1)).reshape(shape[0], -1, 32).sum(-1)   # sum |d * q| per block [N, nb]
    for M in ROWS:
        x = rng.standard_normal((M, shape[1])).astype(np.float32)
        x[:, :32] *= 40.0   # one block with outliers
        y = np.asarray(fn(x, pw), np.float64)
        emu, dx = emulate(x, raw, "Q4_1", shape, levels=32767)
        mag = np.abs(x).astype(np.float64) @ wd.T
        np.testing.assert_allclose(y, emu, rtol=0, atol=float(2e-6 * mag.max()),
                                   err_msg=f"{shape} M={M}: not the int16 computation")
        ref = matmul_reference(x, raw, "Q4_1", shape)
        err = np.abs(y - ref)
        assert (err <= np.einsum("mb,nb->mn", dx / 2, dq) + 2e-6 * mag).all(), \
            f"{shape} M={M}: error {err.max():.3g} over the rounding bound"
        err8 = np.abs(np.asarray(fn8(x, pw), np.float64) - ref).max()
        assert err.max() * 20 < err8, (err.max(), err8)
        if M == 1 and shape == (576, 1536):
            print(f"Q4_1 by int16: max |error| {err.max():.2e} ({err.max() / np.abs(ref).max():.1e} of max |y|); "
                  f"int8: {err8:.2e}")


@pytest.mark.parametrize("shape", [(576, 576), (1539, 576), (41, 288), (37, 96)])
def test_int16_row_is_the_same_bits_whatever_rows_share_the_call(shape):
    """A row of x gives the same bits alone (a decode: four weight rows a pass) as in calls of
    2, 3, 5 or 17 rows (tiles of 2 to 4 rows of x, fewer weight rows a pass) and of 33 or 40
    (a prefill's panels: the weights widened once, tiles of 4 x 2, a last tile of 1)."""
    rng, raw, pw = _random_packed(shape, hash(("i16 bits", shape)) % 2**32)
    fn = jax.jit(lambda x, pw: linear_packed(x, pw, int16_activations=True))
    x = rng.standard_normal((40, shape[1])).astype(np.float32)
    alone = np.stack([np.asarray(fn(x[i:i + 1], pw))[0] for i in range(40)])
    for M in (2, 3, 5, 17, 33, 40):
        np.testing.assert_array_equal(np.asarray(fn(x[:M], pw)), alone[:M], err_msg=f"{shape} M={M}")


@pytest.mark.parametrize("type_name", ("Q4_1", "Q8_0"))
@pytest.mark.parametrize("shape", INTERLEAVED_SHAPES)
def test_interleaved_rows_compute_the_int16_matmul(shape, type_name):
    """jaxllm_dot16_i16_q4_1 (Q4_1 in 16-row groups by int16 activations, vpdpwssd) computes
    the row-major int16 kernel's integer block sums, and jaxllm_dot16_i16_q8_0 (the tied LM
    head's type) the same sums of its int8 quants: equal to the emulation to float32
    rounding, within the rounding's bound of the float64 product, at every row count (tiles of
    1 to 8 rows of x, the few-row ones with more independent sums)."""
    if not native.quant_dot_vnni():
        pytest.skip("the CPU lacks AVX512F/BW/VNNI: the interleaved kernel cannot run here")
    rng, raw, pw = _random_packed(shape, hash(("i16 interleaved", shape, type_name)) % 2**32, type_name)
    iw = jax.device_put(interleave_rows(pw))
    fn = jax.jit(lambda x, w: linear_packed(x, w, int16_activations=True))
    wd = np.abs(dequantize_reference(raw, type_name, shape).astype(np.float64))
    q, d, _ = _quants(raw, type_name, shape)
    dq = np.abs(q * np.repeat(d, 32, axis=1)).reshape(shape[0], -1, 32).sum(-1)   # [N, nb]
    for M in ROWS:
        x = rng.standard_normal((M, shape[1])).astype(np.float32)
        x[:, :32] *= 40.0
        y = np.asarray(fn(x, iw), np.float64)
        emu, dx = emulate(x, raw, type_name, shape, levels=32767)
        mag = np.abs(x).astype(np.float64) @ wd.T
        np.testing.assert_allclose(y, emu, rtol=0, atol=float(2e-6 * mag.max()),
                                   err_msg=f"{type_name} {shape} M={M}: not the int16 computation")
        err = np.abs(y - matmul_reference(x, raw, type_name, shape))
        assert (err <= np.einsum("mb,nb->mn", dx / 2, dq) + 2e-6 * mag).all(), \
            f"{type_name} {shape} M={M}: error {err.max():.3g} over the rounding bound"


@pytest.mark.parametrize("type_name", ("Q4_1", "Q8_0"))
@pytest.mark.parametrize("shape", [(576, 576), (576, 1536), (48, 96)])
def test_interleaved_int16_row_is_the_same_bits_whatever_rows_share_the_call(shape, type_name):
    """A row of x gives the same bits alone (a decode) as in calls of 2 to 40 rows: tiles of 1
    to 8 rows of x, whose integer sums run in 8 or 2 chains (the order of exact integer adds)."""
    if not native.quant_dot_vnni():
        pytest.skip("the CPU lacks AVX512F/BW/VNNI: the interleaved kernel cannot run here")
    rng, raw, pw = _random_packed(shape, hash(("i16 interleaved bits", shape, type_name)) % 2**32, type_name)
    iw = jax.device_put(interleave_rows(pw))
    fn = jax.jit(lambda x, w: linear_packed(x, w, int16_activations=True))
    x = rng.standard_normal((40, shape[1])).astype(np.float32)
    alone = np.stack([np.asarray(fn(x[i:i + 1], iw))[0] for i in range(40)])
    for M in (2, 3, 5, 9, 17, 33, 40):
        np.testing.assert_array_equal(np.asarray(fn(x[:M], iw)), alone[:M], err_msg=f"{shape} M={M}")


def test_int16_activations_are_refused_for_other_types():
    """Row-major: Q4_1 only (Q8_0 has its int16 kernel in interleaved rows alone); interleaved:
    Q4_1 and Q8_0."""
    raw = gguf.quants.quantize(np.ones((32, 64), np.float32), gguf.GGMLQuantizationType.Q8_0)
    pw = pack(raw, "Q8_0", (32, 64))
    with pytest.raises(ValueError, match=r"no 16-bit-activation kernel for Q8_0 weights \(those: Q4_1\)"):
        linear_packed(jnp.ones((1, 64), jnp.float32), pw, int16_activations=True)
    raw = gguf.quants.quantize(np.ones((32, 64), np.float32), gguf.GGMLQuantizationType.Q4_0)
    with pytest.raises(ValueError, match=r"for Q4_0 weights in interleaved rows \(those: Q4_1, Q8_0\)"):
        linear_packed(jnp.ones((1, 64), jnp.float32), interleave_rows(pack(raw, "Q4_0", (32, 64))),
                      int16_activations=True)
