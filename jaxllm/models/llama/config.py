"""The Llama family's config (:class:`LlamaConfig`): a transformers config or a GGUF file's
metadata in llama.cpp's llama / mistral / qwen2 / qwen3 layout -> the ``ArchConfig`` of the
decoder in ``llama/model.py``.  The variants' switches (Phi-3, SmolLM3, OLMo 2/3, Granite,
GLM-4-MoE), HF and GGUF, are read by ``llama/variants.py``."""

from __future__ import annotations

from dataclasses import dataclass, fields as dataclass_fields

from jaxllm.errors import ModelLoadError
from jaxllm.models.config import ArchConfig, FamilyConfig, RopeScaling, _eos_tuple, rope_scaling_from_dict
from jaxllm.models.gguf_arch import finish
from jaxllm.models.llama import variants
from jaxllm.models.llama.variants import FAMILY_B, family_b_fields, glm4_moe_fields

MOE_ARCHITECTURES = ("Qwen3MoeForCausalLM", "MixtralForCausalLM", "Glm4MoeForCausalLM")

# GGUF general.architecture -> HF architecture: llama.cpp's llama layout, then the variants'
# own architecture names (their metadata: llama/variants.py).
GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    **variants.GGUF_ARCHITECTURES,
}


@dataclass(frozen=True)
class LlamaConfig(FamilyConfig):
    """The Llama variants' switches (``ArchConfig.variant``: SmolLM3, OLMo 2/3, Granite) and the
    family's readers (the registry's ``Family.config``)."""

    no_rope_layers: tuple[int, ...] = ()
    """Layers that apply no rotary embedding (SmolLM3's NoPE layers)."""
    post_norms_only: bool = False
    """OLMo 2/3: no norm before attention and MLP; each output is normalised before the residual add."""
    qk_norm_whole: bool = False
    """With ``qk_norm``: one RMSNorm over the whole q (k) projection, not per head (OLMo 2/3)."""
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float | None = None
    """The softmax scale (Granite); None: ``head_dim ** -0.5``."""
    logits_scaling: float = 1.0
    """Logits are divided by it (Granite)."""

    @classmethod
    def from_hf(cls, hf, arch: str, where: str) -> ArchConfig:
        return _from_hf(hf, arch, where)

    @classmethod
    def from_gguf(cls, fields: dict, tensors: dict, gguf_arch: str, path: str, read=None) -> ArchConfig:
        """llama.cpp's metadata of one of :data:`GGUF_ARCHITECTURES` (``tensors``: name -> GGUF
        shape; ``read``: Phi-3's LongRoPE factor tensors)."""
        if gguf_arch not in variants.GGUF_ARCHITECTURES:
            return _from_gguf(fields, tensors, gguf_arch, GGUF_ARCHITECTURES[gguf_arch], path)
        m, base = variants.gguf_fields(fields, tensors, gguf_arch, path)
        # Phi-3's rope.dimension_count is checked against its partial rotary in its reader
        arch = finish(m, _with_variant(base), check_rope=gguf_arch != "phi3")
        if gguf_arch == "phi3" and arch.longrope and read is not None:
            arch = variants.with_longrope_factors(arch, read, path)
        return arch


_PLAIN = LlamaConfig()
_VARIANT_FIELDS = tuple(f.name for f in dataclass_fields(LlamaConfig))


def variant(arch: ArchConfig) -> LlamaConfig:
    """``arch``'s variant switches (all at their defaults when ``arch.variant`` is None)."""
    return arch.variant or _PLAIN


def _with_variant(d: dict) -> dict:
    """``d`` (ArchConfig fields) with the variants' switches moved into ``variant`` (None when
    every one is at its default)."""
    d = dict(d)
    v = LlamaConfig(**{k: d.pop(k) for k in _VARIANT_FIELDS if k in d})
    d["variant"] = None if v == _PLAIN else v
    return d


