"""Qwen3.5's image encoder as pure functions: a ViT over ``[C, Tp, P, P]`` patches (a Conv3d
whose stride is its kernel, so one matmul), a learned square position grid bilinearly resampled
to each image's patch grid, 2D rotary attention (the h and w coordinates each rotate a quarter
of the head dim, twice), bidirectional inside one image, and the patch merger folding each 2x2
block of patches into one text-model row.  Follows transformers' ``Qwen3_5VisionModel``.

``grid_inputs`` is the host half (numpy, from the images' ``grid_thw`` alone: the same for every
image of one size, so an image-size bucket compiles ``encode`` once); ``encode`` is the jitted
half.  Several images are packed along the patch axis and kept apart by a segment mask.  Under tensor
parallelism the parameters split by ``PARAM_AXES`` (``parallel/sharding.vision_rules``), the
fused q/k/v projection cut in three first (``tp_layout``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.models.qwen3_5_vl.config import VisionConfig
from jaxllm.parallel.sharding import VISION_HEADS, VISION_MERGE, VISION_MLP

_VISUAL = "model.visual."
_HI = jax.lax.Precision.HIGHEST


def tensor_shapes(cfg: VisionConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of the vision tower in the checkpoint (HF name -> shape)."""
    D, F, Dm = cfg.hidden_size, cfg.intermediate_size, cfg.hidden_size * cfg.merge_unit
    out = {_VISUAL + "patch_embed.proj.weight": (D, cfg.in_channels, cfg.temporal_patch_size, cfg.patch_size,
                                                  cfg.patch_size),
           _VISUAL + "patch_embed.proj.bias": (D,),
           _VISUAL + "pos_embed.weight": (cfg.num_position_embeddings, D)}
    linears = {"attn.qkv": (D, 3 * D), "attn.proj": (D, D), "mlp.linear_fc1": (D, F), "mlp.linear_fc2": (F, D)}
    for i in range(cfg.depth):
        p = f"{_VISUAL}blocks.{i}."
        for n in ("norm1", "norm2"):
            out[p + n + ".weight"] = out[p + n + ".bias"] = (D,)
        for n, (n_in, n_out) in linears.items():
            out[p + n + ".weight"], out[p + n + ".bias"] = (n_out, n_in), (n_out,)
    m = _VISUAL + "merger."
    out[m + "norm.weight"] = out[m + "norm.bias"] = (D,)
    for n, (n_in, n_out) in (("linear_fc1", (Dm, Dm)), ("linear_fc2", (Dm, cfg.out_hidden_size))):
        out[m + n + ".weight"], out[m + n + ".bias"] = (n_out, n_in), (n_out,)
    return out


def check_tensors(cfg: VisionConfig, tensors: Mapping[str, object]) -> None:
    """The vision tower's tensors (HF name -> array or shape) are exactly those the tower reads:
    a missing or unexpected name (Qwen3-VL's DeepStack mergers) or a wrong shape is a ValueError
    naming it."""
    want = tensor_shapes(cfg)
    for name, shape in want.items():
        if name not in tensors:
            raise ValueError(f"Qwen3_5ForConditionalGeneration: tensor {name!r} missing from the checkpoint")
        got = tuple(getattr(tensors[name], "shape", tensors[name]))
        if got != shape:
            raise ValueError(f"Qwen3_5ForConditionalGeneration: tensor {name!r} has shape {got}, expected {shape}")
    extra = sorted(n for n in tensors if n.startswith(_VISUAL) and n not in want)
    if extra:
        raise ValueError(f"Qwen3_5ForConditionalGeneration: vision tensor(s) the tower does not read: "
                         f"{', '.join(extra[:3])}{' ...' if len(extra) > 3 else ''}")


