"""Qwen3.5 with images (jaxllm/models/qwen3_5_vl/) against transformers' tiny random
``Qwen3_5ForConditionalGeneration`` (tests/support/tiny_qwen3_5_vl.py), float32: the vision
tower + patch merger's rows equal ``get_image_features`` for images packed together whose patch
grids are smaller and larger than the learned position grid, one image alone too; the config
read off transformers' and refusals by name."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from support.tiny_qwen3_5_vl import tiny_model

from jaxllm.models.qwen3_5_vl import VisionConfig, encode, grid_inputs, load_params, num_tokens


@pytest.fixture(scope="module")
def hf_vl():
    return tiny_model()


@pytest.fixture(scope="module")
def tower(hf_vl):
    cfg = VisionConfig.from_hf(hf_vl.config)
    return cfg, load_params(cfg, {k: v.numpy() for k, v in hf_vl.state_dict().items()})


@pytest.mark.parametrize("grids", [[(1, 2, 2)], [(1, 4, 6), (1, 8, 4), (1, 2, 2)]], ids=["one", "three"])
def test_image_features_equal_transformers(hf_vl, tower, grids):
    cfg, params = tower
    n = sum(t * h * w for t, h, w in grids)
    px = torch.randn(n, cfg.patch_dim, generator=torch.Generator().manual_seed(n))
    with torch.no_grad():
        ref = torch.cat(hf_vl.model.get_image_features(px, torch.tensor(grids)).pooler_output).numpy()
    got = np.asarray(encode(cfg, params, px.numpy(), grid_inputs(cfg, grids)))
    assert got.shape == ref.shape == (sum(num_tokens(cfg, g) for g in grids), 64)
    np.testing.assert_allclose(got, ref, rtol=0, atol=2e-5 * np.abs(ref).max())


def test_config_and_refusals(hf_vl, tower):
    cfg, params = tower
    assert (cfg.depth, cfg.head_dim, cfg.grid_side, cfg.patch_dim, cfg.image_token_id) == (2, 16, 4, 96, 250)
    assert VisionConfig.from_hf(hf_vl.config.to_dict()) == cfg
    sd = {k: v.numpy() for k, v in hf_vl.state_dict().items()}
    with pytest.raises(ValueError, match="merger.linear_fc2.bias"):
        load_params(cfg, {k: v for k, v in sd.items() if "merger.linear_fc2.bias" not in k})
    with pytest.raises(ValueError, match="pos_embed.weight.*shape"):
        load_params(cfg, dict(sd, **{"model.visual.pos_embed.weight": np.zeros((9, 32), np.float32)}))
    with pytest.raises(ValueError, match="spatial_merge_size"):
        grid_inputs(cfg, [(1, 3, 4)])
    with pytest.raises(ValueError, match="do not match"):
        encode(cfg, params, np.zeros((8, 96), np.float32), grid_inputs(cfg, [(1, 2, 2)]))
    d = hf_vl.config.to_dict()
    d["vision_config"]["hidden_act"] = "relu"
    with pytest.raises(ValueError, match="hidden_act"):
        VisionConfig.from_hf(d)
