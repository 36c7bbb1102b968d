"""ArchConfig: the architecture hyperparameters of a decoder checkpoint, however it was stored.

Built from an HF ``config.json`` (read through transformers' own config classes, which
know every historical spelling) or from GGUF metadata.  Frozen and hashable: it is part
of what identifies a compiled step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from jaxllm.errors import ModelLoadError
from jaxllm.layers.rotary import RopeScaling

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope")


@dataclass(frozen=True)
class FamilyConfig:
    """A model family's config: its readers of a transformers config (:meth:`from_hf`) and of a
    GGUF file's metadata (:meth:`from_gguf`), each giving the ``ArchConfig`` the engine reads.
    Each family subclasses it in ``models/<family>/config.py``; the registry's ``Family.config``
    names the subclass."""

    @classmethod
    def from_hf(cls, hf, arch: str, where: str) -> ArchConfig:
        """A transformers ``PretrainedConfig`` of architecture ``arch`` -> ``ArchConfig``."""
        raise NotImplementedError

    @classmethod
    def from_gguf(cls, fields: dict, tensors: dict, gguf_arch: str, path: str, read=None) -> ArchConfig:
        """A GGUF file's metadata (``fields``; ``tensors``: name -> shape as GGUF stores it;
        ``read``: a config tensor's values by name) -> ``ArchConfig``.  The default: the family
        has no GGUF form."""
        raise ModelLoadError(f"{path}: GGUF architecture {gguf_arch!r} has no reader in {cls.__name__}")


@dataclass(frozen=True)
class MoeRouting:
    """How a MoE checkpoint routes beyond softmax top-k of every layer (``ArchConfig.moe``):
    read by ``layers/moe.py``, the Llama family's GLM-4-MoE and DeepSeek."""

    first_k_dense: int = 0
    """The first k layers have a dense MLP of ``intermediate_size`` (GLM-4-MoE, DeepSeek)."""
    shared_experts: int = 0
    """Shared experts (one SwiGLU of ``shared_experts * moe_intermediate_size``) every token passes."""
    router_scoring: str = "softmax"
    """"softmax" (Qwen3-MoE, Mixtral) or "sigmoid" with a score-correction bias (GLM-4-MoE)."""
    n_group: int = 1
    topk_group: int = 1
    """Grouped top-k: experts in ``n_group`` groups, only the best ``topk_group`` groups eligible."""
    routed_scaling_factor: float = 1.0
    topk_method: str = "greedy"
    """DeepSeek-V2's softmax routing: "greedy" (top-k of all) or "group_limited_greedy"
    (top-k within the ``topk_group`` groups of best single expert)."""


