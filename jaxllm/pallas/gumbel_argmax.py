"""The sampler's draw as a Pallas kernel: temperature, min_p, top-k/top-p mask, Gumbel noise and
the first-argmax over the vocabulary, fused into one pass over the logits.

``gumbel_argmax(x, ...)`` returns, for each row of the processed logits ``x`` [S, V], the token
that ``jaxllm.sample.sampler.sample`` draws (greedy rows: the lowest index of the maximum of
``x``; random rows: the lowest index of the maximum of ``x1 + g``, ``x1`` the scaled and
truncated logits, ``g`` the counter-based Gumbel noise of ``gumbel.py``), bit for bit equal to
the serial host reference ``jaxllm.sample.reference.sample_row``.  The thresholds (``tau`` of
top-k/top-p, the row maximum for min_p) are the caller's (``jaxllm.sample.truncation``, see
``draw.draw_pallas``): the kernel applies them, it does not search for them.

Two Pallas calls, a grid reduction:

1. ``_tile_kernel`` over the grid (row blocks, vocabulary tiles): each program reads one
   [BR, BV] tile of ``x``, computes the scores, and writes the tile's maximum and the lowest
   index holding it ([S, T] partials, T the tile count rounded up to a power of two; the
   extra tiles write ``-inf``).
2. ``_reduce_kernel`` over row blocks: the row maximum of the partials, then the lowest
   index among the tiles holding it.

Both reductions are max then min-of-index, which no order of evaluation can change, so the
result equals the serial left-to-right scan whatever the tiling.

Exactness on a GPU: the noise is computed with ``numerics.py``'s exactly rounded
operations, which need IEEE division.  Triton lowers a float32 ``arith.divf`` to PTX
``div.full.f32`` (approximate, up to 2 ulp), so on CUDA every float32 division of the tile
computation is replaced by an inline ``div.rn.f32`` (``_ieee_division``).  Products that feed
additions go through ``numerics.barrier`` with the runtime zero passed in as an input, so
Triton's FMA contraction cannot change them either.

Lowering constraints (jax 0.10, Triton backend): block shapes are powers of two, no
``pl.load``/``pl.store`` (ref indexing), no reshapes of odd shapes in the kernel, and the
``pallas_call`` is built inside the traced wrapper (a module-level kernel reused across grid
sizes can read a stale ``pl.num_programs()``, jax#40847).  On CPU the kernels run with
``interpret=True``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton
from jax.extend import core as jex_core

from jaxllm.formats import numerics as nx
from jaxllm.formats.gumbel import element_bits, gumbel_from_bits, row_keys, runtime_zero

_NEG_INF = -np.inf
_BIG = np.iinfo(np.int32).max           # "no index": above every vocabulary index

GPU_BLOCK_ROWS = 1
"""Rows per program on a GPU: one row per program keeps a tile's intermediates in registers."""
GPU_BLOCK_VOCAB = 2048
"""Vocabulary entries per program on a GPU (16 per thread with 4 warps)."""
CPU_BLOCK_ROWS = 8
"""Rows per program in interpret mode (each program is one iteration of a serial loop there,
so fewer, larger tiles are faster)."""
CPU_BLOCK_VOCAB = 8192
NUM_WARPS = 4


def _is_pow2(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


# ---------------------------------------------------------------- IEEE division on CUDA

def _div_rn_ptx(a, b):
    """a / b rounded to nearest (PTX ``div.rn.f32``); a, b float32, broadcast to one shape."""
    a, b = jnp.broadcast_arrays(a, b)
    [q] = pltriton.elementwise_inline_asm(
        "div.rn.f32 $0, $1, $2;", args=[a, b], constraints="=f,f,f", pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(a.shape, a.dtype)])
    return q


