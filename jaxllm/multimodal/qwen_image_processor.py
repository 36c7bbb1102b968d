"""The Qwen vision families' image preprocessing in Pillow + numpy (the runtime stays torch-free).

Follows transformers' ``Qwen2VLImageProcessorPil``, the processor Qwen2-VL, Qwen2.5-VL, Qwen3-VL
and Qwen3.5 checkpoints name: ``smart_resize`` picks a size whose sides are multiples of
``patch_size * merge_size`` with the pixel count inside [min_pixels, max_pixels] and the aspect
ratio kept; then the same convert / resize / rescale / normalize as ``image_processor.py``;
then ``patchify`` flattens the image into one row per patch, the rows in spatial-merge-block
order (each ``merge_size x merge_size`` block of patches consecutive, what the vision tower's
patch merger folds into one token), each row ``[C, temporal_patch_size, P, P]`` flattened with
the still image repeated over the temporal patch.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from jaxllm.multimodal.image_processor import ImageProcessorConfig, preprocess

# transformers' OPENAI_CLIP_MEAN / _STD, the Qwen processors' defaults
_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclass(frozen=True)
class QwenImageProcessorConfig:
    """The fields of a Qwen ``preprocessor_config.json`` the processor uses."""

    min_pixels: int = 56 * 56              # size.shortest_edge
    max_pixels: int = 28 * 28 * 1280       # size.longest_edge
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    resample: int = 3                      # PIL's BICUBIC
    do_convert_rgb: bool = True
    do_resize: bool = True
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    image_mean: tuple[float, ...] = _CLIP_MEAN
    image_std: tuple[float, ...] = _CLIP_STD

    def __post_init__(self):
        for name in ("min_pixels", "max_pixels", "patch_size", "temporal_patch_size", "merge_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"preprocessor_config.json: {name} must be >= 1, got {getattr(self, name)}")
        if self.min_pixels > self.max_pixels:
            raise ValueError(f"preprocessor_config.json: min_pixels {self.min_pixels} > max_pixels {self.max_pixels}")

    @property
    def factor(self) -> int:
        """Both resized sides are multiples of this (one merged token covers factor x factor pixels)."""
        return self.patch_size * self.merge_size

    @classmethod
    def from_dict(cls, d: dict) -> QwenImageProcessorConfig:
        """A ``preprocessor_config.json`` dict (``size`` or the older ``min_pixels``/``max_pixels``)."""
        size = dict(d.get("size") or {})
        kw = {}
        if (v := d.get("min_pixels", size.get("shortest_edge"))) is not None:
            kw["min_pixels"] = int(v)
        if (v := d.get("max_pixels", size.get("longest_edge"))) is not None:
            kw["max_pixels"] = int(v)
        for k in ("patch_size", "temporal_patch_size", "merge_size", "resample"):
            if d.get(k) is not None:
                kw[k] = int(d[k])
        for k in ("do_convert_rgb", "do_resize", "do_rescale", "do_normalize"):
            if d.get(k) is not None:
                kw[k] = bool(d[k])
        if d.get("rescale_factor") is not None:
            kw["rescale_factor"] = float(d["rescale_factor"])
        for k in ("image_mean", "image_std"):
            if d.get(k) is not None:
                v = d[k]
                kw[k] = tuple(float(x) for x in (v if isinstance(v, (list, tuple)) else [v] * 3))
        return cls(**kw)

    @classmethod
    def from_file(cls, path: str | Path) -> QwenImageProcessorConfig:
        return cls.from_dict(json.loads(Path(path).read_text()))


DEFAULT_MAX_PATCHES = 4096
"""The largest image, in patches, served without ``--mm-processor-kwargs``: the tower's dense
attention holds ``[H, N, N]`` float32 scores a layer, at Qwen3.5's 16 heads 16 * 4096^2 * 4 B
= 1 GiB at N = 4096 (16 GiB at 16,384; 64 GiB at 32,768, and a real checkpoint's
max_pixels (16.7M px of 16-px patches) asks for 65,536: 256 GiB, which neither compiles nor
runs).  4096 patches of 16 px are about 1024 x 1024 px, 1024 tokens an image."""


def with_pixels(cfg: QwenImageProcessorConfig, kwargs: dict) -> QwenImageProcessorConfig:
    """``cfg`` with ``kwargs``' ``min_pixels`` / ``max_pixels`` over it (``--mm-processor-kwargs``,
    as transformers' processor takes them); without max_pixels, max_pixels is capped at
    :data:`DEFAULT_MAX_PATCHES` patches (never below min_pixels).  ValueError naming the flag."""
    over = {k: kwargs[k] for k in ("min_pixels", "max_pixels") if k in kwargs}
    if "max_pixels" not in over:
        over["max_pixels"] = min(cfg.max_pixels, max(DEFAULT_MAX_PATCHES * cfg.patch_size ** 2,
                                                     over.get("min_pixels", cfg.min_pixels)))
    try:
        return dataclasses.replace(cfg, **over)
    except ValueError as e:
        raise ValueError(f"--mm-processor-kwargs (mm_processor_kwargs): {e}") from None


def patch_buckets(cfg: QwenImageProcessorConfig) -> tuple[int, ...]:
    """The patch counts the vision encoder is compiled for (runner/vision.py), ascending: powers
    of two from the smallest image's patch count (``min_pixels``) up to the largest's
    (``max_pixels``), at least one merge block.  The encoder's program depends on an image's grid
    only through its patch count N (the grid's position taps, rotary angles and attention
    segments are host-computed arrays), so an image runs padded to the first bucket >= N; one
    larger than the last is refused (the input processor says so)."""
    area = cfg.patch_size ** 2
    lo = max(cfg.merge_size ** 2, -(-cfg.min_pixels // area))
    hi = max(lo, cfg.max_pixels // area)
    first = 1 << (lo - 1).bit_length()
    return tuple(1 << k for k in range(first.bit_length() - 1, (hi - 1).bit_length() + 1))


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """(height, width) -> the resized (height, width): multiples of ``factor``, pixel count in
    [min_pixels, max_pixels], aspect ratio kept as closely as that allows (transformers' formula,
    Python's round-half-even included)."""
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"image: aspect ratio must be at most 200, got {max(height, width) / min(height, width)}")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def resized_size(image: Image.Image, cfg: QwenImageProcessorConfig) -> tuple[int, int]:
    """The (height, width) the processor gives ``image`` (its own size when do_resize is off)."""
    w, h = image.size
    return smart_resize(h, w, cfg.factor, cfg.min_pixels, cfg.max_pixels) if cfg.do_resize else (h, w)


