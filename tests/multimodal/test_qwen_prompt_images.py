"""A Qwen3.5 engine's images at the edge (jaxllm/multimodal/qwen_prompt_images.py): placeholders
expanded per image grid, each image's start, grid and causal flag, its key (pixels and grid), the
prompt's M-RoPE positions; refusals naming ``multi_modal_data``: an image larger than the
encoder's largest patch bucket, a processor whose patch size is not the tower's.
``--mm-processor-kwargs``: its max_pixels resizes the edge's images (the largest patch count
follows), the default cap logs one INFO line naming the flag, bad values are refused naming it
(``LLM(...)``'s config and the CLI).  No JAX runs: the tower's config is read off transformers'
tiny config."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
from PIL import Image

from support.tiny_qwen3_5_vl import PROCESSOR, tiny_config

from jaxllm.cli import build_parser, engine_config_from_args
from jaxllm.config import EngineConfig
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


def test_processor_kwargs_at_the_edge(tmp_path, caplog):
    caplog.set_level("INFO", "jaxllm.engine")
    pi = QwenPromptImages(_vision(tmp_path), {"max_pixels": 16 * 16})
    assert pi.max_patches == 16 and pi.processor.max_pixels == 256
    _, (im,) = pi.process([I], {"image": _img(40, 28)})               # 48 patches by the config alone
    assert im.grid == (1, 4, 2)                                      # 16x8 px: 8 patches
    assert "capped" not in caplog.text
    # a huge max_pixels (a real checkpoint's) is capped at 4096 patches of 4 px, said once
    pi = QwenPromptImages(_vision(tmp_path, size={"shortest_edge": 256, "longest_edge": 16777216}))
    assert (pi.processor.max_pixels, pi.max_patches) == (4096 * 16, 4096)
    assert caplog.text.count("max_pixels capped at 65536 (4096 patches; preprocessor_config.json asks "
                             "16777216)") == 1 and "--mm-processor-kwargs" in caplog.text


def test_processor_kwargs_refused_naming_the_flag():
    flag = r"--mm-processor-kwargs \(mm_processor_kwargs\)"
    for kwargs, needle in [({"max_pixel": 10}, "unknown key 'max_pixel'"),
                           ({"max_pixels": 0}, "max_pixels must be a positive integer"),
                           ({"min_pixels": True}, "min_pixels must be a positive integer"),
                           ({"min_pixels": 900, "max_pixels": 100}, "min_pixels 900 > max_pixels 100"),
                           ([1], "must be a JSON object"), ("{max_pixels: 1}", "not JSON")]:
        with pytest.raises(ValueError, match=f"{flag}: .*{needle}|{flag} {needle}"):
            EngineConfig(mm_processor_kwargs=kwargs)

    def config(*flags):
        return engine_config_from_args(build_parser().parse_args(["serve", *flags]))

    assert config("--mm-processor-kwargs", '{"max_pixels": 4194304}').mm_processor_kwargs == {"max_pixels": 4194304}
    assert config().mm_processor_kwargs == {}
    with pytest.raises(ValueError, match=f"{flag}: unknown key 'size'"):
        config("--mm-processor-kwargs", '{"size": 1}')