def _from_hf(hf, arch: str, where: str) -> ArchConfig:
    """Maps a transformers ``PretrainedConfig`` of the Llama-family decoder (the variants of
    ``llama/variants.py`` included) to an ArchConfig."""

    def get(*names, default=None):
        for n in names:
            v = getattr(hf, n, None)
            if v is not None:
                return v
        return default

    # transformers 5 moves rope_theta and the scaling dict into rope_parameters.
    rope_params = get("rope_parameters")
    if isinstance(rope_params, dict) and "rope_theta" not in rope_params and rope_params:
        # Per-layer-type nesting ({"full_attention": {...}}): one RoPE for every layer type only.
        nested = [v for v in rope_params.values() if isinstance(v, dict)]
        if any(v != nested[0] for v in nested):
            raise ModelLoadError(f"{where}: rope_parameters differ between layer types "
                                 f"({', '.join(rope_params)}); per-layer RoPE is not supported")
        rope_params = nested[0] if nested else rope_params
    rope_theta = (rope_params or {}).get("rope_theta") if isinstance(rope_params, dict) else None
    if rope_theta is None:
        rope_theta = get("rope_theta", default=10000.0)
    scaling = get("rope_scaling")
    if scaling is None and isinstance(rope_params, dict):
        scaling = rope_params
    if isinstance(scaling, dict):
        # LongRoPE's defaults come from the config's top level (Phi-3).
        scaling = {**scaling, "_max_position_embeddings": get("max_position_embeddings", default=4096)}
        if scaling.get("original_max_position_embeddings") is None and get("original_max_position_embeddings"):
            scaling["original_max_position_embeddings"] = get("original_max_position_embeddings")
    act = get("hidden_act", default="silu")
    if act not in ("silu", "swish"):
        raise ModelLoadError(f"{where}: hidden_act {act!r} is not supported (only silu)")
    if get("mlp_bias", default=False):
        raise ModelLoadError(f"{where}: mlp_bias=true is not supported")
    hidden = int(get("hidden_size"))
    heads = int(get("num_attention_heads"))
    head_dim = get("head_dim") or hidden // heads
    # Qwen2 always has q/k/v biases and never an output bias; Llama and Qwen3 put
    # ``attention_bias`` on all four projections; Mistral has none.
    bias = arch in ("LlamaForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM") and bool(
        get("attention_bias", default=False))
    sliding = None
    if get("use_sliding_window", default=True) and get("sliding_window") is not None:
        sliding = int(get("sliding_window"))
    moe = _moe_fields(arch, get, where) if arch in MOE_ARCHITECTURES else {}
    family = family_b_fields(arch, get, rope_params, where, int(head_dim)) if arch in FAMILY_B else {}
    fields = dict(
        architecture=arch,
        vocab_size=int(get("vocab_size")),
        hidden_size=hidden,
        intermediate_size=int(get("intermediate_size")),
        num_layers=int(get("num_hidden_layers")),
        num_heads=heads,
        num_kv_heads=int(get("num_key_value_heads", default=heads)),
        head_dim=int(head_dim),
        rms_norm_eps=float(get("rms_norm_eps", default=1e-6)),
        rope_theta=float(rope_theta),
        rope_scaling=rope_scaling_from_dict(scaling, where),
        max_position_embeddings=int(get("max_position_embeddings", default=4096)),
        tie_word_embeddings=bool(get("tie_word_embeddings", default=False)),
        qkv_bias=arch == "Qwen2ForCausalLM" or bias,
        o_bias=bias,
        qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
        sliding_window=sliding,
        bos_token_id=get("bos_token_id"),
        eos_token_ids=_eos_tuple(get("eos_token_id")),
        **moe,
    )
    fields.update(family)
    return ArchConfig(**_with_variant(fields))


