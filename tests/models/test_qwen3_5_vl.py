"""Qwen3.5 with images (jaxllm/models/qwen3_5_vl/) against transformers' tiny random
``Qwen3_5ForConditionalGeneration`` (tests/support/tiny_qwen3_5_vl.py), float32: the vision
tower + patch merger's rows equal ``get_image_features`` for images packed together whose patch
grids are smaller and larger than the learned position grid, one image alone too; the
placeholder expansion and M-RoPE positions equal transformers'; the text model (models/qwen3_next
with the image rows and the 3D rotary, paged; XLA and the native CPU kernels) gives
transformers' prompt logits and 32 greedy tokens with 1 and 2 images of two sizes (pixels from
multimodal/qwen_image_processor.py); the config read off transformers' and refusals by name.  Through the engine (text and images):
tests/engine/test_qwen_images_end_to_end.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from support.tiny_qwen3_5_vl import PagedQwen3_5VL, hf_greedy_vl, tiny_model

from jaxllm.errors import ModelLoadError
from jaxllm.models.qwen3_5_vl import (VisionConfig, encode, expand_placeholders, grid_inputs, load_params, mrope_axes,
                                       mrope_positions, num_tokens, split_text_and_vision, tensor_shapes)


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
    with pytest.raises(ValueError, match="does not read: model.visual.deepstack_merger_list.0.norm.weight"):
        load_params(cfg, dict(sd, **{"model.visual.deepstack_merger_list.0.norm.weight": np.zeros(128)}))
    text, vision = split_text_and_vision(hf_vl.config, {k: (v, "f") for k, v in sd.items()}, "ckpt")
    assert "model.layers.0.input_layernorm.weight" in text and "lm_head.weight" in text
    assert not any(k.startswith(("model.language_model.", "model.visual.")) for k in text)
    assert set(vision.tensors) == set(tensor_shapes(cfg)) and vision.cfg == cfg
    with pytest.raises(ModelLoadError, match="ckpt: .*pos_embed.weight.*missing"):
        split_text_and_vision(hf_vl.config, {k: (v, "f") for k, v in sd.items() if "pos_embed" not in k}, "ckpt")
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


def test_placeholders_and_mrope_positions_equal_transformers(hf_vl, tower):
    cfg, _ = tower
    grids = [(1, 4, 6), (1, 8, 4)]                                           # 6 and 8 tokens
    ids = expand_placeholders(cfg, [5, 252, 250, 253, 7, 8, 252, 250, 253, 9], grids)
    assert ids == [5, 252, *[250] * 6, 253, 7, 8, 252, *[250] * 8, 253, 9]
    x = torch.tensor([ids])
    ref, ref_delta = hf_vl.model.get_rope_index(x, (x == 250).int(), torch.tensor(grids))
    pos, delta = mrope_positions(cfg, ids, grids)
    np.testing.assert_array_equal(pos, ref[:, 0].numpy())
    assert delta == int(ref_delta) == (3 - 6) + (4 - 8)          # max(merged rows, cols) - tokens
    with pytest.raises(ValueError, match="2 image"):
        expand_placeholders(cfg, [5, 250, 7], grids)
    with pytest.raises(ValueError, match="needs 6"):
        mrope_positions(cfg, [5, 250, 250, 7], grids[:1])


def test_mrope_axes_equal_transformers_rotary(hf_vl):
    # transformers' text rotary on three different position streams: each frequency turns with
    # the stream mrope_axes names
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextRotaryEmbedding
    tc = hf_vl.config.text_config
    rot = Qwen3_5TextRotaryEmbedding(tc)
    p = torch.stack([torch.arange(7), 10 + torch.arange(7) * 3, 50 - torch.arange(7)])[:, None]   # [3, 1, 7]
    cos, _ = rot(torch.zeros(1), p)
    half = rot.inv_freq.shape[0]
    axes = mrope_axes(2 * half, tc.rope_parameters["mrope_section"])
    assert axes.tolist() == [0, 1, 2, 0]
    want = np.cos(p[:, 0].numpy()[axes].T * rot.inv_freq.numpy())                # [7, half]
    np.testing.assert_allclose(cos[0, :, :half].numpy(), want, rtol=0, atol=1e-6)


@pytest.fixture(scope="module")
def vl_path(hf_vl, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("qwen3_5_vl"))
    hf_vl.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def paged(hf_vl, vl_path):
    # the whole checkpoint as transformers saves it, through the loader (registry, config, split)
    made = {}

    def get(backend):
        if backend not in made:
            made[backend] = PagedQwen3_5VL(vl_path, hf_vl, backend=backend)
        return made[backend]
    return get


# the Pallas attention (interpret mode) also gives these tokens (run by hand; left out of the
# suite's time budget: ~10 CPU-s)
@pytest.mark.parametrize("n_images,backend", [(1, "xla"), (2, "xla"), (2, "native")])
def test_greedy_equals_transformers(hf_vl, tower, paged, n_images, backend):
    from jaxllm.cpu import native
    if backend == "native" and not native.available():
        pytest.skip("the native CPU kernels are unavailable")
    from PIL import Image
    from jaxllm.multimodal.qwen_image_processor import QwenImageProcessorConfig, preprocess_qwen
    cfg, _ = tower
    pcfg = QwenImageProcessorConfig(patch_size=4, min_pixels=16 * 16, max_pixels=32 * 32)
    rng = np.random.default_rng(n_images)
    imgs = [Image.fromarray(rng.integers(0, 256, s, dtype=np.uint8)) for s in [(20, 30, 3), (33, 17, 3)][:n_images]]
    pre = [preprocess_qwen(im, pcfg) for im in imgs]
    grids = [thw for _, thw in pre]
    assert grids == [(1, 4, 8), (1, 8, 4)][:n_images]                          # two sizes, two shapes
    patches = np.concatenate([p for p, _ in pre])
    prompt = [5, 252, 250, 253, 7, 8, 252, 250, 253, 9][:4 + 6 * (n_images - 1)] + [11, 12]
    ids = expand_placeholders(cfg, prompt, grids)
    ref_logits, ref = hf_greedy_vl(hf_vl, ids, patches, grids)
    logits, got = paged(backend).greedy(ids, patches, grids)
    arch = paged(backend).arch
    assert arch.architecture == "Qwen3_5ForConditionalGeneration" and arch.hybrid.mrope_section == (2, 1, 1)
    np.testing.assert_allclose(logits, ref_logits, rtol=0, atol=1e-4 * np.abs(ref_logits).max())
    assert got == ref and len(set(ref)) > 3
