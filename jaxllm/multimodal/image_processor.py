"""A vision checkpoint's image preprocessing in Pillow + numpy (the runtime stays torch-free).

Follows transformers' ``Gemma3ImageProcessorPil`` (a SigLIP-style processor): convert to RGB,
resize to the fixed ``size`` with the configured resample filter, rescale by ``rescale_factor``
(1/255), normalize by ``image_mean`` / ``image_std``, channels first.  Pan-and-scan crops are
not supported (refused, not silently ignored).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

# transformers' IMAGENET_STANDARD_MEAN / _STD, the Gemma 3 defaults
_STANDARD = (0.5, 0.5, 0.5)


@dataclass(frozen=True)
class ImageProcessorConfig:
    """The fields of ``preprocessor_config.json`` the processor uses."""

    height: int = 224
    width: int = 224
    resample: int = 2                      # PIL's BILINEAR, transformers' default for Gemma 3
    do_convert_rgb: bool = True
    do_resize: bool = True
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    image_mean: tuple[float, ...] = _STANDARD
    image_std: tuple[float, ...] = _STANDARD

    @classmethod
    def from_dict(cls, d: dict) -> ImageProcessorConfig:
        """A ``preprocessor_config.json`` dict -> its config; pan-and-scan is refused."""
        if d.get("do_pan_and_scan"):
            raise ValueError("preprocessor_config.json: do_pan_and_scan=true is not supported")
        size = d.get("size") or {}
        if "height" not in size and "shortest_edge" in size:
            size = {"height": size["shortest_edge"], "width": size["shortest_edge"]}
        kw = {k: d[k] for k in ("resample", "do_convert_rgb", "do_resize", "do_rescale", "rescale_factor",
                                "do_normalize") if d.get(k) is not None}
        for k in ("image_mean", "image_std"):
            if d.get(k) is not None:
                v = d[k]
                kw[k] = tuple(float(x) for x in (v if isinstance(v, (list, tuple)) else [v] * 3))
        return cls(height=int(size.get("height", cls.height)), width=int(size.get("width", cls.width)), **kw)

    @classmethod
    def from_file(cls, path: str | Path) -> ImageProcessorConfig:
        return cls.from_dict(json.loads(Path(path).read_text()))


def preprocess(image: Image.Image, cfg: ImageProcessorConfig) -> np.ndarray:
    """One PIL image -> float32 pixel values [3, H, W] as the checkpoint's processor gives them."""
    if not isinstance(image, Image.Image):
        raise ValueError(f"multi_modal_data image: expected a PIL.Image.Image, got {type(image).__name__}")
    if cfg.do_convert_rgb and image.mode != "RGB":
        if "A" in image.getbands() or image.info.get("transparency") is not None:
            # transparency composited onto white, as transformers' convert_to_rgb does
            rgba = image.convert("RGBA")
            image = Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba)
        image = image.convert("RGB")
    if cfg.do_resize and image.size != (cfg.width, cfg.height):
        # PIL resizes the uint8 image, as transformers does when it is handed uint8 pixels
        image = image.resize((cfg.width, cfg.height), resample=cfg.resample)
    x = np.asarray(image)                                                # [H, W, C] uint8
    if cfg.do_rescale:
        # float64 product rounded to float32, like transformers' rescale
        x = (x.astype(np.float64) * cfg.rescale_factor).astype(np.float32)
    else:
        x = x.astype(np.float32)
    if cfg.do_normalize:
        mean = np.asarray(cfg.image_mean, np.float32)
        std = np.asarray(cfg.image_std, np.float32)
        x = (x - mean) / std
    return np.ascontiguousarray(x.transpose(2, 0, 1), dtype=np.float32)  # [C, H, W]


def pixel_hash(pixels: np.ndarray) -> str:
    """sha256 of the preprocessed pixels: the key of the encoder cache and of prefix blocks
    holding the image's tokens (two files decoding to the same pixels share it)."""
    return hashlib.sha256(np.ascontiguousarray(pixels).tobytes()).hexdigest()
