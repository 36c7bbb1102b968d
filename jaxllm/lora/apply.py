"""The LoRA delta a layer adds to a projection's output, per token, inside the compiled step.

The step carries the distinct slots its tokens use (``LoRAStep.used``, from the host) and a
loop over just those reads each used slot's ``A [in, R]`` / ``B [R, out]`` of this layer, the
shrink ``x @ A`` masked to the tokens of that slot, then the expand: the step's cost follows
the adapters in the batch, not ``max_loras`` (a step with no adapter runs no iteration).  The
loop's trip count is an input, so a new mix of adapters never compiles.  Measured on the
built-in model (docs/BENCHMARKS.md "LoRA adapters"): the earlier one-hot einsum over every
slot read ~20 MB of float32 ``A``/``B`` per slot per step, 0.16x of base at ``max_loras=8``.

A step that can use at most one slot (a one-token bucket: batch-1 decode; or ``max_loras``
1) runs no loop: a ``cond`` on that slot reads its matrices or nothing.  In the built-in
model's one-token program that is 490 dynamic slices and 3 copies instead of the loops' 1120
and 632; it compiles in the same time (docs/BENCHMARKS.md "LoRA adapters": the cost is the 420
shrink/expand dots and their fusions, not the loops).

Without ``used`` (training, lora/train.py: the loop's dynamic trip count is not
reverse-differentiable) the one-hot einsum over every slot is kept
(``einsum(x, one_hot(slot), A)``, as tpu-inference and sglang-jax do).
A token with slot -1 (the base model, or bucket padding) matches no slot: no delta.
The delta is float32 (on the native CPU path the activations are float32 already), whatever
the slots' dtype (``--lora-dtype``): a slice of a bfloat16 slot is widened before its dot.

Projections of one input (q/k/v; gate/up) store their ``A`` side by side in one slot array
(``A [max_loras, L, in, n*R]``, lora/slots.py, for every family, fused base weights or not):
their shrinks are one dot ``x @ A`` and only the expands are one per projection, 11 dots a
layer instead of 14 (docs/BENCHMARKS.md "LoRA adapters": what that saves in compile time).

When the step runs the GPU path (``Kernels.attention`` or ``Kernels.matmul`` "pallas"), the
delta is the Pallas kernel of ``pallas/lora.py`` instead (per token, only its own slot's
matrices are read).

On the native CPU matmul (``Kernels.matmul`` "native", float32 slots) the deltas are the native
kernel of ``cpu/lora.cc`` (punica's sgmv): one call per ``A`` key, its shrink and then the
expand of each of its projections, added straight into the base outputs (aliased): 4 calls a
layer of the built-in model, where one call per shrink and per expand made 11 (~1 us each
even when they return at once).  It groups the tokens by slot, reads each used slot's rows in
place once per block of tokens, and returns at once when no token has a slot.  The slots hold
``A`` transposed for it (:func:`transposes_a`), so a rank-8 adapter in rank-16 slots reads 8
rows of each part and none of the padding: a batch-1 step's LoRA calls are bound by the
bytes they read (~10 MB of float32 a step for one rank-8 adapter on every projection).  Profiled on the built-in model at batch 32 (docs/BENCHMARKS.md "LoRA adapters"), the
XLA loop's cost was not its arithmetic but its machinery: with no adapter in use, copies and
concatenations were ~8% of the step's op time; with 8 adapters, the masked dots over every
token per slot (8x the work), the accumulating adds, copies of each slot's slice and the loops
were ~31%; the kernel's calls are ~16% with 8 adapters and nothing visible with none.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import jax
import jax.numpy as jnp

from jaxllm.cpu import native
from jaxllm.pallas.lora import lora_delta

GROUPS = (("q", "k", "v"), ("gate", "up"))
"""Projections of one input whose ``A`` the slots hold side by side (one shrink for them all)."""


def shrink_groups(params, can_group=lambda members: True) -> dict[str, tuple[str, ...]]:
    """The slot layout's ``A`` keys: ``"q+k+v"`` -> ("q", "k", "v") for each of :data:`GROUPS`
    whose members are all among ``params`` (and ``can_group(members)``: e.g. laid out alike
    under tensor parallelism), every other param its own key."""
    params = list(params)
    out, grouped = {}, set()
    for g in GROUPS:
        if all(p in params for p in g) and can_group(g):
            out["+".join(g)] = g
            grouped |= set(g)
    out.update((p, (p,)) for p in params if p not in grouped)
    return out


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class LoRAStep:
    """The step's adapters: the slot arrays and each token's slot."""

    weights: dict
    """``{"A": {key: A [max_loras, L, in, n*R]}, "B": {param: B [max_loras, L, R, out]}}``, the
    scale folded into B; a key of ``A`` names its params joined by "+" (:func:`shrink_groups`:
    ``"q+k+v"`` holds q's, k's and v's ``A`` side by side, ``"o"`` o's alone).  float32, or the
    16-bit ``--lora-dtype`` (each slice read is widened to float32).  ``"rank"`` (lora/slots.py,
    optional): [max_loras] int32, each slot's adapter's rank, past which its B rows are padding."""
    slots: jax.Array
    """[T] int32, each token's slot (-1: none)."""
    used: jax.Array | None = None
    """[max_loras] int32: the distinct slots in ``slots``, then -1s; None: every slot (the
    differentiable one-hot einsum)."""
    kernel: str = field(default="einsum", metadata=dict(static=True))
    """"einsum" (XLA: the used slots' loop or ``cond``, or the one-hot einsum without ``used``),
    "pallas" (``pallas/lora.py``) or "native" (``cpu/lora.cc``, float32 slots; other dtypes
    take the XLA path)."""
    a_transposed: bool = field(default=False, metadata=dict(static=True))
    """``A`` held as ``[max_loras, L, n*R, in]`` (:func:`transposes_a`: the native kernel's
    layout) instead of ``[max_loras, L, in, n*R]``."""