@dataclass(frozen=True)
class ArchConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool = False
    """q/k/v projections carry a bias (Qwen2; Llama and Qwen3 with ``attention_bias``)."""
    o_bias: bool = False
    """The output projection carries a bias (Llama and Qwen3 with ``attention_bias``)."""
    qk_norm: bool = False
    """RMSNorm over each head of q and k before RoPE (Qwen3)."""
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    num_experts: int = 0
    """Routed experts per layer; 0: a dense SwiGLU MLP of ``intermediate_size`` in every layer.
    Otherwise every layer's MLP is a sparse MoE block (``layers/moe.py``)."""
    num_experts_per_tok: int = 0
    """Experts each token is routed to (top-k of the router's softmax)."""
    moe_intermediate_size: int = 0
    """Hidden width F of each expert (Qwen3-MoE's ``moe_intermediate_size``; Mixtral's
    ``intermediate_size``)."""
    norm_topk_prob: bool = False
    """Renormalise the k routing weights to sum to 1 (Qwen3-MoE's flag; Mixtral: always)."""
    layer_types: tuple[str, ...] = ()
    """Per layer "sliding_attention" or "full_attention"; empty: every layer alike, with
    ``sliding_window`` (or none).  Layers that differ run unrolled (engine/resolve.py)."""
    attn_scale: float | None = None
    """The softmax scale (Gemma's ``query_pre_attn_scalar ** -0.5``, MLA's with YaRN's mscale);
    None: ``head_dim ** -0.5``."""
    rotary_dim: int = 0
    """Leading dims of each head that RoPE rotates (``partial_rotary_factor``); 0: all of them."""
    moe: MoeRouting = MoeRouting()
    """How a MoE checkpoint routes beyond softmax top-k (GLM-4-MoE, DeepSeek); the default for
    dense models and plain softmax MoE."""

    # Each family's own knobs: an instance of its config type (models/<family>/config.py, a
    # FamilyConfig: frozen and hashable), named here by the base class (this module imports no family).
    variant: FamilyConfig | None = None
    """``llama.LlamaConfig``: the Llama variants' switches (SmolLM3, OLMo 2/3, Granite); None:
    all at their defaults (the plain decoders; ``llama.config.variant(arch)`` reads either)."""
    gemma: FamilyConfig | None = None
    """``gemma.GemmaConfig``: Gemma 2/3's soft caps and local RoPE base; None: not Gemma."""
    gpt_oss: FamilyConfig | None = None
    """``gpt_oss.GptOssConfig``: GPT-OSS's clamped SwiGLU; None: not GPT-OSS."""
    mla: FamilyConfig | None = None
    """``deepseek.DeepseekConfig``: multi-head latent attention (DeepSeek-V2/V3); None: not MLA.
    ``head_dim`` is then the rope dims of a head (``qk_rope_head_dim``) and ``attn_scale`` the
    softmax scale."""
    encoder: FamilyConfig | None = None
    """``bert.BertConfig`` or ``modernbert.ModernBertConfig``: a bidirectional encoder's knobs
    (token types, LayerNorm epsilon, GELU, position offset; ModernBERT's local window); None: a
    causal decoder."""

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ModelLoadError(f"num_attention_heads ({self.num_heads}) is not a multiple of "
                                 f"num_key_value_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ModelLoadError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.num_experts and not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ModelLoadError(f"num_experts_per_tok ({self.num_experts_per_tok}) must be between 1 and "
                                 f"num_experts ({self.num_experts})")
        if self.rotary_dim % 2 or not 0 <= self.rotary_dim <= self.head_dim:
            raise ModelLoadError(f"partial_rotary_factor gives {self.rotary_dim} rotary dims of {self.head_dim}: "
                                 "must be even and at most head_dim")
        if self.num_experts and self.num_experts % self.moe.n_group:
            raise ModelLoadError(f"n_routed_experts ({self.num_experts}) is not a multiple of n_group ({self.moe.n_group})")
        if self.num_experts and not 1 <= self.moe.topk_group <= self.moe.n_group:
            raise ModelLoadError(f"topk_group ({self.moe.topk_group}) must be between 1 and n_group ({self.moe.n_group})")
        if self.num_experts and self.moe_intermediate_size <= 0:
            raise ModelLoadError(f"moe_intermediate_size must be positive, got {self.moe_intermediate_size}")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def rope_dim(self) -> int:
        """Dims of each head RoPE rotates."""
        return self.rotary_dim or self.head_dim

    @property
    def longrope(self) -> bool:
        return self.rope_scaling.rope_type == "longrope"

    @property
    def dense_mlp(self) -> bool:
        """Some layer has a dense MLP."""
        return not self.is_moe or self.moe.first_k_dense > 0

    def layer_is_moe(self, layer: int) -> bool:
        return self.is_moe and layer >= self.moe.first_k_dense

    def window(self, layer: int) -> int | None:
        """The sliding window of ``layer`` (None: global attention)."""
        if self.layer_types and self.layer_types[layer] != "sliding_attention":
            return None
        return self.sliding_window

    @property
    def uniform_layers(self) -> bool:
        """Every layer has the same parameters and static attributes (what ``lax.scan``
        needs): no dense first layers before MoE ones, one attention kind (window) for all."""
        return not (self.is_moe and self.moe.first_k_dense) and len(set(self.layer_types)) <= 1

    def num_params(self) -> int:
        """All parameters (for MoE: every expert, not only the k a token activates)."""
        if self.is_moe:
            mlp = self.num_experts * (self.hidden_size + 3 * self.hidden_size * self.moe_intermediate_size)
        else:
            mlp = 3 * self.hidden_size * self.intermediate_size
        per_layer = (self.hidden_size * (self.q_size + 2 * self.kv_size) + self.q_size * self.hidden_size
                     + mlp + 2 * self.hidden_size)
        if self.qkv_bias:
            per_layer += self.q_size + 2 * self.kv_size
        if self.o_bias:
            per_layer += self.hidden_size
        if self.qk_norm:
            per_layer += 2 * self.head_dim
        total = self.num_layers * per_layer + self.vocab_size * self.hidden_size + self.hidden_size
        if not self.tie_word_embeddings:
            total += self.vocab_size * self.hidden_size
        return total


