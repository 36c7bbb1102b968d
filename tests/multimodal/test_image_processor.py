"""The torch-free image preprocessing (jaxllm/multimodal/image_processor.py) against
transformers' ``Gemma3ImageProcessorPil``: the same pixel values for RGB, RGBA (transparency on
white), grayscale and already-sized images; its config read off the processor's own dict."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image
from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

from jaxllm.multimodal.image_processor import ImageProcessorConfig, pixel_hash, preprocess


@pytest.mark.parametrize("shape", [(40, 60, 3), (28, 28, 3), (17, 90, 4), (30, 30)],
                         ids=["rgb", "sized", "rgba", "gray"])
def test_pixels_equal_transformers(shape):
    hf = Gemma3ImageProcessorPil(size={"height": 28, "width": 28}, image_mean=[0.4, 0.5, 0.6],
                                 image_std=[0.2, 0.3, 0.25])
    cfg = ImageProcessorConfig.from_dict(hf.to_dict())
    img = Image.fromarray(np.random.default_rng(len(shape) * 100 + shape[0]).integers(0, 256, shape, dtype=np.uint8))
    ref = hf(img, return_tensors="np")["pixel_values"][0]              # [3, 28, 28]
    got = preprocess(img, cfg)
    assert got.shape == ref.shape == (3, 28, 28) and got.dtype == np.float32
    np.testing.assert_allclose(got, ref, rtol=0, atol=1e-6)


def test_hash_and_refusals():
    cfg = ImageProcessorConfig(height=14, width=14)
    a = preprocess(Image.new("RGB", (20, 20), (10, 20, 30)), cfg)
    b = preprocess(Image.new("RGB", (20, 20), (10, 20, 31)), cfg)
    assert pixel_hash(a) == pixel_hash(a.copy()) != pixel_hash(b)
    with pytest.raises(ValueError, match="do_pan_and_scan"):
        ImageProcessorConfig.from_dict({"do_pan_and_scan": True})
    with pytest.raises(ValueError, match="PIL.Image.Image"):
        preprocess(np.zeros((3, 14, 14)), cfg)
