"""Tool calling and reasoning through a real server, as the official ``openai`` client sees them.

The model is tests/support/tool_models.py's scripted checkpoint: ``logit_bias`` on a script's first
token makes it write that script (hermes tool calls, or ``<think>`` reasoning then content),
and its chat template renders ``tools``, assistant ``tool_calls`` and ``role: tool`` results.
One engine serves two apps: one started with ``--enable-auto-tool-choice --tool-call-parser
hermes --reasoning-parser qwen3``, one with no tool flags.
"""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

pytest.register_assert_rewrite("support.serve_helpers")

from support.serve_helpers import ServerThread, assert_error_shape, make_engine  # noqa: E402
from support.tool_models import build_scripted, script_ids  # noqa: E402

pytest_plugins = ["support.serve_helpers"]

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "London"]}},
                   "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"tz": {"type": "string", "enum": ["CET"]}},
                                       "required": ["tz"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
MSGS = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def scripted(tmp_path_factory, smollm_tokenizer_dir):
    return build_scripted(str(tmp_path_factory.mktemp("scripted")), smollm_tokenizer_dir)


@pytest.fixture(scope="module")
def scripted_engine(scripted):
    engine = make_engine(scripted, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=512)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def tool_server(scripted_engine):
    from jaxllm.config import ServingConfig
    srv = ServerThread(scripted_engine, ServingConfig(
        host="127.0.0.1", port=0, served_model_names=("scripted",), enable_auto_tool_choice=True,
        tool_call_parser="hermes", reasoning_parser="qwen3"))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def plain_server(scripted_engine):
    from jaxllm.config import ServingConfig
    srv = ServerThread(scripted_engine, ServingConfig(host="127.0.0.1", port=0, served_model_names=("scripted",)))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def script(scripted):
    return script_ids(scripted)


def _client(srv):
    return openai.OpenAI(base_url=srv.base + "/v1", api_key="unused", max_retries=0, timeout=120)


def _bias(script, name):
    return {str(script[name][0]): 100}


def _collect(stream):
    """A streamed chat answer folded as an agent framework folds it."""
    content, reasoning, calls, finish, raw = "", "", {}, None, []
    for chunk in stream:
        for ch in chunk.choices:
            d = ch.delta
            raw.append(d)
            content += d.content or ""
            reasoning += (d.model_extra or {}).get("reasoning") or ""
            for tc in d.tool_calls or []:
                if tc.index not in calls:
                    # The first delta of a call: id, type and name, before any argument text.
                    assert tc.id and tc.type == "function" and tc.function.name, tc
                    assert not tc.function.arguments, tc
                    calls[tc.index] = {"id": tc.id, "name": tc.function.name, "arguments": ""}
                else:
                    assert tc.id is None and tc.function.name is None, tc
                    calls[tc.index]["arguments"] += tc.function.arguments or ""
            if ch.finish_reason is not None:
                finish = ch.finish_reason
    return content, reasoning, [calls[i] for i in sorted(calls)], finish, raw


def test_auto_tool_calls_full_and_streamed_agree(tool_server, script):
    client = _client(tool_server)
    kw = dict(model="scripted", messages=MSGS, tools=TOOLS, temperature=0, max_tokens=40,
              logit_bias=_bias(script, "tools"))
    full = client.chat.completions.create(**kw)  # tool_choice defaults to "auto" with tools
    choice = full.choices[0]
    assert choice.finish_reason == "tool_calls"
    msg = choice.message
    assert msg.content == "Let me check."
    got = [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls]
    assert got == [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})]
    assert all(c.type == "function" and c.id.startswith("chatcmpl-tool-") for c in msg.tool_calls)
    assert len({c.id for c in msg.tool_calls}) == 2
    for c, tool in zip(msg.tool_calls, TOOLS):
        jsonschema.validate(json.loads(c.function.arguments), tool["function"]["parameters"])

    content, reasoning, calls, finish, raw = _collect(client.chat.completions.create(**kw, stream=True))
    assert finish == "tool_calls" and content == msg.content and reasoning == ""
    assert [(c["name"], c["arguments"]) for c in calls] == [(c.function.name, c.function.arguments)
                                                          for c in msg.tool_calls]
    assert not any("<" in (d.content or "") for d in raw), "a tag leaked into content"
    assert sum(1 for d in raw if d.tool_calls) > 4, "arguments did not arrive in fragments"


def test_parallel_tool_calls_false_keeps_one_call(tool_server, script):
    client = _client(tool_server)
    kw = dict(model="scripted", messages=MSGS, tools=TOOLS, tool_choice="auto", parallel_tool_calls=False,
              temperature=0, max_tokens=40, logit_bias=_bias(script, "tools"))
    full = client.chat.completions.create(**kw)
    assert [c.function.name for c in full.choices[0].message.tool_calls] == ["get_weather"]
    _, _, calls, finish, _ = _collect(client.chat.completions.create(**kw, stream=True))
    assert [c["name"] for c in calls] == ["get_weather"] and finish == "tool_calls"