_E = ("vision_embed",)   # the tower's hidden width: never split
PARAM_AXES = {
    "patch": ("vision_patch",) + _E, "patch_b": _E, "pos": ("vision_positions",) + _E,
    **{n: _E for n in ("norm1", "norm1_b", "norm2", "norm2_b", "o_b", "fc2_b", "merge_norm", "merge_norm_b")},
    # the fused [D, 3D] q/k/v: whole on every device (its columns are (q | k | v) x heads, so an
    # even cut would not be by heads); ``tp_layout`` replaces it by q, k, v when heads split
    "qkv": _E + ("vision_qkv",), "qkv_b": ("vision_qkv",),
    # Megatron's layout: q/k/v, fc1 and the merger's fc1 by output, o, fc2 and merger fc2 by input
    **{n: _E + (VISION_HEADS,) for n in ("q", "k", "v")}, **{n + "_b": (VISION_HEADS,) for n in ("q", "k", "v")},
    "o": (VISION_HEADS,) + _E, "fc1": _E + (VISION_MLP,), "fc1_b": (VISION_MLP,), "fc2": (VISION_MLP,) + _E,
    "merge_fc1": ("vision_merged", VISION_MERGE), "merge_fc1_b": (VISION_MERGE,),
    "merge_fc2": (VISION_MERGE, "embed"), "merge_fc2_b": ("embed",),
}
"""Logical axes of each parameter of ``load_params`` / ``tp_layout`` (a layer's by its name in ``layers[i]``)."""


def split_sizes(cfg: VisionConfig) -> dict[str, int]:
    """The sizes of the axes tensor parallelism may split (``parallel/sharding.vision_rules``)."""
    return {VISION_HEADS: cfg.num_heads, VISION_MLP: cfg.intermediate_size,
            VISION_MERGE: cfg.hidden_size * cfg.merge_unit}


def tp_layout(params: dict, split_heads: bool) -> dict:
    """``load_params``' parameters laid out for a tensor-parallel split: with ``split_heads``,
    each layer's fused q/k/v [D, 3D] (columns q | k | v, each heads x head_dim, as transformers'
    ``reshape(N, 3, H, Dh)`` reads them) as three [D, D] matrices ``q``, ``k``, ``v`` (and
    their biases), which split by heads; else unchanged (``encode`` reads either)."""
    if not split_heads:
        return params
    layers = []
    for lp in params["layers"]:
        lp = dict(lp)
        w, b = lp.pop("qkv"), lp.pop("qkv_b")
        for n, wn, bn in zip("qkv", jnp.split(w, 3, axis=1), jnp.split(b, 3)):
            lp[n], lp[n + "_b"] = wn, bn
        layers.append(lp)
    return {**params, "layers": layers}


def load_params(cfg: VisionConfig, tensors: Mapping[str, np.ndarray]) -> dict:
    """HF tensor names -> the tower's parameters (linear weights transposed to [in, out]).
    A missing, unexpected or misshapen tensor is a ValueError naming it (:func:`check_tensors`)."""
    check_tensors(cfg, {n: np.shape(t) for n, t in tensors.items() if n.startswith(_VISUAL)})

    def get(name):
        return jnp.asarray(np.asarray(tensors[name], np.float32))

    def linear(name):
        return get(name + ".weight").T, get(name + ".bias")                  # [in, out], [out]

    def layers(i):
        p = f"{_VISUAL}blocks.{i}."
        lp = {}
        for n in ("norm1", "norm2"):
            lp[n], lp[n + "_b"] = get(p + n + ".weight"), get(p + n + ".bias")
        for n, hf in (("qkv", "attn.qkv"), ("o", "attn.proj"), ("fc1", "mlp.linear_fc1"), ("fc2", "mlp.linear_fc2")):
            lp[n], lp[n + "_b"] = linear(p + hf)
        return lp

    conv = get(_VISUAL + "patch_embed.proj.weight")                           # [D, C, Tp, P, P]
    m = _VISUAL + "merger."
    fc1, fc1_b = linear(m + "linear_fc1")
    fc2, fc2_b = linear(m + "linear_fc2")
    return {
        "patch": conv.reshape(cfg.hidden_size, -1).T,                            # [C*Tp*P*P, D]
        "patch_b": get(_VISUAL + "patch_embed.proj.bias"),
        "pos": get(_VISUAL + "pos_embed.weight"),                                # [side*side, D]
        "layers": [layers(i) for i in range(cfg.depth)],
        "merge_norm": get(m + "norm.weight"), "merge_norm_b": get(m + "norm.bias"),
        "merge_fc1": fc1, "merge_fc1_b": fc1_b, "merge_fc2": fc2, "merge_fc2_b": fc2_b,
    }


