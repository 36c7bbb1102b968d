"""Qwen3.5's prompt with images for the text model: the image placeholders expanded as
transformers' ``Qwen3VLProcessor`` expands them, and the multimodal rotary positions (M-RoPE)
as ``Qwen3_5Model.get_rope_index`` computes them.

Each token has three positions (temporal, height, width).  A text token has the same value in
all three, one past the previous token's largest; an image's tokens (one per merged 2x2 patch
block, row-major over the merged grid) sit at ``start`` in t and at ``start + row`` /
``start + col`` in h / w, and the text after it resumes at ``start + max(rows, cols)``.  So the
positions past the prompt are the sequence index plus one ``delta`` (each image of n tokens
over a merged rows x cols grid adds ``max(rows, cols) - n``), the same in all three streams: a
decode step needs only ``delta``.

Which stream turns which rotary frequency: ``layers/rotary.mrope_axes`` (the interleaved
layout of Qwen3.5's ``recomposition_frequencies``), applied by the text model
(``models/qwen3_next``'s ``rope_positions``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from jaxllm.layers.rotary import mrope_axes  # noqa: F401  (re-exported: the rotary half of M-RoPE)
from jaxllm.models.qwen3_5_vl.config import VisionConfig
from jaxllm.models.qwen3_5_vl.vision import num_tokens


def expand_placeholders(cfg: VisionConfig, ids: Sequence[int], grids: Sequence[Sequence[int]]) -> list[int]:
    """Prompt ids with one image token per image -> ids with each image's ``num_tokens`` image
    tokens (its grid's merged blocks).  The prompt must hold exactly ``len(grids)`` image tokens."""
    marks = [i for i, t in enumerate(ids) if t == cfg.image_token_id]
    if len(marks) != len(grids):
        raise ValueError(f"multi_modal_data: {len(grids)} image(s) but the prompt has {len(marks)} image "
                         f"placeholder(s) (token {cfg.image_token_id})")
    out: list[int] = []
    prev = 0
    for m, g in zip(marks, grids):
        out += list(ids[prev:m]) + [cfg.image_token_id] * num_tokens(cfg, g)
        prev = m + 1
    return out + list(ids[prev:])


def mrope_positions(cfg: VisionConfig, ids: Sequence[int], grids: Sequence[Sequence[int]]) -> tuple[np.ndarray, int]:
    """Expanded prompt ids [T] and the images' grid_thw (in prompt order) -> (positions int32
    [3, T], delta: the position of token ``i >= T`` is ``i + delta`` in every stream).  A run of
    consecutive image tokens is one image; its length must be its grid's token count."""
    is_img = np.asarray(ids) == cfg.image_token_id
    M = cfg.spatial_merge_size
    cols: list[np.ndarray] = []
    pos, i, k, T = 0, 0, 0, len(ids)
    while i < T:
        j = i
        while j < T and is_img[j] == is_img[i]:
            j += 1
        if not is_img[i]:
            cols.append(np.broadcast_to(np.arange(pos, pos + j - i), (3, j - i)))
            pos += j - i
        else:
            if k >= len(grids):
                raise ValueError(f"image tokens: more image runs in the prompt than the {len(grids)} image(s) given")
            t, h, w = (int(x) for x in grids[k])
            gh, gw = h // M, w // M
            if j - i != t * gh * gw:
                raise ValueError(f"image {k}: {j - i} image tokens in the prompt, its grid {t}x{h}x{w} "
                                 f"needs {t * gh * gw}")
            tt, hh, ww = np.meshgrid(np.arange(t), np.arange(gh), np.arange(gw), indexing="ij")
            cols.append(np.stack([tt.ravel() + pos, hh.ravel() + pos, ww.ravel() + pos]))
            # transformers advances by the larger merged side (a still image's t is one)
            pos += max(gh, gw)
            k += 1
        i = j
    if k != len(grids):
        raise ValueError(f"image tokens: {k} image run(s) in the prompt, {len(grids)} image(s) given")
    positions = np.concatenate(cols, axis=1).astype(np.int32) if cols else np.zeros((3, 0), np.int32)
    return positions, int(pos - T)

