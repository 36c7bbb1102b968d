"""Gemma 3's image placeholders in a prompt, as transformers' ``Gemma3Processor`` expands them:
each image placeholder becomes ``"\n\n" boi, image_token x mm_tokens_per_image, eoi "\n\n"``
(its ``full_image_sequence``); the image groups (which tokens belong to which image) give the
bidirectional attention span."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from jaxllm.models.gemma3_vl.config import VisionConfig


def expand_placeholders(cfg: VisionConfig, ids: Sequence[int], num_images: int,
                        newlines: Sequence[Sequence[int]] = ()) -> list[int]:
    """Prompt ids with one ``boi`` (or image token) per image -> ids with each image's tokens.
    The prompt must name exactly ``num_images`` images (a ValueError otherwise).

    ``newlines[k]``: the tokenizer's ids of ``"\n" * k`` (k = 0, 1, ..., at least 2).
    transformers replaces the placeholder in the *text* by ``"\n\n<boi>...<eoi>\n\n"`` and
    then tokenizes, so the inserted newlines join a run of newlines next to them (Gemma 3 has
    one token per run length: "\n" + "\n\n" is one "\n\n\n" token).  Working on ids, a
    run of newline tokens met at a seam is re-spelled as ``newlines[total]`` (what vLLM's
    Gemma 3 processor does after its token-level replacement).  Empty (no tokenizer): the
    image blocks alone, without the newlines."""
    marks = [i for i, t in enumerate(ids) if t in (cfg.boi_token_id, cfg.image_token_id)]
    if len(marks) != num_images:
        raise ValueError(f"multi_modal_data: {num_images} image(s) but the prompt has {len(marks)} image "
                         f"placeholder(s) (token {cfg.boi_token_id})")
    if newlines and len(newlines) < 3:
        raise ValueError(f"newlines: the ids of '\\n' * k for k = 0..2 at least, got {len(newlines)} entries")
    nl2 = list(newlines[2]) if newlines else []
    # a token that is a whole run of k newlines -> k (those the seams may merge)
    run = {seq[0]: k for k, seq in enumerate(newlines) if len(seq) == 1}
    block = nl2 + [cfg.boi_token_id] + [cfg.image_token_id] * cfg.mm_tokens_per_image + [cfg.eoi_token_id] + nl2
    out: list[int] = []
    prev = 0
    for m in marks:
        _join(out, list(ids[prev:m]), run, newlines)
        _join(out, block, run, newlines)
        prev = m + 1
    _join(out, list(ids[prev:]), run, newlines)
    return out


def _join(out: list[int], seg: list[int], run: dict[int, int], newlines: Sequence[Sequence[int]]) -> None:
    """out += seg, the newline tokens on both sides of the seam re-spelled as one run's ids
    (as the tokenizer spells the joined text); left as they are past the longest known run."""
    a = len(out)
    while a > 0 and out[a - 1] in run:
        a -= 1
    b = 0
    while b < len(seg) and seg[b] in run:
        b += 1
    if a < len(out) and b > 0:
        total = sum(run[t] for t in out[a:]) + sum(run[t] for t in seg[:b])
        if total < len(newlines):
            del out[a:]
            out += list(newlines[total])
            seg = seg[b:]
    out += seg


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
