"""The torch-free Qwen image preprocessing (jaxllm/multimodal/qwen_image_processor.py) against
transformers' ``Qwen2VLImageProcessorPil`` (the processor Qwen3-VL / Qwen3.5 name): the same
``pixel_values`` rows (smart-resize, rescale, normalize, merge-block patchify) and
``image_grid_thw`` for images that grow to min_pixels, shrink to max_pixels, round to the
factor, are gray or RGBA; its config read off the processor's own dict; refusals by name.
``--mm-processor-kwargs``' min/max pixels give what transformers' processor gives called with the
same kwargs, and the default cap (``DEFAULT_MAX_PATCHES``) resizes as transformers' processor with
that max_pixels: a real checkpoint's 16.7M-pixel max_pixels gives buckets up to 4096 patches."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil, smart_resize as hf_sr

from jaxllm.multimodal.qwen_image_processor import (DEFAULT_MAX_PATCHES, QwenImageProcessorConfig, patch_buckets,
                                                    preprocess_qwen, smart_resize, with_pixels)


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


def _assert_equal(got_thw, ref):
    got, thw = got_thw
    assert thw == tuple(ref["image_grid_thw"][0].tolist())
    np.testing.assert_allclose(got, ref["pixel_values"], rtol=0, atol=1e-6)


@pytest.mark.parametrize("kwargs", [{"max_pixels": 24 * 24}, {"min_pixels": 40 * 40, "max_pixels": 64 * 64}],
                         ids=["max", "min-max"])
@pytest.mark.filterwarnings("ignore:Passing `min_pixels` and `max_pixels`:FutureWarning")
def test_pixel_kwargs_equal_transformers_called_with_them(hf, kwargs):
    # the 100x60 image shrinks to 2304 px by the config, the 13x17 one grows to 576: the kwargs move both
    cfg = with_pixels(QwenImageProcessorConfig.from_dict(hf.to_dict()), kwargs)
    assert (cfg.min_pixels, cfg.max_pixels) == (kwargs.get("min_pixels", 576), kwargs["max_pixels"])
    moved = []
    for shape in [(100, 60, 3), (13, 17, 3)]:
        img = Image.fromarray(np.random.default_rng(shape[0]).integers(0, 256, shape, dtype=np.uint8))
        ref = hf(img, return_tensors="np", **kwargs)
        moved.append(ref["image_grid_thw"].tolist() != hf(img, return_tensors="np")["image_grid_thw"].tolist())
        _assert_equal(preprocess_qwen(img, cfg), ref)
    assert moved == [True, "min_pixels" in kwargs]


@pytest.mark.filterwarnings("ignore:Passing `min_pixels` and `max_pixels`:FutureWarning")
def test_default_cap_on_a_huge_max_pixels():
    # a real Qwen3.5 preprocessor_config.json's sizes (16-px patches): 65,536 patches uncapped
    real = QwenImageProcessorConfig(patch_size=16, min_pixels=65536, max_pixels=16777216)
    assert patch_buckets(real)[-1] == 65536
    capped = with_pixels(real, {})
    assert capped.max_pixels == DEFAULT_MAX_PATCHES * 256 == 1048576 and patch_buckets(capped)[-1] == 4096
    assert with_pixels(real, {"min_pixels": 2 * 1048576}).max_pixels == 2 * 1048576     # never below min
    assert with_pixels(real, {"max_pixels": 16777216}) == real                           # the flag lifts it
    assert with_pixels(QwenImageProcessorConfig(patch_size=16, max_pixels=500000), {}).max_pixels == 500000
    # a large image is resized down to the cap, as transformers' processor with that max_pixels does
    small = QwenImageProcessorConfig(patch_size=4, merge_size=2, min_pixels=64, max_pixels=10 ** 7)
    cfg = with_pixels(small, {})
    assert cfg.max_pixels == DEFAULT_MAX_PATCHES * 16
    img = Image.fromarray(np.random.default_rng(3).integers(0, 256, (300, 260, 3), dtype=np.uint8))
    hf = Qwen2VLImageProcessorPil(patch_size=4, merge_size=2, temporal_patch_size=2,
                                  size={"shortest_edge": 64, "longest_edge": 10 ** 7})
    got = preprocess_qwen(img, cfg)
    assert len(got[0]) <= DEFAULT_MAX_PATCHES
    _assert_equal(got, hf(img, return_tensors="np", max_pixels=cfg.max_pixels))
    with pytest.raises(ValueError, match=r"--mm-processor-kwargs \(mm_processor_kwargs\): .*min_pixels 65536 > "
                                         r"max_pixels 1000"):
        with_pixels(real, {"max_pixels": 1000})