def _moe_fields(arch: str, get, where: str) -> dict:
    """The MoE fields of a Qwen3-MoE or Mixtral config; refuses variants we do not implement.

    transformers 5 saves ``num_local_experts`` for both (``num_experts`` is an alias on
    Qwen3-MoE's config class, and older Qwen3-MoE configs spell it so)."""
    num_experts = int(get("num_local_experts", "num_experts", default=0))
    top_k = int(get("num_experts_per_tok", default=0))
    unsupported = {
        # field: (value, what the implementation assumes)
        "shared_expert_intermediate_size": (get("shared_expert_intermediate_size", default=0), 0),
        "n_shared_experts": (get("n_shared_experts", default=0), 0),
        "num_shared_experts": (get("num_shared_experts", default=0), 0),
        "first_k_dense_replace": (get("first_k_dense_replace", default=0), 0),
        "moe_layer_freq": (get("moe_layer_freq", default=1), 1),
        "routed_scaling_factor": (get("routed_scaling_factor", default=1.0), 1.0),
        "scoring_func": (get("scoring_func", default="softmax"), "softmax"),
        "topk_method": (get("topk_method", default="greedy"), "greedy"),
        "n_group": (get("n_group", default=1), 1),
        "topk_group": (get("topk_group", default=1), 1),
    }
    if arch == "Glm4MoeForCausalLM":
        return glm4_moe_fields(get, num_experts, top_k, where)
    if arch == "Qwen3MoeForCausalLM":
        if num_experts == 0:
            return {}   # transformers then builds a dense MLP in every layer: the dense path
        unsupported["decoder_sparse_step"] = (get("decoder_sparse_step", default=1), 1)
        unsupported["mlp_only_layers"] = (list(get("mlp_only_layers", default=[]) or []), [])
        inter = int(get("moe_intermediate_size", default=0))
        renorm = bool(get("norm_topk_prob", default=False))
    else:
        if num_experts == 0:
            raise ModelLoadError(f"{where}: num_local_experts must be positive for {arch}")
        inter = int(get("intermediate_size"))
        renorm = True   # MixtralTopKRouter always renormalises the top-k weights
    for name, (value, supported) in unsupported.items():
        if value != supported:
            raise ModelLoadError(f"{where}: {name}={value!r} is not supported for {arch} "
                                 f"(only {supported!r}: every layer a routed-experts block, softmax top-k routing)")
    return dict(num_experts=num_experts, num_experts_per_tok=top_k, moe_intermediate_size=inter,
                norm_topk_prob=renorm)


def _from_gguf(fields: dict, names, a: str, architecture: str, path: str) -> ArchConfig:
    """The ``ArchConfig`` of a GGUF file in llama.cpp's llama / mistral / qwen2 / qwen3 layout
    (``a``: its general.architecture, ``architecture`` the HF one it runs as; ``names``: its
    tensors by name)."""

    def field(key, default=None):
        v = fields.get(key)
        return default if v is None else v

    heads = int(field(f"{a}.attention.head_count"))
    kv_heads = int(field(f"{a}.attention.head_count_kv", heads))
    hidden = int(field(f"{a}.embedding_length"))
    head_dim = int(field(f"{a}.attention.key_length", hidden // heads))
    tokens = field("tokenizer.ggml.tokens") or []
    eos = field("tokenizer.ggml.eos_token_id")
    scaling_type = field(f"{a}.rope.scaling.type")
    scaling = RopeScaling()
    if scaling_type == "linear":
        scaling = RopeScaling(rope_type="linear", factor=float(field(f"{a}.rope.scaling.factor", 1.0)))
    elif scaling_type not in (None, "none"):
        raise ModelLoadError(f"{path}: GGUF rope scaling type {scaling_type!r} is not supported")
    return ArchConfig(
        architecture=architecture,
        vocab_size=int(field(f"{a}.vocab_size", len(tokens))),
        hidden_size=hidden,
        intermediate_size=int(field(f"{a}.feed_forward_length")),
        num_layers=int(field(f"{a}.block_count")),
        num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
        rms_norm_eps=float(field(f"{a}.attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(field(f"{a}.rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        max_position_embeddings=int(field(f"{a}.context_length", 4096)),
        tie_word_embeddings="output.weight" not in names,
        qkv_bias="blk.0.attn_q.bias" in names,
        o_bias="blk.0.attn_output.bias" in names,
        qk_norm="blk.0.attn_q_norm.weight" in names,
        sliding_window=None,
        bos_token_id=field("tokenizer.ggml.bos_token_id"),
        eos_token_ids=() if eos is None else (int(eos),),
    )
