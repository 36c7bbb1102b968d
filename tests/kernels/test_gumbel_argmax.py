"""The Pallas draw kernel (jaxllm/pallas/gumbel_argmax.py) in interpret mode, against its plain-jnp
reference and the serial host reference ``reference.sample_row`` (the oracle), and the sampler's
``kernel_backend="pallas"`` against the XLA path.

The kernel's thresholds come from the caller; here they are read off the host reference's own
(sort-based) truncation, so the kernel is checked against an independent oracle for top-k /
top-p / min-p, not against the device threshold search.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import io
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.pallas import gumbel_argmax as ga
from jaxllm.sample import metadata as smd
from jaxllm.formats import numerics as nx
from jaxllm.sample import reference as ref
from jaxllm.sample import sampler as sm
from jaxllm.sample import truncation
from jaxllm.formats.gumbel import gumbel_noise_np, split_seed
from jaxllm.sample.metadata import RowParams

_F = np.float32
SMALL = dict(block_rows=2, block_vocab=1024)   # many tiles and row blocks (8192 entries: 1 tile)


# ---------------------------------------------------------------- host side: args and oracle

def host_args(rows):
    """rows: [(logits [V], RowParams, out_pos)] -> the kernel's eight arguments (numpy), with tau
    and the row maximum taken from the serial reference's truncation."""
    S = len(rows)
    x = np.stack([ref.process_row(lg, p) for lg, p, _ in rows]).astype(_F)
    temp = np.array([p.temperature for _, p, _ in rows], _F)
    tau = np.zeros(S, np.uint32)
    lmp = np.array([smd.log_min_p(p.min_p) for _, p, _ in rows], _F)
    rmax = np.zeros(S, _F)
    for i, (_, p, _) in enumerate(rows):
        if p.temperature <= 0:
            continue
        x1 = x[i] / _F(p.temperature)
        rmax[i] = np.where(x1 == 0, _F(0), x1).max()
        kept = ref.truncate_row(x1, p)
        fin = np.isfinite(kept)
        # The least key of the kept entries keeps exactly them (float_key is monotone).
        tau[i] = nx.float_key(kept[fin], np).min() if fin.any() else 0
    seeds = [split_seed(p.seed) for _, p, _ in rows]
    lo = np.array([s[0] for s in seeds], np.uint32)
    hi = np.array([s[1] for s in seeds], np.uint32)
    pos = np.array([t for _, _, t in rows], np.int32)
    return x, temp, tau, lmp, rmax, lo, hi, pos


def oracle(rows):
    return [ref.sample_row(lg, p, t) for lg, p, t in rows]


_reference_jit = jax.jit(ga.gumbel_argmax_reference)


def kernel_tokens(args, **blocks):
    # interpret=None: interpreted on CPU, the compiled kernel on a GPU (the device check runs this file).
    return np.asarray(ga.gumbel_argmax(*map(jnp.asarray, args), **blocks)).tolist()


def reference_tokens(args):
    return np.asarray(_reference_jit(*map(jnp.asarray, args))).tolist()


def noise_ties(seed: int, V: int, positions=range(8)):
    """(out_pos, i, j), i < j, with identical noise at i and j, for a few positions."""
    out = []
    for t in positions:
        g = gumbel_noise_np(seed, t, V)
        order = np.argsort(g, kind="stable")
        for k in np.flatnonzero(g[order][1:] == g[order][:-1]):
            i, j = sorted((int(order[k]), int(order[k + 1])))
            out.append((t, i, j))
    return out


def only(V, idx, value=0.0):
    """A row of -inf except ``value`` at ``idx``."""
    x = np.full(V, -np.inf, _F)
    x[list(idx)] = value
    return x


# ---------------------------------------------------------------- rows

