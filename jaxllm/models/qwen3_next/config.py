"""The hybrid family's config: :class:`HybridConfig` (what the model functions need of a
Qwen3-Next / Qwen3.5 text config, read by :func:`config_from_hf`, refusing by name what the
model does not implement), :class:`HybridArch` (the engine's ``ArchConfig`` of it) and
:class:`Qwen3NextConfig` (the registry's config type)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from jaxllm.errors import ModelLoadError
from jaxllm.models.config import ArchConfig, FamilyConfig, RopeScaling, _eos_tuple

ARCHITECTURES = ("Qwen3NextForCausalLM", "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM")
VL_ARCHITECTURE = "Qwen3_5ForConditionalGeneration"   # its text_config read as Qwen3_5ForCausalLM
LINEAR, FULL = "linear_attention", "full_attention"


@dataclass(frozen=True)
class HybridConfig:
    """What the model functions need of a Qwen3-Next / Qwen3.5 config (read by :func:`config_from_hf`)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    layer_types: tuple[str, ...]
    rms_norm_eps: float
    tie_word_embeddings: bool
    max_position_embeddings: int
    # full-attention layers
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rotary_dim: int
    # GDN layers
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    conv_kernel: int
    # MLPs
    intermediate_size: int
    moe_layers: tuple[bool, ...]
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Qwen3.5's multimodal RoPE: frequencies per (t, h, w) stream (layers/rotary.mrope_axes);
    # text alone has all three streams equal, so it matters only with 3D rope_positions
    mrope_section: tuple[int, ...] = ()

    @property
    def is_moe(self) -> bool:
        return any(self.moe_layers)

    @property
    def fused_projections(self) -> bool:
        """Qwen3-Next's interleaved ``in_proj_qkvz`` / ``in_proj_ba`` (Qwen3.5: four matrices)."""
        return self.architecture == "Qwen3NextForCausalLM"

    @property
    def key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        """The conv's channels: q, k and v of a GDN layer."""
        return 2 * self.key_dim + self.value_dim

    def is_linear(self, i: int) -> bool:
        return self.layer_types[i] == LINEAR

    def state_bytes(self, dtype_bytes: int = 4) -> int:
        """One sequence's recurrent state over all GDN layers (conv + delta rule), in bytes:
        what a per-sequence cache kind must reserve per request."""
        per_layer = ((self.conv_kernel - 1) * self.conv_dim
                     + self.linear_num_value_heads * self.linear_key_head_dim * self.linear_value_head_dim)
        return per_layer * dtype_bytes * sum(map(self.is_linear, range(self.num_layers)))