def transposes_a(kernel: str, dtype) -> bool:
    """Whether the slots hold ``A`` transposed, ``[max_loras, L, n*R, in]``: for cpu/lora.cc (the
    native kernel, float32 slots), whose shrink reads a part's first ``rank`` rows of it and
    none of the padding past them (lora/slots.py pads a smaller adapter to ``max_lora_rank``;
    a rank-8 adapter in rank-16 slots: half of ``A``'s bytes, and a shrink of a batch-1 step
    is bound by the bytes it reads)."""
    return kernel == "native" and jnp.dtype(dtype) == jnp.float32


def kernel_for(kernels) -> str:
    """The delta's implementation for a step run with ``kernels`` (models/kernels.py)."""
    if "pallas" in (kernels.attention, kernels.matmul):
        return "pallas"
    return "native" if kernels.matmul == "native" else "einsum"


def _a_key(lora: LoRAStep, name: str) -> tuple[str, int]:
    """The key of ``lora.weights["A"]`` holding ``name``'s A, and ``name``'s place in it."""
    for key in lora.weights["A"]:
        members = key.split("+")
        if name in members:
            return key, members.index(name)
    raise KeyError(name)


def _native_ok(lora: LoRAStep | None, names: tuple[str, ...], ys) -> bool:
    """Whether ``cpu/lora.cc`` adds the deltas of ``names`` to ``ys``: the native path (A
    transposed), every name a target, float32 slots and outputs."""
    if (lora is None or lora.kernel != "native" or not lora.a_transposed or "rank" not in lora.weights
            or not all(n in lora.weights["B"] for n in names)):
        return False
    arrays = [lora.weights["B"][n] for n in names] + [lora.weights["A"][_a_key(lora, n)[0]] for n in names]
    return all(a.dtype == jnp.float32 for a in arrays) and all(y.dtype == jnp.float32 for y in ys)


def _native_add(lora: LoRAStep, ys: list, names: tuple[str, ...], where: list[tuple[int, int]], x, layer) -> list:
    """``ys`` with the delta of ``names[j]`` added to ``ys[k]``'s columns ``col:`` for
    ``(k, col) = where[j]`` (one fused output, or each projection its own), through cpu/lora.cc:
    one call per ``A`` key (q/k/v's side by side: one) that shrinks, then expands into each of
    its projections' outputs (aliased: no copy; nothing read or written at a step whose tokens
    use no slot)."""
    xf = x.astype(jnp.float32)
    by_key: dict[str, list] = {}
    for name, (k, col) in zip(names, where):
        key, i = _a_key(lora, name)
        by_key.setdefault(key, []).append((name, i, k, col))
    out = list(ys)
    for key, parts in by_key.items():
        mine = sorted({k for _, _, k, _ in parts})                      # the outputs this A's projections add to
        bs = [lora.weights["B"][name] for name, _, _, _ in parts]       # [S, L, R, out] each
        R = bs[0].shape[-2]
        new = native.lora_add([out[k] for k in mine], xf, lora.weights["A"][key], bs, lora.slots, layer,
                              lora.weights["rank"], [mine.index(k) for _, _, k, _ in parts],
                              [col for _, _, _, col in parts], [i * R for _, i, _, _ in parts])
        for k, y in zip(mine, new):
            out[k] = y                                                  # [T, N]
    return out