def mixed_rows(V: int, seed: int):
    rng = np.random.default_rng(seed)
    seeds = [int(s) for s in rng.integers(0, 2**63, size=12, dtype=np.uint64)]

    def logits(scale=3.0):
        return (rng.standard_normal(V) * scale).astype(_F)

    rows = []
    lg = logits()                                        # greedy, maximum repeated: lowest index wins
    lg[np.sort(rng.choice(V, 3, replace=False))] = lg.max() + 1
    rows.append((lg, RowParams(temperature=0.0), 0))
    rows.append((logits(), RowParams(temperature=1.0, seed=seeds[0]), 3))
    rows.append((logits(), RowParams(temperature=0.6, seed=seeds[1]), 17))
    rows.append((logits(), RowParams(temperature=0.8, top_k=40, seed=seeds[2]), 5))
    rows.append((logits(1.0), RowParams(temperature=1.0, top_p=0.9, seed=seeds[3]), 1))
    rows.append((logits(), RowParams(temperature=1.5, min_p=0.05, seed=seeds[4]), 9))
    rows.append((logits(), RowParams(temperature=1.2, top_k=200, top_p=0.8, min_p=0.01, seed=seeds[5]), 2))
    tied = np.round(logits(1.0)).astype(_F)              # top-k through a tie group (all of it kept)
    rows.append((tied, RowParams(temperature=0.9, top_k=7, seed=seeds[6]), 4))
    lg = logits()
    lg[rng.choice(V, V // 2, replace=False)] = -np.inf   # masked entries (allowed tokens)
    rows.append((lg, RowParams(temperature=0.7, top_p=0.95, seed=seeds[7]), 6))
    j = int(rng.integers(V))                             # masked but one entry
    rows.append((only(V, [j], 1.5), RowParams(temperature=1.0, seed=seeds[8]), 8))
    return rows


# ---------------------------------------------------------------- kernel vs references

@pytest.mark.parametrize("V", [1000, 4096, 32003, 49152])
def test_kernel_equals_references(V):
    seeds = (0, 1) if V <= 4096 else (0,)
    for seed in seeds:
        rows = mixed_rows(V, seed)
        args = host_args(rows)
        expect = oracle(rows)
        assert reference_tokens(args) == expect, f"V={V} seed={seed}: jnp reference"
        assert kernel_tokens(args) == expect, f"V={V} seed={seed}: kernel, default blocks"
        if V != 49152:
            assert kernel_tokens(args, **SMALL) == expect, f"V={V} seed={seed}: kernel, small blocks"


def test_noise_ties_resolve_to_the_lowest_index_across_and_within_tiles():
    V, seed = 49152, 12345
    ties = noise_ties(seed, V)
    bv = SMALL["block_vocab"]
    across = [t for t in ties if t[1] // bv != t[2] // bv]
    within = [t for t in ties if t[1] // bv == t[2] // bv]
    assert across and within, "no noise ties found"
    rows = [(only(V, [i, j]), RowParams(temperature=1.0, seed=seed), t) for t, i, j in across[:2] + within[:1]]
    # Greedy ties: across tiles (first and last tile) and within one tile.
    rows.append((only(V, [5, V - 3], 2.0), RowParams(temperature=0.0), 0))
    rows.append((only(V, [bv + 7, bv + 9], 2.0), RowParams(temperature=0.0), 0))
    args = host_args(rows)
    expect = [min(np.flatnonzero(np.isfinite(lg))) for lg, _, _ in rows]
    assert oracle(rows) == expect
    assert reference_tokens(args) == expect
    assert kernel_tokens(args, **SMALL) == expect
    assert kernel_tokens(args, block_rows=1, block_vocab=4096) == expect


def test_winner_in_the_first_and_the_last_tile():
    V = 32003                                            # last tile partial: padded with -inf
    rng = np.random.default_rng(7)
    rows = []
    for idx in (0, 3, V - 1, V - 600):
        for temp in (0.0, 1.0):
            lg = (rng.standard_normal(V)).astype(_F)
            lg[idx] = 100.0
            rows.append((lg, RowParams(temperature=temp, top_p=0.99 if temp else 1.0, seed=int(rng.integers(2**62))),
                         idx % 5))
    # Every entry masked: the serial scan keeps index 0 (greedy and random).
    rows.append((np.full(V, -np.inf, _F), RowParams(temperature=0.0), 0))
    rows.append((np.full(V, -np.inf, _F), RowParams(temperature=1.0, seed=3), 0))
    args = host_args(rows)
    expect = oracle(rows)
    assert expect[:8] == [0, 0, 3, 3, V - 1, V - 1, V - 600, V - 600] and expect[8:] == [0, 0]
    assert kernel_tokens(args, **SMALL) == expect
    assert kernel_tokens(args) == expect


def test_noise_is_bit_exact():
    """Logits x = -g (the host noise): every score x + g is exactly 0 and the serial scan keeps
    index 0.  A kernel whose noise is one ulp above the host's anywhere (e.g. a product fused into
    an FMA because the barrier's zero was a constant) scores > 0 there and wins instead."""
    V = 32003
    rows = []
    for seed, t in ((1, 0), (2**40 + 3, 7), (2**63 + 5, 123)):
        rows.append((-gumbel_noise_np(seed, t, V), RowParams(temperature=1.0, seed=seed), t))
    args = host_args(rows)
    assert oracle(rows) == [0, 0, 0]
    assert reference_tokens(args) == [0, 0, 0]
    assert kernel_tokens(args) == [0, 0, 0]


def test_token_does_not_depend_on_the_batch_row():
    V = 4096
    rows = mixed_rows(V, 2) + mixed_rows(V, 3)[1:6]
    expect = oracle(rows)
    perm = np.random.default_rng(0).permutation(len(rows))
    shuffled = [rows[i] for i in perm]
    got = kernel_tokens(host_args(shuffled), **SMALL)
    assert got == [expect[i] for i in perm]
    assert kernel_tokens(host_args(rows[3:4]), **SMALL) == expect[3:4]   # alone: the S=1 shape


def test_several_seeds_and_positions():
    V = 4096
    rng = np.random.default_rng(11)
    lg = (rng.standard_normal(V) * 2).astype(_F)
    rows = [(lg, RowParams(temperature=1.0, top_k=50 * (i % 3), seed=int(s)), int(t))
            for i, (s, t) in enumerate(zip(rng.integers(0, 2**63, 12, dtype=np.uint64), rng.integers(0, 4000, 12)))]
    expect = oracle(rows)
    assert len(set(expect)) > 3, "the same logits must draw different tokens under different seeds"
    assert kernel_tokens(host_args(rows), **SMALL) == expect


def test_ieee_division_rewrite_keeps_the_result():
    """The CUDA path swaps every float32 division of the tile computation for PTX ``div.rn``
    (``_ieee_division``).  Run that same jaxpr rewrite with XLA's (IEEE) division in interpret
    mode: the tokens must not change; with a wrong division they must."""
    rows = mixed_rows(4096, 5)
    args = host_args(rows)
    expect = oracle(rows)

    def run(division):
        f = jax.jit(functools.partial(ga._gumbel_argmax, block_rows=4, block_vocab=1024, interpret=True,
                                      division=division))
        return np.asarray(f(*map(jnp.asarray, args))).tolist()

    assert run(jax.lax.div) == expect
    assert run(lambda a, b: a * b) != expect             # the hook does reach the divisions


def test_lowers_through_triton_with_ieee_division():
    """Lowering for CUDA needs no GPU: both kernels must lower through Pallas' Triton backend (power
    of two blocks, supported primitives), with no approximate ``arith.divf`` left."""
    S, V = 3, 5000
    shapes = [jax.ShapeDtypeStruct((S, V), jnp.float32)] + [
        jax.ShapeDtypeStruct((S,), d) for d in (jnp.float32, jnp.uint32, jnp.float32, jnp.float32, jnp.uint32,
                                                jnp.uint32, jnp.int32)]
    br, bv = ga.resolve_blocks(S, V, None, None, interpret=False)
    f = jax.jit(functools.partial(ga._gumbel_argmax, block_rows=br, block_vocab=bv, interpret=False,
                                  division=ga._div_rn_ptx, debug=True))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        lowered = f.trace(*shapes).lower(lowering_platforms=("cuda",))
    text = out.getvalue()
    assert lowered.as_text().count("xla.gpu.triton") == 2
    assert "arith.divf" not in text
    assert len(re.findall(r'tt.elementwise_inline_asm "div.rn.f32', text)) >= 2


def test_refuses_fp64_and_odd_blocks():
    args = [jnp.asarray(a) for a in host_args(mixed_rows(1000, 0)[:2])]
    with pytest.raises(ValueError, match="float32"):
        ga.gumbel_argmax(*args, fp64=True)
    with pytest.raises(ValueError, match="power"):
        ga.gumbel_argmax(*args, block_vocab=1000, interpret=True)


# ---------------------------------------------------------------- the sampler, end to end

def sampler_batch(V: int, seed: int):
    """A batch mixing greedy, temperature, top-k, top-p (a wide nucleus over a flat row, which the
    candidate search leaves open), min-p and penalty rows: (logits, metadata, state, host rows)."""
    rng = np.random.default_rng(seed)
    seeds = [int(s) for s in rng.integers(0, 2**63, size=8, dtype=np.uint64)]
    flat = np.full(V, 0.5, _F)
    flat[rng.choice(V, V // 3, replace=False)] = 0.25
    lg = lambda s=3.0: (rng.standard_normal(V) * s).astype(_F)   # noqa: E731
    rows = [(lg(), RowParams(temperature=0.0), 0),
            (lg(), RowParams(temperature=0.8, seed=seeds[0]), 4),
            (lg(), RowParams(temperature=1.0, top_k=20, seed=seeds[1]), 1),
            (lg(1.0), RowParams(temperature=1.0, top_p=0.9, seed=seeds[2]), 7),
            (flat, RowParams(temperature=1.0, top_p=0.999, seed=seeds[3]), 2),
            (lg(1.0), RowParams(temperature=1.0, top_k=3000, top_p=0.97, seed=seeds[4]), 5),
            (lg(), RowParams(temperature=1.3, min_p=0.1, seed=seeds[5]), 3),
            (lg(), RowParams(temperature=0.0, repetition_penalty=1.5), 0)]
    S = len(rows)
    a = smd.empty_metadata(S)
    a["slot"][:] = S
    counts = np.zeros((S + 1, V), np.int32)
    counts[7, rng.choice(V, 30, replace=False)] = 2
    for i, (_, p, t) in enumerate(rows):
        smd.fill_row(a, i, p, slot=i, out_pos=t, num_prompt=0, reset=False, suppress=[], num_logprobs=2)
    state = sm.SamplerState(jnp.asarray(counts), jnp.zeros((S + 1, V), bool), jnp.zeros((S + 1, V), _F))
    logits = jnp.asarray(np.stack([r[0] for r in rows]))
    host = [(r[0], r[1], r[2], counts[i]) for i, r in enumerate(rows)]
    return logits, smd.to_metadata(a), state, host


@functools.cache
def _sample(backend):
    """The sampler with the given draw backend, jitted once for the file: processed logprobs
    (the mode whose logprobs are read off the logits the draw sees; raw logprobs come from the
    step's logits before any processing, whichever backend draws), 2 of them."""
    return jax.jit(lambda l, d, s: sm.sample(l, d, s, max_logprobs=2, logprobs_mode="processed_logprobs",
                                             kernel_backend=backend))


SAMPLER_V = 8192                                         # above the candidate search's 1024 entries


def test_sampler_pallas_backend_equals_xla():
    V = SAMPLER_V
    logits, md, state, host = sampler_batch(V, 0)
    m = jnp.asarray(np.asarray(logits)[4:5])
    # The flat top_p=0.999 row is left open by the candidate search: the whole-row search runs.
    x1 = m / 1.0
    _, open_p, _, _ = truncation.truncation_threshold(x1, x1.max(axis=-1), jax.tree.map(lambda v: v[4:5], md),
                                                      jnp.zeros((1, 1), jnp.int32))
    assert bool(open_p[0])

    def run(backend):
        return jax.tree.map(np.asarray, _sample(backend)(logits, md, state))

    expect = [ref.sample_row(lg, p, t, counts=c) for lg, p, t, c in host]
    xla, pallas = run("xla"), run("pallas")
    assert xla.token_ids.tolist() == pallas.token_ids.tolist() == expect
    for name in ("sampled_logprob", "sampled_rank", "top_ids", "top_logprobs"):
        np.testing.assert_array_equal(getattr(xla, name), getattr(pallas, name), err_msg=name)


def test_sampler_pallas_backend_all_greedy_and_refusals():
    # The programs of test_sampler_pallas_backend_equals_xla (same shapes), other rows.
    logits, md, state, host = sampler_batch(SAMPLER_V, 1)
    greedy = dataclasses.replace(md, temperature=jnp.zeros_like(md.temperature))
    got, want = (np.asarray(_sample(b)(logits, greedy, state).token_ids).tolist() for b in ("pallas", "xla"))
    assert got == want
    with pytest.raises(ValueError, match="fp64"):
        sm.sample(logits, md, state, max_logprobs=0, fp64=True, kernel_backend="pallas")
    with pytest.raises(ValueError, match="kernel_backend"):
        sm.sample(logits, md, state, max_logprobs=0, kernel_backend="triton")
