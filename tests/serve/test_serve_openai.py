"""The server as the official ``openai`` client sees it: sync and async, streaming and not.

Also: 64 concurrent greedy streams each equal the same request sent alone (no token lost
or duplicated), n > 1, logprobs, echo, usage options, and the small endpoints.
"""

from __future__ import annotations

import asyncio
import threading

import httpx
import openai
import pytest

pytest.register_assert_rewrite("support.serve_helpers")  # before its import, so its asserts show values

from support.serve_helpers import parse_sse  # noqa: E402

# The shared engine and server fixtures (serve_engine, server, http, idle_engine).
pytest_plugins = ["support.serve_helpers"]

GREEDY = dict(temperature=0, extra_body={"ignore_eos": True})


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture
def aclient_factory(server):
    return lambda: openai.AsyncOpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_models_version_health(client, http):
    ids = [m.id for m in client.models.list().data]
    assert ids == ["tiny", "tiny-alias"]
    assert http.get("/version").json()["version"]
    assert http.get("/health").status_code == 200


def test_completion_sync_stream_equals_non_stream(client):
    full = client.completions.create(model="tiny", prompt="The capital of France is", max_tokens=12, **GREEDY)
    choice = full.choices[0]
    assert full.object == "text_completion" and full.model == "tiny"
    assert choice.finish_reason == "length" and full.usage.completion_tokens == 12
    assert full.usage.total_tokens == full.usage.prompt_tokens + 12
    chunks = list(client.completions.create(model="tiny", prompt="The capital of France is", max_tokens=12,
                                            stream=True, stream_options={"include_usage": True}, **GREEDY))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    body = chunks[:-1]
    assert all(c.choices[0].text for c in body[:-1]), "an empty delta was sent"
    assert "".join(c.choices[0].text for c in body) == choice.text
    assert [c.choices[0].finish_reason for c in body] == [None] * (len(body) - 1) + ["length"]


def test_chat_sync_stream_equals_non_stream(client):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a color."}]
    full = client.chat.completions.create(model="tiny-alias", messages=msgs, max_completion_tokens=10, **GREEDY)
    assert full.model == "tiny" and full.object == "chat.completion"
    msg = full.choices[0].message
    assert msg.role == "assistant" and full.choices[0].finish_reason == "length"
    stream = client.chat.completions.create(model="tiny", messages=msgs, max_completion_tokens=10, stream=True,
                                            stream_options={"include_usage": True, "continuous_usage_stats": True},
                                            **GREEDY)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content == ""
    content = chunks[1:-1]
    assert "".join(c.choices[0].delta.content or "" for c in content) == msg.content
    # continuous_usage_stats: every chunk counts the tokens so far; the last one has no choices.
    counts = [c.usage.completion_tokens for c in chunks[:-1]]
    assert counts == sorted(counts) and counts[-1] == 10
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_async_client_stream_and_non_stream(aclient_factory):
    async def run():
        async with aclient_factory() as ac:
            full = await ac.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                                    max_tokens=8, **GREEDY)
            pieces = []
            async for ch in await ac.chat.completions.create(
                    model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=8, stream=True, **GREEDY):
                pieces.append(ch.choices[0].delta.content or "")
            return full, pieces

    full, pieces = asyncio.run(run())
    assert "".join(pieces) == full.choices[0].message.content


def test_n_and_seed(client):
    kw = dict(model="tiny", prompt="Once upon a time", max_tokens=8, temperature=1.0, seed=7, n=3,
              extra_body={"ignore_eos": True})
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert len({c.text for c in a.choices}) == 3
    assert a.usage.completion_tokens == 24
    streamed = ["", "", ""]
    for ch in client.completions.create(stream=True, **kw):
        for c in ch.choices:
            streamed[c.index] += c.text
    assert streamed == [c.text for c in a.choices]


