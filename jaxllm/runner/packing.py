"""One host-to-device transfer per step: a step's inputs, a pytree of small 32-bit and bool
arrays, packed into a single uint32 vector on the host and unpacked inside the compiled step.

``jax.device_put`` of StepInputs' ~26 arrays cost 2.3-3.4 ms per step on the 2-core CPU
(Python and PjRt work per array): over 10% of a batch-1 decode step.  One vector costs a
small fraction of that, and the slices that unpack it are fused into their consumers.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np


def _words(a) -> np.ndarray:
    a = np.asarray(a)
    if a.dtype == np.bool_:
        return a.astype(np.uint32).ravel()
    if a.dtype.itemsize != 4:
        raise ValueError(f"cannot pack a {a.dtype} array: only 32-bit and bool arrays are packed")
    return np.ascontiguousarray(a).view(np.uint32).ravel()


def pack(tree) -> np.ndarray:
    """The leaves of ``tree`` (in ``jax.tree.leaves`` order) as one flat uint32 vector."""
    leaves = jax.tree.leaves(tree)
    return np.concatenate([_words(a) for a in leaves]) if leaves else np.zeros(0, np.uint32)


def num_words(spec_tree) -> int:
    """Length of ``pack`` of a tree shaped like ``spec_tree`` (ShapeDtypeStruct leaves)."""
    return sum(math.prod(s.shape) for s in jax.tree.leaves(spec_tree))


def span(spec_tree, sub) -> tuple[int, int]:
    """The words ``[lo, hi)`` that ``sub``, a subtree of ``spec_tree`` (the same leaf objects),
    takes in ``pack`` of a tree shaped like ``spec_tree``."""
    specs, subs = jax.tree.leaves(spec_tree), jax.tree.leaves(sub)
    ids = [id(s) for s in specs]
    i = ids.index(id(subs[0])) if subs and id(subs[0]) in ids else -1
    if i < 0 or ids[i:i + len(subs)] != [id(s) for s in subs]:
        raise ValueError("span: not a contiguous subtree of the packed tree")
    lo = num_words(specs[:i])
    return lo, lo + num_words(subs)


def unpack(words: jax.Array, spec_tree):
    """Inverse of :func:`pack` inside a traced function: ``words`` [num_words] uint32 back to
    a tree of ``spec_tree``'s structure, shapes and dtypes."""
    specs, treedef = jax.tree.flatten(spec_tree)
    leaves, off = [], 0
    for s in specs:
        n = math.prod(s.shape)
        w = words[off:off + n].reshape(s.shape)
        off += n
        if s.dtype == jnp.bool_:
            leaves.append(w != 0)
        elif s.dtype == jnp.uint32:
            leaves.append(w)
        else:
            leaves.append(jax.lax.bitcast_convert_type(w, s.dtype))
    return jax.tree.unflatten(treedef, leaves)
