"""The Responses API through a real server, as the official ``openai`` client sees it: text equal
to the chat endpoint's, the stream's event order and sequence numbers, ``text.format``
json_schema, the store (retrieve, input items, delete, ``store: false``), a continued
conversation's prefix-cache hits, cancel freeing the KV, ``include`` logprobs equal to chat's,
``reasoning.effort`` refused on a template that does not read it, and fuzzed bad bodies
answered 4xx in OpenAI's shape.

One server on the tiny Llama with its own store file; compact JSON engine-wide
(``disable_any_whitespace``), since the random model would pad JSON with whitespace.
"""

from __future__ import annotations

import dataclasses
import json
import random

import httpx
import jsonschema
import openai
import pytest

pytest.register_assert_rewrite("support.serve_helpers")

from support.serve_helpers import ServerThread, assert_error_shape, make_engine, wait_until  # noqa: E402

from jaxllm.errors import EngineDeadError  # noqa: E402
from serve.responses import handler  # noqa: E402

pytest_plugins = ["support.serve_helpers"]

SCHEMA = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["color", "n"], "additionalProperties": False}


@pytest.fixture(scope="module")
def engine(tiny_llama):
    eng = make_engine(tiny_llama, precompile="auto", structured_outputs_config={"disable_any_whitespace": True})
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def server(engine, tmp_path_factory):
    from jaxllm.config import ServingConfig
    store = str(tmp_path_factory.mktemp("responses") / "store.sqlite3")
    srv = ServerThread(engine, ServingConfig(host="127.0.0.1", port=0, served_model_names=("tiny",),
                                             responses_store=store))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_text_equals_chat_and_the_store_round_trip(client):
    r = client.responses.create(model="tiny", input="Hello there", max_output_tokens=8, temperature=0)
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hello there"}],
                                          max_tokens=8, temperature=0)
    assert r.output_text == chat.choices[0].message.content
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 8 and r.usage.input_tokens == chat.usage.prompt_tokens
    # No --reasoning-parser: no reasoning tokens, and chat reports no breakdown (vLLM's rule).
    assert r.usage.output_tokens_details.reasoning_tokens == 0 and chat.usage.completion_tokens_details is None
    got = client.responses.retrieve(r.id)
    assert got.id == r.id and got.output_text == r.output_text
    items = client.responses.input_items.list(r.id)
    assert [(i.type, i.role, i.content[0].text) for i in items.data] == [("message", "user", "Hello there")]
    assert client.responses.delete(r.id) is None
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.retrieve(r.id)
    assert_error_shape(e.value.response.json(), 404, "response_id")


def test_store_false_is_not_retrievable_and_unknown_previous_is_404(client):
    r = client.responses.create(model="tiny", input="Hi", max_output_tokens=2, temperature=0, store=False)
    assert r.status == "incomplete"
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model="tiny", input="Hi", max_output_tokens=2, previous_response_id=r.id)
    assert_error_shape(e.value.response.json(), 404, "previous_response_id")


def test_previous_response_id_continues_the_conversation(client):
    first = client.responses.create(model="tiny", input="One", instructions="Be brief.", max_output_tokens=3,
                                    temperature=0)
    second = client.responses.create(model="tiny", input="Two", previous_response_id=first.id,
                                     max_output_tokens=4, temperature=0)
    chat = client.chat.completions.create(model="tiny", temperature=0, max_tokens=4, messages=[
        {"role": "user", "content": "One"}, {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "Two"}])
    assert second.output_text == chat.choices[0].message.content
    assert second.previous_response_id == first.id


def test_metadata_and_request_id_name_the_stored_response(client):
    r = client.responses.create(model="tiny", input="Hi", max_output_tokens=1, metadata={"ticket": "42"},
                                extra_body={"request_id": "resp_mine_1"})
    assert (r.id, r.metadata) == ("resp_mine_1", {"ticket": "42"})
    got = client.responses.retrieve("resp_mine_1")
    assert (got.id, got.metadata) == ("resp_mine_1", {"ticket": "42"})
    client.responses.delete("resp_mine_1")


