"""The projections of a model family an adapter may change, read off its parameter table.

A target is a per-layer weight matrix ``[out, in]`` the model multiplies every layer by
(attention q/k/v/o, the dense MLP's gate/up/down).  Its PEFT module name is the last component
of its HF checkpoint name (``model.layers.{layer}.self_attn.q_proj.weight`` -> ``q_proj``);
where the checkpoint fuses it (Phi-3's ``qkv_proj``, ``gate_up_proj``) the fused module is a
target too, its ``lora_B`` rows split between the parts as the checkpoint's rows are.
"""

from __future__ import annotations

from dataclasses import dataclass

from jaxllm.models.config import ArchConfig
from jaxllm.models.params import LAYER, MATRIX, Chunk, ParamTable

TARGET_PARAMS = ("q", "k", "v", "o", "gate", "up", "down")
"""Device parameters an adapter can change, in the order the slot arrays hold them."""


@dataclass(frozen=True)
class Target:
    param: str
    """The device parameter (``"q"``, ``"gate"``, ...)."""
    module: str
    """The HF module's name pattern without ``.weight`` (``model.layers.{layer}.self_attn.q_proj``)."""
    in_size: int
    out_size: int
    rows: tuple[int, int] | None = None
    """Inside a fused module: (offset, total) of this parameter's rows in its ``lora_B``."""

    @property
    def short(self) -> str:
        """The module's last name component: what ``target_modules`` lists."""
        return self.module.rsplit(".", 1)[-1]


def lora_targets(table: ParamTable, arch: ArchConfig) -> dict[str, Target]:
    """Device parameter -> :class:`Target`, for the projections present in every layer of ``arch``."""
    out: dict[str, Target] = {}
    for p in table.present(arch, LAYER):
        if p.name not in TARGET_PARAMS or p.kind != MATRIX:
            continue
        if not all(p.has(arch, i) for i in range(arch.num_layers)):
            continue   # in some layers only (GLM-4-MoE's dense first layers): not a target here
        patterns = p.patterns(arch, "hf")
        if not patterns:
            continue
        first = patterns[0]
        o, i = p.shape(arch)
        if isinstance(first, Chunk):
            offset, total = first.extent(arch, o)
            out[p.name] = Target(p.name, first.pattern.removesuffix(".weight"), i, o, (offset, total))
        elif isinstance(first, str) and first.endswith(".weight"):
            out[p.name] = Target(p.name, first.removesuffix(".weight"), i, o)
    return out


def modules(targets: dict[str, Target]) -> dict[str, list[Target]]:
    """Module name (last component) -> the targets it holds (several for a fused module)."""
    by: dict[str, list[Target]] = {}
    for t in targets.values():
        by.setdefault(t.short, []).append(t)
    return by
