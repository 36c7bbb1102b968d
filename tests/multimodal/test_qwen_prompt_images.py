"""A Qwen3.5 engine's images at the edge (jaxllm/multimodal/qwen_prompt_images.py): placeholders
expanded per image grid, each image's start, grid and causal flag, its key (pixels and grid), the
prompt's M-RoPE positions; refusals naming ``multi_modal_data``: an image larger than the
encoder's largest patch bucket, a processor whose patch size is not the tower's.  No JAX runs:
the tower's config is read off transformers' tiny config."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
from PIL import Image

from support.tiny_qwen3_5_vl import PROCESSOR, tiny_config

from jaxllm.models.qwen3_5_vl import VisionConfig, mrope_positions
from jaxllm.multimodal.qwen_prompt_images import QwenPromptImages

S, I, E = 252, 250, 253


def _vision(tmp_path, **processor):
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(dict(PROCESSOR, **processor)))
    return SimpleNamespace(cfg=VisionConfig.from_hf(tiny_config()), tensors={}, path=str(tmp_path))


def _img(h, w, v=None):
    px = np.full((h, w, 3), v, np.uint8) if v is not None else np.random.default_rng(h * w).integers(0, 256, (h, w, 3))
    return Image.fromarray(px.astype(np.uint8))


def test_placeholders_starts_keys_and_positions(tmp_path):
    pi = QwenPromptImages(_vision(tmp_path))
    assert pi.max_patches == 64
    ids, images = pi.process([5, S, I, E, 7, S, I, E], {"image": [_img(20, 30), _img(40, 28)]})
    assert [im.grid for im in images] == [(1, 4, 8), (1, 8, 6)]
    assert [(im.start, im.length, im.causal) for im in images] == [(2, 8, True), (13, 12, True)]
    assert ids == [5, S, *[I] * 8, E, 7, S, *[I] * 12, E]
    m = pi.mrope(ids, images)
    pos, delta = mrope_positions(pi.cfg, ids, [(1, 4, 8), (1, 8, 6)])
    np.testing.assert_array_equal(m.positions, pos)
    assert m.delta == delta == -12
    # a flat image and the same image on its side: equal patch rows, other grids -> other keys
    _, (a,) = pi.process([I], {"image": _img(16, 32, 7)})
    _, (b,) = pi.process([I], {"image": _img(32, 16, 7)})
    assert np.array_equal(a.pixels, b.pixels) and a.grid != b.grid and a.hash != b.hash


def test_refusals_name_the_field(tmp_path):
    pi = QwenPromptImages(_vision(tmp_path, do_resize=False))
    with pytest.raises(ValueError, match=r"multi_modal_data image 0: 48x40 px gives 120 patches .* largest \(64"):
        pi.process([I], {"image": _img(40, 48)})
    with pytest.raises(ValueError, match="multi_modal_data image 0: .*multiples of patch_size"):
        pi.process([I], {"image": _img(20, 30)})
    with pytest.raises(ValueError, match="patch_size 8 is not the vision tower's patch_size 4"):
        QwenPromptImages(_vision(tmp_path, patch_size=8))