def rope_scaling_from_dict(d: dict | None, where: str, supported: tuple[str, ...] = SUPPORTED_ROPE_TYPES
                           ) -> RopeScaling:
    """Reads an HF ``rope_scaling`` / ``rope_parameters`` dict; refuses types we do not implement
    (``supported``: the architecture's)."""
    if not d:
        return RopeScaling()
    rope_type = d.get("rope_type") or d.get("type") or "default"
    if rope_type in ("su", "yarn") and "long_factor" in d:   # Phi-3's older spellings of LongRoPE
        rope_type = "longrope"
    if rope_type not in supported:
        raise ModelLoadError(f"{where}: rope scaling type {rope_type!r} is not supported "
                             f"(supported: {', '.join(supported)})")
    if rope_type == "default":
        return RopeScaling()
    if rope_type == "yarn":
        return _yarn(d, where)
    if rope_type == "longrope":
        return _longrope(d, where)
    return RopeScaling(
        rope_type=rope_type,
        factor=float(d.get("factor", 1.0)),
        low_freq_factor=float(d.get("low_freq_factor", 1.0)),
        high_freq_factor=float(d.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(d.get("original_max_position_embeddings", 8192)),
    )


def _yarn(d: dict, where: str) -> RopeScaling:
    """YaRN's parameters, with transformers' defaults and its attention factor
    (``_compute_yarn_parameters``)."""
    for key in ("factor", "original_max_position_embeddings"):
        if d.get(key) is None:
            raise ModelLoadError(f"{where}: yarn rope scaling needs {key}")
    factor = float(d["factor"])
    attention_factor = d.get("attention_factor")
    if attention_factor is None:
        def mscale(scale, m=1.0):
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0
        m, m_all = d.get("mscale"), d.get("mscale_all_dim")
        attention_factor = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    return RopeScaling(rope_type="yarn", factor=factor,
                       original_max_position_embeddings=int(d["original_max_position_embeddings"]),
                       beta_fast=float(d.get("beta_fast") or 32), beta_slow=float(d.get("beta_slow") or 1),
                       truncate=bool(d.get("truncate", True)), attention_factor=float(attention_factor))
def _longrope(d: dict, where: str) -> RopeScaling:
    """LongRoPE as transformers' ``_compute_longrope_parameters`` reads it (``_longrope_context``
    has filled in ``max_position_embeddings`` / ``original_max_position_embeddings``)."""
    for key in ("short_factor", "long_factor", "original_max_position_embeddings"):
        if d.get(key) is None:
            raise ModelLoadError(f"{where}: rope scaling type 'longrope' needs {key}")
    original = int(d["original_max_position_embeddings"])
    factor = d.get("factor")
    if factor is None:   # Phi-3: the ratio of the extended context to the pretrained one
        factor = d["_max_position_embeddings"] / original
    attention = d.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return RopeScaling(rope_type="longrope", factor=float(factor), original_max_position_embeddings=original,
                       short_factor=tuple(float(x) for x in d["short_factor"]),
                       long_factor=tuple(float(x) for x in d["long_factor"]), attention_factor=float(attention))


def _eos_tuple(eos) -> tuple[int, ...]:
    if eos is None:
        return ()
    if isinstance(eos, int):
        return (eos,)
    return tuple(int(e) for e in eos)
