"""ModernBERT's config (:class:`ModernBertConfig`): a transformers ``ModernBertConfig`` ->
``ArchConfig`` with the encoder's own knobs in ``ArchConfig.encoder`` (the local window and its
RoPE base, LayerNorm epsilon and biases, the GeGLU's activation, a cross-encoder's head).

``ArchConfig.layer_types`` says which layers are local ("sliding_attention": a token sees the
tokens at most ``half_window`` away on either side) and which global; ``ArchConfig.rope_theta``
is the global layers' RoPE base."""

from __future__ import annotations

from dataclasses import dataclass

from jaxllm.errors import ModelLoadError
from jaxllm.layers.rotary import RopeScaling
from jaxllm.models.config import ArchConfig, FamilyConfig

# transformers' names of the exact (erf) GELU and of its tanh approximation.
GELU_EXACT = ("gelu",)
GELU_TANH = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")
CLASSIFIERS = ("ModernBertForSequenceClassification",)
LAYER_TYPES = ("full_attention", "sliding_attention")
POOLINGS = ("cls", "mean")
# transformers' defaults (ModernBertConfig.default_theta, global_attn_every_n_layers).
GLOBAL_THETA, LOCAL_THETA, GLOBAL_EVERY = 160_000.0, 10_000.0, 3


@dataclass(frozen=True)
class ModernBertConfig(FamilyConfig):
    """ModernBERT's own knobs (``ArchConfig.encoder``) and its reader (the registry's ``Family.config``)."""

    half_window: int = 64
    """A local layer's reach: a token sees the tokens at most this far on either side
    (``local_attention // 2``, the ends included, as transformers' mask has it)."""
    local_rope_theta: float = LOCAL_THETA
    """The local layers' RoPE base (the global ones': ``ArchConfig.rope_theta``)."""
    norm_eps: float = 1e-5
    norm_bias: bool = False
    """Whether the LayerNorms have a bias."""
    attention_bias: bool = False
    mlp_bias: bool = False
    gelu_tanh: bool = False
    """The GeGLU's activation: False the exact (erf) GELU, True its tanh approximation."""
    num_labels: int = 0
    """A cross-encoder's classifier outputs (``ModernBertForSequenceClassification``); 0: an embedder."""
    classifier_pooling: str = "cls"
    """The token the head reads: "cls" the first, "mean" the mean over the prompt."""
    classifier_bias: bool = False
    """Whether the head's dense layer has a bias (the classifier always has one)."""
    classifier_gelu_tanh: bool = False
    """The head's activation, as ``gelu_tanh``."""
    position_offset: int = 0
    """No absolute positions (rotary only): nothing is offset (the pooling engine reads it)."""

    @classmethod
    def from_hf(cls, hf, arch: str, where: str) -> ArchConfig:
        return _from_hf(hf, arch, where)


def encoder(arch: ArchConfig) -> ModernBertConfig:
    """The encoder section of ``arch`` (a ModernBERT ``ArchConfig`` always has one)."""
    assert isinstance(arch.encoder, ModernBertConfig), arch.architecture
    return arch.encoder


def _gelu_tanh(act, name: str, arch: str, where: str) -> bool:
    if act not in GELU_EXACT + GELU_TANH:
        raise ModelLoadError(f"{where}: {name} {act!r} is not supported for {arch} "
                             f"(supported: {', '.join(GELU_EXACT + GELU_TANH)})")
    return act in GELU_TANH


def _theta(rope: dict, kind: str, legacy, default: float, arch: str, where: str) -> float:
    """The RoPE base of ``kind`` layers from transformers 5's ``rope_parameters`` (per layer
    type, or one flat dict for both), else the 4.x attribute ``legacy``, else ``default``."""
    params = rope.get(kind) or (rope if "rope_theta" in rope or "rope_type" in rope else {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise ModelLoadError(f"{where}: rope_parameters[{kind!r}] rope_type {rope_type!r} is not supported for "
                             f"{arch} (default only)")
    theta = params.get("rope_theta")
    return float(theta if theta is not None else legacy if legacy is not None else default)


def _from_hf(hf, arch: str, where: str) -> ArchConfig:
    """A transformers ``ModernBertConfig`` -> ArchConfig; refuses by name what the encoder does
    not implement."""
    def get(name, default=None):
        v = getattr(hf, name, None)
        return default if v is None else v

    heads = int(get("num_attention_heads"))
    hidden = int(get("hidden_size"))
    if hidden % heads:
        raise ModelLoadError(f"{where}: hidden_size ({hidden}) is not a multiple of num_attention_heads ({heads})")
    num_layers = int(get("num_hidden_layers"))
    every = int(get("global_attn_every_n_layers", GLOBAL_EVERY))
    layer_types = tuple(get("layer_types") or ("sliding_attention" if i % every else "full_attention"
                                               for i in range(num_layers)))
    bad = sorted(set(layer_types) - set(LAYER_TYPES))
    if bad or len(layer_types) != num_layers:
        raise ModelLoadError(f"{where}: layer_types must name {num_layers} layers, each one of "
                             f"{', '.join(LAYER_TYPES)}; got {list(layer_types)}")
    rope = get("rope_parameters", {})
    if not isinstance(rope, dict):
        raise ModelLoadError(f"{where}: rope_parameters must be a dict, got {rope!r}")
    global_theta = _theta(rope, "full_attention", get("global_rope_theta"), GLOBAL_THETA, arch, where)
    # transformers 4.x: a local_rope_theta of None means the global base.
    local_theta = _theta(rope, "sliding_attention", get("local_rope_theta"), global_theta, arch, where)
    local_attention = int(get("local_attention", 128))
    if local_attention < 2:
        raise ModelLoadError(f"{where}: local_attention must be at least 2, got {local_attention}")
    classifier = arch in CLASSIFIERS
    pooling = get("classifier_pooling", "cls")
    if classifier and pooling not in POOLINGS:
        raise ModelLoadError(f"{where}: classifier_pooling {pooling!r} is not supported for {arch} "
                             f"(supported: {', '.join(POOLINGS)})")
    eps = float(get("norm_eps", 1e-5))
    attention_bias = bool(get("attention_bias", False))
    return ArchConfig(
        architecture=arch,
        vocab_size=int(get("vocab_size")),
        hidden_size=hidden,
        intermediate_size=int(get("intermediate_size")),
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=hidden // heads,
        rms_norm_eps=eps,
        rope_theta=global_theta,
        rope_scaling=RopeScaling(),
        max_position_embeddings=int(get("max_position_embeddings", 8192)),
        tie_word_embeddings=False,
        qkv_bias=attention_bias,
        o_bias=attention_bias,
        layer_types=layer_types,
        encoder=ModernBertConfig(
            half_window=local_attention // 2, local_rope_theta=local_theta, norm_eps=eps,
            norm_bias=bool(get("norm_bias", False)), attention_bias=attention_bias,
            mlp_bias=bool(get("mlp_bias", False)),
            gelu_tanh=_gelu_tanh(get("hidden_activation", "gelu"), "hidden_activation", arch, where),
            num_labels=int(get("num_labels", 1)) if classifier else 0,
            classifier_pooling=pooling if classifier else "cls",
            classifier_bias=bool(get("classifier_bias", False)) if classifier else False,
            classifier_gelu_tanh=(_gelu_tanh(get("classifier_activation", "gelu"), "classifier_activation", arch,
                                             where) if classifier else False)),
    )
