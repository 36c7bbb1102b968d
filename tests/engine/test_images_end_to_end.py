"""Gemma 3 with images through the whole engine (issue 41): a tiny random
``Gemma3ForConditionalGeneration`` checkpoint (tests/support/tiny_gemma3_vl.py: weights,
tokenizer, the image processor's config) starts one engine, which says it takes images; the
offline ``LLM.generate`` with ``multi_modal_data``, ``LLM.chat`` with an ``image_url`` data URL,
and ``jaxllm serve``'s app through the official ``openai`` client each give transformers'
32 greedy tokens (float32), with transformers' own ``Gemma3Processor`` making the oracle's
prompt ids (each placeholder -> "\\n\\n", boi, image tokens, eoi, "\\n\\n": the tokenizer has
newline tokens) and pixels.

The engine resolves ``--attention-backend auto`` as a user's would: on this CPU that is the native
kernel (jaxllm/cpu/attention.cc, its ``visible_upto`` targets); the XLA path's token-exactness is
tests/models/test_gemma3_vl.py's.  The engine's token budget (8) is smaller than the prompts, so the prefill is chunked around the
images (a chunk never ends inside one); the strict compile guard fails any step or encoder
call that compiles after its program was made.  One engine serves the whole module.
"""

from __future__ import annotations

import base64
import contextlib
import io

import jax
import numpy as np
import pytest
from PIL import Image

from support.images import data_url, encode
from support.snippets import all_blocks
from support.serve_helpers import ServerThread
from support.tiny_gemma3_vl import IMAGE_TOKEN, NEWLINES, hf_greedy_vl, hf_processor, save_vl_checkpoint, tiny_model

from jaxllm import LLM, SamplingParams
from jaxllm.cpu import native as cpu_native

GREEDY = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True, logprobs=0)
ONE = "what is in this <start_of_image> picture ?"
# first in its batch, so its chunks are 8 tokens from 0 unless cut: its second image (15-18,
# after "\n\n" boi) straddles position 16, where the second chunk would end
TWO = "<start_of_image> a cat and the picture <start_of_image> dog ?"


def _image(seed: int, w: int = 70, h: int = 40) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), np.uint8))


@pytest.fixture(scope="module")
def vl_checkpoint(tmp_path_factory):
    hf = tiny_model()
    return hf, save_vl_checkpoint(hf, str(tmp_path_factory.mktemp("gemma3_vl")))


@pytest.fixture(scope="module")
def vl(vl_checkpoint):
    hf, path = vl_checkpoint
    llm = LLM(path, max_num_seqs=2, max_num_batched_tokens=8, max_model_len=64, dtype="float32", block_size=4,
              strict_compile_guard=True, show_progress=False)
    processor = hf_processor(path)
    return hf, llm, processor.tokenizer, processor


def _reference(vl, text: str, images: list[Image.Image]):
    """transformers: its Gemma3Processor's ids (each <start_of_image> expanded in the text, then
    tokenized) and pixels, greedy generate -> (32 tokens, expanded ids, the first token's logprob)."""
    hf, _, _, processor = vl
    inputs = processor(text=text, images=images, return_tensors="np")
    out = inputs["input_ids"][0].tolist()
    logits, tokens = hf_greedy_vl(hf, out, inputs["pixel_values"])
    last = logits[-1].astype(np.float64)
    return tokens, out, last[tokens[0]] - last.max() - np.log(np.exp(last - last.max()).sum())


