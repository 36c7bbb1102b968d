"""Tool-call and reasoning parsers without a server: whole outputs, and the same outputs streamed
cut at every split point (and character by character), which must give the same content and
tool calls, and never send part of a tag as content."""

from __future__ import annotations

import json

import jsonschema
import pytest

from serve.chat_parsing import ChoiceParser  # noqa: E402
from serve.reasoning import ReasoningParserManager  # noqa: E402
from serve.reasoning.base import ReasoningParser  # noqa: E402
from serve.tool_choice import NamedToolParser, RequiredToolParser, tool_choice_schema  # noqa: E402
from serve.tool_parsers import ToolParser, ToolParserManager  # noqa: E402

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                     "metric": {"type": "boolean"}, "opts": {"type": "object"}}}}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"tz": {"type": "string"}}}}}]

W = ("get_weather", {"city": "Paris", "days": 3})
T = ("get_time", {"tz": "CET"})

# parser -> [(output, expected content, expected [(name, arguments)], tags that must not leak)]
SAMPLES = {
    "hermes": [
        ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>'
         '\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>', "Let me check.", [W, T]),
        ('<tool_call>{"arguments": {"tz": "CET"}, "name": "get_time"}</tool_call>', None, [T]),
        ('<tool_call>\n{"name": "get_time"}\n</tool_call>', None, [("get_time", {})]),
        # Escaped quotes, backslashes and brackets inside strings.
        ('<tool_call>{"name": "get_weather", "arguments": {"city": "P\\"a}r{is\\\\"}}</tool_call>', None,
         [("get_weather", {"city": 'P"a}r{is\\'})]),
        ("Just text, a < and a <tool but no call.", "Just text, a < and a <tool but no call.", []),
        # A tag without a call in it: the whole output is content, streamed or not.
        ('Text <tool_call>{"x": 1}</tool_call>', 'Text <tool_call>{"x": 1}</tool_call>', []),
        ('<tool_call>\n{"name": "get_time", "arguments": {"tz": "CE', '<tool_call>\n{"name": "get_time", '
         '"arguments": {"tz": "CE', None),  # cut short: content (a stream already sent the name)
    ],
    "llama3_json": [
        ('{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}; {"name": "get_time", '
         '"parameters": {"tz": "CET"}}', None, [W, T]),
        ('<|python_tag|>{"name": "get_time", "arguments": {"tz": "CET"}}', None, [T]),
        ("The answer is {not a call}", "The answer is {not a call}", []),
        ('{"answer": 42}', '{"answer": 42}', []),
    ],
    "mistral": [
        ('Sure. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}, '
         '{"name": "get_time", "arguments": {"tz": "CET"}}]', "Sure.", [W, T]),
        ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 3}[TOOL_CALLS]get_time[ARGS]{"tz": "CET"}', None,
         [W, T]),
        ("[not a call] just text", "[not a call] just text", []),
    ],
    "qwen3_xml": [
        ("I will look.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
         "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_time>\n"
         "<parameter=tz>\nCET\n</parameter>\n</function>\n</tool_call>", "I will look.", [W, T]),
        ("<tool_call>\n<function=get_weather>\n<parameter=metric>\ntrue\n</parameter>\n<parameter=opts>\n"
         '{"a": [1]}\n</parameter>\n<parameter=city>\n123\n</parameter>\n</function>\n</tool_call>', None,
         [("get_weather", {"metric": True, "opts": {"a": [1]}, "city": "123"})]),
    ],
}

CASES = [(name, *s) for name, samples in SAMPLES.items() for s in samples]
TAGS = ("<tool_call", "</tool_call", "[TOOL_CALLS", "[ARGS", "<function", "<parameter", "<|python_tag")


def _stream(parser: ToolParser, pieces):
    deltas = []
    for p in pieces:
        deltas += parser.extract_tool_calls_streaming(p)
    deltas += parser.finish_streaming()
    content = "".join(d.content or "" for d in deltas)
    calls: dict[int, dict] = {}
    for d in deltas:
        assert not (d.content and d.tool_calls)
        for t in d.tool_calls:
            if t.index not in calls:
                assert t.id and t.name and t.arguments == "", t  # name first, then fragments
                calls[t.index] = {"id": t.id, "name": t.name, "arguments": ""}
            else:
                assert t.id is None and t.name is None, t
                calls[t.index]["arguments"] += t.arguments
    return deltas, content or None, [calls[i] for i in sorted(calls)]


