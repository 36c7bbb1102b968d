"""DeepSeek-V2/V3's config (:class:`DeepseekConfig`): a transformers config -> ``ArchConfig`` (the MLA ranks, YaRN
with its softmax-scale correction, the routing of V2 and V3), refusing by name what the
engine does not implement."""

from __future__ import annotations

import math
from dataclasses import dataclass

from jaxllm.errors import ModelLoadError
from jaxllm.models.config import ArchConfig, FamilyConfig, MoeRouting, _eos_tuple, rope_scaling_from_dict

ROPE_TYPES = ("default", "yarn")
ARCHITECTURES = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")


@dataclass(frozen=True)
class DeepseekConfig(FamilyConfig):
    """Multi-head latent attention's ranks (``ArchConfig.mla``) and DeepSeek-V2/V3's config
    reader (the registry's ``Family.config``); no GGUF form."""

    kv_lora_rank: int = 0
    """The latent each token caches."""
    q_lora_rank: int = 0
    """The query's low-rank width (``q_a_proj``, ``q_a_layernorm``, ``q_b_proj``); 0: one ``q_proj``."""
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False
    """RoPE rotates interleaved pairs (DeepSeek's layout), not the two halves of the rope dims."""

    @classmethod
    def from_hf(cls, hf, arch: str, where: str) -> ArchConfig:
        return _from_hf(hf, arch, where)


def _mscale(scale: float, m: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


def _from_hf(hf, arch: str, where: str) -> ArchConfig:
    """A ``DeepseekV2Config`` / ``DeepseekV3Config`` -> ArchConfig; refuses by name what the
    model does not implement."""
    def get(name, default=None):
        v = getattr(hf, name, None)
        return default if v is None else v

    v3 = arch == "DeepseekV3ForCausalLM"
    refused = {
        # field: (value, what the implementation assumes)
        "hidden_act": (get("hidden_act", "silu"), "silu"),
        "attention_bias": (bool(get("attention_bias", False)), False),
        "mlp_bias": (bool(get("mlp_bias", False)), False),
        "moe_layer_freq": (get("moe_layer_freq", 1), 1),
    }
    for name, (value, supported) in refused.items():
        if value != supported:
            raise ModelLoadError(f"{where}: {name}={value!r} is not supported for {arch} (only {supported!r})")
    heads = int(get("num_attention_heads"))
    if int(get("num_key_value_heads", heads)) != heads:
        raise ModelLoadError(f"{where}: num_key_value_heads={get('num_key_value_heads')} is not supported for {arch}: "
                             f"MLA expands the latent into all {heads} heads (num_key_value_heads must equal it)")
    topk_method = "noaux_tc" if v3 else str(get("topk_method", "greedy"))
    if not v3 and topk_method not in ("greedy", "group_limited_greedy"):
        raise ModelLoadError(f"{where}: topk_method={topk_method!r} is not supported for {arch} "
                             "(greedy, group_limited_greedy)")
    L = int(get("num_hidden_layers"))
    rope = dict(get("rope_parameters") or {})
    theta = float(rope.get("rope_theta", get("rope_theta", 10000.0)))
    scaling = rope_scaling_from_dict(rope, where, ROPE_TYPES)
    rope_dim, nope, v_dim = int(get("qk_rope_head_dim")), int(get("qk_nope_head_dim")), int(get("v_head_dim"))
    kv_rank = int(get("kv_lora_rank"))
    if min(rope_dim, kv_rank, v_dim) <= 0 or nope < 0:
        raise ModelLoadError(f"{where}: kv_lora_rank, qk_rope_head_dim and v_head_dim must be positive "
                             f"(got {kv_rank}, {rope_dim}, {v_dim})")
    scale = (nope + rope_dim) ** -0.5
    if scaling.rope_type != "default" and rope.get("mscale_all_dim"):
        scale *= _mscale(scaling.factor, float(rope["mscale_all_dim"])) ** 2
    num_experts = int(get("n_routed_experts", 0))
    if num_experts <= 0:
        raise ModelLoadError(f"{where}: n_routed_experts must be positive for {arch}")
    top_k = int(get("num_experts_per_tok", 0))
    n_group = int(get("n_group", 1))
    topk_group = int(get("topk_group", 1))
    grouped = v3 or topk_method == "group_limited_greedy"
    if not grouped:
        n_group = topk_group = 1
    if grouped and v3 and n_group > 1 and num_experts // n_group < 2:
        raise ModelLoadError(f"{where}: n_group={n_group} leaves fewer than 2 experts per group "
                             "(a group's score is the sum of its best two)")
    if grouped and top_k > topk_group * (num_experts // max(n_group, 1)):
        raise ModelLoadError(f"{where}: num_experts_per_tok={top_k} exceeds the experts of topk_group={topk_group} "
                             f"of n_group={n_group} groups")
    hidden = int(get("hidden_size"))
    return ArchConfig(
        architecture=arch,
        vocab_size=int(get("vocab_size")),
        hidden_size=hidden,
        intermediate_size=int(get("intermediate_size")),
        num_layers=L,
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=rope_dim,
        rms_norm_eps=float(get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=int(get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(get("tie_word_embeddings", False)),
        bos_token_id=get("bos_token_id"),
        eos_token_ids=_eos_tuple(get("eos_token_id")),
        num_experts=num_experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=int(get("moe_intermediate_size")),
        norm_topk_prob=bool(get("norm_topk_prob", False)) if v3 else False,   # V2's router never renormalises
        attn_scale=scale,
        moe=MoeRouting(first_k_dense=min(int(get("first_k_dense_replace", 0)), L),
                       shared_experts=int(get("n_shared_experts", 0) or 0),
                       router_scoring="sigmoid" if v3 else "softmax", n_group=n_group, topk_group=topk_group,
                       routed_scaling_factor=float(get("routed_scaling_factor", 1.0)), topk_method=topk_method),
        mla=DeepseekConfig(kv_lora_rank=kv_rank, q_lora_rank=int(get("q_lora_rank", 0) or 0), qk_nope_head_dim=nope,
                           v_head_dim=v_dim, rope_interleave=bool(get("rope_interleave", True)) if v3 else True),
    )