def test_generate_with_images_equals_transformers(vl):
    _, llm, _, _ = vl
    assert llm.llm_engine.supports_images
    # auto picks the native CPU attention (its *_vis kernel) where it is built: images run there
    want = "native" if cpu_native.available() else "xla"
    assert llm.llm_engine.core.resolved.step.kernels.attention == want
    vision = llm.llm_engine.core.runner.vision
    a, b = _image(1), _image(2, 33, 90)
    cases = [(TWO, [b, a]), (ONE, [a]), (ONE, [b])]
    outs = llm.generate([{"prompt": p, "multi_modal_data": {"image": im if len(im) > 1 else im[0]}}
                         for p, im in cases], GREEDY, use_tqdm=False)
    for (prompt, images), out in zip(cases, outs):
        ref, ids, lp = _reference(vl, prompt, images)
        assert out.prompt_token_ids == ids, "placeholders expanded unlike transformers' processor"
        assert out.outputs[0].token_ids == ref, f"{prompt!r} with {len(images)} image(s): tokens differ"
        # the prefill's result itself, finer than greedy tokens: the first token's logprob
        got = out.outputs[0].logprobs[0][ref[0]].logprob
        assert abs(got - lp) < 1e-4 * max(1.0, abs(lp)), f"{prompt!r}: first logprob {got} vs transformers' {lp}"
    assert outs[1].outputs[0].token_ids != outs[2].outputs[0].token_ids, "two images gave the same tokens"
    assert outs[0].prompt_token_ids[15:19] == [IMAGE_TOKEN] * 4, "the image must straddle the chunk end at 16"
    assert outs[1].prompt_token_ids.count(NEWLINES["\n\n"]) == 2, "an image's newlines are tokens here"
    # The same image again: the encoder cache and the prefix cache (its hash is in the salt)
    # serve it, tokens unchanged; the same text with another image shares no cached block.
    before = llm.llm_engine.get_stats()
    again = llm.generate({"prompt": ONE, "multi_modal_data": {"image": a}}, GREEDY, use_tqdm=False)[0]
    after = llm.llm_engine.get_stats()
    assert (after.encoder_cache_hits, after.encoder_cache_misses) == (
        before.encoder_cache_hits + 1, before.encoder_cache_misses), "the same image must not be encoded again"
    assert after.encoder_cache_entries == len(vision.cache) == 2
    assert again.outputs[0].token_ids == outs[1].outputs[0].token_ids
    assert again.num_cached_tokens > 0
    assert after.prefix_cache_hits - before.prefix_cache_hits == again.num_cached_tokens
    other = llm.generate({"prompt": ONE, "multi_modal_data": {"image": _image(3)}}, GREEDY, use_tqdm=False)[0]
    assert other.num_cached_tokens == 0
    with pytest.raises(ValueError, match=r"multi_modal_data: 2 image\(s\) but the prompt has 1"):
        llm.generate({"prompt": ONE, "multi_modal_data": {"image": [a, b]}}, GREEDY, use_tqdm=False)


def test_image_and_text_requests_batched_equal_each_alone(vl):
    _, llm, _, _ = vl
    text = "describe the cat ."
    image = {"prompt": TWO, "multi_modal_data": {"image": [_image(4), _image(5)]}}
    # the text request first: the image's rows sit at an offset in the step's flat tokens
    alone = [llm.generate(p, GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in (text, image)]
    both = [o.outputs[0].token_ids for o in llm.generate([text, image], GREEDY, use_tqdm=False)]
    assert both == alone
    # the steps without image tokens (the decodes, the text prompt's) sent no [T, D] rows: they
    # passed a zero buffer kept on the device per token bucket (runner/model_runner._image_rows)
    zeros = llm.llm_engine.core.runner._zero_image_rows
    assert zeros and all(isinstance(z, jax.Array) and z.shape == (T, 64) and not np.asarray(z).any()
                         for T, z in zeros.items())


def test_image_request_preempted_recomputes_its_image_rows(vl_checkpoint):
    # A KV pool of 16 usable blocks of 4 (one 64-token sequence): the text request (10 blocks
    # at its end) and the two-image one (15) each fit alone, not together, so the later one,
    # the image request, is preempted and recomputed from token 0 -- its image rows merged
    # again (from the encoder cache).  No prefix caching: the recompute cannot skip them.
    _, path = vl_checkpoint
    llm = LLM(path, max_num_seqs=2, max_num_batched_tokens=8, max_model_len=64, dtype="float32", block_size=4,
              num_gpu_blocks_override=17, enable_prefix_caching=False, strict_compile_guard=True,
              show_progress=False)
    engine = llm.llm_engine
    text = "describe the cat and the dog ."
    image = {"prompt": TWO, "multi_modal_data": {"image": [_image(7), _image(8, 30, 80)]}}
    alone = [llm.generate(p, GREEDY, use_tqdm=False)[0] for p in (text, image)]
    before = engine.get_stats()
    assert before.num_preemptions == 0, "each request alone must fit the pool"
    both = llm.generate([text, image], GREEDY, use_tqdm=False)
    after = engine.get_stats()
    assert after.num_preemptions > 0, "the pool was meant to force a preemption"
    assert [o.outputs[0].token_ids for o in both] == [o.outputs[0].token_ids for o in alone]
    # each admission (the first and one per preemption, all of the image request: the later
    # one) asked for its 2 images: served by the encoder cache, never encoded again
    assert after.encoder_cache_hits - before.encoder_cache_hits == 2 * (1 + after.num_preemptions)
    assert after.encoder_cache_misses == before.encoder_cache_misses == 2
    # its prompt (image tokens included) was run through the model again
    prompts = sum(len(o.prompt_token_ids) for o in both)
    assert after.prompt_tokens_computed - before.prompt_tokens_computed > prompts


def test_readme_image_example_runs_as_written(vl):
    # README's "Images" block (skip-annotated for tests/docs/test_snippets.py, which builds no
    # checkpoint), its placeholder model swapped for this engine: its tokens are transformers'.
    _, llm, tok, _ = vl
    (b,) = [b for b in all_blocks() if b.path == "README.md" and "multi_modal_data" not in b.body
            and "/path/to/gemma-3-4b-it" in b.body]
    assert b.kind == "skip" and "test_images_end_to_end.py" in b.attrs["reason"], b.where
    ns: dict = {"vl_llm": llm}
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(b.body.replace('LLM("/path/to/gemma-3-4b-it")', "vl_llm"), b.where, "exec"), ns)  # noqa: S102
    got = ns["out"][0].outputs[0]
    image = Image.open(io.BytesIO(base64.b64decode(ns["url"].split(",", 1)[1]))).convert("RGB")
    text = tok.apply_chat_template(_template(), add_generation_prompt=True, tokenize=False)
    ref, _, _ = _reference(vl, text, [image])
    eos = ref.index(1) + 1 if 1 in ref else len(ref)                      # the block stops at EOS
    assert got.token_ids == ref[:eos]
    assert printed.getvalue() == got.text + "\n"