def test_a_continued_conversation_reuses_its_kv(client, engine):
    # Long enough to fill blocks: the follow-up's prompt starts with the first turn's prompt and
    # output, whose KV the prefix cache still holds.
    block = engine.engine.core.kv_manager.block_size
    first = client.responses.create(model="tiny", input="Tell me a story about " + "a cat and a dog " * 6,
                                    max_output_tokens=20, temperature=0)
    second = client.responses.create(model="tiny", input="And then?", previous_response_id=first.id,
                                     max_output_tokens=2, temperature=0)
    # The first turn's last sampled token was never fed back, so its KV is the prompt and all
    # output tokens but the last; the cache hands back whole blocks of it.  Equal, not just > 0:
    # the history re-rendered from the store must tokenize exactly as the tokens were generated.
    reusable = (first.usage.input_tokens + first.usage.output_tokens - 1) // block * block
    assert second.usage.input_tokens_details.cached_tokens == reusable


class _FailingStream:
    """An engine stream whose next result is an engine failure (the request itself is queued
    and, on leaving the block, aborted as usual)."""

    def __init__(self, inner):
        self.inner = inner

    async def __aenter__(self):
        await self.inner.__aenter__()
        return self

    async def __aexit__(self, *exc):
        return await self.inner.__aexit__(*exc)

    def __aiter__(self):
        return self

    async def __anext__(self):
        raise EngineDeadError("injected engine failure")


def test_an_engine_error_still_closes_the_stream_with_response_failed(client, server, monkeypatch):
    real = handler.start_chat

    def failing(state, req, *images):
        ctx = real(state, req, *images)
        return dataclasses.replace(ctx, stream=_FailingStream(ctx.stream))

    monkeypatch.setattr(handler, "start_chat", failing)
    with client.responses.stream(model="tiny", input="Hi", max_output_tokens=4) as s:
        events = list(s)
    assert [e.type for e in events] == ["response.created", "response.in_progress", "response.failed"]
    assert [e.sequence_number for e in events] == [0, 1, 2]
    assert "injected engine failure" in events[-1].response.error.message
    with pytest.raises(openai.InternalServerError) as e:
        client.responses.create(model="tiny", input="Hi", max_output_tokens=4)
    assert_error_shape(e.value.response.json(), 500)
    monkeypatch.undo()
    assert client.responses.create(model="tiny", input="Hi", max_output_tokens=1).status == "incomplete"


def test_truncation_auto_drops_the_oldest_items(client):
    long = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i} " + "word " * 30}
            for i in range(12)]  # far past max_model_len (256)
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model="tiny", input=long, max_output_tokens=2, temperature=0)
    r = client.responses.create(model="tiny", input=long, max_output_tokens=2, temperature=0, truncation="auto")
    assert r.status == "incomplete" and 200 < r.usage.input_tokens <= 254


def test_stream_events_order_sequence_and_deltas(client):
    whole = client.responses.create(model="tiny", input="Tell me", max_output_tokens=10, temperature=0)
    with client.responses.stream(model="tiny", input="Tell me", max_output_tokens=10, temperature=0) as s:
        events = list(s)
    final = events[-1].response  # incomplete (max_output_tokens): the SDK's final response is completed-only
    kinds = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == final.output_text == whole.output_text
    assert events[-1].response.usage.output_tokens == 10
    assert client.responses.retrieve(final.id).output_text == deltas


