"""Qwen3.5 with images through the whole engine: a tiny random ``Qwen3_5ForConditionalGeneration``
checkpoint (tests/support/tiny_qwen3_5_vl.py, saved with its ``preprocessor_config.json``: images
resized to 16..64 patches of 4 px) served by ``LLM``; ``generate`` with ``multi_modal_data``
gives transformers' 32 greedy tokens (float32) with 1 and 2 images of two sizes, on the native
CPU kernels (``auto`` here) and on the XLA path.  The oracle's pixels and grids are transformers'
``Qwen2VLImageProcessorPil``'s; its prompt ids are written out (one image token per merged 2x2
patch block); ``generate`` runs with its M-RoPE positions (``get_rope_index``).  ``LLM.chat``
with an ``image_url`` part gives transformers' tokens on the chat template's prompt, and the same
engine served: the official ``openai`` client's chat gives the same tokens and logprobs.  On the
XLA engine (max_pixels 384, a KV pool of one sequence) an image request batched with a text one
is preempted and recomputed (its rows from the encoder cache, its M-RoPE positions again): every
token and logprob = alone.  The Pallas attention (interpret mode): one image, transformers'
tokens and the XLA engine's logprobs (one case: two more step programs, slow in interpret mode).

The token budget (8) is smaller than the prompts, so prefill chunks end inside an image (its
tokens attend causally: the runner slices the request's [3, P] positions per chunk) and the
decodes use position + rope delta.  The 48-patch image runs in the encoder's 64-patch program
(padded).  The XLA engine runs with ``mm_processor_kwargs={"max_pixels": 384}``: its pixels and
grids are transformers' processor's called with it, its encoder buckets stop at 32 patches.
The strict compile guard fails any step or encoder call that compiles after start-up.
"""

from __future__ import annotations

import io

import numpy as np
import openai
import pytest
import torch
from PIL import Image

from support.images import data_url, encode
from support.serve_helpers import ServerThread
from support.tiny_qwen3_5_vl import (IMAGE_TOKEN, VISION_END, VISION_START, hf_greedy_vl, hf_processor,
                                     save_vl_checkpoint, tiny_model)

from jaxllm import LLM, SamplingParams
from jaxllm.config import ServingConfig
from jaxllm.cpu import native as cpu_native
from jaxllm.engine.async_engine import AsyncEngine

GREEDY = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True, logprobs=0)
S, I, E = VISION_START, IMAGE_TOKEN, VISION_END
ONE = [5, 17, S, I, E, 7, 8, 11]                       # the image's tokens start at 3: chunk 0-7 ends inside
TWO = [5, S, I, E, 7, 8, S, I, E, 9, 11, 12]


def _image(seed: int, h: int, w: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), np.uint8))


# (1, 4, 8) patches: 8 tokens, 32 patches (its bucket); (1, 8, 6): 12 tokens, 48 patches (padded to 64)
A, B = _image(1, 20, 30), _image(2, 40, 28)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    hf = tiny_model()
    return hf, save_vl_checkpoint(hf, str(tmp_path_factory.mktemp("qwen3_5_vl")))


def _engine(path, **kw):
    return LLM(path, max_num_batched_tokens=8, max_model_len=64, dtype="float32", block_size=4,
               strict_compile_guard=True, show_progress=False, **kw)


@pytest.fixture(scope="module")
def native_llm(checkpoint):
    # auto: the native CPU kernels where they are built (the XLA path otherwise)
    return _engine(checkpoint[1], max_num_seqs=2)


def _messages(url: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": "describe the"},
                                         {"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": "picture ."}]}]


_REFS: dict = {}


def _reference(hf, prompt: list[int], images: list[Image.Image], **kwargs):
    """transformers: its processor's pixels and grids (called with ``kwargs``: min/max_pixels),
    the placeholders expanded by the grids' merged blocks, greedy generate -> (expanded ids, 32
    tokens); kept for the other backend."""
    key = (tuple(prompt), tuple(im.tobytes() + bytes(str(im.size), "ascii") for im in images),
           tuple(sorted(kwargs.items())))
    if key not in _REFS:
        _REFS[key] = _hf_reference(hf, prompt, images, **kwargs)
    return _REFS[key]


