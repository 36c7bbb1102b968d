"""The torch-free Qwen image preprocessing (jaxllm/multimodal/qwen_image_processor.py) against
transformers' ``Qwen2VLImageProcessorPil`` (the processor Qwen3-VL / Qwen3.5 name): the same
``pixel_values`` rows (smart-resize, rescale, normalize, merge-block patchify) and
``image_grid_thw`` for images that grow to min_pixels, shrink to max_pixels, round to the
factor, are gray or RGBA; its config read off the processor's own dict; refusals by name."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil, smart_resize as hf_sr

from jaxllm.multimodal.qwen_image_processor import QwenImageProcessorConfig, preprocess_qwen, smart_resize


@pytest.fixture(scope="module")
def hf():
    # small patches keep the images small; min/max pixels chosen so each case below takes its own branch
    return Qwen2VLImageProcessorPil(patch_size=4, merge_size=2, temporal_patch_size=2,
                                    size={"shortest_edge": 24 * 24, "longest_edge": 48 * 48})


@pytest.mark.parametrize("shape", [(13, 17, 3), (30, 46, 3), (100, 60, 3), (21, 35, 4), (40, 28)],
                         ids=["grow", "round", "shrink", "rgba", "gray"])
def test_patches_equal_transformers(hf, shape):
    cfg = QwenImageProcessorConfig.from_dict(hf.to_dict())
    assert (cfg.min_pixels, cfg.max_pixels, cfg.patch_size, cfg.resample) == (576, 2304, 4, 3)
    img = Image.fromarray(np.random.default_rng(shape[0]).integers(0, 256, shape, dtype=np.uint8))
    ref = hf(img, return_tensors="np")
    got, thw = preprocess_qwen(img, cfg)
    assert thw == tuple(ref["image_grid_thw"][0].tolist())
    assert got.shape == ref["pixel_values"].shape and got.dtype == np.float32
    np.testing.assert_allclose(got, ref["pixel_values"], rtol=0, atol=1e-6)


def test_smart_resize_and_refusals():
    for h, w in [(13, 17), (30, 46), (100, 60), (8, 1500), (1000, 1000), (44, 44), (36, 36)]:
        assert smart_resize(h, w, 8, 576, 2304) == hf_sr(h, w, 8, 576, 2304)
    assert QwenImageProcessorConfig.from_dict({"min_pixels": 100, "max_pixels": 900}).max_pixels == 900
    with pytest.raises(ValueError, match="aspect ratio"):
        smart_resize(1, 300, 8, 576, 2304)
    with pytest.raises(ValueError, match="min_pixels"):
        QwenImageProcessorConfig(min_pixels=10, max_pixels=5)
    with pytest.raises(ValueError, match="PIL.Image.Image"):
        preprocess_qwen(np.zeros((3, 8, 8)), QwenImageProcessorConfig())
