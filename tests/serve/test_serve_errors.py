"""Every way a request can be wrong gets a 4xx in OpenAI's error shape, naming the parameter.

Includes a fuzz test: at least 500 malformed, mistyped or out-of-range bodies, none of
which may produce a 5xx or hurt the server, which must then serve a normal request.
"""

from __future__ import annotations

import json
import socket
import time

import httpx
import openai
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

pytest.register_assert_rewrite("support.serve_helpers")  # before its import, so its asserts show values

from support.serve_helpers import ServerThread, assert_error_shape  # noqa: E402

from jaxllm.config import ServingConfig  # noqa: E402

# The shared engine and server fixtures (serve_engine, server, http, idle_engine).
pytest_plugins = ["support.serve_helpers"]

CHAT = "/v1/chat/completions"
COMPL = "/v1/completions"
MSGS = [{"role": "user", "content": "Hi"}]


def _post(http, path, body):
    return http.post(path, content=body if isinstance(body, (bytes, str)) else json.dumps(body))


@pytest.mark.parametrize("path, body, param", [
    (COMPL, {"prompt": "x", "temperature": -0.5}, "temperature"),
    (COMPL, {"prompt": "x", "top_p": 0}, "top_p"),
    (COMPL, {"prompt": "x", "top_p": 1.5}, "top_p"),
    (COMPL, {"prompt": "x", "top_k": -2}, "top_k"),
    (COMPL, {"prompt": "x", "min_p": 1.5}, "min_p"),
    (COMPL, {"prompt": "x", "n": 0}, "n"),
    (COMPL, {"prompt": "x", "n": 129}, "n"),
    (COMPL, {"prompt": "x", "max_tokens": 0}, "max_tokens"),
    (COMPL, {"prompt": "x", "max_tokens": -3}, "max_tokens"),
    (COMPL, {"prompt": "x", "presence_penalty": 2.5}, "presence_penalty"),
    (COMPL, {"prompt": "x", "frequency_penalty": -3}, "frequency_penalty"),
    (COMPL, {"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
    (COMPL, {"prompt": "x", "seed": 2**64}, "seed"),
    (COMPL, {"prompt": "x", "min_tokens": 20, "max_tokens": 10}, "min_tokens"),
    (COMPL, {"prompt": "x", "stop": [""]}, "stop"),
    (COMPL, {"prompt": "x", "stop_token_ids": [49152]}, "stop_token_ids"),
    (COMPL, {"prompt": "x", "logprobs": 21}, "logprobs"),
    (COMPL, {"prompt": "x", "logprobs": -1}, "logprobs"),
    (COMPL, {"prompt": [5, 49152]}, "prompt"),
    (COMPL, {"prompt": []}, "prompt"),
    (COMPL, {"prompt": ""}, "prompt"),
    (COMPL, {"prompt": "x", "suffix": "y"}, "suffix"),
    (COMPL, {"prompt": "x", "best_of": 3}, "best_of"),
    (COMPL, {"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    (COMPL, {"prompt": "x", "stream": False, "stream_options": {"include_usage": True}}, "stream_options"),
    (COMPL, {"prompt": "x", "logit_bias": {"abc": 1}}, "logit_bias"),
    (COMPL, {"prompt": "x", "temperature": "hot"}, "temperature"),
    (COMPL, {"prompt": "x", "n": 2.0}, "n"),
    (COMPL, {"prompt": "x", "stream": "yes"}, "stream"),
    (COMPL, {"temperature": 0}, "prompt"),
    (CHAT, {"messages": MSGS, "max_completion_tokens": 0}, "max_completion_tokens"),
    (CHAT, {"messages": MSGS, "max_tokens": 0}, "max_tokens"),
    (CHAT, {"messages": MSGS, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    (CHAT, {"messages": MSGS, "top_logprobs": 2}, "top_logprobs"),
    (CHAT, {"messages": MSGS, "stream_options": {"include_usage": True}}, "stream_options"),
    (CHAT, {"messages": []}, "messages"),
    (CHAT, {"messages": [{"content": "no role"}]}, "messages"),
    # A text-only model: the image part is named (tests/serve/test_image_parts.py has the rest).
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content[0].image_url"),
    (CHAT, {"messages": MSGS, "tool_choice": "auto", "tools": []}, "tool_choice"),
    (CHAT, {"messages": MSGS, "response_format": {"type": "yaml"}}, "response_format"),
    (CHAT, {"messages": MSGS, "continue_final_message": True}, "continue_final_message"),
    (CHAT, {"messages": MSGS, "chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs"),
    (CHAT, {"messages": MSGS, "chat_template": "{% for %}"}, "chat_template"),
    (CHAT, {"messages": MSGS, "n": 2, "temperature": 0}, "n"),
])
def test_bad_parameters_are_400s_naming_the_parameter(http, path, body, param):
    r = _post(http, path, body)
    assert r.status_code == 400, r.text
    assert_error_shape(r.json(), 400, param)


@pytest.mark.parametrize("raw", [b"", b"{", b"not json", b"[]", b"1", b'"prompt"', b"null", b'{"prompt": NaN}',
                                 b'{"prompt": "x", "temperature": Infinity}', b"\xff\xfe"])
def test_malformed_bodies_are_400s(http, raw):
    for path in (COMPL, CHAT, "/tokenize", "/detokenize"):
        r = _post(http, path, raw)
        assert r.status_code == 400, (path, raw, r.text)
        assert_error_shape(r.json(), 400)


def test_unknown_model_is_404_and_aliases_work(http):
    for path, body in ((COMPL, {"prompt": "x"}), (CHAT, {"messages": MSGS}), ("/tokenize", {"prompt": "x"}),
                       ("/detokenize", {"tokens": [1]})):
        r = _post(http, path, {**body, "model": "gpt-4"})
        assert r.status_code == 404
        err = assert_error_shape(r.json(), 404, "model")
        assert "gpt-4" in err["message"]
    r = _post(http, COMPL, {"prompt": "x", "model": "tiny-alias", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["model"] == "tiny"


def test_embeddings_on_a_generation_server_is_404_naming_the_runner(http):
    """vLLM answers 404 where the model does not embed or score; the message says how to serve one that does."""
    for path, body, name in (("/v1/embeddings", {"input": "x"}, "/v1/embeddings"),
                             ("/score", {"text_1": "a", "text_2": "b"}, "/score"),
                             ("/pooling", {"input": "x"}, "/pooling"), ("/classify", {"input": "x"}, "/classify"),
                             ("/v2/rerank", {"query": "a", "documents": ["b"]}, "/rerank")):
        r = _post(http, path, body)
        assert r.status_code == 404
        err = assert_error_shape(r.json(), 404)
        assert f"{name} needs a pooling model" in err["message"] and "--runner pooling" in err["message"]


def test_prompt_at_or_over_the_context_length_is_400(http):
    for n in (256, 300):
        r = _post(http, COMPL, {"prompt": [5] * n, "max_tokens": 1})
        assert r.status_code == 400
        err = assert_error_shape(r.json(), 400, "prompt")
        assert "256" in err["message"] and str(n) in err["message"]
    r = _post(http, CHAT, {"messages": [{"role": "user", "content": "word " * 300}]})
    assert r.status_code == 400
    assert_error_shape(r.json(), 400, "messages")


def test_max_tokens_beyond_the_context_is_clamped(http):
    r = _post(http, COMPL, {"prompt": [5] * 250, "max_tokens": 1000, "ignore_eos": True, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 6
    assert r.json()["choices"][0]["finish_reason"] == "length"
    r = _post(http, COMPL, {"prompt": [5] * 255, "ignore_eos": True})  # default max_tokens 16
    assert r.json()["usage"]["completion_tokens"] == 1


SAMPLER_FIELDS = [
    ("presence_penalty", 0.5, 0.5), ("frequency_penalty", 0.5, 0.5), ("repetition_penalty", 1.2, 1.2),
    ("logit_bias", {"5": 3.0}, {5: 3.0}), ("allowed_token_ids", [5, 6, 7], [5, 6, 7]),
    ("bad_words", ["the"], ["the"]), ("prompt_logprobs", 1, 1), ("min_tokens", 2, 2)]


@pytest.mark.parametrize("name, value, expect", SAMPLER_FIELDS)
def test_sampler_parameters_reach_the_engine(http, name, value, expect):
    """Each sampler field of a request body becomes the same SamplingParams field (completions and
    chat), and a request using it is served."""
    from serve.protocol import ChatCompletionRequest, CompletionRequest
    comp = CompletionRequest.model_validate({"prompt": "Hello", name: value})
    chat = ChatCompletionRequest.model_validate({"messages": MSGS, name: value})
    for req in (comp, chat):
        assert getattr(req.to_sampling_params(8, {}, 49152), name) == expect
    r = _post(http, COMPL, {"prompt": "Hello", "max_tokens": 2, name: value})
    assert r.status_code == 200, r.text


def test_logit_bias_over_http_forces_the_token(http):
    """The clamped +100 bias reaches the device sampler: every greedy token is the biased one."""
    r = _post(http, COMPL, {"prompt": "Hello", "max_tokens": 4, "temperature": 0, "ignore_eos": True,
                            "logit_bias": {"1000": 500}, "return_token_ids": True})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["token_ids"] == [1000] * 4


def test_huge_but_valid_values_are_served(http, serve_engine):
    """Integers that are valid but would overflow a device array must not reach the runner raw."""
    r = _post(http, COMPL, {"prompt": "Hi", "max_tokens": 2**62, "top_k": 2**62, "seed": -(2**63),
                            "priority": 2**62, "temperature": 1e30, "stop_token_ids": [49151]})
    assert r.status_code == 200, r.text
    r = _post(http, CHAT, {"messages": MSGS, "max_completion_tokens": 3, "top_k": 49152, "seed": 2**63 - 1,
                           "n": 128})
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 128
    assert serve_engine.error is None and http.get("/health").status_code == 200


def test_unknown_routes_and_methods_use_the_error_shape(http):
    r = http.get("/v1/nothing")
    assert r.status_code == 404
    assert_error_shape(r.json(), 404)
    r = http.get("/v1/completions")
    assert r.status_code == 405
    assert_error_shape(r.json(), 405)


def _read_one_response(sock) -> tuple[int, bytes]:
    """One HTTP/1.1 response with a Content-Length body, leaving the connection open."""
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = sock.recv(4096)
        assert chunk, "the server closed the connection"
        buf += chunk
    head, _, rest = buf.partition(b"\r\n\r\n")
    lines = head.decode("latin1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
    length = int(headers["content-length"])
    while len(rest) < length:
        chunk = sock.recv(4096)
        assert chunk, "the server closed the connection"
        rest += chunk
    return int(lines[0].split(" ")[1]), rest[:length]


def test_api_key(serve_engine):
    srv = ServerThread(serve_engine, ServingConfig(port=0, api_key="s3cret"))
    try:
        with httpx.Client(base_url=srv.base, timeout=30) as c:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"},
                            {"Authorization": "Basic s3cret"}):
                for method, path in (("GET", "/v1/models"), ("POST", COMPL), ("POST", CHAT)):
                    r = c.request(method, path, headers=headers, json={"prompt": "x", "messages": MSGS})
                    assert r.status_code == 401, (headers, path)
                    assert_error_shape(r.json(), 401)
            ok = {"Authorization": "Bearer s3cret"}
            assert c.get("/v1/models", headers=ok).status_code == 200
            # Health, metrics and the rest stay open.
            assert c.get("/health").status_code == 200
            assert c.get("/metrics").status_code == 200
            assert c.get("/version").status_code == 200
        # A 401 sent before a slow body arrived must not cost the client its keep-alive connection.
        with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as sock:
            body = b'{"prompt": "x"}'
            sock.sendall(f"POST {COMPL} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         f"Content-Length: {len(body)}\r\n\r\n".encode())
            time.sleep(0.3)
            sock.sendall(body)
            status, _ = _read_one_response(sock)
            assert status == 401
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            status, _ = _read_one_response(sock)
            assert status == 200
        good = openai.OpenAI(base_url=srv.base + "/v1", api_key="s3cret", max_retries=0)
        assert good.completions.create(model=serve_engine.model_name, prompt="x", max_tokens=2).choices
        bad = openai.OpenAI(base_url=srv.base + "/v1", api_key="nope", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
    finally:
        assert srv.stop()


# ---------------------------------------------------------------------------- fuzzing

# Each field maps to a tuple of strategies ("branches"), every one of which only yields values
# that are invalid for that field: a wrong type, an out-of-range number, a semantic mistake.
_TEXT = st.text(max_size=5)
_WRONG_TYPE = (_TEXT, st.lists(st.integers(), max_size=2), st.dictionaries(_TEXT, st.integers(), max_size=2),
               st.booleans())
_NOT_INT = _WRONG_TYPE + (st.floats(allow_nan=False, allow_infinity=False).filter(lambda f: f != int(f)),
                          st.just(1.0))
_NOT_BOOL = (st.integers(), _TEXT, st.just(1.0), st.lists(st.booleans(), min_size=1, max_size=2))
_HUGE = st.integers(min_value=2**63, max_value=2**80) | st.integers(min_value=-(2**80), max_value=-(2**63) - 1)


def _floats(**kw):
    return st.floats(allow_nan=False, allow_infinity=False, **kw)


_BAD_COMMON = {
    "model": (st.integers(), st.just("not-a-served-model"), st.lists(_TEXT, max_size=2)),
    "n": _NOT_INT + (st.integers(max_value=0), st.integers(min_value=129, max_value=10**9), _HUGE),
    "temperature": _WRONG_TYPE + (_floats(max_value=-1e-3),),
    "top_p": _WRONG_TYPE + (_floats(max_value=0.0), _floats(min_value=1.001)),
    "top_k": _NOT_INT + (st.integers(max_value=-2), _HUGE),
    "min_p": _WRONG_TYPE + (_floats(min_value=1.001), _floats(max_value=-0.001)),
    "presence_penalty": _WRONG_TYPE + (_floats(min_value=2.001),),
    "frequency_penalty": _WRONG_TYPE + (_floats(max_value=-2.001),),
    "repetition_penalty": _WRONG_TYPE + (_floats(max_value=0.0),),
    "seed": _NOT_INT + (_HUGE,),
    "stop": (st.integers(), st.lists(st.integers(), min_size=1, max_size=3), st.just([""]),
             st.dictionaries(_TEXT, _TEXT, min_size=1, max_size=2)),
    "stop_token_ids": (st.integers(), _TEXT, st.lists(st.integers(49152, 2**40), min_size=1, max_size=3),
                       st.lists(st.integers(max_value=-1), min_size=1, max_size=3)),
    "ignore_eos": _NOT_BOOL,
    "min_tokens": _NOT_INT + (st.integers(max_value=-1), _HUGE, st.integers(3, 10**6)),  # > max_tokens (2)
    "logit_bias": (st.integers(), st.lists(st.integers(), max_size=2),
                   # keys int() cannot read; values that are not numbers
                   st.dictionaries(st.text(alphabet="abcxyz", min_size=1, max_size=3), _floats(), min_size=1,
                                   max_size=2),
                   st.dictionaries(st.integers(0, 100).map(str), _TEXT, min_size=1, max_size=2)),
    "allowed_token_ids": (st.just([]), st.integers(), st.lists(st.integers(max_value=-1), min_size=1, max_size=2)),
    "stream": _NOT_BOOL,
    # Well-formed stream_options are still a 400 without stream (the generator keeps stream off).
    "stream_options": (st.integers(), _TEXT, st.lists(st.booleans(), max_size=2),
                       st.fixed_dictionaries({"include_usage": st.integers()}),
                       st.fixed_dictionaries({"include_usage": st.booleans()}),
                       st.fixed_dictionaries({}, optional={"continuous_usage_stats": st.booleans()})),
    "priority": _NOT_INT + (_HUGE,),
    "skip_special_tokens": _NOT_BOOL,
    "user": (st.integers(), st.lists(_TEXT, max_size=2)),
}
_BAD_COMPLETION = {
    **_BAD_COMMON,
    "prompt": (st.integers(), st.just([]), st.just(""), st.booleans(), st.none(),
               st.lists(st.integers(49152, 2**40), min_size=1, max_size=3),
               st.lists(st.integers(max_value=-1), min_size=1, max_size=3),
               st.tuples(st.integers(0, 100), _TEXT).map(list),  # token ids and text mixed
               st.integers(256, 400).map(lambda n: [5] * n)),  # at or over the context length
    "max_tokens": _NOT_INT + (st.integers(max_value=0), _HUGE),
    "logprobs": _NOT_INT + (st.integers(21, 10**6), st.integers(max_value=-1)),
    "echo": _NOT_BOOL,
    "suffix": (_TEXT,),
    "best_of": (st.integers(2, 10), _TEXT),
}
_BAD_CHAT = {
    **_BAD_COMMON,
    "messages": (st.just([]), st.none(), _TEXT, st.integers(),
                 st.lists(st.fixed_dictionaries({"content": _TEXT}), min_size=1, max_size=2),
                 st.lists(st.fixed_dictionaries({"role": st.integers(), "content": _TEXT}), min_size=1, max_size=2),
                 st.lists(st.fixed_dictionaries({"role": st.just("user"), "content": st.integers()}), min_size=1,
                          max_size=2),
                 st.lists(st.fixed_dictionaries({"role": st.just("user"), "content": st.lists(
                     st.fixed_dictionaries({"type": st.just("image_url"), "image_url": st.just({"url": "x"})}),
                     min_size=1, max_size=1)}), min_size=1, max_size=1),
                 st.integers(300, 400).map(lambda n: [{"role": "user", "content": "word " * n}])),
    "max_tokens": _NOT_INT + (st.integers(max_value=0), _HUGE),
    "max_completion_tokens": _NOT_INT + (st.integers(max_value=0), _HUGE),
    "logprobs": _NOT_BOOL,
    "top_logprobs": _NOT_INT + (st.integers(max_value=-1), st.integers(21, 10**6)),
    "tool_choice": (st.sampled_from(["auto", "required", {"type": "function", "function": {"name": "f"}}]),),
    "response_format": (st.sampled_from([{"type": "yaml"}, {"type": "json_schema"}]), st.integers()),
    "chat_template_kwargs": (st.integers(), _TEXT, st.sampled_from([{"tokenize": True}, {"conversation": []}])),
    "chat_template": (st.integers(), st.just("{% for %}"), st.just("{{ 1 + }}")),
    "add_generation_prompt": _NOT_BOOL,
    "continue_final_message": (st.just(True), st.integers()),  # True clashes with add_generation_prompt
}
_BAD = {COMPL: _BAD_COMPLETION, CHAT: _BAD_CHAT}
_BASE = {COMPL: {"prompt": "Hello", "max_tokens": 2}, CHAT: {"messages": MSGS, "max_tokens": 2}}
_GARBAGE = (st.binary(max_size=40), st.text(max_size=40).filter(lambda t: not t.strip().startswith("{")),
            st.sampled_from([b'{"prompt": "x",', b'{"messages": [{"role": "user", "content": "x"}', b"[]", b"null",
                             b"{}", b'{"prompt": "x", "temperature": NaN}', b'{"prompt": "x", "n": Infinity}',
                             b'{"messages": "\\ud800"}', b'{"prompt": "x"} trailing']))
# Every (endpoint, field, branch) once per sweep, so no check goes untested by chance.
_CASES = [(path, field, i) for path, bad in _BAD.items() for field in sorted(bad) for i in range(len(bad[field]))]


def _body(draw, path: str, corrupt: list[tuple[str, int]]) -> bytes:
    body = dict(_BASE[path])
    for field, branch in corrupt:
        body[field] = draw(_BAD[path][field][branch])
    if draw(st.booleans()) and not any(f in ("stream", "stream_options") for f, _ in corrupt):
        body["stream"] = True  # a stream request must be refused before any frame, too
    return json.dumps(body).encode()


def test_fuzz_malformed_bodies_get_4xx_and_the_server_stays_healthy(server, serve_engine):
    sent = []
    with httpx.Client(base_url=server.base, timeout=30) as c:
        def send(path, raw):
            r = c.post(path, content=raw, headers={"Content-Type": "application/json"})
            assert 400 <= r.status_code < 500, (path, raw, r.status_code, r.text)
            err = assert_error_shape(r.json(), r.status_code)
            sent.append((path, raw, r.status_code, err["param"]))

        settings_ = dict(deadline=None, database=None, derandomize=True, suppress_health_check=list(HealthCheck),
                         phases=[Phase.generate])

        # 1. A sweep: each invalid-value branch of each field, alone in an otherwise valid body.
        def sweep_case(path, field, branch):
            @settings(max_examples=2, **settings_)
            @given(st.data())
            def one_field(data):
                send(path, _body(data.draw, path, [(field, branch)]))

            one_field()

        for case in _CASES:
            sweep_case(*case)

        # 2. Raw garbage, and random combinations of two or three invalid fields.
        @settings(max_examples=150, **settings_)
        @given(st.data())
        def combos(data):
            path = data.draw(st.sampled_from([COMPL, CHAT]))
            if data.draw(st.integers(0, 4)) == 0:
                send(path, data.draw(st.one_of(*_GARBAGE)))
                return
            fields = data.draw(st.lists(st.sampled_from(sorted(_BAD[path])), min_size=2, max_size=3, unique=True))
            send(path, _body(data.draw, path, [(f, data.draw(st.integers(0, len(_BAD[path][f]) - 1)))
                                               for f in fields]))

        combos()
        assert len(sent) >= 500, len(sent)
        # Breadth: every field's corruption was caught and reported under its own name.
        missing = (set(_BAD_COMPLETION) | set(_BAD_CHAT)) - {p for *_, p in sent}
        assert not missing, f"no 4xx named these fields: {sorted(missing)}"
        assert c.get("/health").status_code == 200
        r = c.post(COMPL, json={"prompt": "Still alive?", "max_tokens": 4, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    assert serve_engine.error is None
    assert {s for _, _, s, _ in sent} == {400, 404}