def test_completion_logprobs_and_echo(client):
    r = client.completions.create(model="tiny", prompt="Hello there", max_tokens=5, logprobs=3, **GREEDY)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]
    for tok, tlp, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert tlp <= 0 and tok in top and len(top) <= 4
        assert tlp == pytest.approx(max(top.values()))  # greedy: the sampled token is the most likely
    streamed = list(client.completions.create(model="tiny", prompt="Hello there", max_tokens=5, logprobs=3,
                                              stream=True, **GREEDY))
    slp = [c.choices[0].logprobs for c in streamed]
    assert sum((x.tokens for x in slp), []) == lp.tokens
    assert sum((x.token_logprobs for x in slp), []) == lp.token_logprobs
    assert sum((x.top_logprobs for x in slp), []) == lp.top_logprobs
    assert sum((x.text_offset for x in slp), []) == lp.text_offset
    e = client.completions.create(model="tiny", prompt="Hello there", max_tokens=5, echo=True, **GREEDY)
    assert e.choices[0].text == "Hello there" + r.choices[0].text
    es = list(client.completions.create(model="tiny", prompt="Hello there", max_tokens=5, echo=True, stream=True,
                                        **GREEDY))
    assert es[0].choices[0].text.startswith("Hello there") and len(es[0].choices[0].text) > len("Hello there")
    assert "".join(c.choices[0].text for c in es) == e.choices[0].text


def test_chat_logprobs(client):
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                       logprobs=True, top_logprobs=3, **GREEDY)
    content = r.choices[0].logprobs.content
    assert len(content) == 4
    assert "".join(c.token for c in content) == r.choices[0].message.content
    streamed = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                              max_tokens=4, logprobs=True, top_logprobs=3, stream=True, **GREEDY)
    streamed_content = sum((ch.choices[0].logprobs.content for ch in streamed if ch.choices[0].logprobs), [])
    assert [c.model_dump() for c in streamed_content] == [c.model_dump() for c in content]
    for c in content:
        assert len(c.top_logprobs) == 3
        lps = [t.logprob for t in c.top_logprobs]
        assert lps == sorted(lps, reverse=True)
        assert c.top_logprobs[0].token == c.token and c.logprob == pytest.approx(lps[0])
        assert bytes(c.bytes).decode() == c.token


def test_stop_token_ids_and_stop_reason(client):
    base = client.completions.create(model="tiny", prompt="One two", max_tokens=10,
                                     extra_body={"ignore_eos": True, "return_token_ids": True}, temperature=0)
    ids = base.choices[0].token_ids
    stop_id = ids[4]
    first = ids.index(stop_id)
    r = client.completions.create(model="tiny", prompt="One two", max_tokens=10, temperature=0,
                                  extra_body={"ignore_eos": True, "stop_token_ids": [stop_id],
                                              "return_token_ids": True})
    assert r.choices[0].finish_reason == "stop" and r.choices[0].stop_reason == stop_id
    assert r.choices[0].token_ids == ids[:first + 1]


def test_tokenize_detokenize_round_trip(http):
    t = http.post("/tokenize", json={"model": "tiny", "prompt": "Hello world", "return_token_strs": True}).json()
    assert t["count"] == len(t["tokens"]) == len(t["token_strs"]) and t["max_model_len"] == 256
    assert http.post("/detokenize", json={"tokens": t["tokens"]}).json() == {"prompt": "Hello world"}
    chat = http.post("/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]}).json()
    full = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                   "max_tokens": 1}).json()
    assert chat["count"] == full["usage"]["prompt_tokens"]


def test_metrics_count_what_was_served(http):
    def sample(text, name):
        for line in text.splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                return float(line.rsplit(" ", 1)[1])
        raise AssertionError(f"{name} missing")

    before = http.get("/metrics").text
    r = http.post("/v1/completions", json={"prompt": "Count me", "max_tokens": 7, "ignore_eos": True}).json()
    after = http.get("/metrics").text
    assert sample(after, "jaxllm:generation_tokens_total") - sample(before, "jaxllm:generation_tokens_total") == 7
    assert (sample(after, "jaxllm:prompt_tokens_total") - sample(before, "jaxllm:prompt_tokens_total")
            == r["usage"]["prompt_tokens"])
    for h in ("jaxllm:time_to_first_token_seconds", "jaxllm:e2e_request_latency_seconds",
              "jaxllm:request_queue_time_seconds"):
        assert sample(after, h + "_count") == sample(before, h + "_count") + 1
    assert sample(after, "jaxllm:inter_token_latency_seconds_count") >= sample(
        before, "jaxllm:inter_token_latency_seconds_count") + 6
    for g in ("jaxllm:num_requests_running", "jaxllm:num_requests_waiting", "jaxllm:kv_cache_usage_perc"):
        assert sample(after, g) == 0


