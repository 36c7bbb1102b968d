"""A Qwen3.5 engine's images at the edge (the input processor), as ``prompt_images.py`` does
Gemma 3's: each ``multi_modal_data`` image -> its patch rows and grid (the checkpoint's
``preprocessor_config.json``, ``qwen_image_processor.py``: variable sizes, so variable token
counts), the prompt's image placeholders expanded per grid (``Qwen3VLProcessor``'s expansion),
and the prompt's M-RoPE positions and rope delta (``get_rope_index``), computed once here and
kept with the request (``request.MRope``).

The processor's ``min_pixels`` / ``max_pixels`` are the checkpoint's with
``--mm-processor-kwargs`` over them; without a max_pixels there, max_pixels is capped at
``qwen_image_processor.DEFAULT_MAX_PATCHES`` patches (larger images are resized down, as
transformers' processor would with that max_pixels): the encoder's buckets follow it.  An
image whose patch count is past the encoder's largest compiled bucket
(``qwen_image_processor.patch_buckets``; only with ``do_resize`` off) is refused by name:
serving never compiles.  Its
tokens attend causally (``ImageInput.causal``), so a prefill chunk may end inside it.
"""

from __future__ import annotations

import hashlib
import logging
import os

from jaxllm.models.qwen3_5_vl import expand_placeholders, mrope_positions, num_tokens
from jaxllm.models.vision_common import VisionWeights
from jaxllm.multimodal.image_processor import pixel_hash
from jaxllm.multimodal.prompt_images import pil_images
from jaxllm.multimodal.qwen_image_processor import (QwenImageProcessorConfig, patch_buckets, preprocess_qwen,
                                                    with_pixels)
from jaxllm.request import ImageInput, MRope

log = logging.getLogger("jaxllm.engine")


def checkpoint_processor_config(vision: VisionWeights) -> QwenImageProcessorConfig:
    """The checkpoint's ``preprocessor_config.json`` (the tower's patch sizes and the processor's
    defaults without one); patch sizes that disagree with the tower are a ValueError."""
    cfg = vision.cfg
    path = os.path.join(vision.path, "preprocessor_config.json")
    if os.path.isfile(path):
        pcfg = QwenImageProcessorConfig.from_file(path)
    else:
        pcfg = QwenImageProcessorConfig(patch_size=cfg.patch_size, temporal_patch_size=cfg.temporal_patch_size,
                                        merge_size=cfg.spatial_merge_size)
    for mine, tower in (("patch_size", "patch_size"), ("temporal_patch_size", "temporal_patch_size"),
                        ("merge_size", "spatial_merge_size")):
        if getattr(pcfg, mine) != getattr(cfg, tower):
            raise ValueError(f"{path}: {mine} {getattr(pcfg, mine)} is not the vision tower's {tower} "
                             f"{getattr(cfg, tower)}")
    return pcfg


def processor_config(vision: VisionWeights, mm_processor_kwargs: dict | None = None) -> QwenImageProcessorConfig:
    """The processor the engine runs: the checkpoint's with ``mm_processor_kwargs`` over it and
    the default cap (``qwen_image_processor.with_pixels``); the edge and the encoder both read it."""
    return with_pixels(checkpoint_processor_config(vision), mm_processor_kwargs or {})


class QwenPromptImages:
    """``vision``: the checkpoint's image side (models/qwen3_5_vl/checkpoint.py)."""

    def __init__(self, vision: VisionWeights, mm_processor_kwargs: dict | None = None):
        self.cfg = vision.cfg
        self.processor = processor_config(vision, mm_processor_kwargs)
        self.max_patches = patch_buckets(self.processor)[-1]
        asked = checkpoint_processor_config(vision).max_pixels
        if self.processor.max_pixels < asked and "max_pixels" not in (mm_processor_kwargs or {}):
            log.info("images: max_pixels capped at %d (%d patches; preprocessor_config.json asks %d): larger "
                     "images are resized down to it; --mm-processor-kwargs '{\"max_pixels\": N}' lifts the cap",
                     self.processor.max_pixels, self.max_patches, asked)

    def process(self, ids: list[int], data) -> tuple[list[int], tuple[ImageInput, ...]]:
        """(prompt ids with one image token per image, ``multi_modal_data``) -> (the ids with each
        image's tokens, its images).  ValueError naming what is wrong (reported as
        ``multi_modal_data``)."""
        images = pil_images(data)
        pre = []
        for i, im in enumerate(images):
            try:
                patches, grid = preprocess_qwen(im, self.processor)       # [N, C*Tp*P*P], (1, h, w)
            except ValueError as e:
                raise ValueError(f"multi_modal_data image {i}: {e}") from None
            if len(patches) > self.max_patches:
                raise ValueError(f"multi_modal_data image {i}: {im.size[0]}x{im.size[1]} px gives {len(patches)} "
                                 f"patches ({grid[1]}x{grid[2]}), more than the vision encoder's largest "
                                 f"({self.max_patches}, max_pixels in preprocessor_config.json or "
                                 f"--mm-processor-kwargs)")
            pre.append((patches, grid))
        grids = [g for _, g in pre]
        marks = [i for i, t in enumerate(ids) if t == self.cfg.image_token_id]
        ids = expand_placeholders(self.cfg, ids, grids)
        out, shift = [], 0
        for m, (patches, grid) in zip(marks, pre):
            n = num_tokens(self.cfg, grid)
            # the grid joins the pixels in the key: equal patch rows on another grid (a flat image
            # turned on its side) take other position embeddings, so other rows
            key = hashlib.sha256(f"{pixel_hash(patches)}:{grid}".encode()).hexdigest()
            out.append(ImageInput(patches, key, m + shift, n, grid=tuple(grid), causal=True))
            shift += n - 1
        return ids, tuple(out)

    def mrope(self, ids: list[int], images: tuple[ImageInput, ...]) -> MRope:
        """The expanded prompt's M-RoPE positions [3, P] and rope delta."""
        positions, delta = mrope_positions(self.cfg, ids, [im.grid for im in images])
        return MRope(positions, delta)