def test_each_choice_has_its_own_parser(tool_server, script):
    client = _client(tool_server)
    # Sampled (n > 1 is not greedy); the script's logits make every sample the same text.
    kw = dict(model="scripted", messages=MSGS, tools=TOOLS, n=2, temperature=1, seed=0, max_tokens=40,
              logit_bias=_bias(script, "tools"))
    full = client.chat.completions.create(**kw)
    assert [len(c.message.tool_calls) for c in full.choices] == [2, 2]
    chunks = list(client.chat.completions.create(**kw, stream=True))
    for i in range(2):
        args = {}
        for ch in chunks:
            for c in ch.choices:
                if c.index == i:
                    for tc in c.delta.tool_calls or []:
                        args[tc.index] = args.get(tc.index, "") + (tc.function.arguments or "")
        assert [args[0], args[1]] == [t.function.arguments for t in full.choices[i].message.tool_calls]


def test_tool_choice_none_returns_the_raw_text(tool_server, script):
    client = _client(tool_server)
    full = client.chat.completions.create(model="scripted", messages=MSGS, tools=TOOLS, tool_choice="none",
                                          temperature=0, max_tokens=40, logit_bias=_bias(script, "tools"))
    c = full.choices[0]
    assert c.finish_reason == "stop" and not c.message.tool_calls
    assert c.message.content.startswith("Let me check.\n<tool_call>")


def test_reasoning_full_and_streamed_agree(tool_server, script):
    client = _client(tool_server)
    kw = dict(model="scripted", messages=MSGS, temperature=0, max_tokens=20, logit_bias=_bias(script, "think"))
    full = client.chat.completions.create(**kw)
    msg = full.choices[0].message
    assert msg.model_extra["reasoning"] == "I know this." and msg.content == "It is sunny."
    assert full.choices[0].finish_reason == "stop"
    content, reasoning, calls, finish, raw = _collect(client.chat.completions.create(**kw, stream=True))
    assert (reasoning, content, calls, finish) == ("I know this.", "It is sunny.", [], "stop")
    assert not any("think>" in (d.content or "") + ((d.model_extra or {}).get("reasoning") or "") for d in raw)


def test_include_reasoning_false_leaves_the_reasoning_out(tool_server, script):
    client = _client(tool_server)
    kw = dict(model="scripted", messages=MSGS, temperature=0, max_tokens=20, logit_bias=_bias(script, "think"),
              extra_body={"include_reasoning": False})
    msg = client.chat.completions.create(**kw).choices[0].message
    assert msg.model_extra.get("reasoning") is None and msg.content == "It is sunny."
    content, reasoning, calls, finish, raw = _collect(client.chat.completions.create(**kw, stream=True))
    assert (reasoning, content, calls, finish) == ("", "It is sunny.", [], "stop")
    assert not any("reasoning" in (d.model_extra or {}) for d in raw)


def test_tools_reach_the_template_and_tool_results_round_trip(tool_server):
    msgs = [MSGS[0],
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "18C and sunny"}]
    r = httpx.post(tool_server.base + "/tokenize", json={"messages": msgs, "tools": TOOLS}, timeout=60)
    assert r.status_code == 200, r.text
    r2 = httpx.post(tool_server.base + "/detokenize", json={"tokens": r.json()["tokens"]}, timeout=60)
    text = r2.json()["prompt"]
    assert json.dumps(WEATHER) in text  # the template saw the tools as sent
    # The assistant's arguments reach the template as a mapping (rendered by tojson, not quoted).
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in text
    assert '<tool_response id="call_1">\n18C and sunny\n</tool_response>' in text
    # And a chat request with that history is served.
    client = _client(tool_server)
    out = client.chat.completions.create(model="scripted", messages=msgs, tools=TOOLS, max_tokens=3,
                                         temperature=0)
    assert out.choices[0].finish_reason in ("length", "stop")