def _f32(w: jax.Array) -> jax.Array:
    # a slot slice in the --lora-dtype, widened: the shrink and expand accumulate in float32
    return w.astype(jnp.float32)


def _a(lora: LoRAStep, key: str) -> jax.Array:
    """The slots' A of ``key`` as the XLA paths read it, [S, L, in, n*R] (held transposed for
    the native kernel: its outputs' dtype a fallback to these paths, never the default)."""
    A = lora.weights["A"][key]
    return jnp.swapaxes(A, -1, -2) if lora.a_transposed else A


def _own_A(lora: LoRAStep, name: str) -> jax.Array:
    """``name``'s A [S, L, in, R]: its key's array, or its columns of a group's."""
    for key in lora.weights["A"]:
        A = _a(lora, key)
        members = key.split("+")
        if name in members:
            R = lora.weights["B"][name].shape[-2]
            i = members.index(name)
            return A if len(members) == 1 else A[..., i * R:(i + 1) * R]
    raise KeyError(name)


def deltas(lora: LoRAStep | None, names: tuple[str, ...], x: jax.Array, layer) -> list | None:
    """x [T, in] -> the deltas [T, out_i] float32 of projections ``names`` (all of one input ``x``)
    at ``layer`` (an int, or a traced index under ``lax.scan``); None when no adapter can change
    them.  One shrink when the slots hold their ``A`` side by side (a key ``"+".join(names)``);
    a name that is no target (only alone) gives None."""
    if lora is None or not any(n in lora.weights["B"] for n in names):
        return None
    key = "+".join(names)
    if key in lora.weights["A"]:
        groups = [(_a(lora, key), names)]
    elif len(names) == 1:
        groups = [(_own_A(lora, names[0]), names)]
    else:
        return [delta(lora, n, x, layer) for n in names]
    out = []
    for A, members in groups:
        Bs = [lora.weights["B"][n] for n in members]
        out += _group_delta(lora, A, Bs, x, layer)
    return out


def _group_delta(lora: LoRAStep, A, Bs, x, layer) -> list:
    """A [S, L, in, n*R] (n parts side by side), Bs n x [S, L, R, out_i] -> n deltas [T, out_i]."""
    R = Bs[0].shape[-2]
    if lora.kernel != "pallas" and lora.used is not None:
        if x.shape[0] == 1 or A.shape[0] == 1:
            # one token (batch-1 decode) or one slot: at most one slot is used, ``used[0]``
            return _one_slot_delta(x, A, Bs, layer, lora.slots, lora.used[0])
        return _used_slots_delta(x, A, Bs, layer, lora.slots, lora.used)
    A_l = A[:, layer]                                                    # [S, in, n*R]
    if lora.kernel == "pallas":
        return [lora_delta(x, A_l[..., i * R:(i + 1) * R], B[:, layer], lora.slots) for i, B in enumerate(Bs)]
    onehot = jax.nn.one_hot(lora.slots, A.shape[0], dtype=jnp.float32)   # [T, S]
    xa = jnp.einsum("ti,sir->tsr", x.astype(jnp.float32), _f32(A_l)) * onehot[:, :, None]   # [T, S, n*R]
    return [jnp.einsum("tsr,sro->to", xa[..., i * R:(i + 1) * R], _f32(B[:, layer]))        # [T, out_i]
            for i, B in enumerate(Bs)]


def _expand(xa, bs, R) -> list:
    # xa [T, n*R]; bs n x [R, out_i] float32 -> n x [T, out_i]
    return [xa[:, i * R:(i + 1) * R] @ b for i, b in enumerate(bs)]


def _read(A, Bs, s, layer):
    """Slot ``s``'s matrices of ``layer``, widened: A [in, n*R], n x B [R, out_i]."""
    (_, _, n_in, nR) = A.shape
    a = _f32(jax.lax.dynamic_slice(A, (s, layer, 0, 0), (1, 1, n_in, nR))[0, 0])               # [in, n*R]
    bs = [_f32(jax.lax.dynamic_slice(B, (s, layer, 0, 0), (1, 1) + B.shape[2:])[0, 0]) for B in Bs]  # [R, out_i]
    return a, bs


