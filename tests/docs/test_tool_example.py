"""The README's tool-calling example, run as written but small: its ``jaxllm serve Qwen/Qwen3-0.6B
...`` command (parsers and all) and its openai client block, unchanged but for the server's port.

Reduced: the Hub is tests/support/fake_hub.py on 127.0.0.1 (``HF_ENDPOINT``), holding under the
README's id a tiny random Qwen3 checkpoint (tests/support/tiny_models.py) with the tool-rendering
chat template of tests/support/tool_models.py; the server gets the docs suite's smaller buckets
(SERVER_FLAGS).  Random weights write random text, so what is asserted is the responses' shape:
each request answered, ``finish_reason`` ``"tool_calls"`` exactly when the hermes parser found
calls (else ``"stop"`` or ``"length"``), each call's arguments JSON, the streamed chunks well
formed.  The Responses section's openai-agents block runs against the same server, with one
substitution: random weights never write EOS, and the SDK takes a ``max_output_tokens`` stop
as a failure, so the block's ``ModelSettings`` gain a body that ends each answer after a few
tokens (``min_tokens`` and a ``logit_bias`` on EOS); the agent's run ends with that text, and
any tool call it made went through the block's function.
(The README blocks themselves are ``skip``-annotated in tests/docs/test_snippets.py, which
cannot start a Hub; their reasons name this file.)"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys

import agents
import httpx
import pytest
import transformers
from support.fake_hub import FakeHub, read_folder
from support.serve_process import running_server
from support.snippets import SERVER_FLAGS, all_blocks, argv_of, commands
from support.tiny_models import build_tiny
from support.tool_models import CHAT_TEMPLATE

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


@pytest.fixture(scope="module")
def tool_server(tmp_path_factory, smollm_tokenizer_dir):
    serve_block, _ = _readme_blocks()
    (cmd,) = commands(serve_block.body)
    argv = argv_of(cmd)
    assert argv[:3] == ["jaxllm", "serve", README_ID], argv
    root = tmp_path_factory.mktemp("tool_example")
    hf = build_tiny("qwen3_qk_norm", str(root / "qwen3"), smollm_tokenizer_dir)
    tok = transformers.AutoTokenizer.from_pretrained(hf)
    tok.chat_template = CHAT_TEMPLATE   # renders `tools` and hermes <tool_call> turns, as Qwen3's does
    tok.save_pretrained(hf)
    hub = FakeHub({README_ID: read_folder(hf)})
    env = dict(os.environ, HF_ENDPOINT=hub.url, HF_HUB_CACHE=str(root / "hf_cache"), HF_HUB_DISABLE_IMPLICIT_TOKEN="1")
    env.pop("HF_HUB_OFFLINE", None)
    env.pop("HF_TOKEN", None)
    log = root / "serve.log"
    try:
        with running_server([sys.executable, "-m", "jaxllm.cli", *argv[1:], *SERVER_FLAGS], env=env, log=log,
                            timeout=START_S) as base:
            yield base, hub, log
    finally:
        hub.stop()


def test_readme_tool_calling_example_runs_against_the_hub_id(tool_server):
    base, hub, log = tool_server
    _, client_block = _readme_blocks()
    # the server downloaded the README's id from the fake Hub
    assert any(f.startswith(f"{README_ID}/") and f.endswith(".safetensors") for f in hub.fetched), hub.fetched
    ns: dict = {}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(client_block.body.replace("http://127.0.0.1:8000", base), client_block.where, "exec"), ns)   # noqa: S102
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
    base, _, _ = tool_server
    (block,) = [b for b in all_blocks() if b.path == "README.md" and "OpenAIResponsesModel" in b.body]
    assert block.lang == "python" and "http://127.0.0.1:8000" in block.body, block.where
    assert f'model="{README_ID}"' in block.body and "set_tracing_disabled(True)" in block.body, block.where
    (eos,) = httpx.post(base + "/tokenize", json={"prompt": "<|im_end|>", "add_special_tokens": False},
                        timeout=60).json()["tokens"]
    settings = "ModelSettings(temperature=0, max_tokens=256)"
    assert settings in block.body, block.where
    code = block.body.replace("http://127.0.0.1:8000", base).replace(
        settings, settings[:-1] + f", extra_body={{'min_tokens': 4, 'logit_bias': {{'{eos}': 100}}}})")
    ns: dict = {}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, block.where, "exec"), ns)   # noqa: S102
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