def _template() -> list[dict]:
    """_messages as the chat template sees them (the image part a placeholder)."""
    return [{"role": "user", "content": [{"type": "text", "text": "describe the"}, {"type": "image"},
                                         {"type": "text", "text": "picture ."}]}]


def _messages(url: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": "describe the"},
                                         {"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": "picture ."}]}]


def test_chat_and_served_chat_with_an_image_url_equal_transformers(vl):
    _, llm, tok, _ = vl
    png = encode(_image(6), "PNG")
    url = data_url(png)
    text = tok.apply_chat_template(_template(), add_generation_prompt=True, tokenize=False)
    ref, _, _ = _reference(vl, text, [Image.open(io.BytesIO(png)).convert("RGB")])
    assert llm.chat(_messages(url), GREEDY, use_tqdm=False)[0].outputs[0].token_ids == ref

    # The same engine served (the offline LLM is not used after this): the official client.
    import openai
    from jaxllm.config import ServingConfig
    from jaxllm.engine.async_engine import AsyncEngine
    srv = ServerThread(AsyncEngine(llm.llm_engine), ServingConfig(host="127.0.0.1", port=0,
                                                                  served_model_names=("tiny-vl",)))
    try:
        client = openai.OpenAI(base_url=srv.base + "/v1", api_key="unused", max_retries=0, timeout=120)
        r = client.chat.completions.create(model="tiny-vl", messages=_messages(url), max_tokens=32, temperature=0,
                                           extra_body={"ignore_eos": True}, logprobs=True)
        assert [tok.convert_tokens_to_ids(t.token) for t in r.choices[0].logprobs.content] == ref
        # the image llm.chat sent: /metrics shows the encoder cache's hit and the prefix cache's
        import httpx
        page = httpx.get(srv.base + "/metrics", timeout=30).text
        s = llm.llm_engine.get_stats()
        for name, value in (("jaxllm:encoder_cache_hits_total", s.encoder_cache_hits),
                            ("jaxllm:encoder_cache_misses_total", s.encoder_cache_misses),
                            ("jaxllm:encoder_cache_entries", s.encoder_cache_entries),
                            ("jaxllm:prefix_cache_hits_total", s.prefix_cache_hits)):
            (line,) = [ln for ln in page.splitlines() if ln.startswith(name + "{")]
            assert float(line.rsplit(" ", 1)[1]) == value > 0, line
        assert r.usage.prompt_tokens_details.cached_tokens > 0
    finally:
        srv.stop()
