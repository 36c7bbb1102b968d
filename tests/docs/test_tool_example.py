"""The README's tool-calling example, run as written but small: its ``jaxllm serve Qwen/Qwen3-0.6B
...`` command (parsers and all) and its openai client block, unchanged but for the server's port.

Reduced: the Hub is tests/support/fake_hub.py on 127.0.0.1 (``HF_ENDPOINT``), holding under the
README's id tests/support/tool_models.py's scripted checkpoint (its chat template renders tools
and hermes turns as Qwen3's does; a ``logit_bias`` on a script's first token makes it write that
script: a tool call, or ``<think>`` reasoning then text); the server gets the docs suite's
smaller buckets (SERVER_FLAGS).  The chat block sends no bias, so the text is arbitrary and what
is asserted is the responses' shape: each request answered, ``finish_reason`` ``"tool_calls"``
exactly when the hermes parser found calls (else ``"stop"`` or ``"length"``), each call's
arguments JSON, the streamed chunks well formed.  The Responses section's blocks run against
the same server, each with one substitution, a body carrying the bias: the function-tool round
trip (a ``function_call`` item, then after its ``function_call_output`` with
``previous_response_id`` the final answer), and the openai-agents block (the ``<think>`` script
ends the answer with EOS; the SDK takes a ``max_output_tokens`` stop as a failure).
(The README blocks themselves are ``skip``-annotated in tests/docs/test_snippets.py, which
cannot start a Hub; their reasons name this file.)"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys

import agents
import pytest
import openai
from support.fake_hub import FakeHub, read_folder
from support.serve_process import running_server
from support.snippets import SERVER_FLAGS, all_blocks, argv_of, commands
from support.tool_models import build_scripted, script_ids

README_ID = "Qwen/Qwen3-0.6B"
START_S = 600


def _readme_blocks():
    """The README's serve command of the tool-calling section and the client block after it."""
    blocks = [b for b in all_blocks() if b.path == "README.md"]
    i = next(i for i, b in enumerate(blocks) if f"jaxllm serve {README_ID} --enable-auto-tool-choice" in b.body)
    client = blocks[i + 1]
    assert "tools=tools" in client.body and client.lang == "python", client.where
    assert "http://127.0.0.1:8000" in client.body, client.where
    return blocks[i], client