def test_64_concurrent_streams_equal_solo_runs(server, aclient_factory, idle_engine):
    """Every stream's tokens, concatenated, equal the same request's tokens when it ran alone."""
    prompts = [f"Request {i}: " + "tell me something " * (i % 7) for i in range(64)]
    lengths = [8 + (i * 5) % 17 for i in range(64)]
    extra = {"ignore_eos": True, "return_token_ids": True}

    solo = []
    with httpx.Client(base_url=server.base, timeout=60) as c:
        for p, n in zip(prompts, lengths):
            r = c.post("/v1/completions", json={"prompt": p, "max_tokens": n, "temperature": 0, **extra}).json()
            solo.append((r["choices"][0]["token_ids"], r["choices"][0]["text"]))

    async def one(ac, p, n):
        ids, text, finish, usage = [], "", None, None
        stream = await ac.completions.create(model="tiny", prompt=p, max_tokens=n, temperature=0, stream=True,
                                             stream_options={"include_usage": True}, extra_body=extra)
        async for ch in stream:
            if ch.choices:
                ids += ch.choices[0].token_ids
                text += ch.choices[0].text
                finish = ch.choices[0].finish_reason or finish
            else:
                usage = ch.usage
        return ids, text, finish, usage

    async def run():
        async with aclient_factory() as ac:
            return await asyncio.gather(*(one(ac, p, n) for p, n in zip(prompts, lengths)))

    # Precondition: the streams really were batched together and queued behind each other.
    peak = {"running": 0, "waiting": 0}
    done = threading.Event()

    def watch():
        while not done.wait(0.005):
            s = idle_engine.stats()
            peak["running"] = max(peak["running"], s.num_running)
            peak["waiting"] = max(peak["waiting"], s.num_waiting)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        results = asyncio.run(run())
    finally:
        done.set()
        watcher.join()
    assert peak["running"] >= 8 and peak["waiting"] > 0, peak
    for i, ((ids, text, finish, usage), (solo_ids, solo_text)) in enumerate(zip(results, solo)):
        assert len(ids) == lengths[i] == usage.completion_tokens, f"request {i}: tokens lost or duplicated"
        assert ids == solo_ids, f"request {i} differs from its solo run"
        assert text == solo_text and finish == "length"


def test_raw_sse_framing(http):
    """Every event is exactly ``data: <json>\\n\\n`` and the stream ends with ``data: [DONE]\\n\\n``."""
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3,
                                                "stream": True})
    assert r.headers["content-type"].startswith("text/event-stream")
    assert r.text.endswith("data: [DONE]\n\n")
    blocks = r.text.split("\n\n")[:-1]
    assert all(b.startswith("data: ") and "\n" not in b for b in blocks)
    events = parse_sse(r.text)
    ids = {e["id"] for e in events[:-1]}
    assert len(ids) == 1 and next(iter(ids)).startswith("chatcmpl-")
    assert all(e["object"] == "chat.completion.chunk" for e in events[:-1])


def test_prompt_logprobs_and_echo_with_logprobs(http):
    r = http.post("/v1/completions", json={"prompt": "Hello world again", "max_tokens": 2, "temperature": 0,
                                          "prompt_logprobs": 1}).json()
    plp = r["choices"][0]["prompt_logprobs"]
    assert len(plp) == r["usage"]["prompt_tokens"] and plp[0] is None
    assert all(1 <= len(step) <= 2 and all(v["logprob"] <= 0 for v in step.values()) for step in plp[1:])
    e = http.post("/v1/completions", json={"prompt": "Hello world again", "max_tokens": 2, "temperature": 0,
                                          "echo": True, "logprobs": 1}).json()
    lp = e["choices"][0]["logprobs"]
    n_prompt = e["usage"]["prompt_tokens"]
    assert len(lp["tokens"]) == n_prompt + 2 and "".join(lp["tokens"]) == e["choices"][0]["text"]
    assert lp["token_logprobs"][0] is None and all(v is not None for v in lp["token_logprobs"][1:])
    # The echoed prompt's logprobs are the prompt_logprobs of the same prompt.
    ids = http.post("/tokenize", json={"prompt": "Hello world again"}).json()["tokens"]
    assert lp["token_logprobs"][1:n_prompt] == [plp[i][str(t)]["logprob"] for i, t in enumerate(ids) if i > 0]
    chat = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                   "max_tokens": 1, "prompt_logprobs": 0}).json()
    assert len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]
