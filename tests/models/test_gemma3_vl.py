"""Gemma 3 with images (jaxllm/models/gemma3_vl/) against transformers' tiny random
``Gemma3ForConditionalGeneration`` (tests/support/tiny_gemma3_vl.py), float32: the SigLIP tower +
projector's rows equal ``get_image_features``; the placeholder expansion and the image groups
equal what transformers' processor / mask builder make of them; refusals by name."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from support.tiny_gemma3_vl import BOI, EOI, IMAGE_TOKEN, tiny_model

from jaxllm.models.gemma3_vl import VisionConfig, encode, expand_placeholders, image_groups, load_params, visible_upto


@pytest.fixture(scope="module")
def hf_vl():
    return tiny_model()


def test_image_features_equal_transformers(hf_vl):
    cfg = VisionConfig.from_hf(hf_vl.config)
    params = load_params(cfg, {k: v.numpy() for k, v in hf_vl.state_dict().items()})
    px = torch.randn(2, 3, 56, 56, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf_vl.get_image_features(px).pooler_output.numpy()              # [2, 4, 64]
    got = np.asarray(encode(cfg, params, px.numpy()))
    assert got.shape == ref.shape == (2, 4, 64)
    np.testing.assert_allclose(got, ref, rtol=0, atol=2e-5 * np.abs(ref).max())
    with pytest.raises(ValueError, match="56x56"):
        encode(cfg, params, px.numpy()[..., :28, :28])
    with pytest.raises(ValueError, match="mm_input_projection_weight"):
        load_params(cfg, {k: v.numpy() for k, v in hf_vl.state_dict().items() if "mm_input_projection" not in k})


def test_placeholders_and_groups(hf_vl):
    from transformers.models.gemma3.modeling_gemma3 import get_block_sequence_ids_for_mask
    cfg = VisionConfig.from_hf(hf_vl.config)
    ids = expand_placeholders(cfg, [2, 10, BOI, 11, BOI, 12], 2)
    img = [BOI, IMAGE_TOKEN, IMAGE_TOKEN, IMAGE_TOKEN, IMAGE_TOKEN, EOI]
    assert ids == [2, 10, *img, 11, *img, 12]
    tt = torch.tensor([ids]) == IMAGE_TOKEN                                    # the processor's token_type_ids
    np.testing.assert_array_equal(image_groups(cfg, ids), get_block_sequence_ids_for_mask(tt.long())[0].numpy())
    vis = visible_upto(cfg, ids)
    assert vis.tolist() == [0, 1, 2, 6, 6, 6, 6, 7, 8, 9, 13, 13, 13, 13, 14, 15]
    with pytest.raises(ValueError, match="2 image"):
        expand_placeholders(cfg, [2, 10, BOI, 11], 2)


def test_unsupported_vision_configs_refused():
    with pytest.raises(ValueError, match="mm_tokens_per_image=9"):
        VisionConfig.from_hf(tiny_model(tokens_per_image=9).config)
