"""The offline API (``from jaxllm import LLM, SamplingParams``), shaped like vLLM's."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from support.images import data_url, encode, pattern
from support.tiny_models import load_hf

from jaxllm import LLM, SamplingParams
from jaxllm.engine.llm_engine import check_processor_kwargs_family
from jaxllm.engine.output_processor import OutputKind
from jaxllm.multimodal.chat_parts import ImageInputError

GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


def test_generate_returns_outputs_in_prompt_order(tiny_llm):
    tok = tiny_llm.get_tokenizer()
    prompts = ["Hello world", "The quick brown fox", {"prompt_token_ids": [11, 12, 13]}, "a"]
    outs = tiny_llm.generate(prompts, GREEDY, use_tqdm=False)
    assert len(outs) == 4
    assert outs[0].prompt == "Hello world" and outs[0].prompt_token_ids == tok.encode("Hello world")
    assert outs[2].prompt is None and outs[2].prompt_token_ids == [11, 12, 13]
    for p, o in zip(prompts, outs):
        solo = tiny_llm.generate([p], GREEDY, use_tqdm=False)[0]
        assert o.outputs[0].token_ids == solo.outputs[0].token_ids
        assert o.finished and o.outputs[0].finish_reason == "length"
        assert o.outputs[0].text == tok.decode(o.outputs[0].token_ids, skip_special_tokens=True)


def test_per_prompt_sampling_params(tiny_llm):
    outs = tiny_llm.generate(["x", "y"], [SamplingParams(max_tokens=3, temperature=0),
                                          SamplingParams(max_tokens=7, temperature=0)], use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 7]


def test_n_sequences_seeded(tiny_llm):
    sp = SamplingParams(n=3, temperature=1.0, seed=1234, max_tokens=12, ignore_eos=True)
    a = tiny_llm.generate(["Tell me a story"], sp, use_tqdm=False)[0]
    b = tiny_llm.generate(["Tell me a story"], sp, use_tqdm=False)[0]
    assert [c.index for c in a.outputs] == [0, 1, 2]
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    assert len({tuple(c.token_ids) for c in a.outputs}) == 3, "the n samples should differ"


def test_seed_changes_the_draw_and_top_k_1_is_greedy(tiny_llm):
    p = ["Once upon a time"]
    runs = {s: tiny_llm.generate(p, SamplingParams(temperature=1.0, seed=s, max_tokens=16, ignore_eos=True),
                                 use_tqdm=False)[0].outputs[0].token_ids for s in (1, 2)}
    assert runs[1] != runs[2]
    greedy = tiny_llm.generate(p, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    top1 = tiny_llm.generate(p, SamplingParams(temperature=1.5, top_k=1, seed=9, max_tokens=16, ignore_eos=True),
                             use_tqdm=False)
    assert top1[0].outputs[0].token_ids == greedy[0].outputs[0].token_ids


def test_stop_strings(tiny_llm):
    base = tiny_llm.generate(["Hello world"], GREEDY, use_tqdm=False)[0].outputs[0]
    text = base.text
    stop = text[len(text) // 2: len(text) // 2 + 3]
    assert len(stop) == 3 and stop.strip(), text
    cut = text.find(stop)
    out = tiny_llm.generate(["Hello world"], GREEDY.replace(stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert out.text == text[:cut]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    inc = tiny_llm.generate(["Hello world"], GREEDY.replace(stop=[stop], include_stop_str_in_output=True),
                            use_tqdm=False)[0].outputs[0]
    assert inc.text == text[:cut + len(stop)]


def test_stop_token_ids(tiny_llm):
    base = tiny_llm.generate(["Hello world"], GREEDY, use_tqdm=False)[0].outputs[0]
    stop_id = base.token_ids[4]
    first = base.token_ids.index(stop_id)
    out = tiny_llm.generate(["Hello world"], GREEDY.replace(stop_token_ids=[stop_id]), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == base.token_ids[:first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id


def test_max_tokens_none_runs_to_max_model_len(tiny_llm):
    out = tiny_llm.generate([{"prompt_token_ids": [7] * 200}],
                            SamplingParams(temperature=0, max_tokens=None, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 256 - 200
    assert out.outputs[0].finish_reason == "length"


def test_logprobs_are_the_raw_distribution(tiny_llm, tiny_llama):
    prompt = [21, 22, 23, 24, 25]
    out = tiny_llm.generate([{"prompt_token_ids": prompt}],
                            SamplingParams(temperature=0.9, seed=5, max_tokens=6, logprobs=4, ignore_eos=True),
                            use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs) == 6
    hf = load_hf(tiny_llama)
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + out.token_ids])).logits[0].double()
    ref = torch.log_softmax(logits, -1).numpy()
    total = 0.0
    for i, (tok, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        row = ref[len(prompt) - 1 + i]
        assert tok in entry and len(entry) >= 4
        assert abs(entry[tok].logprob - row[tok]) < 1e-4
        assert entry[tok].rank == 1 + int((row > row[tok] + 1e-6).sum())
        top = np.argsort(-row)[:4]
        assert set(top.tolist()) <= set(entry)
        total += entry[tok].logprob
    assert abs(out.cumulative_logprob - total) < 1e-6


def test_streaming_deltas_add_up_and_hold_back_stop_prefixes(tiny_llm):
    engine = tiny_llm.llm_engine
    base = tiny_llm.generate(["Hello world"], GREEDY, use_tqdm=False)[0].outputs[0].text
    stop = base[-6:-2]
    sp = GREEDY.replace(stop=[stop])
    engine.add_request("delta-1", "Hello world", sp, kind=OutputKind.DELTA)
    pieces = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            pieces.append(out.outputs[0].text)
            assert stop not in "".join(pieces)
    assert "".join(pieces) == base[:base.find(stop)]


def test_chat_and_tokenizer(tiny_llm):
    tok = tiny_llm.get_tokenizer()
    out = tiny_llm.chat([{"role": "user", "content": "hi"}], GREEDY, use_tqdm=False)[0]
    assert out.prompt_token_ids == tok.encode(
        tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True),
        add_special_tokens=False)
    outs = tiny_llm.chat([[{"role": "user", "content": "a"}], [{"role": "user", "content": "b"}]], GREEDY,
                         use_tqdm=False)
    assert len(outs) == 2


def test_skip_tokenizer_init(tiny_llama):
    from support.engines import SMALL_ENGINE
    llm = LLM(tiny_llama, skip_tokenizer_init=True, **SMALL_ENGINE)
    assert llm.get_tokenizer() is None
    out = llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=4, temperature=0),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 4 and out.text == ""


def test_chat_image_parts(tiny_llm, tiny_llama, monkeypatch):
    """LLM.chat's image parts (jaxllm/multimodal/chat_parts.py): refused by a text-only model
    naming the part; where the engine says ``supports_images``, the limit holds and the images
    reach ``generate`` as vLLM's ``multi_modal_data`` in order (the call site the vision
    engine takes them at).  The mm arguments are checked before any engine is built."""
    pngs = [data_url(encode(pattern(4, 3, seed=s), "PNG")) for s in (0, 1)]
    conv = [{"role": "user", "content": [{"type": "text", "text": "see"},
                                         *({"type": "image_url", "image_url": {"url": u}} for u in pngs)]}]
    with pytest.raises(ImageInputError, match="does not take images") as e:
        tiny_llm.chat(conv, GREEDY, use_tqdm=False)
    assert e.value.param == "messages[0].content[1].image_url"

    seen = []
    monkeypatch.setattr(tiny_llm.llm_engine, "supports_images", True, raising=False)
    monkeypatch.setattr(tiny_llm, "generate", lambda prompts, *a, **k: seen.extend(prompts))
    template = ("{% for m in messages %}{% for p in m.content %}{% if p.type == 'image' %}<image>{% else %}"
                "{{ p.text }}{% endif %}{% endfor %}{% endfor %}")
    tiny_llm.chat(conv, GREEDY, use_tqdm=False, chat_template=template)
    prompt, = seen
    assert prompt["prompt"] == "see<image><image>"
    assert [np.asarray(i).tolist() for i in prompt["multi_modal_data"]["image"]] == \
        [np.asarray(pattern(4, 3, seed=s)).tolist() for s in (0, 1)]
    monkeypatch.setattr(tiny_llm, "_image_limit", 1)
    with pytest.raises(ImageInputError, match=r"At most 1 image\(s\)") as e:
        tiny_llm.chat(conv, GREEDY, use_tqdm=False, chat_template=template)
    assert e.value.param == "messages[0].content[2].image_url"

    for kw, needle in (({"limit_mm_per_prompt": {"image": -1}}, "'image' must be a non-negative integer"),
                       ({"allowed_local_media_path": "/no/such/dir"}, "not an existing directory"),
                       ({"mm_processor_kwargs": {"max_pixels": 0}}, r"\(mm_processor_kwargs\): max_pixels must be a"),
                       # a model without Qwen3.5's image processor: refused, not ignored
                       ({"mm_processor_kwargs": {"max_pixels": 9}}, r"\(mm_processor_kwargs\) \['max_pixels'\]: "
                                                                    r".* has no image processor")):
        with pytest.raises(ValueError, match=needle):
            LLM(tiny_llama, **kw)
    with pytest.raises(ValueError, match=r"--mm-processor-kwargs .* has an image processor without min/max"):
        check_processor_kwargs_family({"min_pixels": 1}, SimpleNamespace(cfg=object()), "gemma-3")