@pytest.mark.parametrize("body, param", [
    ({"tools": [{"type": "function"}]}, "tools"),
    ({"tools": [{"type": "bogus", "function": {"name": "f"}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "not a schema"}}]}, "tools"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, "tool_choice"),
])
def test_bad_tools_and_tool_choice_are_400(tool_server, body, param):
    r = httpx.post(tool_server.base + "/v1/chat/completions", json={"messages": MSGS, "max_tokens": 2, **body},
                   timeout=60)
    assert r.status_code == 400, r.text
    assert_error_shape(r.json(), 400, param)
    ok = httpx.post(tool_server.base + "/v1/chat/completions", json={"messages": MSGS, "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200, ok.text  # still serving


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
@pytest.mark.parametrize("constraint", [
    {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}},
    {"response_format": {"type": "json_object"}},
    {"structured_outputs": {"regex": "a+"}},
    {"guided_choice": ["a", "b"]},
])
def test_a_constraint_with_a_constraining_tool_choice_is_400_naming_both(tool_server, tool_choice, constraint):
    """Two constraints are refused, never one silently replacing the other."""
    body = {"messages": MSGS, "max_tokens": 2, "tools": TOOLS, "tool_choice": tool_choice, **constraint}
    r = httpx.post(tool_server.base + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    field, = constraint
    err = assert_error_shape(r.json(), 400, field)
    assert f"got both tool_choice and {field}" in err["message"], err


def test_auto_with_a_template_that_ignores_tools_is_400(tool_server):
    ignores = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    body = {"messages": MSGS, "tools": TOOLS, "max_tokens": 2, "chat_template": ignores}
    r = httpx.post(tool_server.base + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert "does not render `tools`" in assert_error_shape(r.json(), 400, "tools")["message"]
    ok = httpx.post(tool_server.base + "/v1/chat/completions", json={**body, "tool_choice": "none"}, timeout=60)
    assert ok.status_code == 200, ok.text


def test_auto_without_the_flag_is_400_and_none_is_served(plain_server):
    r = httpx.post(plain_server.base + "/v1/chat/completions", json={"messages": MSGS, "tools": TOOLS,
                                                                   "max_tokens": 2}, timeout=60)
    assert r.status_code == 400, r.text
    err = assert_error_shape(r.json(), 400, "tool_choice")
    assert "--enable-auto-tool-choice" in err["message"]
    ok = httpx.post(plain_server.base + "/v1/chat/completions",
                    json={"messages": MSGS, "tools": TOOLS, "tool_choice": "none", "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200, ok.text


@pytest.mark.parametrize("stream", [False, True])
def test_named_tool_choice_arguments_validate(tool_server, stream):
    client = _client(tool_server)
    kw = dict(model="scripted", messages=MSGS, tools=TOOLS, max_tokens=60, temperature=0,
              tool_choice={"type": "function", "function": {"name": "get_weather"}})
    if stream:
        _, _, calls, finish, _ = _collect(client.chat.completions.create(**kw, stream=True))
    else:
        c = client.chat.completions.create(**kw).choices[0]
        finish = c.finish_reason
        calls = [{"name": t.function.name, "arguments": t.function.arguments} for t in c.message.tool_calls]
    assert finish == "stop" and [c["name"] for c in calls] == ["get_weather"]
    jsonschema.validate(json.loads(calls[0]["arguments"]), WEATHER["function"]["parameters"])


@pytest.mark.parametrize("stream, parallel", [(False, False), (True, False), (False, True)])
def test_required_tool_choice_arguments_validate(tool_server, stream, parallel):
    client = _client(tool_server)
    kw = dict(model="scripted", messages=MSGS, tools=TOOLS, max_tokens=120, temperature=0, tool_choice="required",
              parallel_tool_calls=parallel)
    if parallel:
        # The model's logits are flat here, and "," sorts before "]": bias the array's end so
        # that a greedy pick closes the array after a call instead of adding calls forever.
        close = httpx.post(tool_server.base + "/tokenize", json={"prompt": "]", "add_special_tokens": False},
                           timeout=60).json()["tokens"]
        kw["logit_bias"] = {str(close[0]): 50}
    if stream:
        _, _, calls, finish, _ = _collect(client.chat.completions.create(**kw, stream=True))
    else:
        c = client.chat.completions.create(**kw).choices[0]
        finish = c.finish_reason
        calls = [{"name": t.function.name, "arguments": t.function.arguments} for t in c.message.tool_calls]
    assert finish == "tool_calls" and calls
    if not parallel:
        assert len(calls) == 1
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for call in calls:
        jsonschema.validate(json.loads(call["arguments"]), schemas[call["name"]])


@pytest.mark.parametrize("flags, message", [
    (["--enable-auto-tool-choice"], "--enable-auto-tool-choice requires --tool-call-parser"),
    (["--tool-call-parser", "nope"], "--tool-call-parser 'nope' is not registered"),
    (["--reasoning-parser", "nope"], "--reasoning-parser 'nope' is not registered"),
    (["--tool-parser-plugin", "/no/such/plugin.py"], "--tool-parser-plugin '/no/such/plugin.py': no such file"),
])
def test_serve_flags_are_checked(flags, message):
    from jaxllm.cli import build_parser
    from serve.cli import serving_config_from_args
    from serve.state import resolve_parsers
    args = build_parser().parse_args(["serve", *flags])
    with pytest.raises(ValueError) as e:
        resolve_parsers(serving_config_from_args(args))
    assert message in str(e.value)
    if flags[0] == "--tool-call-parser":  # and the CLI says so before loading anything
        import subprocess
        import sys
        r = subprocess.run([sys.executable, "-m", "jaxllm.cli", "serve", "--port", "0", *flags],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode != 0 and message in r.stderr, r.stderr[-2000:]