def patchify(pixels: np.ndarray, cfg: QwenImageProcessorConfig) -> tuple[np.ndarray, tuple[int, int, int]]:
    """pixels [C, H, W] -> (patches [gh*gw, C*Tp*P*P] in merge-block order, grid_thw (1, gh, gw))."""
    C, H, W = pixels.shape
    P, M, Tp = cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size
    if H % (P * M) or W % (P * M):
        raise ValueError(f"image: {H}x{W} pixels are not multiples of patch_size*merge_size={P * M}")
    gh, gw = H // P, W // P
    x = pixels.astype(np.float32).reshape(C, gh // M, M, P, gw // M, M, P)
    x = x.transpose(1, 4, 2, 5, 0, 3, 6)                            # [gh/M, gw/M, M, M, C, P, P]
    # a still image fills every temporal slot of the tower's 3D patch
    x = np.broadcast_to(x[:, :, :, :, :, None], (*x.shape[:5], Tp, P, P))
    return np.ascontiguousarray(x.reshape(gh * gw, C * Tp * P * P)), (1, gh, gw)


def preprocess_qwen(image: Image.Image, cfg: QwenImageProcessorConfig) -> tuple[np.ndarray, tuple[int, int, int]]:
    """One PIL image -> (float32 patches [N, C*Tp*P*P], grid_thw) as the checkpoint's processor
    gives them (``pixel_values`` and ``image_grid_thw`` of one image)."""
    if not isinstance(image, Image.Image):
        raise ValueError(f"multi_modal_data image: expected a PIL.Image.Image, got {type(image).__name__}")
    h, w = resized_size(image, cfg)
    base = ImageProcessorConfig(height=h, width=w, resample=cfg.resample, do_convert_rgb=cfg.do_convert_rgb,
                                do_resize=cfg.do_resize, do_rescale=cfg.do_rescale,
                                rescale_factor=cfg.rescale_factor, do_normalize=cfg.do_normalize,
                                image_mean=cfg.image_mean, image_std=cfg.image_std)
    return patchify(preprocess(image, base), cfg)