def _ieee_division(fn, div):
    """``fn`` with every float32 division (``lax.div_p``, nested ``jit``s included) computed by
    ``div(a, b)``: ``fn`` is traced to a jaxpr and re-evaluated with that one rule swapped.
    numerics.py divides with the ``/`` operator, which Triton would make approximate."""
    if div is None:
        return fn

    def run(jaxpr, consts, args):
        env = {}

        def read(v):
            return v.val if isinstance(v, jex_core.Literal) else env[v]

        env.update(zip(jaxpr.constvars, consts))
        env.update(zip(jaxpr.invars, args))
        for eqn in jaxpr.eqns:
            ins = [read(v) for v in eqn.invars]
            if eqn.primitive is jax.lax.div_p and eqn.outvars[0].aval.dtype == jnp.float32:
                outs = [div(*ins)]
            elif eqn.primitive.name in ("jit", "pjit", "closed_call"):
                sub = eqn.params["jaxpr"]                                 # a ClosedJaxpr
                outs = run(sub.jaxpr, sub.consts, ins)
            elif any(True for _ in jex_core.jaxprs_in_params(eqn.params)):
                # A loop or a branch could hide a division: refuse rather than miss it.
                raise NotImplementedError(f"_ieee_division: {eqn.primitive.name} is not handled")
            else:
                outs = eqn.primitive.bind(*ins, **eqn.primitive.get_bind_params(eqn.params))
                if not eqn.primitive.multiple_results:
                    outs = [outs]
            for v, o in zip(eqn.outvars, outs):
                if not isinstance(v, jex_core.DropVar):
                    env[v] = o
        return [read(v) for v in jaxpr.outvars]

    @functools.wraps(fn)
    def wrapped(*args):
        closed = jax.make_jaxpr(fn)(*args)
        [out] = run(closed.jaxpr, closed.consts, args)
        return out

    return wrapped


def _division_for(interpret: bool):
    """The float32 division the kernels need: PTX ``div.rn`` on CUDA; native in interpret mode
    (XLA's is IEEE) and on ROCm (no PTX there; Triton's AMD lowering of ``divf`` is the
    correctly rounded sequence, not verified on hardware here)."""
    if interpret:
        return None
    if "rocm" in jax.devices()[0].client.platform_version.lower():
        return None
    return _div_rn_ptx


# ---------------------------------------------------------------- the scores (one tile)

def _scores(x, temp, tau, log_min_p, row_max, keys, zero, idx):
    """The draw's score of every entry of a tile; x [BR, BV] f32, idx [BR, BV] i32 vocabulary
    indices; temp, log_min_p, row_max [BR, 1] f32, tau, keys [BR, 1] u32, zero [BR, 1] i32.

    Random rows (temp > 0): the sampler's x1 = x / temp (no -0.0), min_p against the caller's
    row maximum, the top-k/top-p threshold on the monotone key, plus the Gumbel noise.
    Greedy rows: x itself (no noise, no thresholds)."""
    random = temp > 0.0                                                  # [BR, 1]
    x1 = x / jnp.where(random, temp, jnp.float32(1.0))                  # [BR, BV]
    x1 = jnp.where(x1 == 0.0, jnp.float32(0.0), x1)                     # no -0.0 for float_key
    x1 = jnp.where(x1 - row_max < log_min_p, jnp.float32(_NEG_INF), x1)  # min_p (-inf: off)
    x1 = jnp.where(nx.float_key(x1) >= tau, x1, jnp.float32(_NEG_INF))  # top-k / top-p (0: off)
    g = gumbel_from_bits(element_bits(keys[:, 0], idx), zero=zero)       # [BR, BV] f32
    return jnp.where(random, x1 + g, x)


# ---------------------------------------------------------------- pass 1: per-tile partials