def _splits(text):
    yield [text]
    yield list(text)
    for k in range(1, len(text)):
        yield [text[:k], text[k:]]


@pytest.mark.parametrize("name, text, content, calls", CASES)
def test_whole_output(name, text, content, calls):
    got = ToolParserManager.get_tool_parser(name)(tools=TOOLS).extract_tool_calls(text)
    assert got.content == content
    if calls is None or not calls:
        assert not got.tools_called and got.tool_calls == []
        return
    assert got.tools_called
    assert [(c.name, json.loads(c.arguments)) for c in got.tool_calls] == calls
    assert len({c.id for c in got.tool_calls}) == len(calls)


@pytest.mark.parametrize("name, text, content, calls", CASES)
def test_every_split_point_streams_the_same(name, text, content, calls):
    P = ToolParserManager.get_tool_parser(name)
    full = P(tools=TOOLS).extract_tool_calls(text)
    for pieces in _splits(text):
        deltas, s_content, s_calls = _stream(P(tools=TOOLS), pieces)
        if calls is None:  # cut short: the stream sent the call it saw; content stays whole before it
            assert s_calls and s_calls[0]["name"] == "get_time"
            continue
        assert s_content == (full.content if full.tools_called else text), pieces
        assert [(c["name"], c["arguments"]) for c in s_calls] == [(c.name, c.arguments) for c in full.tool_calls]
        if full.tools_called:
            for d in deltas:
                assert not any(tag[:2] in (d.content or "") and tag in text for tag in TAGS), (pieces, d)


def test_held_back_tag_prefix_is_not_content_until_resolved():
    p = ToolParserManager.get_tool_parser("hermes")()
    assert [d.content for d in p.extract_tool_calls_streaming("Hi <tool")] == ["Hi"]
    assert p.extract_tool_calls_streaming("_c") == []
    out = p.extract_tool_calls_streaming("ar is not a tag")
    assert "".join(d.content for d in out) == " <tool_car is not a tag"


def test_mistral_ids_are_nine_alphanumerics():
    got = ToolParserManager.get_tool_parser("mistral")().extract_tool_calls('[TOOL_CALLS]f[ARGS]{}')
    assert len(got.tool_calls[0].id) == 9 and got.tool_calls[0].id.isalnum()


def test_plugin_registers_a_parser(tmp_path):
    plugin = tmp_path / "my_parser.py"
    plugin.write_text(
        "from serve.tool_parsers import ToolParserManager\n"
        "from serve.tool_parsers.hermes import HermesToolParser\n"
        "@ToolParserManager.register_module('my_hermes')\n"
        "class Mine(HermesToolParser):\n    pass\n")
    from jaxllm.config import ServingConfig
    from serve.state import resolve_parsers
    tool, reasoning = resolve_parsers(ServingConfig(tool_call_parser="my_hermes", tool_parser_plugin=str(plugin),
                                                    enable_auto_tool_choice=True))
    assert tool.__name__ == "Mine" and reasoning is None
    with pytest.raises(ValueError, match="--tool-call-parser 'nope'"):
        resolve_parsers(ServingConfig(tool_call_parser="nope"))
    with pytest.raises(ValueError, match="--reasoning-parser 'nope'"):
        resolve_parsers(ServingConfig(reasoning_parser="nope"))
    with pytest.raises(ValueError, match="--tool-parser-plugin"):
        resolve_parsers(ServingConfig(tool_parser_plugin=str(tmp_path / "missing.py")))
    with pytest.raises(ValueError, match="--enable-auto-tool-choice requires --tool-call-parser"):
        ServingConfig(enable_auto_tool_choice=True)


# ---------------------------------------------------------------------------- reasoning

REASONING = [
    ("deepseek_r1", "", "<think>\nStep one.</think>\n\nThe answer.", "\nStep one.", "\n\nThe answer."),
    ("deepseek_r1", "", "Step one.</think>The answer.", "Step one.", "The answer."),
    ("deepseek_r1", "", "Still thinking </thi", "Still thinking </thi", None),
    ("qwen3", "", "<think>a < b</think>Yes.", "a < b", "Yes."),
    ("qwen3", "", "No thinking here.", None, "No thinking here."),
    ("qwen3", "<|im_start|>assistant\n<think>\n", "a</think>b", "a", "b"),
    ("qwen3", "<|im_start|>assistant\n<think>\n\n</think>\n\n", "plain", None, "plain"),
]


