"""The Responses API's function tools and reasoning items through a real server: a function-call
round trip (``function_call_output`` with ``previous_response_id``), the streamed function-call
and reasoning events, ``reasoning.effort`` (and chat's ``reasoning_effort``) reaching the chat
template, reasoning tokens in usage and output logprobs after the reasoning, on
tests/support/tool_models.py's scripted checkpoint (``logit_bias`` picks the script; hermes
tool calls, qwen3 reasoning; its template prints ``reasoning_effort``)."""

from __future__ import annotations

import json

import agents
import httpx
import openai
import pytest

pytest.register_assert_rewrite("support.serve_helpers")

from support.serve_helpers import ServerThread, make_engine  # noqa: E402
from support.tool_models import build_scripted, script_ids  # noqa: E402

pytest_plugins = ["support.serve_helpers"]

WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
TIME = {"type": "function", "name": "get_time",
        "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]}}
ASK = "What is the weather in Paris?"


@pytest.fixture(scope="module")
def scripted(tmp_path_factory, smollm_tokenizer_dir):
    return build_scripted(str(tmp_path_factory.mktemp("scripted")), smollm_tokenizer_dir)


@pytest.fixture(scope="module")
def server(scripted, tmp_path_factory):
    from jaxllm.config import ServingConfig
    engine = make_engine(scripted, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=512, precompile="auto")
    srv = ServerThread(engine, ServingConfig(
        host="127.0.0.1", port=0, served_model_names=("scripted",), enable_auto_tool_choice=True,
        tool_call_parser="hermes", reasoning_parser="qwen3",
        responses_store=str(tmp_path_factory.mktemp("store") / "r.sqlite3")))
    yield srv
    srv.stop()
    engine.shutdown()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def bias(scripted):
    ids = script_ids(scripted)
    return lambda name: {"logit_bias": {str(ids[name][0]): 100}}


def test_function_call_round_trip(client, server, bias):
    r1 = client.responses.create(model="scripted", input=ASK, tools=[WEATHER, TIME], temperature=0,
                                 max_output_tokens=40, extra_body=bias("tools"))
    assert r1.status == "completed"
    assert [o.type for o in r1.output] == ["message", "function_call", "function_call"]
    assert r1.output_text == "Let me check."
    calls = r1.output[1:]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"}),
                                                                   ("get_time", {"tz": "CET"})]
    results = [{"type": "function_call_output", "call_id": c.call_id, "output": out}
               for c, out in zip(calls, ["18C and sunny", "14:00"])]
    r2 = client.responses.create(model="scripted", input=results, previous_response_id=r1.id, tools=[WEATHER, TIME],
                                 temperature=0, max_output_tokens=20, extra_body=bias("think"))
    assert [o.type for o in r2.output] == ["reasoning", "message"]
    assert r2.output[0].content[0].text == "I know this." and r2.output_text == "It is sunny."
    # The prompt was the whole conversation, rebuilt from the store, as the chat template renders it.
    msgs = [{"role": "user", "content": ASK},
            {"role": "assistant", "content": "Let me check.", "tool_calls": [
                {"id": c.call_id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for c in calls]},
            {"role": "tool", "tool_call_id": calls[0].call_id, "content": "18C and sunny"},
            {"role": "tool", "tool_call_id": calls[1].call_id, "content": "14:00"}]
    chat_tools = [{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}} for t in (WEATHER, TIME)]
    tok = httpx.post(server.base + "/tokenize", json={"messages": msgs, "tools": chat_tools}, timeout=60).json()
    assert r2.usage.input_tokens == tok["count"]
    assert [i.type for i in client.responses.input_items.list(r2.id, order="asc").data] == ["function_call_output"] * 2


def test_streamed_function_calls_and_reasoning(client, bias):
    with client.responses.stream(model="scripted", input=ASK, tools=[WEATHER, TIME], temperature=0,
                                 max_output_tokens=40, extra_body=bias("tools")) as s:
        events = list(s)
        final = s.get_final_response()
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[-1].type == "response.completed"
    args = {}
    for e in events:
        if e.type == "response.function_call_arguments.delta":
            args[e.output_index] = args.get(e.output_index, "") + e.delta
    assert [args[1], args[2]] == [c.arguments for c in final.output[1:]]
    assert sum(e.type == "response.function_call_arguments.delta" for e in events) > 2  # in fragments
    assert [json.loads(c.arguments) for c in final.output[1:]] == [{"city": "Paris"}, {"tz": "CET"}]

    with client.responses.stream(model="scripted", input=ASK, temperature=0, max_output_tokens=20,
                                 extra_body=bias("think")) as s:
        events = list(s)
        final = s.get_final_response()
    kinds = [e.type for e in events]
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == "I know this."
    assert final.output_text == "It is sunny."