def _used_slots_delta(x, A, Bs, layer, slots, used) -> list:
    """x [T, in]; A [S, L, in, n*R], Bs n x [S, L, R, out_i]; slots [T]; used [S] -> n x [T, out_i]
    float32, reading only the used slots' matrices of ``layer``."""
    T, R = x.shape[0], Bs[0].shape[-2]
    xf = x.astype(jnp.float32)
    layer = jnp.asarray(layer, jnp.int32)

    def one_slot(i, accs):
        s = used[i]
        a, bs = _read(A, Bs, s, layer)
        xa = jnp.where((slots == s)[:, None], xf @ a, 0.0)                         # [T, n*R]
        return tuple(acc + d for acc, d in zip(accs, _expand(xa, bs, R)))          # [T, out_i] each

    # A dynamic trip count: the loop runs once per used slot (none when the step has no adapter).
    count = jnp.sum(used >= 0)
    zeros = tuple(jnp.zeros((T, B.shape[-1]), jnp.float32) for B in Bs)
    return list(jax.lax.fori_loop(0, count, one_slot, zeros))


def _one_slot_delta(x, A, Bs, layer, slots, s) -> list:
    """x [T, in]; A [S, L, in, n*R], Bs n x [S, L, R, out_i]; slots [T]; s: the step's one used
    slot (-1: none) -> n x [T, out_i] float32.  A step that can use at most one slot (a one-token
    bucket, or ``max_loras`` 1) needs no loop: a ``cond`` reads that slot's matrices of ``layer``
    or nothing (no copies of a loop's carried values: the module docstring)."""
    T, R = x.shape[0], Bs[0].shape[-2]
    layer = jnp.asarray(layer, jnp.int32)

    def read():
        a, bs = _read(A, Bs, s, layer)
        xa = jnp.where((slots == s)[:, None], x.astype(jnp.float32) @ a, 0.0)      # [T, n*R]
        return tuple(_expand(xa, bs, R))                                           # [T, out_i] each

    zeros = tuple(jnp.zeros((T, B.shape[-1]), jnp.float32) for B in Bs)
    return list(jax.lax.cond(s >= 0, read, lambda: zeros))


def delta(lora: LoRAStep | None, name: str, x: jax.Array, layer) -> jax.Array | None:
    """x [T, in] -> the delta [T, out] float32 of projection ``name``; None when no adapter can change it."""
    d = deltas(lora, (name,), x, layer)
    return None if d is None else d[0]


def add(y: jax.Array, lora: LoRAStep | None, name: str, x: jax.Array, layer) -> jax.Array:
    """``y`` (the projection of ``x``) plus its LoRA delta, in ``y``'s dtype."""
    if _native_ok(lora, (name,), (y,)):
        return _native_add(lora, [y], (name,), [(0, 0)], x, layer)[0]
    d = delta(lora, name, x, layer)
    return y if d is None else (y.astype(jnp.float32) + d).astype(y.dtype)


def add_each(ys: tuple, lora: LoRAStep | None, names: tuple[str, ...], x: jax.Array, layer) -> tuple:
    """``ys``: the projections ``names`` of one input ``x`` (separate base weights), each plus
    its delta, their shrinks one dot where the slots hold their ``A`` side by side."""
    if _native_ok(lora, names, ys):
        return tuple(_native_add(lora, list(ys), names, [(j, 0) for j in range(len(names))], x, layer))
    ds = deltas(lora, names, x, layer)
    if ds is None:
        return tuple(ys)
    return tuple(y if d is None else (y.astype(jnp.float32) + d).astype(y.dtype) for y, d in zip(ys, ds))


def add_fused(y: jax.Array, lora: LoRAStep | None, names: tuple[str, ...], x: jax.Array, layer) -> jax.Array:
    """``y``: a fused projection (the parts' outputs concatenated in ``names``' order) plus each
    part's delta.  The slot arrays hold every target the model has (lora/targets.py), so a
    part no adapter changes adds zeros."""
    if _native_ok(lora, names, (y,)):
        widths = [lora.weights["B"][n].shape[-1] for n in names]
        return _native_add(lora, [y], names, [(0, sum(widths[:j])) for j in range(len(names))], x, layer)[0]
    ds = deltas(lora, names, x, layer)                                   # [T, out_i] each
    if ds is None:
        return y
    return (y.astype(jnp.float32) + jnp.concatenate(ds, axis=-1)).astype(y.dtype)
