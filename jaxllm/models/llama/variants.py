"""Config mapping of the Llama-family variants Phi-3, SmolLM3, OLMo 2/3, Granite and GLM-4-MoE.

Each is the decoder of ``models/llama/`` with some ``ArchConfig`` switches on; this module
reads those switches from the transformers config (``models/config.arch_config_from_hf``
calls :func:`family_b_fields` last, its values override the generic ones) and refuses, by
name, the options the engine does not implement instead of ignoring them:

* Phi-3 (``Phi3ForCausalLM``): fused ``qkv_proj`` / ``gate_up_proj`` (split at load, the
  parameter table's ``Chunk`` patterns), LongRoPE (``rope_scaling.type = longrope``),
  ``partial_rotary_factor`` (Phi-4-mini).
* SmolLM3: NoPE layers (``no_rope_layers``: 1 = RoPE, 0 = none; transformers derives it from
  ``no_rope_layer_interval``).
* OLMo 2/3: norms after attention and MLP only, q/k RMSNorm over the whole projection.
* Granite: embedding, residual, attention (the softmax scale) and logits multipliers.
* GLM-4-MoE: sigmoid routing with a score-correction bias, grouped top-k, shared experts,
  dense first layers, partial rotary, q/k/v bias, optional per-head q/k norm
  (:func:`glm4_moe_fields`).

OLMo 3's ``layer_types`` (sliding and full layers) become ``ArchConfig.layer_types``: each
layer's window is ``ArchConfig.window(i)``, and mixed layers run unrolled.  SmolLM3's sliding
NoPE layers are refused naming ``layer_types``.
"""

from __future__ import annotations

from jaxllm.errors import ModelLoadError

FAMILY_B = ("Phi3ForCausalLM", "SmolLM3ForCausalLM", "Olmo2ForCausalLM", "Olmo3ForCausalLM",
            "GraniteForCausalLM", "Glm4MoeForCausalLM")

FUSED_QKV = ("Phi3ForCausalLM",)
"""Checkpoints with one ``qkv_proj`` and one ``gate_up_proj`` per layer."""


def _rotary_dim(get, rope_params, head_dim: int) -> int:
    factor = None
    if isinstance(rope_params, dict):
        factor = rope_params.get("partial_rotary_factor")
    if factor is None:
        factor = get("partial_rotary_factor", default=1.0)
    dim = int(head_dim * float(factor))
    return 0 if dim == head_dim else dim


def _sliding_window(get, arch: str, where: str) -> tuple[int | None, tuple[str, ...]]:
    """(the sliding layers' window or None, the per-layer types when they mix sliding and full
    attention, else ())."""
    window = get("sliding_window")
    if arch == "SmolLM3ForCausalLM" and not get("use_sliding_window", default=False):
        window = None
    types = list(get("layer_types", default=None) or [])
    if window is None:
        return None, ()
    if not types or all(t == "sliding_attention" for t in types):
        return int(window), ()
    if all(t != "sliding_attention" for t in types):
        return None, ()
    if int(window) >= int(get("max_position_embeddings", default=4096)):
        return None, ()   # the window never cuts anything off within the model's context
    if arch != "Olmo3ForCausalLM":
        raise ModelLoadError(f"{where}: layer_types mixes sliding_attention and full_attention layers with "
                             f"sliding_window={window} (below max_position_embeddings); per-layer sliding windows "
                             f"are not supported for {arch}")
    bad = sorted(set(types) - {"sliding_attention", "full_attention"})
    if bad:
        raise ModelLoadError(f"{where}: layer_types {bad} are not supported (sliding_attention, full_attention)")
    return int(window), tuple(types)


def family_b_fields(arch: str, get, rope_params, where: str, head_dim: int) -> dict:
    """The ``ArchConfig`` fields of ``arch`` (one of :data:`FAMILY_B`) that differ from the
    generic Llama reading; ``get`` reads the transformers config."""
    bias = bool(get("attention_bias", default=False))
    out: dict = {"rotary_dim": _rotary_dim(get, rope_params, head_dim),
                 "qkv_bias": bias, "o_bias": bias}
    out["sliding_window"], out["layer_types"] = _sliding_window(get, arch, where)
    if arch == "SmolLM3ForCausalLM":
        flags = list(get("no_rope_layers", default=None) or [])
        if not flags:
            interval = int(get("no_rope_layer_interval", default=4))
            flags = [int((i + 1) % interval != 0) for i in range(int(get("num_hidden_layers")))]
        out["no_rope_layers"] = tuple(i for i, use_rope in enumerate(flags) if not use_rope)
    elif arch in ("Olmo2ForCausalLM", "Olmo3ForCausalLM"):
        out.update(post_norms_only=True, qk_norm=True, qk_norm_whole=True)
    elif arch == "GraniteForCausalLM":
        out.update(embedding_multiplier=float(get("embedding_multiplier", default=1.0)),
                   residual_multiplier=float(get("residual_multiplier", default=1.0)),
                   attention_multiplier=float(get("attention_multiplier", default=head_dim ** -0.5)),
                   logits_scaling=float(get("logits_scaling", default=1.0)))
    elif arch == "Glm4MoeForCausalLM":
        out.update(o_bias=False, qk_norm=bool(get("use_qk_norm", default=False)))
    return out


def glm4_moe_fields(get, num_experts: int, top_k: int, where: str) -> dict:
    """GLM-4-MoE's MoE fields (transformers' ``Glm4MoeTopkRouter`` / ``Glm4MoeMoE``)."""
    if num_experts <= 0:
        raise ModelLoadError(f"{where}: n_routed_experts must be positive for Glm4MoeForCausalLM")
    n_group = int(get("n_group", default=1))
    if n_group > 1 and num_experts // n_group < 2:
        raise ModelLoadError(f"{where}: n_group={n_group} leaves fewer than 2 experts per group "
                             "(a group's score is the sum of its best two)")
    topk_group = int(get("topk_group", default=1))
    if n_group > 1 and topk_group <= n_group and top_k > topk_group * (num_experts // n_group):
        raise ModelLoadError(f"{where}: num_experts_per_tok={top_k} exceeds the experts of topk_group={topk_group} "
                             f"of n_group={n_group} groups")
    return dict(num_experts=num_experts, num_experts_per_tok=top_k,
                moe_intermediate_size=int(get("moe_intermediate_size", default=0)),
                norm_topk_prob=bool(get("norm_topk_prob", default=True)),
                first_k_dense=min(int(get("first_k_dense_replace", default=1)), int(get("num_hidden_layers"))),
                shared_experts=int(get("n_shared_experts", default=1)),
                router_scoring="sigmoid", n_group=n_group, topk_group=int(get("topk_group", default=1)),
                routed_scaling_factor=float(get("routed_scaling_factor", default=1.0)))