def num_tokens(cfg: VisionConfig, grid_thw: Sequence[int]) -> int:
    """The text-model rows (image placeholder tokens) one image of this grid becomes."""
    t, h, w = grid_thw
    return t * h * w // cfg.merge_unit


def grid_inputs(cfg: VisionConfig, grids: Sequence[Sequence[int]]) -> dict[str, np.ndarray]:
    """The images' ``grid_thw`` rows -> the host-computed inputs of ``encode`` for their packed
    patches (N = sum of t*h*w), in the processor's merge-block patch order:

    ``interp_idx`` int32 [N, 4] and ``interp_w`` float32 [N, 4]: the four taps of the learned
    grid each patch's position embedding blends (bilinear, align_corners=True);
    ``cos``/``sin`` float32 [N, head_dim]: the 2D rotary angles of each patch's (row, col);
    ``segment`` int32 [N]: which frame (image) each patch attends within."""
    M, side = cfg.spatial_merge_size, cfg.grid_side
    inv_freq = 1.0 / (np.float32(cfg.rope_theta) ** (np.arange(0, cfg.head_dim // 2, 2, dtype=np.float32)
                                                      / np.float32(cfg.head_dim // 2)))   # [head_dim/4]
    idx, wts, rows, cols, seg = [], [], [], [], []
    frame = 0
    for t, h, w in (tuple(int(x) for x in g) for g in grids):
        if h % M or w % M:
            raise ValueError(f"image grid {h}x{w} patches is not a multiple of spatial_merge_size={M}")
        # merge-block order: (block row, block col, row in block, col in block)
        r = np.arange(h).reshape(h // M, M)[:, None, :, None]
        c = np.arange(w).reshape(w // M, M)[None, :, None, :]
        r, c = np.broadcast_arrays(r, c)                                     # [h/M, w/M, M, M]
        r, c = r.reshape(-1), c.reshape(-1)                                  # [h*w]
        hi, hw_ = _taps(r, h, side)
        wi, ww = _taps(c, w, side)
        i4 = (hi[:, :, None] * side + wi[:, None, :]).reshape(-1, 4)         # [h*w, 4]
        w4 = (hw_[:, :, None] * ww[:, None, :]).reshape(-1, 4)
        for _ in range(t):                                                   # each frame attends alone
            idx.append(i4), wts.append(w4), rows.append(r), cols.append(c)
            seg.append(np.full(h * w, frame, np.int32))
            frame += 1
    rows_f = np.concatenate(rows).astype(np.float32)[:, None] * inv_freq    # [N, head_dim/4]
    cols_f = np.concatenate(cols).astype(np.float32)[:, None] * inv_freq
    ang = np.concatenate([rows_f, cols_f, rows_f, cols_f], axis=-1)          # [N, head_dim]
    return {"interp_idx": np.concatenate(idx).astype(np.int32), "interp_w": np.concatenate(wts),
            "cos": np.cos(ang), "sin": np.sin(ang), "segment": np.concatenate(seg)}


def _taps(index: np.ndarray, size: int, side: int) -> tuple[np.ndarray, np.ndarray]:
    """Target positions on an axis of ``size`` -> (their 2 source taps on the learned grid's
    ``side``, the bilinear weights), align_corners=True, float32 as transformers computes them."""
    src = index.astype(np.float32) * np.float32(side - 1) / np.float32(max(size - 1, 1))
    floor = np.floor(src)
    raw = floor.astype(np.int64)[:, None] + np.arange(2)                     # [n, 2]
    weights = np.maximum(1 - np.abs(src[:, None] - floor[:, None] - np.arange(2, dtype=np.float32)), 0)
    return np.clip(raw, 0, side - 1), weights.astype(np.float32)


def _ln(x, w, b, eps):
    mu = jnp.mean(x, -1, keepdims=True)
    var = jnp.mean(jnp.square(x - mu), -1, keepdims=True)
    return (x - mu) * jax.lax.rsqrt(var + eps) * w + b


def _dense(x, w, b):
    return jnp.matmul(x, w, precision=_HI) + b


def _rotate_half(x):
    a, b = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([-b, a], axis=-1)


def _block(cfg: VisionConfig, x, lp, cos, sin, mask):
    # x [N, D]; cos/sin [N, Dh]; mask [N, N] (same image): pre-norm attention, then the MLP
    N, D = x.shape
    H, Dh = cfg.num_heads, cfg.head_dim
    h = _ln(x, lp["norm1"], lp["norm1_b"], cfg.layer_norm_eps)
    if "qkv" in lp:
        q, k, v = jnp.split(_dense(h, lp["qkv"], lp["qkv_b"]).reshape(N, 3, H, Dh), 3, axis=1)
        q, k, v = q[:, 0], k[:, 0], v[:, 0]                                   # [N, H, Dh]
    else:   # tensor parallel (tp_layout): each device computes its heads' q, k, v
        q, k, v = (_dense(h, lp[n], lp[n + "_b"]).reshape(N, H, Dh) for n in ("q", "k", "v"))
    q = q * cos[:, None] + _rotate_half(q) * sin[:, None]
    k = k * cos[:, None] + _rotate_half(k) * sin[:, None]
    s = jnp.einsum("qhd,khd->hqk", q, k, precision=_HI) * (Dh ** -0.5)       # [H, N, N]
    s = jnp.where(mask[None], s, -jnp.inf)
    a = jnp.einsum("hqk,khd->qhd", jax.nn.softmax(s, axis=-1), v, precision=_HI).reshape(N, D)
    x = x + _dense(a, lp["o"], lp["o_b"])
    h = _ln(x, lp["norm2"], lp["norm2_b"], cfg.layer_norm_eps)
    h = jax.nn.gelu(_dense(h, lp["fc1"], lp["fc1_b"]), approximate=cfg.gelu_tanh)
    return x + _dense(h, lp["fc2"], lp["fc2_b"])


def encode(cfg: VisionConfig, params: dict, patches: jax.Array, inputs: Mapping[str, jax.Array]) -> jax.Array:
    """patches [N, C*Tp*P*P] (the processor's ``pixel_values``, images packed) and their
    ``grid_inputs`` -> the text model's image rows [N / merge_unit, out_hidden_size], the images'
    rows in order."""
    N = patches.shape[0]
    if patches.ndim != 2 or patches.shape[1] != cfg.patch_dim:
        raise ValueError(f"Qwen3.5 vision: patches {tuple(patches.shape)} are not [N, {cfg.patch_dim}]")
    if N % cfg.merge_unit or inputs["segment"].shape != (N,):
        raise ValueError(f"Qwen3.5 vision: {N} patches do not match grid_inputs of "
                         f"{inputs['segment'].shape[0]} patches in blocks of {cfg.merge_unit}")
    x = _dense(patches.astype(jnp.float32), params["patch"], params["patch_b"])   # [N, D]
    # the learned grid resampled to this image's grid: 4 taps per patch, weighted
    x = x + jnp.einsum("nt,ntd->nd", inputs["interp_w"], params["pos"][inputs["interp_idx"]], precision=_HI)
    seg = inputs["segment"]
    mask = seg[:, None] == seg[None, :]                                       # [N, N]
    for lp in params["layers"]:
        x = _block(cfg, x, lp, inputs["cos"], inputs["sin"], mask)
    x = _ln(x, params["merge_norm"], params["merge_norm_b"], cfg.layer_norm_eps)
    x = x.reshape(N // cfg.merge_unit, -1)                                    # [N/4, 4D]: one 2x2 block a row
    x = jax.nn.gelu(_dense(x, params["merge_fc1"], params["merge_fc1_b"]), approximate=False)
    return _dense(x, params["merge_fc2"], params["merge_fc2_b"])              # [N/4, text D]
