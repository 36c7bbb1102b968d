"""Qwen3.5's encoder through its patch buckets (jaxllm/runner/qwen_vision.py): an image of 48
patches run padded in the 64-patch program gives the rows of the tower run on its 48 patches
alone (the padding is a segment of its own: no real patch attends to it), and one past the last
bucket is refused by name.  The buckets follow ``--mm-processor-kwargs``' max_pixels, and a
real checkpoint's max_pixels (16.7M px: 65,536 patches of 16 px) is capped at 4096 patches by
default (the buckets are only listed here: none is compiled).  The tower's rows vs
transformers: tests/models/test_qwen3_5_vl.py."""

from __future__ import annotations

import json
from types import SimpleNamespace

import jax
import numpy as np
import pytest

from support.tiny_qwen3_5_vl import PROCESSOR, tiny_model

from jaxllm.models import qwen3_5_vl
from jaxllm.runner.qwen_vision import QwenVisionEncoder


@pytest.fixture(scope="module")
def tower():
    hf = tiny_model()
    cfg = qwen3_5_vl.VisionConfig.from_hf(hf.config)
    return cfg, {k: v.numpy() for k, v in hf.state_dict().items() if k.startswith("model.visual.")}


def _encoder(tower, folder, processor=PROCESSOR, **kw):
    (folder / "preprocessor_config.json").write_text(json.dumps(processor))
    cfg, tensors = tower
    return QwenVisionEncoder(qwen3_5_vl, SimpleNamespace(cfg=cfg, tensors=tensors, path=str(folder)),
                             jax.sharding.SingleDeviceSharding(jax.devices()[0]), strict=True, **kw)


def test_a_padded_image_gives_its_unpadded_rows(tower, tmp_path):
    enc = _encoder(tower, tmp_path)
    cfg = enc.cfg
    assert enc.buckets == (16, 32, 64)
    grid = (1, 8, 6)                                                          # 48 patches -> the 64 bucket
    px = np.random.default_rng(0).standard_normal((48, cfg.patch_dim)).astype(np.float32)
    got = enc.run(px, grid)                                                   # [12, 64]
    want = np.asarray(qwen3_5_vl.encode(cfg, enc.params, px, qwen3_5_vl.grid_inputs(cfg, [grid])))
    assert list(enc._programs) == [64] and got.shape == want.shape == (12, 64)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6 * np.abs(want).max())
    with pytest.raises(ValueError, match="80 patches: more than the vision encoder's largest bucket 64"):
        enc.run(np.zeros((80, cfg.patch_dim), np.float32), (1, 8, 10))


def test_buckets_follow_the_processor_kwargs_and_the_cap(tower, tmp_path):
    assert _encoder(tower, tmp_path, mm_processor_kwargs={"max_pixels": 16 * 16}).buckets == (16,)
    assert _encoder(tower, tmp_path, mm_processor_kwargs={"max_pixels": 64 * 64}).buckets == (16, 32, 64, 128, 256)
    huge = dict(PROCESSOR, size={"shortest_edge": 16 * 16, "longest_edge": 16777216})
    assert _encoder(tower, tmp_path, huge).buckets == (16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
    lifted = _encoder(tower, tmp_path, huge, mm_processor_kwargs={"max_pixels": 16777216})
    assert lifted.buckets[-1] == 16777216 // 16 and lifted._programs == {}
