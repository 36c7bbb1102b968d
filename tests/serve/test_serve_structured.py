"""Structured outputs through the server, as the official ``openai`` client sends them:
``chat.completions.parse`` with a pydantic model, ``response_format`` json_schema /
json_object, vLLM's ``structured_outputs`` and ``guided_*`` fields on both endpoints, streaming
equal to non-streaming, and a 400 naming the field for a constraint that cannot compile (the
server keeps serving).  The tiny model's free output is gibberish, so valid JSON is the
grammar's doing."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

pytest.register_assert_rewrite("support.serve_helpers")

from support.serve_helpers import ServerThread, assert_error_shape, make_engine  # noqa: E402

pytest_plugins = ["support.serve_helpers"]

GREEDY = dict(temperature=0, max_tokens=120)
MSG = [{"role": "user", "content": "Give me the data."}]

SCHEMAS = {
    "nested": {"type": "object", "properties": {
        "user": {"type": "object", "properties": {"id": {"type": "integer"}, "ok": {"type": "boolean"}},
                 "required": ["id", "ok"], "additionalProperties": False}},
        "required": ["user"], "additionalProperties": False},
    "bounded_array": {"type": "object", "properties": {
        "xs": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 2,
               "maxItems": 4}}, "required": ["xs"], "additionalProperties": False},
    "enum_optional": {"type": "object", "properties": {
        "color": {"enum": ["red", "green", "blue"]}, "note": {"type": "string", "maxLength": 5}},
        "required": ["color"], "additionalProperties": False},
    "any_of": {"type": "object", "properties": {
        "v": {"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 4}, {"type": "null"}]}},
        "required": ["v"], "additionalProperties": False},
    "pattern": {"type": "object", "properties": {
        "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}}, "required": ["code"],
        "additionalProperties": False},
}


class Pet(BaseModel):
    name: str = Field(max_length=6)
    legs: int = Field(ge=0, le=8)
    kind: str = Field(pattern="^(cat|dog)$")


@pytest.fixture(scope="module")
def server(tiny_llama):
    """A server of its own: compact JSON (``disable_any_whitespace`` engine-wide, which
    ``--structured-outputs-config`` sets), since the random model would pad JSON with
    whitespace until max_tokens."""
    from jaxllm.config import ServingConfig
    engine = make_engine(tiny_llama, structured_outputs_config={"disable_any_whitespace": True})
    srv = ServerThread(engine, ServingConfig(host="127.0.0.1", port=0, served_model_names=("tiny",)))
    yield srv
    srv.stop()
    engine.shutdown()


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_parse_with_a_pydantic_model(client):
    out = client.chat.completions.parse(model="tiny", messages=MSG, response_format=Pet, **GREEDY)
    msg = out.choices[0].message
    assert isinstance(msg.parsed, Pet), msg.content
    assert out.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_json_schema_responses_validate(client, name):
    schema = SCHEMAS[name]
    out = client.chat.completions.create(
        model="tiny", messages=MSG, **GREEDY,
        response_format={"type": "json_schema", "json_schema": {"name": name, "schema": schema}})
    text = out.choices[0].message.content
    jsonschema.validate(json.loads(text), schema)


def test_json_object_and_seeded_sampling(client):
    out = client.chat.completions.create(model="tiny", messages=MSG, temperature=1.0, seed=5, max_tokens=200,
                                         response_format={"type": "json_schema", "json_schema": {
                                             "name": "p", "schema": SCHEMAS["enum_optional"]}})
    jsonschema.validate(json.loads(out.choices[0].message.content), SCHEMAS["enum_optional"])
    out = client.chat.completions.create(model="tiny", messages=MSG, max_tokens=40, temperature=0,
                                         response_format={"type": "json_object"})
    assert out.choices[0].message.content.lstrip().startswith("{")


@pytest.mark.parametrize("body, check", [
    ({"guided_regex": r"[a-z]{3}-[0-9]{3}"}, lambda t: re.fullmatch(r"[a-z]{3}-[0-9]{3}", t)),
    ({"guided_choice": ["left", "right"]}, lambda t: t in ("left", "right")),
    ({"structured_outputs": {"regex": r"(ab|cd){2,3}"}}, lambda t: re.fullmatch(r"(ab|cd){2,3}", t)),
    ({"structured_outputs": {"choice": ["up", "down"]}}, lambda t: t in ("up", "down")),
    ({"guided_grammar": 'start: "x" ("," "x")*'}, lambda t: re.fullmatch(r"x(,x)*", t)),
    ({"guided_json": SCHEMAS["pattern"]}, lambda t: jsonschema.validate(json.loads(t), SCHEMAS["pattern"]) or True),
])
def test_regex_choice_grammar_on_both_endpoints(client, body, check):
    chat = client.chat.completions.create(model="tiny", messages=MSG, extra_body=body, **GREEDY)
    assert check(chat.choices[0].message.content), chat.choices[0].message.content
    comp = client.completions.create(model="tiny", prompt="Answer:", extra_body=body, **GREEDY)
    assert check(comp.choices[0].text), comp.choices[0].text


def test_response_format_is_honoured_by_completions(client):
    comp = client.completions.create(model="tiny", prompt="Data:", **GREEDY, extra_body={"response_format": {
        "type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMAS["nested"]}}})
    jsonschema.validate(json.loads(comp.choices[0].text), SCHEMAS["nested"])


def test_streaming_equals_non_streaming(client):
    rf = {"type": "json_schema", "json_schema": {"name": "b", "schema": SCHEMAS["bounded_array"]}}
    full = client.chat.completions.create(model="tiny", messages=MSG, response_format=rf, **GREEDY)
    parts = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="tiny", messages=MSG, response_format=rf, stream=True, **GREEDY) if c.choices]
    assert "".join(parts) == full.choices[0].message.content
    body = {"guided_regex": r"[0-9]{2,5}"}
    full = client.completions.create(model="tiny", prompt="n=", extra_body=body, **GREEDY)
    parts = [c.choices[0].text for c in client.completions.create(model="tiny", prompt="n=", extra_body=body,
                                                                  stream=True, **GREEDY)]
    assert "".join(parts) == full.choices[0].text


@pytest.mark.parametrize("path, body, param, needle", [
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "strin"}}}}}},
     "response_format", "strin"),
    ("/v1/chat/completions", {"response_format": {"type": "yaml"}}, "response_format", "yaml"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema"}}, "response_format", "json_schema"),
    ("/v1/chat/completions", {"guided_regex": "(ab"}, "guided_regex", "unclosed"),
    ("/v1/completions", {"guided_regex": "(ab"}, "guided_regex", "unclosed"),
    ("/v1/completions", {"guided_json": {"type": "object", "properties": {"a": {"type": "strin"}}}},
     "guided_json", "strin"),
    ("/v1/completions", {"structured_outputs": {"grammar": "start: nope"}}, "structured_outputs", "nope"),
    ("/v1/completions", {"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs",
     "exactly one"),
    ("/v1/completions", {"guided_choice": []}, "guided_choice", "non-empty"),
    ("/v1/completions", {"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice",
     "got both guided_regex and guided_choice"),
    ("/v1/completions", {"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex",
     "got both response_format and guided_regex"),
    ("/v1/chat/completions", {"structured_outputs": {"regex": "a"}, "guided_json": {"type": "object"}},
     "guided_json", "got both structured_outputs and guided_json"),
    ("/v1/completions", {"guided_regex": "a", "guided_decoding_backend": "xgrammar"}, "guided_decoding_backend",
     "xgrammar"),
])
def test_bad_constraints_are_a_400_naming_the_field(server, path, body, param, needle):
    base = {"model": "tiny", "max_tokens": 5}
    base.update({"messages": MSG} if "chat" in path else {"prompt": "x"})
    r = httpx.post(server.base + path, json={**base, **body}, timeout=60)
    assert_error_shape(r.json(), 400, param)
    assert needle in r.json()["error"]["message"], r.json()
    ok = httpx.post(server.base + path, json=base, timeout=60)   # still serving
    assert ok.status_code == 200