def _tile_kernel(x_ref, temp_ref, tau_ref, lmp_ref, rmax_ref, keys_ref, zero_ref,   # inputs
                 max_ref, arg_ref,                                                   # outputs
                 *, block_vocab: int, num_tiles: int, division):
    # x_ref [BR, BV]; the per-row refs [BR, 1]; max_ref, arg_ref [BR, 1]: this tile's partials.
    j = pl.program_id(1)

    @pl.when(j < num_tiles)
    def _():
        x = x_ref[...]                                                   # [BR, BV] f32
        temp = temp_ref[...]                                             # [BR, 1]
        idx = j * block_vocab + jax.lax.broadcasted_iota(jnp.int32, x.shape, 1)   # [BR, BV]
        scores = _ieee_division(_scores, division)
        # A block of greedy rows needs no noise: skip the hash and the logarithms.
        y = jax.lax.cond(
            jnp.max(temp) > 0.0,
            lambda: scores(x, temp, tau_ref[...], lmp_ref[...], rmax_ref[...], keys_ref[...], zero_ref[...], idx),
            lambda: x)
        m = jnp.max(y, axis=1)                                           # [BR]
        # Lowest index holding the maximum (an all -inf tile: its first index).
        first = jnp.min(jnp.where(y == m[:, None], idx, _BIG), axis=1)   # [BR]
        max_ref[...] = m[:, None]
        arg_ref[...] = first[:, None]

    @pl.when(j >= num_tiles)
    def _():
        # Padding tiles (the partials' width is a power of two): never the answer.
        max_ref[...] = jnp.full(max_ref.shape, _NEG_INF, jnp.float32)
        arg_ref[...] = jnp.full(arg_ref.shape, _BIG, jnp.int32)


# ---------------------------------------------------------------- pass 2: partials -> token

def _reduce_kernel(max_ref, arg_ref, tok_ref):
    # max_ref, arg_ref [BR, T] partials; tok_ref [BR, 1].
    pm = max_ref[...]                                                    # [BR, T] f32
    m = jnp.max(pm, axis=1)                                              # [BR]
    # The tiles holding the maximum; each tile's index lies in its own range, so the least
    # index among them is the lowest tile's lowest index: the serial scan's first maximum.
    tok = jnp.min(jnp.where(pm == m[:, None], arg_ref[...], _BIG), axis=1)   # [BR]
    tok_ref[...] = tok[:, None]


# ---------------------------------------------------------------- wrapper