def config_from_hf(hf, arch: str, where: str) -> HybridConfig:
    """A transformers ``Qwen3NextConfig`` / ``Qwen3_5TextConfig`` / ``Qwen3_5MoeTextConfig``
    -> :class:`HybridConfig`; what the model does not implement is refused by name."""
    if arch not in ARCHITECTURES:
        raise ModelLoadError(f"{where}: architecture {arch!r} is not one of {', '.join(ARCHITECTURES)}")
    if getattr(hf, "text_config", None) is not None and getattr(hf, "model_type", "") in ("qwen3_5", "qwen3_5_moe"):
        raise ModelLoadError(f"{where}: a multimodal Qwen3.5 config; only the text models ({arch} with a "
                             "qwen3_5_text / qwen3_5_moe_text config) are supported")

    def get(name, default=None):
        v = getattr(hf, name, None)
        return default if v is None else v

    act = get("hidden_act", "silu")
    if act != "silu":
        raise ModelLoadError(f"{where}: hidden_act {act!r} is not supported (silu only)")
    if get("attention_bias", False):
        raise ModelLoadError(f"{where}: attention_bias=true is not supported for {arch}")
    rope = dict(get("rope_parameters") or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise ModelLoadError(f"{where}: rope_parameters.rope_type {rope_type!r} is not supported for {arch} "
                             "(default only)")
    L = int(get("num_hidden_layers"))
    layer_types = tuple(get("layer_types") or ())
    if len(layer_types) != L or set(layer_types) - {LINEAR, FULL}:
        raise ModelLoadError(f"{where}: layer_types must name {LINEAR} or {FULL} for each of the {L} layers, "
                             f"got {list(layer_types)}")
    heads = int(get("num_attention_heads"))
    head_dim = int(get("head_dim") or int(get("hidden_size")) // heads)
    partial_rotary = float(rope.get("partial_rotary_factor", get("partial_rotary_factor", 1.0)))
    rotary_dim = int(head_dim * partial_rotary)
    if rotary_dim <= 0 or rotary_dim % 2 or rotary_dim > head_dim:
        raise ModelLoadError(f"{where}: partial_rotary_factor {partial_rotary} gives {rotary_dim} rotary dims of "
                             f"{head_dim}; need an even number in (0, head_dim]")
    hk, hv = int(get("linear_num_key_heads")), int(get("linear_num_value_heads"))
    if hv % hk:
        raise ModelLoadError(f"{where}: linear_num_value_heads ({hv}) must be a multiple of "
                             f"linear_num_key_heads ({hk})")
    if arch == "Qwen3_5ForCausalLM":
        moe_layers, num_experts = (False,) * L, 0
    else:
        num_experts = int(get("num_experts", 0))
        if arch == "Qwen3_5MoeForCausalLM":
            if num_experts <= 0:
                raise ModelLoadError(f"{where}: num_experts must be positive for {arch}, got {num_experts}")
            moe_layers = (True,) * L
        else:
            step = int(get("decoder_sparse_step", 1))
            only = set(get("mlp_only_layers") or ())
            moe_layers = tuple(num_experts > 0 and i not in only and (i + 1) % step == 0 for i in range(L))
    is_moe = any(moe_layers)
    # Qwen3.5-MoE's router always renormalises (its config has no norm_topk_prob).
    norm_topk = True if arch == "Qwen3_5MoeForCausalLM" else bool(get("norm_topk_prob", True))
    return HybridConfig(
        architecture=arch,
        vocab_size=int(get("vocab_size")),
        hidden_size=int(get("hidden_size")),
        num_layers=L,
        layer_types=layer_types,
        rms_norm_eps=float(get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(get("tie_word_embeddings", False)),
        max_position_embeddings=int(get("max_position_embeddings", 32768)),
        num_heads=heads,
        num_kv_heads=int(get("num_key_value_heads", heads)),
        head_dim=head_dim,
        rope_theta=float(rope.get("rope_theta", get("rope_theta", 10000.0))),
        rotary_dim=rotary_dim,
        linear_num_key_heads=hk,
        linear_num_value_heads=hv,
        linear_key_head_dim=int(get("linear_key_head_dim")),
        linear_value_head_dim=int(get("linear_value_head_dim")),
        conv_kernel=int(get("linear_conv_kernel_dim", 4)),
        # Qwen3.5-MoE has no dense MLP (its config has no intermediate_size).
        intermediate_size=int(getattr(hf, "intermediate_size", 0) or 0) if arch != "Qwen3_5MoeForCausalLM" else 0,
        moe_layers=moe_layers,
        num_experts=num_experts if is_moe else 0,
        num_experts_per_tok=int(get("num_experts_per_tok", 0)) if is_moe else 0,
        moe_intermediate_size=int(get("moe_intermediate_size", 0)) if is_moe else 0,
        shared_expert_intermediate_size=int(get("shared_expert_intermediate_size", 0)) if is_moe else 0,
        norm_topk_prob=norm_topk,
        bos_token_id=get("bos_token_id"),
        eos_token_ids=_eos_tuple(get("eos_token_id")),
        mrope_section=tuple(int(x) for x in rope.get("mrope_section") or ()),
    )


@dataclass(frozen=True)
class HybridArch(ArchConfig):
    """The engine's config of a hybrid model: an :class:`ArchConfig` (what the engine reads
    of every model: vocabulary, the full-attention layers' heads, rope, context length) with
    the whole :class:`HybridConfig` in ``hybrid``; what ArchConfig lacks (the GDN dims, the
    layer kinds) is read from it through the properties below, so the parameter table takes either."""

    hybrid: HybridConfig | None = None

    # What the parameter table and the forward read of the hybrid config, declared one by one.
    @property
    def linear_num_key_heads(self) -> int:
        return self.hybrid.linear_num_key_heads

    @property
    def linear_num_value_heads(self) -> int:
        return self.hybrid.linear_num_value_heads

    @property
    def linear_key_head_dim(self) -> int:
        return self.hybrid.linear_key_head_dim

    @property
    def linear_value_head_dim(self) -> int:
        return self.hybrid.linear_value_head_dim

    @property
    def conv_kernel(self) -> int:
        return self.hybrid.conv_kernel

    @property
    def moe_layers(self) -> tuple[bool, ...]:
        return self.hybrid.moe_layers

    @property
    def shared_expert_intermediate_size(self) -> int:
        return self.hybrid.shared_expert_intermediate_size

    @property
    def fused_projections(self) -> bool:
        return self.hybrid.fused_projections

    @property
    def key_dim(self) -> int:
        return self.hybrid.key_dim

    @property
    def value_dim(self) -> int:
        return self.hybrid.value_dim

    @property
    def conv_dim(self) -> int:
        return self.hybrid.conv_dim

    def is_linear(self, i: int) -> bool:
        return self.hybrid.is_linear(i)

    def state_bytes(self, dtype_bytes: int = 4) -> int:
        return self.hybrid.state_bytes(dtype_bytes)


@dataclass(frozen=True)
class Qwen3NextConfig(FamilyConfig):
    """The hybrid family's config reader (the registry's ``Family.config``); no GGUF form."""

    @classmethod
    def from_hf(cls, hf, arch: str, where: str) -> HybridArch:
        if arch == VL_ARCHITECTURE:
            # Qwen3.5 with images: the text model is its text_config's Qwen3_5ForCausalLM; the
            # engine looks the family up by the checkpoint's own name (models/qwen3_5_vl/)
            text = getattr(hf, "text_config", None)
            if text is None:
                raise ModelLoadError(f"{where}: {arch} config.json has no text_config")
            return dataclasses.replace(_from_hf(text, "Qwen3_5ForCausalLM", where), architecture=arch)
        return _from_hf(hf, arch, where)


def _from_hf(hf, arch: str, where: str) -> HybridArch:
    """A transformers Qwen3-Next / Qwen3.5 text config -> :class:`HybridArch` (refusals by name
    in :func:`config_from_hf`)."""
    h = config_from_hf(hf, arch, where)
    return HybridArch(
        architecture=arch, vocab_size=h.vocab_size, hidden_size=h.hidden_size, intermediate_size=h.intermediate_size,
        num_layers=h.num_layers, num_heads=h.num_heads, num_kv_heads=h.num_kv_heads, head_dim=h.head_dim,
        rms_norm_eps=h.rms_norm_eps, rope_theta=h.rope_theta, rope_scaling=RopeScaling(),
        max_position_embeddings=h.max_position_embeddings, tie_word_embeddings=h.tie_word_embeddings, qk_norm=True,
        bos_token_id=h.bos_token_id, eos_token_ids=h.eos_token_ids, num_experts=h.num_experts,
        num_experts_per_tok=h.num_experts_per_tok, moe_intermediate_size=h.moe_intermediate_size,
        norm_topk_prob=h.norm_topk_prob,
        # The layer kinds differ: engine/resolve.py runs them unrolled (uniform_layers is False).
        layer_types=h.layer_types, rotary_dim=h.rotary_dim, hybrid=h)


def num_full_layers(cfg: HybridConfig) -> int:
    return cfg.num_layers - num_gdn_layers(cfg)


def num_gdn_layers(cfg: HybridConfig) -> int:
    return sum(map(cfg.is_linear, range(cfg.num_layers)))