@pytest.mark.parametrize("name, prompt, text, reasoning, content", REASONING)
def test_reasoning_whole_and_every_split(name, prompt, text, reasoning, content):
    P = ReasoningParserManager.get_reasoning_parser(name)
    assert P(prompt_text=prompt).extract_reasoning(text) == (reasoning, content)
    for pieces in _splits(text):
        p = P(prompt_text=prompt)
        ds = [p.extract_reasoning_streaming(x) for x in pieces] + [p.finish_streaming()]
        r = "".join(d.reasoning or "" for d in ds if d) or None
        c = "".join(d.content or "" for d in ds if d) or None
        assert (r, c) == (reasoning, content), pieces
        assert not any(d and d.content and "</th" in d.content for d in ds)


def test_reasoning_end_token_ids(smollm_tokenizer_dir):
    import transformers
    tok = transformers.AutoTokenizer.from_pretrained(smollm_tokenizer_dir)
    P = ReasoningParserManager.get_reasoning_parser("deepseek_r1")
    ids = P(tok).end_token_ids()
    assert tok.decode(list(ids)) == "</think>"
    tok.add_tokens(["</think>"])
    assert P(tok).end_token_ids() == (tok.convert_tokens_to_ids("</think>"),)


@pytest.fixture(scope="module")
def think_tokenizer(smollm_tokenizer_dir):
    import transformers
    tok = transformers.AutoTokenizer.from_pretrained(smollm_tokenizer_dir)
    tok.add_tokens(["<think>", "</think>"])  # single-token tags, as reasoning models have them
    return tok


@pytest.mark.parametrize("name, prompt, text, reasoning, content", REASONING)
def test_reasoning_span_marks_the_reasoning_tokens(think_tokenizer, name, prompt, text, reasoning, content):
    """``reasoning_span`` over the token ids covers exactly the reasoning text and starts the
    content after the end tag ((0, 0, 0) without reasoning); the generic answer (re-tokenizing
    ``split``'s parts, for plugin parsers) counts the same here."""
    tok = think_tokenizer
    ids = tok.encode(text, add_special_tokens=False)
    p = ReasoningParserManager.get_reasoning_parser(name)(tok, prompt_text=prompt)
    start, end, content_start = p.reasoning_span(ids, text)
    assert tok.decode(ids[start:end]) == (reasoning or "")
    if reasoning is None:
        assert (start, end, content_start) == (0, 0, 0)
    else:
        assert tok.decode(ids[content_start:]) == (content or "")
    assert ReasoningParser.reasoning_span(p, ids, text)[1] == end - start


def test_reasoning_then_tool_calls_in_one_choice():
    text = ('<think>Need the weather.</think>\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n'
            '</tool_call>')

    def mk():
        return ChoiceParser(ReasoningParserManager.get_reasoning_parser("qwen3")(),
                            ToolParserManager.get_tool_parser("hermes")(tools=TOOLS))

    full = mk().parse(text)
    assert full.reasoning == "Need the weather." and full.content is None
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in full.tool_calls] == [
        ("get_time", '{"tz": "CET"}')]
    for pieces in _splits(text):
        p = mk()
        ds = [d for i, x in enumerate(pieces) for d in p.feed(x, i == len(pieces) - 1)]
        assert "".join(d.reasoning or "" for d in ds) == full.reasoning
        assert not any(d.content for d in ds), pieces
        args = "".join(tc["function"]["arguments"] for d in ds for tc in d.tool_calls or [])
        assert args == '{"tz": "CET"}' and p.tools_called


# ---------------------------------------------------------------------------- required / named


def _req(**kw):
    from serve.protocol import ChatCompletionRequest
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}], "tools": TOOLS,
                                                 **kw})