def test_output_logprobs_equal_chat_logprobs_whole_and_streamed(client):
    body = dict(model="tiny", input="Tell me", max_output_tokens=6, temperature=0,
                include=["message.output_text.logprobs"], top_logprobs=3)
    r = client.responses.create(**body)
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Tell me"}],
                                          max_tokens=6, temperature=0, logprobs=True, top_logprobs=3)
    lp = r.output[0].content[0].logprobs
    want = chat.choices[0].logprobs.content
    assert [(e.token, e.logprob, e.bytes) for e in lp] == [(e.token, e.logprob, e.bytes) for e in want]
    assert [[(t.token, t.logprob) for t in e.top_logprobs] for e in lp] == \
        [[(t.token, t.logprob) for t in e.top_logprobs] for e in want]
    assert len(lp) == 6 and all(len(e.top_logprobs) == 3 for e in lp)
    with client.responses.stream(**body) as s:
        events = list(s)
    deltas = [ev for ev in events if ev.type == "response.output_text.delta"]
    assert [(e.token, e.logprob) for ev in deltas for e in ev.logprobs] == [(e.token, e.logprob) for e in lp]
    assert all(ev.logprobs for ev in deltas if ev.delta)  # a delta carries its own tokens' logprobs
    plain = client.responses.create(**{**body, "include": None, "top_logprobs": None})
    assert plain.output[0].content[0].logprobs == [] and plain.output_text == r.output_text


def test_effort_and_include_are_honoured_or_refused(client):
    """``reasoning.effort`` (and chat's ``reasoning_effort``) on a chat template that does not
    read it: a 400 naming it; an unknown ``include`` value or ``top_logprobs`` without the
    logprobs include: a 400 naming that; ``include`` values that would add nothing here are
    accepted (vLLM's)."""
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="tiny", input="Hi", reasoning={"effort": "high"}, max_output_tokens=1)
    assert_error_shape(e.value.response.json(), 400, "reasoning")
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                       reasoning_effort="high", max_tokens=1)
    assert_error_shape(e.value.response.json(), 400, "reasoning_effort")
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="tiny", input="Hi", include=["message.output_text.bogus"], max_output_tokens=1)
    assert_error_shape(e.value.response.json(), 400, "include")
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="tiny", input="Hi", top_logprobs=2, max_output_tokens=1)
    assert_error_shape(e.value.response.json(), 400, "top_logprobs")
    r = client.responses.create(model="tiny", input="Hi", max_output_tokens=1, store=False,
                                include=["reasoning.encrypted_content", "file_search_call.results",
                                         "web_search_call.action.sources", "message.input_image.image_url"])
    assert r.status == "incomplete" and r.output[0].content[0].logprobs == []


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_json_schema_validates(client, seed):
    r = client.responses.create(model="tiny", input="Give me the data.", temperature=1.0, max_output_tokens=60,
                                extra_body={"seed": seed},
                                text={"format": {"type": "json_schema", "name": "c", "schema": SCHEMA}})
    assert r.status == "completed", r
    jsonschema.validate(json.loads(r.output_text), SCHEMA)


