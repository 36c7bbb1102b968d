"""Gemma 3's image encoder as pure functions: the SigLIP vision tower and the multimodal
projector (average pooling to ``mm_tokens_per_image``, Gemma's RMSNorm, a projection into the
text model's hidden size), following transformers' ``modeling_siglip`` / ``modeling_gemma3``.

The output rows are what the text model takes at an image's placeholder tokens
(``processing.py`` expands them); the engine runs ``encode`` as its own compiled program.
Under tensor parallelism the parameters split by ``PARAM_AXES`` (``parallel/sharding.vision_rules``).
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.models.gemma.model import gemma_norm
from jaxllm.models.gemma3_vl.config import VisionConfig
from jaxllm.parallel.sharding import VISION_HEADS, VISION_MLP

_TOWER = "model.vision_tower."
_PROJ = "model.multi_modal_projector."
_HI = jax.lax.Precision.HIGHEST


_E = ("vision_embed",)   # the tower's hidden width: never split
PARAM_AXES = {
    "patch": ("vision_patch",) + _E, "patch_b": _E, "pos": ("vision_positions",) + _E,
    **{n: _E for n in ("layer_norm1", "layer_norm1_b", "layer_norm2", "layer_norm2_b", "o_b", "fc2_b",
                       "post_ln", "post_ln_b", "mm_norm")},
    # Megatron's layout: q/k/v and fc1 by output (heads, MLP width), o and fc2 by input
    **{n: _E + (VISION_HEADS,) for n in ("q", "k", "v")}, **{n + "_b": (VISION_HEADS,) for n in ("q", "k", "v")},
    "o": (VISION_HEADS,) + _E, "fc1": _E + (VISION_MLP,), "fc1_b": (VISION_MLP,), "fc2": (VISION_MLP,) + _E,
    "mm_proj": _E + ("embed",),
}
"""Logical axes of each parameter of ``load_params`` (a layer's by its name in ``layers[i]``)."""


def split_sizes(cfg: VisionConfig) -> dict[str, int]:
    """The sizes of the axes tensor parallelism may split (``parallel/sharding.vision_rules``)."""
    return {VISION_HEADS: cfg.num_heads, VISION_MLP: cfg.intermediate_size}


def tp_layout(params: dict, split_heads: bool) -> dict:
    """``load_params``' parameters laid out for a tensor-parallel split: unchanged (q, k and v
    are separate matrices already)."""
    return params


def load_params(cfg: VisionConfig, tensors: Mapping[str, np.ndarray]) -> dict:
    """HF tensor names -> the encoder's parameters (linear weights transposed to [in, out]).
    A missing tensor is a ValueError naming it."""
    def get(name):
        if name not in tensors:
            raise ValueError(f"Gemma3ForConditionalGeneration: tensor {name!r} missing from the checkpoint")
        return jnp.asarray(np.asarray(tensors[name], np.float32))

    e = _TOWER + "embeddings."
    layers = []
    for i in range(cfg.num_layers):
        p = f"{_TOWER}encoder.layers.{i}."
        lp = {n: get(p + n + ".weight") for n in ("layer_norm1", "layer_norm2")}
        lp.update({n + "_b": get(p + n + ".bias") for n in ("layer_norm1", "layer_norm2")})
        for n, hf in (("q", "self_attn.q_proj"), ("k", "self_attn.k_proj"), ("v", "self_attn.v_proj"),
                      ("o", "self_attn.out_proj"), ("fc1", "mlp.fc1"), ("fc2", "mlp.fc2")):
            lp[n] = get(p + hf + ".weight").T                                 # [in, out]
            lp[n + "_b"] = get(p + hf + ".bias")
        layers.append(lp)
    conv = get(e + "patch_embedding.weight")                                  # [D, 3, P, P]
    return {
        "patch": conv.reshape(conv.shape[0], -1).T,                           # [3*P*P, D]
        "patch_b": get(e + "patch_embedding.bias"),
        "pos": get(e + "position_embedding.weight"),                          # [N, D]
        "layers": layers,
        "post_ln": get(_TOWER + "post_layernorm.weight"), "post_ln_b": get(_TOWER + "post_layernorm.bias"),
        "mm_norm": get(_PROJ + "mm_soft_emb_norm.weight"),
        "mm_proj": get(_PROJ + "mm_input_projection_weight"),                 # [D, text D]
    }


def _ln(x, w, b, eps):
    mu = jnp.mean(x, -1, keepdims=True)
    var = jnp.mean(jnp.square(x - mu), -1, keepdims=True)
    return (x - mu) * jax.lax.rsqrt(var + eps) * w + b


def _dense(x, w, b):
    return jnp.matmul(x, w, precision=_HI) + b


def _patches(cfg: VisionConfig, pixels: jax.Array) -> jax.Array:
    """pixels [B, 3, H, W] -> [B, N, 3*P*P] in the conv weight's (c, y, x) order, row-major patches."""
    B, C, H, W = pixels.shape
    P = cfg.patch_size
    x = pixels.reshape(B, C, H // P, P, W // P, P)
    return x.transpose(0, 2, 4, 1, 3, 5).reshape(B, (H // P) * (W // P), C * P * P)


def _block(cfg: VisionConfig, x, lp):
    # x [B, N, D]: pre-norm bidirectional attention, then the tanh-GELU MLP
    B, N, D = x.shape
    H = cfg.num_heads
    Dh = D // H
    h = _ln(x, lp["layer_norm1"], lp["layer_norm1_b"], cfg.layer_norm_eps)
    q, k, v = (_dense(h, lp[n], lp[n + "_b"]).reshape(B, N, H, Dh) for n in ("q", "k", "v"))
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k, precision=_HI) * (Dh ** -0.5)     # [B, H, N, N]
    a = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v, precision=_HI).reshape(B, N, D)
    x = x + _dense(a, lp["o"], lp["o_b"])
    h = _ln(x, lp["layer_norm2"], lp["layer_norm2_b"], cfg.layer_norm_eps)
    return x + _dense(jax.nn.gelu(_dense(h, lp["fc1"], lp["fc1_b"]), approximate=True), lp["fc2"], lp["fc2_b"])


def encode(cfg: VisionConfig, params: dict, pixels: jax.Array) -> jax.Array:
    """pixels [B, 3, S, S] (``image_size``) -> image embeddings [B, mm_tokens_per_image, text D]."""
    if pixels.shape[-2:] != (cfg.image_size, cfg.image_size):
        raise ValueError(f"Gemma 3 vision: pixels {tuple(pixels.shape)} are not {cfg.image_size}x{cfg.image_size}")
    x = _dense(_patches(cfg, pixels.astype(jnp.float32)), params["patch"], params["patch_b"]) + params["pos"]
    for lp in params["layers"]:
        x = _block(cfg, x, lp)                                                # [B, N, D]
    x = _ln(x, params["post_ln"], params["post_ln_b"], cfg.layer_norm_eps)
    B, N, D = x.shape
    side, k, t = cfg.patches_per_side, cfg.pool, cfg.tokens_per_side
    # average pool k x k patches (nn.AvgPool2d, stride k): [B, side, side, D] -> [B, t*t, D]
    x = x.reshape(B, t, k, t, k, D).mean(axis=(2, 4)).reshape(B, t * t, D)
    x = gemma_norm(x, params["mm_norm"], cfg.layer_norm_eps)
    return jnp.matmul(x, params["mm_proj"], precision=_HI)                    # [B, T_img, text D]