def test_named_schema_is_the_function_parameters():
    req = _req(tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert tool_choice_schema(req, "named") == TOOLS[1]["function"]["parameters"]
    assert tool_choice_schema(req, "auto") is None


def test_required_schema_accepts_calls_and_refuses_others():
    schema = tool_choice_schema(_req(tool_choice="required"), "required")
    good = [{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_time", "parameters": {}}]
    jsonschema.validate(good, schema)
    for bad in ([], [{"name": "other", "parameters": {}}], [{"name": "get_time"}],
                [{"name": "get_time", "parameters": {}, "extra": 1}],
                [{"name": "get_weather", "parameters": {"days": "three"}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    one = tool_choice_schema(_req(tool_choice="required", parallel_tool_calls=False), "required")
    assert one["maxItems"] == 1
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(good, one)


def test_required_schema_hoists_defs():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"p": {"$ref": "#/$defs/P"}}, "$defs": {"P": {"type": "integer"}}}}}]
    from serve.protocol import ChatCompletionRequest
    req = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}], "tools": tools,
                                                "tool_choice": "required"})
    schema = tool_choice_schema(req, "required")
    assert schema["$defs"] == {"P": {"type": "integer"}}
    jsonschema.validate([{"name": "f", "parameters": {"p": 1}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "f", "parameters": {"p": "x"}}], schema)


@pytest.mark.parametrize("text", [
    '[{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}, {"name": "get_time", "parameters": '
    '{"tz": "CET"}}]',
    ' [ {"name": "get_weather", "parameters": {"city": "Paris", "days": 3}} ,{"parameters": {"tz": "CET"}, '
    '"name": "get_time"} ] '])
def test_required_output_becomes_tool_calls(text):
    full = RequiredToolParser(tools=TOOLS).extract_tool_calls(text)
    assert full.content is None
    want = [(c["name"], c["parameters"]) for c in json.loads(text)]
    assert [(c.name, json.loads(c.arguments)) for c in full.tool_calls] == want
    for pieces in _splits(text):
        _, content, calls = _stream(RequiredToolParser(tools=TOOLS), pieces)
        assert content is None
        assert [(c["name"], c["arguments"]) for c in calls] == [(c.name, c.arguments) for c in full.tool_calls]


def test_named_output_becomes_one_tool_call():
    text = ' {"city": "Paris", "days": 3} '
    full = NamedToolParser("get_weather").extract_tool_calls(text)
    assert [(c.name, c.arguments) for c in full.tool_calls] == [("get_weather", '{"city": "Paris", "days": 3}')]
    for pieces in _splits(text):
        _, content, calls = _stream(NamedToolParser("get_weather"), pieces)
        assert content is None and [(c["name"], c["arguments"]) for c in calls] == [
            ("get_weather", '{"city": "Paris", "days": 3}')]


def test_tool_mode_follows_vllm():
    from serve.protocol import APIError
    from serve.tool_choice import tool_mode
    assert tool_mode(_req(), auto_enabled=True) == "auto"  # tools without tool_choice: auto
    assert tool_mode(_req(tool_choice="none"), auto_enabled=False) == "none"
    assert tool_mode(_req(tool_choice="required"), auto_enabled=False) == "required"
    assert tool_mode(_req(tool_choice={"type": "function", "function": {"name": "get_time"}}), False) == "named"
    assert tool_mode(_req(tool_choice="required", tools=[]), auto_enabled=False) == "none"  # OpenAI's rule
    assert tool_mode(_req(tool_choice="auto", tools=[]), auto_enabled=True) == "none"
    with pytest.raises(APIError, match="--enable-auto-tool-choice"):  # vLLM checks the flag first
        tool_mode(_req(tool_choice="auto", tools=[]), auto_enabled=False)
    with pytest.raises(APIError, match="not in `tools`"):
        tool_mode(_req(tool_choice={"type": "function", "function": {"name": "f"}}, tools=[]), False)
    with pytest.raises(APIError, match="`tools` must be set"):
        tool_mode(_req(tool_choice="required", tools=None), False)
    with pytest.raises(APIError, match="--enable-auto-tool-choice"):
        tool_mode(_req(), auto_enabled=False)


def test_special_token_markers_keep_special_tokens(smollm_tokenizer_dir):
    import transformers
    tok = transformers.AutoTokenizer.from_pretrained(smollm_tokenizer_dir)
    mistral = ToolParserManager.get_tool_parser("mistral")
    hermes = ToolParserManager.get_tool_parser("hermes")
    assert not mistral.needs_special_tokens(tok) and not hermes.needs_special_tokens(tok)
    tok.add_tokens(["<tool_call>"])  # an ordinary added token (Qwen's): nothing to keep
    tok.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]"]})
    assert mistral.needs_special_tokens(tok) and not hermes.needs_special_tokens(tok)