def _run(code: str, where: str, ns: dict) -> io.StringIO:
    """Runs a README block's (adapted) code in ``ns``; returns what it printed."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, where, "exec"), ns)   # noqa: S102
    return out


@pytest.fixture(scope="module")
def tool_server(tmp_path_factory, smollm_tokenizer_dir):
    serve_block, _ = _readme_blocks()
    (cmd,) = commands(serve_block.body)
    argv = argv_of(cmd)
    assert argv[:3] == ["jaxllm", "serve", README_ID], argv
    root = tmp_path_factory.mktemp("tool_example")
    # The scripted checkpoint under the README's id: its template renders `tools` and hermes
    # <tool_call> turns as Qwen3's does, and a logit_bias picks a script (a tool call, <think>).
    hf = build_scripted(str(root / "scripted"), smollm_tokenizer_dir)
    hub = FakeHub({README_ID: read_folder(hf)})
    env = dict(os.environ, HF_ENDPOINT=hub.url, HF_HUB_CACHE=str(root / "hf_cache"), HF_HUB_DISABLE_IMPLICIT_TOKEN="1")
    env.pop("HF_HUB_OFFLINE", None)
    env.pop("HF_TOKEN", None)
    log = root / "serve.log"
    try:
        with running_server([sys.executable, "-m", "jaxllm.cli", *argv[1:], *SERVER_FLAGS], env=env, log=log,
                            timeout=START_S) as base:
            yield base, hub, log, script_ids(hf)
    finally:
        hub.stop()


def test_readme_tool_calling_example_runs_against_the_hub_id(tool_server):
    base, hub, _, _ = tool_server
    _, client_block = _readme_blocks()
    # the server downloaded the README's id from the fake Hub
    assert any(f.startswith(f"{README_ID}/") and f.endswith(".safetensors") for f in hub.fetched), hub.fetched
    ns: dict = {}
    out = _run(client_block.body.replace("http://127.0.0.1:8000", base), client_block.where, ns)
    assert ns["model"] == README_ID   # /v1/models names the Hub id, as vLLM
    for reply in (ns["reply"], ns["final"]):
        choice = reply.choices[0]
        calls = choice.message.tool_calls or []
        assert choice.finish_reason in (("tool_calls",) if calls else ("stop", "length")), choice.finish_reason
        for call in calls:
            assert call.type == "function" and call.id and call.function.name
            json.loads(call.function.arguments)
    printed = out.getvalue().splitlines()
    assert printed and printed[0].split()[0] in ("tool_calls", "stop", "length"), printed[:3]
    print(f"{client_block.where}: ran against {base} ({README_ID} from the fake Hub): "
          f"{len(printed)} lines printed, finish_reason {ns['reply'].choices[0].finish_reason}")


def test_readme_agents_example_runs_against_the_tool_server(tool_server):
    base, _, _, ids = tool_server
    (block,) = [b for b in all_blocks() if b.path == "README.md" and "OpenAIResponsesModel" in b.body]
    assert block.lang == "python" and "http://127.0.0.1:8000" in block.body, block.where
    assert f'model="{README_ID}"' in block.body and "set_tracing_disabled(True)" in block.body, block.where
    settings = "ModelSettings(temperature=0, max_tokens=256)"
    assert settings in block.body, block.where
    # The scripted checkpoint answers with its <think> script (reasoning, then text, then EOS).
    code = block.body.replace("http://127.0.0.1:8000", base).replace(
        settings, settings[:-1] + f", extra_body={{'logit_bias': {{'{ids['think'][0]}': 100}}}})")
    ns: dict = {}
    out = _run(code, block.where, ns)
    result = ns["result"]
    assert isinstance(result.final_output, str) and result.final_output
    assert out.getvalue().strip() == result.final_output.strip()
    calls = [i.raw_item for i in result.new_items if isinstance(i, agents.ToolCallItem)]
    outputs = [i.output for i in result.new_items if isinstance(i, agents.ToolCallOutputItem)]
    for call in calls:
        assert call.name == "get_weather" and isinstance(json.loads(call.arguments)["city"], str)
    assert len(outputs) == len(calls) and all(o.startswith("18C and sunny in ") for o in outputs)
    assert result.raw_responses, "no model response"   # each turn one /v1/responses round trip
    print(f"{block.where}: ran against {base}: {len(result.raw_responses)} model turns, {len(calls)} tool calls, "
          f"final output {result.final_output[:60]!r}")


def test_readme_responses_tool_round_trip_runs_against_the_tool_server(tool_server):
    base, _, _, ids = tool_server
    (block,) = [b for b in all_blocks() if b.path == "README.md" and "previous_response_id=first.id" in b.body]
    assert block.lang == "python" and "function_call_output" in block.body, block.where
    # The block continues the Responses block before it (its `client` and `model`); its two
    # requests gain the logit_bias that picks the scripted checkpoint's tool-call script, then
    # its <think> script.
    first_call, second_call = "in Paris?\", tools=tools)", "previous_response_id=first.id, tools=tools)"
    assert first_call in block.body and second_call in block.body, block.where
    code = block.body.replace(first_call, first_call[:-1] + f", extra_body={{'logit_bias': {{'{ids['tools'][0]}': 100}}}})")
    code = code.replace(second_call, second_call[:-1] + f", extra_body={{'logit_bias': {{'{ids['think'][0]}': 100}}}})")
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)
    ns: dict = {"client": client, "model": client.models.list().data[0].id}
    assert ns["model"] == README_ID
    out = _run(code, block.where, ns)
    first, final = ns["first"], ns["final"]
    calls = [item for item in first.output if item.type == "function_call"]
    assert [(c.name, json.loads(c.arguments)) for c in calls][:1] == [("get_weather", {"city": "Paris"})], first.output
    assert [r["call_id"] for r in ns["results"]] == [c.call_id for c in calls]
    assert final.previous_response_id == first.id and final.status == "completed"
    # The answer after the function_call_output items, its reasoning parsed out.
    assert [o.type for o in final.output] == ["reasoning", "message"] and final.output_text == "It is sunny."
    assert out.getvalue() == "It is sunny.\n"
    print(f"{block.where}: ran against {base}: {len(calls)} function calls, then {final.output_text!r}")