def test_cancel_aborts_and_frees_kv(client, engine, server):
    kv = engine.engine.core.kv_manager
    wait_until(lambda: kv.num_free_blocks == kv.num_blocks, what="blocks held before the test")
    body = {"model": "tiny", "input": "word " * 40, "max_output_tokens": 200, "temperature": 0, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", server.base + "/v1/responses", json=body, timeout=30) as r:
        events = []
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
                if len(events) == 5:
                    assert kv.num_free_blocks < kv.num_blocks  # it holds blocks now
                    got = client.responses.cancel(events[0]["response"]["id"])
                    assert got.status == "cancelled"
    assert events[-1]["type"] == "response.incomplete" and events[-1]["response"]["status"] == "cancelled"
    assert events[-1]["response"]["usage"]["output_tokens"] < 200
    wait_until(lambda: kv.num_free_blocks == kv.num_blocks, timeout=5.0, what="KV blocks to return")
    with pytest.raises(openai.BadRequestError):  # no longer in flight
        client.responses.cancel(events[0]["response"]["id"])


def test_background_response_is_cancelled(client, engine):
    kv = engine.engine.core.kv_manager
    r = client.responses.create(model="tiny", input="word " * 30, max_output_tokens=200, background=True,
                                extra_body={"ignore_eos": True})
    assert r.status == "in_progress"
    wait_until(lambda: kv.num_free_blocks < kv.num_blocks, timeout=10, what="the background response to run")
    assert client.responses.cancel(r.id).status == "cancelled"
    assert client.responses.retrieve(r.id).status == "cancelled"
    wait_until(lambda: kv.num_free_blocks == kv.num_blocks, timeout=5.0, what="KV blocks to return")


def _bad_bodies(n: int, seed: int = 0):
    """Bodies each wrong in one to three (seeded, random) ways; every one must be refused with a 4xx."""
    rng = random.Random(seed)
    wrong = {
        "input": [5, 3.5, True, {"x": 1}, [5], [None], [{"type": "nope"}], [{"role": "robot", "content": "x"}],
                  [{"type": "message"}], [{"type": "function_call", "name": "f"}], [{"role": "user", "content": 3}],
                  [{"type": "function_call_output", "output": "x"}], [{"type": "reasoning", "summary": "s"}],
                  [{"role": "user", "content": [{"type": "image", "url": "x"}]}], "", []],
        "max_output_tokens": [0, -5, "ten", 1.5, 2 ** 64, True, [], {}],
        "temperature": [-1, 3, "hot", [], {}, True, 2.5],
        "top_p": [0, 1.5, "x", -0.1, [], True],
        "tool_choice": ["sometimes", {"type": "function"}, 7, None, {"type": "function", "name": "absent"}, []],
        "tools": ["x", 5, [{}], [{"type": "function"}], [{"type": "function", "name": ""}], [5], [None],
                  [{"type": "function", "name": "f", "parameters": 3}], {"a": 1}],
        "text": ["json", 3, {"format": {"type": "xml"}}, {"format": {"type": "json_schema"}}, {"format": 3},
                 {"format": {"type": "json_schema", "name": "x", "schema": {"type": "strin"}}}],
        "metadata": ["m", 3, [], {"k": 1}, {str(i): "v" for i in range(17)}],
        "truncation": ["sometimes", 1, None, True],
        "store": ["yes", 1, None, []],
        "stream": ["yes", 2, [], {}],
        "background": ["yes", 1],
        "previous_response_id": ["", 5, [], "resp_does_not_exist"],
        "reasoning": ["deep", 3, {"effort": "extreme"}, {"summary": 3}, [1]],
        "model": ["no-such-model", 3, [], True],
        "include": ["x", [1], 3, {}, ["message.output_text.bogus"]],
        "top_logprobs": [-1, 21, "x", 1.5, True],
        "parallel_tool_calls": ["no", 1, None, []],
        "instructions": [3, ["a"], {}, True],
        "seed": ["s", 1.5, 2 ** 70],
    }
    names = sorted(wrong)
    raw = [b"", b"{", b"[1, 2]", b"null", b'"s"', b'{"input": NaN}', b"\xff\xfe", b'{"input": "a"', b"1e999"]
    out = []
    for _ in range(n):
        if rng.random() < 0.06:
            out.append(rng.choice(raw))
            continue
        body = {"model": "tiny", "input": "hi", "max_output_tokens": 1}
        for name in rng.sample(names, rng.randint(1, 3)):
            body[name] = rng.choice(wrong[name])
        out.append(body)
    return out


def test_fuzzed_bodies_are_4xx_in_openai_shape(server):
    bodies = _bad_bodies(320)
    with httpx.Client(base_url=server.base, timeout=30) as http:
        for body in bodies:
            if isinstance(body, bytes):
                r = http.post("/v1/responses", content=body, headers={"Content-Type": "application/json"})
            else:
                r = http.post("/v1/responses", json=body)
            assert 400 <= r.status_code < 500, (body, r.status_code, r.text[:300])
            assert_error_shape(r.json(), r.status_code)
        assert http.get("/health").status_code == 200
        for path in ("/v1/responses/nope", "/v1/responses/nope/input_items"):
            assert_error_shape(http.get(path).json(), 404, "response_id")
        assert_error_shape(http.delete("/v1/responses/nope").json(), 404, "response_id")
        assert_error_shape(http.post("/v1/responses/nope/cancel").json(), 404, "response_id")
