"""The one chat renderer (jaxllm/engine/render.py): what reaches the template, what is
refused (naming the argument), and that the server, ``LLM.chat`` and ``jaxllm chat`` all go
through it rather than applying templates themselves."""

from __future__ import annotations

import ast
import os

import pytest
from transformers import AutoTokenizer

from jaxllm.engine.processor import InvalidRequestError
from jaxllm.engine.render import RESERVED_TEMPLATE_KWARGS, render_chat_prompt
from jaxllm.sampling_params import SamplingParams

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MSGS = [{"role": "user", "content": "hi"}]
ECHO = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
        "{% if tools %}[tools:{{ tools | map(attribute='function.name') | join(',') }}]{% endif %}"
        "{% if documents %}[docs:{{ documents | map(attribute='title') | join(',') }}]{% endif %}"
        "{% if flavour %}[{{ flavour }}]{% endif %}{% if add_generation_prompt %}<assistant>{% endif %}")


@pytest.fixture(scope="module")
def tok(smollm_tokenizer_dir):
    return AutoTokenizer.from_pretrained(smollm_tokenizer_dir)


def test_tools_documents_and_kwargs_reach_the_template(tok):
    r = render_chat_prompt(tok, MSGS, chat_template=ECHO, chat_template_kwargs={"flavour": "x"},
                           tools=[{"type": "function", "function": {"name": "f"}}],
                           documents=[{"title": "A", "text": "a"}, {"title": "B", "text": "b"}])
    assert r.text == "<user>hi[tools:f][docs:A,B][x]<assistant>"
    assert r.token_ids == tok.encode(r.text, add_special_tokens=False)
    assert r.engine_prompt() == {"prompt": r.text, "prompt_token_ids": r.token_ids}
    assert render_chat_prompt(tok, MSGS, chat_template=ECHO, add_generation_prompt=False).text == "<user>hi"


@pytest.mark.parametrize("kwargs, param", [
    (dict(chat_template_kwargs={"tools": []}), "chat_template_kwargs"),
    (dict(chat_template_kwargs={"documents": []}), "chat_template_kwargs"),
    (dict(continue_final_message=True), "continue_final_message"),
    (dict(chat_template="{{ nope( }}"), "chat_template"),
])
def test_refusals_name_the_argument(tok, kwargs, param):
    with pytest.raises(InvalidRequestError) as e:
        render_chat_prompt(tok, MSGS, **kwargs)
    assert e.value.param == param
    assert {"tools", "documents", "add_generation_prompt"} <= RESERVED_TEMPLATE_KWARGS


@pytest.mark.parametrize("path", ["jaxllm/llm.py", "jaxllm/cli.py", "serve/chat.py", "serve/app.py"])
def test_callers_render_through_the_one_renderer(path):
    """No caller applies a chat template itself."""
    with open(os.path.join(ROOT, path)) as f:
        tree = ast.parse(f.read())
    attrs = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    assert "apply_chat_template" not in attrs
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} | attrs
    if path != "serve/app.py":
        assert "render_chat_prompt" in names


def test_cli_chat_and_llm_chat_send_the_renderers_prompt(tiny_llm, monkeypatch, capsys):
    """``jaxllm chat`` and ``LLM.chat`` hand the engine exactly what the renderer makes (the
    server's path is tests/serve/test_request_fields.py's)."""
    from jaxllm import cli

    sent = []
    engine = tiny_llm.llm_engine
    add = engine.add_request
    monkeypatch.setattr(engine, "add_request", lambda rid, prompt, *a, **kw: (sent.append(prompt),
                                                                               add(rid, prompt, *a, **kw))[1])
    process = engine.input_processor.process_inputs
    monkeypatch.setattr(engine.input_processor, "process_inputs",
                        lambda rid, prompt, *a, **kw: (sent.append(prompt), process(rid, prompt, *a, **kw))[1])
    monkeypatch.setattr(cli, "_make_llm", lambda args: tiny_llm)
    lines = iter(["Hello there", ""])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    args = cli.build_parser().parse_args(["chat", "--system", "Be brief.", "--max-tokens", "2"])
    assert cli.cmd_chat(args) == 0
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    expected = render_chat_prompt(tiny_llm.get_tokenizer(), msgs).engine_prompt()
    assert sent[0] == expected
    sent.clear()
    tiny_llm.chat(msgs, SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)
    assert sent == [expected]
