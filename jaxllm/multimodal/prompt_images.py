"""A vision-language engine's images at the edge: a prompt's ``multi_modal_data`` images ->
their pixels (the checkpoint's preprocessing, ``image_processor.py``), the prompt's placeholders
expanded to one token per embedding row, and the :class:`~jaxllm.request.ImageInput`\\ s the
runner's encoder takes.  Runs in the input processor, before anything is queued, so that a bad
image is refused by name and the placeholder tokens count in the length checks and the KV budget.
"""

from __future__ import annotations

import hashlib
import os

import numpy as np
from PIL import Image

from jaxllm.models.gemma3_vl import expand_placeholders
from jaxllm.multimodal.image_processor import ImageProcessorConfig, pixel_hash, preprocess
from jaxllm.models.vision_common import VisionWeights
from jaxllm.request import ImageInput


class PromptImages:
    """``vision``: the checkpoint's image side (models/gemma3_vl/checkpoint.py);
    ``max_num_batched_tokens``: one step's tokens (an image's must fit in one step);
    ``newlines``: the tokenizer's ids of ``"\\n" * k`` for k = 0, 1, ... (:func:`newline_ids`),
    the newlines transformers' processor puts around each image; empty without a tokenizer."""

    def __init__(self, vision: VisionWeights, max_num_batched_tokens: int,
                 newlines: tuple[tuple[int, ...], ...] = ()):
        self.cfg = vision.cfg
        self.newlines = newlines
        path = os.path.join(vision.path, "preprocessor_config.json")
        size = self.cfg.image_size
        self.processor = (ImageProcessorConfig.from_file(path) if os.path.isfile(path)
                          else ImageProcessorConfig(height=size, width=size))
        if (self.processor.height, self.processor.width) != (size, size):
            raise ValueError(f"{path}: size {self.processor.height}x{self.processor.width} is not the vision "
                             f"tower's image_size {size}")
        if self.cfg.mm_tokens_per_image > max_num_batched_tokens:
            raise ValueError(f"--max-num-batched-tokens {max_num_batched_tokens} is less than one image's "
                             f"{self.cfg.mm_tokens_per_image} tokens (one step holds a whole image)")

    def mrope(self, ids: list[int], images: tuple[ImageInput, ...]) -> None:
        """Gemma 3's positions are sequence indices: no M-RoPE."""
        return None

    def process(self, ids: list[int], data) -> tuple[list[int], tuple[ImageInput, ...]]:
        """(prompt ids, ``multi_modal_data``) -> (the ids with each image's tokens, its images).
        ValueError naming what is wrong (a caller reports it as ``multi_modal_data``)."""
        images = pil_images(data)
        ids = expand_placeholders(self.cfg, ids, len(images), self.newlines)
        starts = [i for i, t in enumerate(ids) if t == self.cfg.image_token_id
                  and (i == 0 or ids[i - 1] != self.cfg.image_token_id)]
        out = []
        for im, start in zip(images, starts):
            pixels = preprocess(im, self.processor)                            # [3, S, S] float32
            out.append(ImageInput(pixels, pixel_hash(pixels), start, self.cfg.mm_tokens_per_image))
        return ids, tuple(out)


def pil_images(data) -> list[Image.Image]:
    """``multi_modal_data`` -> its images, in order; ValueError naming what is wrong."""
    if not isinstance(data, dict) or set(data) - {"image"}:
        raise ValueError(f"multi_modal_data: only {{'image': PIL.Image | [PIL.Image, ...]}} is taken, got "
                         f"{sorted(data) if isinstance(data, dict) else type(data).__name__}")
    images = data.get("image")
    images = list(images) if isinstance(images, (list, tuple)) else [images]
    for i, im in enumerate(images):
        if not isinstance(im, Image.Image):
            raise ValueError(f"multi_modal_data image {i}: expected a PIL.Image.Image, got {type(im).__name__}")
    return images


def newline_ids(encode, longest: int = 32) -> tuple[tuple[int, ...], ...]:
    """``encode``: text -> ids (no special tokens) -> the ids of ``"\\n" * k`` for k = 0..longest
    (Gemma 3 spells each run of up to 31 newlines as one token), computed once per engine."""
    return tuple(tuple(encode("\n" * k)) for k in range(longest + 1))


def image_salt(salt: str | None, images: tuple[ImageInput, ...]) -> str | None:
    """The cache salt of a prompt with images: its KV depends on the pixels, which the
    placeholder ids do not show, so the images' hashes join the salt (the same text with
    another image shares no cached block; the same image again does)."""
    if not images:
        return salt
    digest = hashlib.sha256("/".join(im.hash for im in images).encode()).hexdigest()
    return f"{salt or ''}#images:{digest}"
