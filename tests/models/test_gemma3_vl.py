"""Gemma 3 with images (jaxllm/models/gemma3_vl/) against transformers' tiny random
``Gemma3ForConditionalGeneration`` (tests/support/tiny_gemma3_vl.py), float32: the SigLIP tower +
projector's rows equal ``get_image_features``; the text model (models/gemma) with the image rows
merged at the placeholders and Gemma 3's bidirectional attention inside each image gives
transformers' prompt logits and 32 greedy tokens with 1 and 2 images, on each paged attention
backend: XLA, the native CPU kernel and the Pallas kernel in interpret mode (its two-image case);
the placeholder expansion and the image groups equal what transformers' processor / mask
builder make of them; refusals by name."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from support.tiny_gemma3_vl import (BOI, EOI, IMAGE_TOKEN, PagedGemma3VL, hf_greedy_vl, hf_processor, save_text_part,
                                    save_tokenizer, tiny_model)

from jaxllm.cpu import native as cpu_native
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


def test_placeholders_expand_as_transformers_processor(hf_vl, tmp_path):
    # Gemma3Processor replaces each <start_of_image> in the text by "\n\n<boi><img>x4<eoi>\n\n"
    # and then tokenizes: the newlines are tokens, and they merge with a run of newlines the
    # text has beside the image (a run of k newlines is one token, as in Gemma 3's vocab).
    from PIL import Image
    from jaxllm.multimodal.prompt_images import newline_ids
    save_tokenizer(str(tmp_path))
    from transformers import Gemma3ImageProcessor
    Gemma3ImageProcessor(size={"height": 56, "width": 56}).save_pretrained(str(tmp_path))
    processor = hf_processor(str(tmp_path))
    tok = processor.tokenizer
    newlines = newline_ids(lambda text: tok.encode(text, add_special_tokens=False))
    cfg = VisionConfig.from_hf(hf_vl.config)
    image = Image.new("RGB", (56, 56))
    for text in ("<start_of_image>describe this .", "what is : <start_of_image> and <start_of_image> ?",
                 "the\n<start_of_image>\n\n\ncat", "a<start_of_image><start_of_image>\n", "\n\n<start_of_image>"):
        n = text.count("<start_of_image>")
        want = processor(text=text, images=[image] * n)["input_ids"][0]
        assert expand_placeholders(cfg, tok.encode(text), n, newlines) == list(want), repr(text)


def test_unsupported_vision_configs_refused():
    with pytest.raises(ValueError, match="mm_tokens_per_image=9"):
        VisionConfig.from_hf(tiny_model(tokens_per_image=9).config)


@pytest.fixture(scope="module")
def text_dir(hf_vl, tmp_path_factory):
    return save_text_part(hf_vl, str(tmp_path_factory.mktemp("gemma3_text")))


@pytest.fixture(scope="module")
def paged(hf_vl, text_dir):
    return PagedGemma3VL(text_dir, hf_vl)


@pytest.fixture(scope="module")
def paged_native(hf_vl, text_dir):
    if not cpu_native.available():
        pytest.skip("native CPU kernels unavailable here (no AVX2/FMA or no C++ compiler)")
    return PagedGemma3VL(text_dir, hf_vl, attention="native")


@pytest.fixture(scope="module")
def paged_pallas(hf_vl, text_dir):
    return PagedGemma3VL(text_dir, hf_vl, attention="pallas")    # interpret mode on CPU


def _pixels(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, 3, 56, 56)).astype(np.float32)   # [n, 3, 56, 56]


_HF: dict = {}   # transformers' (prompt logits, greedy tokens) per case, shared by the backends


@pytest.mark.parametrize("backend", ["xla", "native", "pallas"])
def test_greedy_with_images_equals_transformers(hf_vl, backend, request):
    paged = request.getfixturevalue({"xla": "paged", "native": "paged_native", "pallas": "paged_pallas"}[backend])
    one = expand_placeholders(paged.vcfg, [2, 10, 11, BOI, 12, 13, 14], 1)
    two = expand_placeholders(paged.vcfg, [2, 10, BOI, 11, BOI, 12, 13], 2)
    outs = {}
    cases = (("one", one, _pixels(1, 3)), ("other", one, _pixels(1, 4)), ("two", two, _pixels(2, 5)))
    if backend == "pallas":         # interpret mode is slow: the two-image case only
        cases = cases[2:]
    for name, ids, px in cases:
        ours_logits, ours = paged.greedy(ids, px)
        if name not in _HF:                                              # the oracle once per case
            _HF[name] = hf_greedy_vl(hf_vl, ids, px)
        ref_logits, ref = _HF[name]
        rel = np.abs(ours_logits - ref_logits).max() / np.abs(ref_logits).max()
        assert rel < 1e-4, f"{name}: max relative prompt-logit error {rel:.2e}"
        assert ours == ref, f"{name}: greedy tokens differ from transformers"
        outs[name] = ours
    if "other" in outs:
        assert outs["one"] != outs["other"], "two different images gave the same 32 tokens"
