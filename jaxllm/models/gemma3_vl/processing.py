"""Gemma 3's image placeholders in a prompt, as transformers' ``Gemma3Processor`` expands them:
each image token in the prompt becomes ``boi, image_token x mm_tokens_per_image, eoi``; the
image groups (which tokens belong to which image) give the bidirectional attention span."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from jaxllm.models.gemma3_vl.config import VisionConfig


def expand_placeholders(cfg: VisionConfig, ids: Sequence[int], num_images: int) -> list[int]:
    """Prompt ids with one ``boi`` (or image token) per image -> ids with each image's tokens.
    The prompt must name exactly ``num_images`` images (a ValueError otherwise)."""
    marks = [i for i, t in enumerate(ids) if t in (cfg.boi_token_id, cfg.image_token_id)]
    if len(marks) != num_images:
        raise ValueError(f"multi_modal_data: {num_images} image(s) but the prompt has {len(marks)} image "
                         f"placeholder(s) (token {cfg.boi_token_id})")
    block = [cfg.boi_token_id] + [cfg.image_token_id] * cfg.mm_tokens_per_image + [cfg.eoi_token_id]
    out: list[int] = []
    prev = 0
    for m in marks:
        out += list(ids[prev:m]) + block
        prev = m + 1
    return out + list(ids[prev:])


def image_groups(cfg: VisionConfig, ids: Sequence[int]) -> np.ndarray:
    """ids [T] -> int32 [T]: the image each token belongs to (0, 1, ...), -1 for text; a run of
    consecutive image tokens is one image (transformers' ``token_type_ids`` groups)."""
    is_img = np.asarray(ids) == cfg.image_token_id
    start = is_img & ~np.concatenate([[False], is_img[:-1]])
    return np.where(is_img, np.cumsum(start) - 1, -1).astype(np.int32)


def visible_upto(cfg: VisionConfig, ids: Sequence[int]) -> np.ndarray:
    """ids [T] -> int32 [T]: the last position each token's query sees.  The causal position for
    text; for an image token, its image's last token (bidirectional inside one image)."""
    groups = image_groups(cfg, ids)
    pos = np.arange(len(groups), dtype=np.int32)
    out = pos.copy()
    for g in range(int(groups.max(initial=-1)) + 1):
        idx = np.nonzero(groups == g)[0]
        out[idx] = idx[-1]
    return out
