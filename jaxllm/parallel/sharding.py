"""The rules that map logical axes to the mesh, and the specs of the parameters and the cache.

Arrays are described by what their dimensions mean (``q_heads``, ``mlp``, ``vocab`` ...),
never by mesh axes: a parameter's axes are in its model's parameter table
(``models/params.py``), the cache's here.  :func:`rules_for` decides, per model and
parallel configuration, which logical axes are split over the ``tp`` mesh axis.  The layout is Megatron's:
q/k/v, gate/up split by output rows (heads, MLP width) and o/down by input columns, so each
device computes its heads and its slice of the MLP and one all-reduce per block joins them
(XLA's SPMD partitioner inserts it).  The embedding and LM head are split over the
vocabulary; the sampler sees the logits gathered.  A hybrid model's GDN layers split by key-head
group (``gdn_heads``, ``gdn_value_heads``), their recurrent states with them.  A vision-language
model's image encoder splits the same way (:func:`vision_rules`: vLLM's
``--mm-encoder-tp-mode weights``, its default).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Protocol

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxllm.parallel.mesh import TP
from jaxllm.quant import ops as qops

log = logging.getLogger("jaxllm.parallel")

KV_AXES = ("kv_blocks", "block", "kv_heads", "head_dim")   # one layer's K or V
LAYERS = "layers"


class ShardedModel(Protocol):
    """What :func:`rules_for` reads of a model's ``ArchConfig`` (``models/config.py``; typed
    here by its fields, so that this module, which the layers import, imports no model)."""

    architecture: str
    num_heads: int
    num_kv_heads: int
    vocab_size: int
    intermediate_size: int


def kv_heads_axis(num_kv_heads: int, tp: int) -> str | None:
    """KV heads are split when they divide evenly, else replicated: every device keeps all
    of them (fewer KV heads than devices; vLLM's rule)."""
    return TP if num_kv_heads % tp == 0 else None


def rules_for(arch: ShardedModel, tp: int, expert_parallel: bool = False) -> dict[str, str | None]:
    """Logical axis -> mesh axis (or None: replicated) for ``arch`` on a ``tp``-way mesh.

    Heads must divide evenly; KV heads are replicated when there are fewer of them than
    shards (vLLM's rule); the vocabulary and MLP width are replicated, with a log line,
    when ``tp`` does not divide them."""
    if tp == 1:
        return {}
    flag = "--tensor-parallel-size"
    if arch.num_heads % tp:
        raise ValueError(f"{flag} {tp} must divide the number of attention heads ({arch.num_heads})")
    rules: dict[str, str | None] = {"q_heads": TP}
    if arch.num_kv_heads % tp and tp % arch.num_kv_heads:
        raise ValueError(f"{flag} {tp} and the number of KV heads ({arch.num_kv_heads}) must divide one another")
    rules["kv_heads"] = kv_heads_axis(arch.num_kv_heads, tp)
    gdn_key_heads = getattr(arch, "linear_num_key_heads", 0)
    if gdn_key_heads:
        # A hybrid model's GDN layers split by key-head group: a group's q, k and v channels,
        # its value heads' z, b, a and state all land on one device (models/qwen3_next/).
        if gdn_key_heads % tp:
            raise ValueError(f"{flag} {tp} must divide the number of linear-attention key heads ({gdn_key_heads})")
        rules["gdn_heads"] = rules["gdn_value_heads"] = TP
    for axis, size in (("vocab", arch.vocab_size), ("mlp", arch.intermediate_size)):
        rules[axis] = TP if size % tp == 0 else None
        if size % tp:
            log.info("%s (%d) is not a multiple of %s %d: replicated", axis, size, flag, tp)
    num_experts = getattr(arch, "num_experts", 0)
    if num_experts:
        moe_f = getattr(arch, "moe_intermediate_size", 0) or arch.intermediate_size
        if expert_parallel:
            if num_experts % tp:
                raise ValueError(f"--enable-expert-parallel: {flag} {tp} must divide the number of experts "
                                 f"({num_experts})")
            rules["expert"] = TP
        else:
            rules["moe_mlp"] = TP if moe_f % tp == 0 else None
    elif expert_parallel:
        raise ValueError(f"--enable-expert-parallel: {arch.architecture} has no experts")
    return rules


VISION_HEADS, VISION_MLP, VISION_MERGE = "vision_heads", "vision_mlp", "vision_merge"
"""The image encoder's split axes: its attention heads, its MLP width, its patch merger's width."""


def vision_rules(sizes: Mapping[str, int], tp: int) -> dict[str, str | None]:
    """An image encoder's logical axes -> mesh axes on a ``tp``-way mesh: the encoder's weights
    split as the text model's are (vLLM's ``--mm-encoder-tp-mode weights``: heads for attention,
    the MLP and the merger column- then row-parallel, one all-reduce each).  ``sizes``: each
    split axis's size (``VISION_HEADS``: the heads; the others: their width); an axis ``tp``
    does not divide is replicated, with a log line (the encoder still runs; vLLM refuses)."""
    if tp == 1:
        return {}
    rules: dict[str, str | None] = {}
    for axis, size in sizes.items():
        rules[axis] = TP if size % tp == 0 else None
        if size % tp:
            log.info("image encoder: %s (%d) is not a multiple of --tensor-parallel-size %d: replicated",
                     axis, size, tp)
    return rules


def spec(axes: tuple[str, ...], rules: dict[str, str | None]) -> P:
    return P(*(rules.get(a) for a in axes))


def param_specs(params: dict, rules: dict[str, str | None], axes: Mapping[str, tuple[str, ...]],
                tp: int = 1) -> dict:
    """A PartitionSpec for every leaf of a params tree (globals, and layers stacked or listed);
    ``axes``: parameter name -> logical axes of one layer's array (the model's parameter table,
    ``models/params.py``); ``tp``: the size of the ``tp`` mesh axis."""
    replicated: list[str] = []

    def field_spec(name: str, names: tuple[str, ...], a) -> P:
        # A field is [(L,) out, in or its blocks, bytes of a block...]: split like the matrix
        # on its first two axes, a block's bytes never.  A block cannot be split, so an axis
        # of fewer blocks than shards (or not a multiple of them) stays whole.
        parts = []
        for i, ax in enumerate(names + (None,) * (a.ndim - len(names))):
            mesh_ax = rules.get(ax) if ax is not None else None
            if mesh_ax is not None and a.shape[i] % tp:
                replicated.append(f"{name} ({ax}: {a.shape[i]} blocks or rows)")
                mesh_ax = None
            parts.append(mesh_ax)
        return P(*parts)

    def one(name: str, v, stacked: bool):
        if name not in axes:
            raise KeyError(f"no logical axes for parameter {name!r} (add it to the model's parameter table)")
        names = ((LAYERS,) if stacked else ()) + axes[name]
        if qops.is_quantized(v):
            return qops.map_fields(v, lambda a: field_spec(name, names, a))
        if len(names) != v.ndim:
            raise ValueError(f"parameter {name!r}: {v.ndim} dims, logical axes {names}")
        return spec(names, rules)

    out = {k: one(k, v, False) for k, v in params.items() if k != "layers"}
    layers = params["layers"]
    if isinstance(layers, dict):
        out["layers"] = {k: one(k, v, True) for k, v in layers.items()}
    else:
        out["layers"] = [{k: one(k, v, False) for k, v in lp.items()} for lp in layers]
    if replicated:
        log.info("quantized weights whose blocks do not split %d ways stay whole on every device: %s", tp,
                 ", ".join(sorted(set(replicated))))
    return out


def lora_specs(targets, axes: Mapping[str, tuple[str, ...]], rules: dict[str, str | None]) -> dict:
    """param -> (spec of A ``[max_loras, L, in, R]``, spec of B ``[max_loras, L, R, out]``): A split
    like the base weight's input, B like its output (``axes``: the model's parameter table, a
    matrix's ``(out, in)``).  A column-parallel projection (q/k/v, gate/up) gets A whole and B
    split by output, a row-parallel one (o, down) A split by input and B whole: its delta is a
    partial sum XLA reduces with the base's."""
    out = {}
    for name in targets:
        out_ax, in_ax = axes[name][-2:]
        out[name] = (P(None, None, rules.get(in_ax), None), P(None, None, None, rules.get(out_ax)))
    return out


def kv_spec(rules: dict[str, str | None], stacked: bool) -> P:
    return spec(((LAYERS,) if stacked else ()) + KV_AXES, rules)


def cache_array(make, sharding, shape: tuple[int, ...], dtype, axes: tuple[str | None, ...]):
    """``make(shape, dtype)`` of a model family's cache array (``allocate_cache``), laid out by
    ``sharding`` (logical axes -> a sharding; None: ``make``'s own placement)."""
    return make(shape, dtype) if sharding is None else make(shape, dtype, sharding=sharding(axes))


def named(mesh: Mesh, specs):
    """PartitionSpec tree -> NamedSharding tree."""
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))
