"""Shared readers of GGUF metadata: what every family's ``from_gguf`` (``models/<family>/config.py``)
reads the same way.

:class:`GgufMeta` reads the keys under ``<arch>.`` typed, and refuses a key no reader
understands by name (it could change the function); :func:`base_fields` reads the sizes, heads,
rope base, biases and end-of-generation ids every llama.cpp architecture writes alike;
:func:`layer_types`, :func:`check_rope_dims` and :func:`refuse_scaling` are the rules several
families share.  Each family's own keys and llama.cpp's defaults for them live in its config.
"""

from __future__ import annotations

from jaxllm.errors import ModelLoadError
from jaxllm.models.config import ArchConfig, RopeScaling

# Keys under "<arch>." every architecture may carry without changing the function (checked
# against what they must agree with, or informational).
COMMON_KEYS = frozenset({
    "context_length", "embedding_length", "block_count", "feed_forward_length", "vocab_size",
    "attention.head_count", "attention.head_count_kv", "attention.key_length", "attention.value_length",
    "attention.layer_norm_rms_epsilon", "rope.dimension_count", "rope.freq_base", "rope.scaling.finetuned"})


class GgufMeta:
    """The file's metadata under ``<arch>.``: typed reads, and the refusal of keys no reader
    understands."""

    def __init__(self, fields: dict, arch: str, path: str):
        self.fields, self.arch, self.path = fields, arch, path

    def get(self, key: str, default=None, required: bool = False):
        full = f"{self.arch}.{key}"
        v = self.fields.get(full)
        if v is None:
            if required:
                raise ModelLoadError(f"{self.path}: GGUF metadata key {full!r} is missing")
            return default
        return v

    def scalar(self, key: str, cast=int, default=None, required: bool = False):
        v = self.get(key, default, required)
        if v is None:
            return None
        if isinstance(v, list):
            if len(set(v)) != 1:
                raise ModelLoadError(f"{self.path}: GGUF metadata key {self.arch}.{key} differs between layers "
                                     f"({v}); per-layer values are not supported")
            v = v[0]
        return cast(v)

    def refuse_unknown(self, arch_keys: frozenset[str] | set[str]):
        """Refuses a key under ``<arch>.`` outside :data:`COMMON_KEYS` and ``arch_keys`` (the
        family's reader's own)."""
        known = COMMON_KEYS | arch_keys
        prefix = self.arch + "."
        unknown = sorted(k for k in self.fields if k.startswith(prefix) and k[len(prefix):] not in known)
        if unknown:
            raise ModelLoadError(f"{self.path}: GGUF metadata key {unknown[0]!r} is not supported for "
                                 f"{self.arch} (it may change the model's function; understood: "
                                 f"{', '.join(sorted(known))})")


def layer_types(m: GgufMeta, L: int, window: int | None, default_period: int | None) -> tuple[str, ...]:
    """Per-layer attention kinds: the file's sliding_window_pattern (true: sliding), else
    llama.cpp's fixed period for the architecture (``set_swa_pattern(n)``: layer i slides
    unless i % n == n - 1); () when no layer slides."""
    if not window:
        return ()
    pattern = m.get("attention.sliding_window_pattern")
    if pattern is not None:
        if not isinstance(pattern, list) or len(pattern) != L:
            raise ModelLoadError(f"{m.path}: {m.arch}.attention.sliding_window_pattern must hold one boolean per "
                                 f"layer ({L}), got {pattern!r}")
        sliding = [bool(p) for p in pattern]
    elif default_period is None:
        sliding = [True] * L
    else:
        sliding = [i % default_period != default_period - 1 for i in range(L)]
    if not any(sliding):
        return ()
    return tuple("sliding_attention" if s else "full_attention" for s in sliding)


def check_rope_dims(m: GgufMeta, rotary: int, head_dim: int):
    n_rot = m.scalar("rope.dimension_count")
    if n_rot is not None and n_rot != rotary:
        raise ModelLoadError(f"{m.path}: {m.arch}.rope.dimension_count is {n_rot}, but this architecture rotates "
                             f"{rotary} of {head_dim} dims per head")


def refuse_scaling(m: GgufMeta):
    t = m.get("rope.scaling.type")
    if t not in (None, "none"):
        raise ModelLoadError(f"{m.path}: {m.arch}.rope.scaling.type {t!r} is not supported for {m.arch}")


def base_fields(m: GgufMeta, architecture: str, tensors: dict) -> dict:
    """The ``ArchConfig`` fields every llama.cpp architecture writes alike (``tensors``: name ->
    shape as GGUF stores it, innermost first); the family's reader updates them."""
    path, fields = m.path, m.fields
    heads = m.scalar("attention.head_count", required=True)
    kv_heads = m.scalar("attention.head_count_kv", default=heads)
    hidden = m.scalar("embedding_length", required=True)
    head_dim = m.scalar("attention.key_length", default=hidden // heads)
    value_dim = m.scalar("attention.value_length", default=head_dim)
    if value_dim != head_dim:
        raise ModelLoadError(f"{path}: {m.arch}.attention.value_length ({value_dim}) differs from key_length "
                             f"({head_dim}); only equal key and value head sizes are supported")
    L = m.scalar("block_count", required=True)
    embd = tensors.get("token_embd.weight")
    vocab = m.scalar("vocab_size", default=None)
    if vocab is None:
        if embd is None:
            raise ModelLoadError(f"{path}: missing tensor 'token_embd.weight'")
        vocab = int(embd[-1])
    # The ids that end a generation: llama.cpp's end-of-generation set (eos, eot, eom), which
    # for chat models (Phi-3's <|end|>, GLM's <|user|>) is more than eos alone.
    eog = []
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        v = fields.get(f"tokenizer.ggml.{key}")
        if v is not None and int(v) not in eog:
            eog.append(int(v))
    return {
        "architecture": architecture, "vocab_size": int(vocab), "hidden_size": hidden,
        "intermediate_size": m.scalar("feed_forward_length", default=0) or 0, "num_layers": L,
        "num_heads": heads, "num_kv_heads": kv_heads, "head_dim": head_dim,
        "rms_norm_eps": m.scalar("attention.layer_norm_rms_epsilon", float, default=1e-6),
        "rope_theta": m.scalar("rope.freq_base", float, default=10000.0), "rope_scaling": RopeScaling(),
        "max_position_embeddings": m.scalar("context_length", default=4096),
        "tie_word_embeddings": "output.weight" not in tensors,
        "qkv_bias": "blk.0.attn_q.bias" in tensors, "o_bias": "blk.0.attn_output.bias" in tensors,
        "bos_token_id": fields.get("tokenizer.ggml.bos_token_id"),
        "eos_token_ids": tuple(eog),
    }


def finish(m: GgufMeta, base: dict, check_rope: bool = True) -> ArchConfig:
    """``base`` (updated by the family's reader) as the ``ArchConfig``, its rotary dims checked
    against the file's ``rope.dimension_count``."""
    if check_rope:
        check_rope_dims(m, base.get("rotary_dim") or base["head_dim"], base["head_dim"])
    return ArchConfig(**base)


__all__ = ["COMMON_KEYS", "GgufMeta", "base_fields", "check_rope_dims", "finish", "layer_types", "refuse_scaling"]