def _gumbel_argmax(x, temperature, tau, log_min_p, row_max, seed_lo, seed_hi, out_pos, *,
                   block_rows: int, block_vocab: int, interpret: bool, division, debug: bool = False):
    """Builds and runs both pallas_calls (called while tracing: a fresh pallas_call per shape)."""
    S, V = x.shape
    BR, BV = block_rows, block_vocab
    S_pad = -(-S // BR) * BR
    num_tiles = -(-V // BV)
    T = pl.next_power_of_2(num_tiles)                                    # partials' width
    V_pad = num_tiles * BV
    nrb = S_pad // BR

    # Padding: -inf entries never beat a real one (ties go to the lower, real, index); padding
    # rows are greedy (temperature 0) and sliced off.
    x = jnp.pad(x.astype(jnp.float32), ((0, S_pad - S), (0, V_pad - V)), constant_values=_NEG_INF)

    def col(a, dtype):
        return jnp.pad(a.astype(dtype), (0, S_pad - S))[:, None]         # [S_pad, 1]

    keys = row_keys(seed_lo, seed_hi, out_pos)                           # [S] u32
    zero = runtime_zero(out_pos)                                         # [S, 1] i32, a runtime 0
    rows = [col(temperature, jnp.float32), col(tau, jnp.uint32), col(log_min_p, jnp.float32),
            col(row_max, jnp.float32), col(keys, jnp.uint32), col(zero[:, 0], jnp.int32)]

    row_spec = pl.BlockSpec((BR, 1), lambda i, j: (i, 0))
    # Tiles past the last real one read the last real tile (their result is discarded).
    x_spec = pl.BlockSpec((BR, BV), lambda i, j: (i, jnp.minimum(j, num_tiles - 1)))
    part_spec = pl.BlockSpec((BR, 1), lambda i, j: (i, j))
    params = None if interpret else pltriton.CompilerParams(num_warps=NUM_WARPS, num_stages=1)
    part_max, part_arg = pl.pallas_call(
        functools.partial(_tile_kernel, block_vocab=BV, num_tiles=num_tiles, division=division),
        grid=(nrb, T),
        in_specs=[x_spec] + [row_spec] * len(rows),
        out_specs=[part_spec, part_spec],
        out_shape=[jax.ShapeDtypeStruct((S_pad, T), jnp.float32),
                   jax.ShapeDtypeStruct((S_pad, T), jnp.int32)],
        compiler_params=params, interpret=interpret, debug=debug, name="gumbel_argmax_tiles",
    )(x, *rows)                                                          # [S_pad, T] each

    tokens = pl.pallas_call(
        _reduce_kernel,
        grid=(nrb,),
        in_specs=[pl.BlockSpec((BR, T), lambda i: (i, 0))] * 2,
        out_specs=pl.BlockSpec((BR, 1), lambda i: (i, 0)),
        out_shape=jax.ShapeDtypeStruct((S_pad, 1), jnp.int32),
        compiler_params=params, interpret=interpret, debug=debug, name="gumbel_argmax_reduce",
    )(part_max, part_arg)                                                # [S_pad, 1]
    return tokens[:S, 0]


def resolve_blocks(S: int, V: int, block_rows: int | None, block_vocab: int | None,
                   interpret: bool) -> tuple[int, int]:
    """Default and validated (power-of-two) block sizes."""
    if block_rows is None:
        block_rows = min(CPU_BLOCK_ROWS, pl.next_power_of_2(S)) if interpret else GPU_BLOCK_ROWS
    if block_vocab is None:
        block_vocab = min(CPU_BLOCK_VOCAB if interpret else GPU_BLOCK_VOCAB, pl.next_power_of_2(V))
    for name, b in (("block_rows", block_rows), ("block_vocab", block_vocab)):
        if not _is_pow2(int(b)):
            raise ValueError(f"{name}={b}: block shapes must be powers of two (Triton)")
    return int(block_rows), int(block_vocab)


@functools.partial(jax.jit, static_argnames=("block_rows", "block_vocab", "interpret", "fp64"))
def gumbel_argmax(x, temperature, tau, log_min_p, row_max, seed_lo, seed_hi, out_pos, *,
                  block_rows: int | None = None, block_vocab: int | None = None,
                  interpret: bool | None = None, fp64: bool = False) -> jax.Array:
    """The sampler's draw for every row: [S] int32 tokens.

    x [S, V] f32 processed logits (-inf: masked), any V; temperature [S] f32 (<= 0: greedy);
    tau [S] u32 (keep entries with ``float_key(x1) >= tau``; 0: no truncation); log_min_p [S]
    f32 (-inf: off); row_max [S] f32 (max of x / temperature, no -0.0, before min_p);
    seed_lo, seed_hi [S] u32; out_pos [S] i32.  ``interpret`` None: True on CPU.
    Float32 noise only (``fp64=True`` raises: the float64 draw stays on the XLA path)."""
    if fp64:
        raise ValueError("gumbel_argmax (Pallas): float32 noise only; use the XLA sampler for fp64 Gumbel")
    if x.ndim != 2 or x.dtype != jnp.float32:
        raise ValueError(f"gumbel_argmax (Pallas): x must be [S, V] float32, got {x.dtype}{list(x.shape)}")
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    S, V = x.shape
    br, bv = resolve_blocks(S, V, block_rows, block_vocab, interpret)
    return _gumbel_argmax(x, temperature, tau, log_min_p, row_max, seed_lo, seed_hi, out_pos,
                          block_rows=br, block_vocab=bv, interpret=interpret, division=_division_for(interpret))


# ---------------------------------------------------------------- plain-jnp reference

def gumbel_argmax_reference(x, temperature, tau, log_min_p, row_max, seed_lo, seed_hi, out_pos) -> jax.Array:
    """The same function in plain jnp over whole rows: [S] int32 (lowest index of the maximum)."""
    S, V = x.shape
    keys = row_keys(seed_lo, seed_hi, out_pos)                           # [S]
    zero = runtime_zero(out_pos)                                         # [S, 1]
    idx = jnp.broadcast_to(jnp.arange(V, dtype=jnp.int32)[None], (S, V))
    y = _scores(x.astype(jnp.float32), temperature[:, None], tau.astype(jnp.uint32)[:, None],
                log_min_p[:, None], row_max[:, None], keys[:, None], zero, idx)   # [S, V]
    m = y.max(axis=1, keepdims=True)
    return jnp.min(jnp.where(y == m, idx, V), axis=1).astype(jnp.int32)