def test_reasoning_effort_reaches_the_chat_template(client, server):
    """Responses' ``reasoning.effort`` and chat's ``reasoning_effort`` render as the template
    variable ``reasoning_effort`` (the prompt is /tokenize's with that chat_template_kwarg);
    the field wins over chat_template_kwargs (vLLM's merge)."""
    msgs = [{"role": "user", "content": ASK}]

    def tokenize(**kw):
        return httpx.post(server.base + "/tokenize", json={"messages": msgs, **kw}, timeout=60).json()

    def detokenize(ids):
        return httpx.post(server.base + "/detokenize", json={"tokens": ids}, timeout=60).json()["prompt"]

    bare = tokenize()
    prompts = {}
    for effort in ("low", "high"):
        want = tokenize(chat_template_kwargs={"reasoning_effort": effort})
        assert want["count"] > bare["count"]
        r = client.responses.create(model="scripted", input=ASK, reasoning={"effort": effort}, max_output_tokens=1,
                                    temperature=0)
        assert r.usage.input_tokens == want["count"] and r.reasoning.effort == effort
        chat = client.chat.completions.create(model="scripted", messages=msgs, reasoning_effort=effort, max_tokens=1,
                                              temperature=0, extra_body={"return_token_ids": True})
        prompts[effort] = chat.prompt_token_ids
        assert chat.prompt_token_ids == want["tokens"]
        assert f"Reasoning effort: {effort}<|im_end|>" in detokenize(chat.prompt_token_ids)
    assert prompts["low"] != prompts["high"]
    both = client.chat.completions.create(model="scripted", messages=msgs, reasoning_effort="high", max_tokens=1,
                                          temperature=0, extra_body={"return_token_ids": True,
                                                                     "chat_template_kwargs": {"reasoning_effort": "low"}})
    assert both.prompt_token_ids == prompts["high"]


def test_reasoning_tokens_and_output_logprobs(client, server, bias):
    """With the qwen3 parser: ``reasoning_tokens`` (Responses and chat, whole and streamed) is
    the token count of the reasoning text; the message's logprobs are those of the tokens after
    ``</think>``, the same streamed (joined deltas) as whole, with ``top_logprobs`` alternatives."""
    body = dict(model="scripted", input=ASK, temperature=0, max_output_tokens=20, extra_body=bias("think"),
                include=["message.output_text.logprobs"], top_logprobs=2)
    r = client.responses.create(**body)
    assert [o.type for o in r.output] == ["reasoning", "message"]
    reasoning = r.output[0].content[0].text
    n = httpx.post(server.base + "/tokenize", json={"prompt": reasoning, "add_special_tokens": False},
                   timeout=60).json()["count"]
    assert 0 < n == r.usage.output_tokens_details.reasoning_tokens <= r.usage.output_tokens
    lp = r.output[1].content[0].logprobs
    assert len(lp) == r.usage.output_tokens - n - 2  # <think> and </think> are neither
    assert "".join(e.token for e in lp).startswith(r.output_text)
    assert all(len(e.top_logprobs) == 2 and e.top_logprobs[0].token == e.token for e in lp)
    assert lp[0].logprob > -1e-3  # the script's successor: certain

    with client.responses.stream(**body) as s:
        events = list(s)
    streamed = [e for ev in events if ev.type == "response.output_text.delta" for e in ev.logprobs]
    assert [(e.token, round(e.logprob, 4)) for e in streamed] == [(e.token, round(e.logprob, 4)) for e in lp]
    done = next(ev for ev in events if ev.type == "response.output_text.done")
    assert [e.token for e in done.logprobs] == [e.token for e in lp]
    assert events[-1].response.usage.output_tokens_details.reasoning_tokens == n

    chat = dict(model="scripted", messages=[{"role": "user", "content": ASK}], temperature=0, max_tokens=20,
                extra_body=bias("think"))
    whole = client.chat.completions.create(**chat)
    assert whole.usage.completion_tokens_details.reasoning_tokens == n
    chunks = list(client.chat.completions.create(**chat, stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == n


def test_openai_agents_sdk_runs_an_agent_turn_with_a_tool(server, bias):
    """The openai-agents SDK (its default model: the Responses API) against the server, tracing off:
    the scripted model calls both tools and the run stops on the first tool's result."""
    agents.set_tracing_disabled(True)
    called = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """Current weather in a city."""
        called.append(("get_weather", city))
        return f"18C and sunny in {city}"

    @agents.function_tool
    def get_time(tz: str) -> str:
        """The time in a time zone."""
        called.append(("get_time", tz))
        return "14:00"

    model = agents.OpenAIResponsesModel(
        model="scripted", openai_client=openai.AsyncOpenAI(base_url=server.base + "/v1", api_key="unused",
                                                           max_retries=0))
    agent = agents.Agent(name="weather", instructions="Answer with the tools.", model=model,
                         tools=[get_weather, get_time], tool_use_behavior="stop_on_first_tool",
                         model_settings=agents.ModelSettings(temperature=0, max_tokens=40,
                                                             extra_body=bias("tools")))
    result = agents.Runner.run_sync(agent, ASK)
    assert sorted(called) == [("get_time", "CET"), ("get_weather", "Paris")]
    assert result.final_output == "18C and sunny in Paris"