def _hf_reference(hf, prompt: list[int], images: list[Image.Image], **kwargs):
    px = hf_processor()(images, return_tensors="np", **kwargs)
    grids = [tuple(g) for g in px["image_grid_thw"].tolist()]
    ids, k = [], 0
    for t in prompt:
        if t == I:
            ids += [I] * (int(np.prod(grids[k])) // 4)
            k += 1
        else:
            ids.append(t)
    logits, tokens = hf_greedy_vl(hf, ids, px["pixel_values"], grids)
    last = logits[-1].astype(np.float64)
    # the first token's logprob: the prefill's result itself, finer than greedy tokens
    return ids, tokens, last[tokens[0]] - last.max() - np.log(np.exp(last - last.max()).sum())


def _check(out, ref, what: str) -> None:
    _, tokens, lp = ref
    assert out.outputs[0].token_ids == tokens, f"{what}: tokens differ"
    got = out.outputs[0].logprobs[0][tokens[0]].logprob
    assert abs(got - lp) < 1e-4 * max(1.0, abs(lp)), f"{what}: first logprob {got} vs transformers' {lp}"


def _logprobs(out) -> list[float]:
    """Each sampled token's logprob."""
    return [d[t].logprob for d, t in zip(out.outputs[0].logprobs, out.outputs[0].token_ids)]


def _generate(llm, cases):
    return llm.generate([{"prompt_token_ids": p, "multi_modal_data": {"image": im}} for p, im in cases], GREEDY,
                        use_tqdm=False)


CASES = [(ONE, [A]), (ONE, [B]), (TWO, [B, A])]


def test_generate_with_images_equals_transformers_native(checkpoint, native_llm):
    hf, _ = checkpoint
    engine = native_llm.llm_engine
    assert engine.supports_images and engine.core.resolved.step.mrope
    want = "native" if cpu_native.available() else "xla"
    assert engine.core.resolved.step.kernels.attention == want
    vision = engine.core.runner.vision
    assert sorted(vision._programs) == [16, 32, 64], "the encoder's patch buckets, compiled at start-up"
    outs = _generate(native_llm, CASES)
    for (prompt, images), out in zip(CASES, outs):
        ref = _reference(hf, prompt, images)
        assert out.prompt_token_ids == ref[0], "placeholders expanded unlike transformers' grids"
        _check(out, ref, f"{len(images)} image(s) of {[im.size for im in images]}")
        assert len(set(ref[1])) > 3
    assert outs[0].outputs[0].token_ids != outs[1].outputs[0].token_ids, "two images gave the same tokens"
    assert len(outs[2].prompt_token_ids) == 30 and vision.misses == 2
    # the same image again: the encoder cache serves it (keyed by its pixels and grid), tokens unchanged
    before = engine.get_stats()
    again = _generate(native_llm, [(ONE, [A])])[0]
    after = engine.get_stats()
    assert (after.encoder_cache_hits, after.encoder_cache_misses) == (before.encoder_cache_hits + 1,
                                                                     before.encoder_cache_misses)
    assert again.outputs[0].token_ids == outs[0].outputs[0].token_ids
    with pytest.raises(ValueError, match=r"multi_modal_data: 2 image\(s\) but the prompt has 1"):
        _generate(native_llm, [(ONE, [A, B])])


def test_image_and_text_requests_batched_equal_each_alone(checkpoint, native_llm):
    hf, _ = checkpoint
    text = np.random.default_rng(1).integers(0, 250, 13).tolist()
    image = {"prompt_token_ids": TWO, "multi_modal_data": {"image": [A, _image(3, 16, 16)]}}
    # the text request first: the image request's rows and positions sit at an offset in the step
    alone = [native_llm.generate(p, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
             for p in ({"prompt_token_ids": text}, image)]
    both = [o.outputs[0].token_ids for o in native_llm.generate([{"prompt_token_ids": text}, image], GREEDY,
                                                                use_tqdm=False)]
    assert both == alone
    # text alone on this engine: its three rotary streams are the sequence index (transformers' text rotary)
    with torch.no_grad():
        want = hf.generate(torch.tensor([text]), max_new_tokens=32, min_new_tokens=32, do_sample=False)
    assert alone[0] == want[0, len(text):].tolist()


def test_chat_and_served_chat_with_an_image_url_equal_transformers(checkpoint, native_llm):
    # the chat template's "<|vision_start|><|image_pad|><|vision_end|>" expanded by the image's
    # grid; then the same engine served (its last use in this module: the offline LLM is not
    # used after this), the same messages through the official openai client.
    hf, _ = checkpoint
    tok = native_llm.get_tokenizer()
    png = encode(_image(6, 24, 40), "PNG")
    template = [{"role": "user", "content": [{"type": "text", "text": "describe the"}, {"type": "image"},
                                             {"type": "text", "text": "picture ."}]}]
    prompt = tok(tok.apply_chat_template(template, add_generation_prompt=True, tokenize=False),
                 add_special_tokens=False)["input_ids"]
    assert prompt.count(I) == 1 and prompt.count(S) == 1
    ref = _reference(hf, prompt, [Image.open(io.BytesIO(png)).convert("RGB")])
    out = native_llm.chat(_messages(data_url(png)), GREEDY, use_tqdm=False)[0]
    assert out.prompt_token_ids == ref[0]
    _check(out, ref, "chat")

    srv = ServerThread(AsyncEngine(native_llm.llm_engine), ServingConfig(host="127.0.0.1", port=0,
                                                                         served_model_names=("tiny-qwen-vl",)))
    try:
        client = openai.OpenAI(base_url=srv.base + "/v1", api_key="unused", max_retries=0, timeout=120)
        r = client.chat.completions.create(model="tiny-qwen-vl", messages=_messages(data_url(png)), max_tokens=32,
                                           temperature=0, extra_body={"ignore_eos": True}, logprobs=True)
    finally:
        srv.stop()
    content = r.choices[0].logprobs.content
    assert [tok.convert_tokens_to_ids(t.token) for t in content] == ref[1]
    assert r.choices[0].message.content == out.outputs[0].text and r.usage.prompt_tokens == len(ref[0])
    # every token's logprob = LLM.chat's: the same pixels reached the encoder (greedy tokens alone
    # survive a mirrored image on this tiny model)
    np.testing.assert_allclose([t.logprob for t in content], _logprobs(out), rtol=0, atol=1e-5)


# --mm-processor-kwargs' max_pixels: 384 px (24 patches) resizes both images smaller than the
# checkpoint's 1024 would (A to 4x6 patches, B to 4x4), as transformers' processor called with it,
# and the encoder's buckets follow (16, 32: not the checkpoint's 64)
KWARGS = {"max_pixels": 16 * 24}


@pytest.fixture(scope="module")
def xla_llm(checkpoint):
    # A KV pool of 16 usable blocks of 4 (one 64-token sequence): each request alone fits, the
    # preemption test's two together do not.  Prefix caching off: a recompute cannot skip tokens.
    return _engine(checkpoint[1], max_num_seqs=2, cpu_matmul="xla", attention_backend="xla",
                   skip_tokenizer_init=True, mm_processor_kwargs=KWARGS, num_gpu_blocks_override=17,
                   enable_prefix_caching=False)


@pytest.mark.filterwarnings("ignore:Passing `min_pixels` and `max_pixels`:FutureWarning")
def test_generate_with_images_equals_transformers_xla(checkpoint, xla_llm):
    hf, _ = checkpoint
    engine = xla_llm.llm_engine
    assert engine.core.resolved.step.kernels.attention == "xla"
    assert engine.core.runner.vision.buckets == (16, 32) and engine.input_processor.images.max_patches == 32
    for prompt, images in (CASES[0], CASES[2]):                   # each alone (the preemption test's reference)
        out = _generate(xla_llm, [(prompt, images)])[0]
        ref = _reference(hf, prompt, images, **KWARGS)
        assert out.prompt_token_ids == ref[0], "placeholders expanded unlike transformers' grids with the kwargs"
        _check(out, ref, f"xla, {len(images)} image(s), {KWARGS}")
    assert len(ref[0]) == len(TWO) - 2 + 6 + 4                         # A: 4x6 patches, 6 tokens; B: 4x4, 4


@pytest.mark.filterwarnings("ignore:Passing `min_pixels` and `max_pixels`:FutureWarning")
def test_image_request_preempted_recomputes_its_rows_and_positions(checkpoint, xla_llm):
    # The text request (13 + 32 tokens: 12 blocks) and the two-image one (B and A at KWARGS:
    # 20 + 32 tokens, 13 blocks) do not fit xla_llm's 16 blocks together, so the later one, the
    # image request, is preempted and recomputed from token 0: its image rows merged again (from
    # the encoder cache) and its prompt and generated tokens at its M-RoPE positions (the
    # prompt's [3, P] columns, then position + delta), which the resumed request carries.  Alone,
    # its tokens are transformers' (the XLA test's, on this engine).
    hf, _ = checkpoint
    engine = xla_llm.llm_engine
    text = {"prompt_token_ids": np.random.default_rng(1).integers(0, 250, 13).tolist()}
    image = {"prompt_token_ids": TWO, "multi_modal_data": {"image": CASES[2][1]}}
    alone = [xla_llm.generate(p, GREEDY, use_tqdm=False)[0] for p in (text, image)]
    _check(alone[1], _reference(hf, *CASES[2], **KWARGS), "alone")
    before = engine.get_stats()
    assert before.num_preemptions == 0, "each request alone must fit the pool"
    both = xla_llm.generate([text, image], GREEDY, use_tqdm=False)
    after = engine.get_stats()
    assert after.num_preemptions > 0, "the pool was meant to force a preemption"
    for a, b in zip(alone, both):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        # every token's logprob, finer than greedy tokens (which survive a recompute at wrong
        # positions here): batched and alone differ by float32 rounding only (~5e-7), a
        # recompute without its M-RoPE positions by ~1e-2 from its first token after it
        np.testing.assert_allclose(_logprobs(b), _logprobs(a), rtol=0, atol=1e-5)
    # each admission (the first and one per preemption, all of the image request's) asked for
    # its 2 images; a recompute's are served by the encoder cache (encoded here only if the XLA
    # test did not run first)
    asked = (after.encoder_cache_hits + after.encoder_cache_misses
             - before.encoder_cache_hits - before.encoder_cache_misses)
    assert asked == 2 * (1 + after.num_preemptions)
    assert after.encoder_cache_misses - before.encoder_cache_misses <= 2
    prompts = sum(len(o.prompt_token_ids) for o in both)
    assert after.prompt_tokens_computed - before.prompt_tokens_computed > prompts, "no recompute ran"


@pytest.mark.filterwarnings("ignore:Passing `min_pixels` and `max_pixels`:FutureWarning")
def test_generate_with_an_image_equals_transformers_pallas(checkpoint, xla_llm):
    # The Pallas attention (and the gated-delta decode kernel) in interpret mode: one image (A,
    # 4x6 patches at the XLA test's max_pixels, whose transformers reference this reuses), its
    # 13-token prompt chunked 8 + 5 (the image's rows and M-RoPE columns split across the chunks),
    # 31 decodes: two step programs, each slow to compile in interpret mode, so one case only.
    hf, path = checkpoint
    llm = _engine(path, max_num_seqs=1, attention_backend="pallas", skip_tokenizer_init=True,
                  mm_processor_kwargs=KWARGS)
    assert llm.llm_engine.core.resolved.step.kernels.attention == "pallas"
    out = _generate(llm, [CASES[0]])[0]
    ref = _reference(hf, *CASES[0], **KWARGS)
    assert out.prompt_token_ids == ref[0]
    _check(out, ref, f"pallas, 1 image, {KWARGS}")
    # every token's logprob = the XLA engine's (its own decodes' too, finer than greedy tokens)
    np.testing.assert_allclose(_logprobs(out), _logprobs(_generate(xla_llm, [CASES[0]])[0]), rtol=0, atol=1e-5)
