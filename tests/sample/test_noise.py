"""The noise and the exactly rounded kernels: device (XLA) and host (numpy) agree bit for bit.

The float32 noise is a function of 24 random bits, so all 2^24 inputs are checked: this is
what makes the serial host reference able to reproduce the device draw at all.  It also
pins down the accuracy of the hand-written logarithm (against float64 numpy) and the bound
the draw uses to skip the exact noise of most of the vocabulary.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.formats import gumbel as G
from jaxllm.formats import numerics as nx

ALL_K = np.arange(1 << 24, dtype=np.int32)


def _host(fn, *args, **kw):
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        return fn(*args, **kw)


def test_float32_noise_is_bit_identical_for_all_2_24_inputs():
    host = _host(G.gumbel_from_index, ALL_K, np)
    dev = np.asarray(jax.jit(lambda k, z: G.gumbel_from_index(k, jnp, z))(ALL_K, jnp.zeros((), jnp.int32)))
    diff = np.flatnonzero(dev.view(np.int32) != host.view(np.int32))
    assert diff.size == 0, f"{diff.size} inputs differ, first k={diff[:5]}: {dev[diff[:5]]} vs {host[diff[:5]]}"
    # Accuracy against float64 (absolute for |g| < 1: near g = 0 the relative error is meaningless).
    u = (2.0 * ALL_K + 1.0) / 2.0 ** 25
    exact = -np.log(-np.log(u))
    err = np.abs(host - exact) / np.maximum(1.0, np.abs(exact))
    assert err.max() < 4 * 2.0 ** -24, err.max()
    # Finite everywhere (the old uniform rounded k = 2^24-1 to u = 1.0: g = +inf).
    assert np.isfinite(host).all()
    assert host.min() == np.float32(G.G_MIN_F32) and 17.32 < host.max() < 17.33


def test_noise_upper_bound_holds_for_all_inputs():
    host = _host(G.gumbel_from_index, ALL_K, np)
    bits = (ALL_K.astype(np.uint32) << np.uint32(8)) | np.uint32(0xA5)
    ub = G.noise_upper_bound(bits, xp=np)
    assert (ub >= host).all()
    # Tight where it matters: the winners (largest noise) are bounded within ln 2.
    top = host > 5
    assert (ub[top] - host[top]).max() < 0.70


def test_log_and_exp_kernels_are_bit_identical_and_accurate():
    rng = np.random.default_rng(0)
    x = np.concatenate([np.exp(rng.uniform(-86, 88, 1 << 20)), rng.uniform(0.5, 2.0, 1 << 18),
                        [np.finfo(np.float32).tiny, 1.0, np.nextafter(np.float32(1), np.float32(0))]]).astype(np.float32)
    z = jnp.zeros((), jnp.int32)
    lh = _host(nx.log_positive, x, nx.F32, np)
    ld = np.asarray(jax.jit(lambda x, z: nx.log_positive(x, nx.F32, jnp, z))(x, z))
    assert np.array_equal(lh.view(np.int32), ld.view(np.int32))
    ex = np.log(x.astype(np.float64))
    ulp = np.abs(lh - ex) / np.spacing(np.abs(ex).astype(np.float32)).astype(np.float64)
    assert ulp[np.abs(ex) > 1e-3].max() <= 2.0

    y = np.concatenate([-rng.exponential(8.0, 1 << 20), [0.0, -0.0, -np.inf, -1e-30, -86.0, -87.5]]).astype(np.float32)
    eh = _host(nx.exp_nonpos, y, np)
    ed = np.asarray(jax.jit(lambda y, z: nx.exp_nonpos(y, jnp, z))(y, z))
    assert np.array_equal(eh.view(np.int32), ed.view(np.int32))
    ey = np.exp(y.astype(np.float64))
    normal = ey > 2.0 ** -125
    assert (np.abs(eh[normal] - ey[normal]) / np.spacing(ey[normal].astype(np.float32))).max() <= 2.0
    assert (eh[~normal] == 0).all()
    # Fixed-point limbs of the masses: exact on both sides.
    for a, b in zip(_host(nx.limbs, eh, np), jax.jit(nx.limbs)(ed)):
        assert np.array_equal(a, np.asarray(b))


def test_float64_noise_is_bit_identical_on_a_sample():
    seeds = np.array([1, 2**40 + 7, 2**63 - 1], dtype=np.uint64)
    lo, hi = (seeds & 0xFFFFFFFF).astype(np.uint32), (seeds >> np.uint64(32)).astype(np.uint32)
    pos = np.array([0, 5, 123456])
    V = 300_000
    with jax.enable_x64(True):
        keys = G.row_keys(lo, hi, pos, xp=np)
        host = _host(G.noise_at, keys, np.arange(V, dtype=np.uint32), None, True, xp=np)
        dev = np.asarray(jax.jit(lambda k, p: G.noise_at(k, jnp.arange(V, dtype=jnp.uint32), G.runtime_zero(p), True))(
            keys, pos.astype(np.int32)))
    assert host.dtype == dev.dtype == np.float64
    assert np.array_equal(host.view(np.int64), dev.view(np.int64))
    assert np.isfinite(host).all()
    bits = G.element_bits(keys, np.arange(V, dtype=np.uint32), np)
    assert (G.noise_upper_bound(bits, fp64=True, xp=np) >= host).all()


def test_noise_depends_on_seed_position_and_index_only():
    a = G.gumbel_noise_np(12345, 7, 1000)
    assert np.array_equal(a, G.gumbel_noise_np(12345, 7, 5000)[:1000])      # width-independent
    assert not np.array_equal(a, G.gumbel_noise_np(12345, 8, 1000))
    assert not np.array_equal(a, G.gumbel_noise_np(12346, 7, 1000))
    assert not np.array_equal(a, G.gumbel_noise_np(12345 + (1 << 32), 7, 1000))   # the high word counts
    lo, hi = G.split_seed(12345)
    dev = jax.jit(lambda a, b, c: G.gumbel_noise(a, b, c, 1000))(
        np.array([0, lo], np.uint32), np.array([0, hi], np.uint32), np.array([0, 7], np.int32))
    assert np.array_equal(np.asarray(dev)[1], a)
