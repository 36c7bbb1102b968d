"""No silently ignored request field: a walk over every field of every request model.

Each field is either honoured with vLLM's meaning (handed to SamplingParams under its name,
which the walk checks; or served by the server, with a named test of its effect; or one that
vLLM itself accepts without effect, with the reason) or refused (the model's ``REFUSED``
table): a request that sets it is a 400 naming it.  A new field that is none of these fails
:func:`test_every_field_is_classified`.  The effect tests of the fields this walk brought in
(``truncate_prompt_tokens``, ``return_tokens_as_token_ids``, ``request_id`` and
``X-Request-Id``, ``documents``) live here, on the shared tiny server.
"""

from __future__ import annotations

import ast
import logging
import os
import re

import httpx
import pytest

pytest.register_assert_rewrite("support.serve_helpers")

from support.serve_helpers import assert_error_shape  # noqa: E402

from jaxllm.sampling_params import SamplingParams  # noqa: E402
from serve.protocol import (ChatCompletionNamedToolChoiceParam, ChatCompletionRequest,  # noqa: E402
                            ChatCompletionToolParam, ChatMessage, ClassifyRequest, CompletionRequest,
                            DetokenizeRequest, EmbeddingRequest, PoolingRequest, RerankRequest, ScoreRequest,
                            FunctionDefinition, ImageContentPart, ImageURL, NamedFunction, OpenAIModel,
                            StreamOptions, TextContentPart,
                            TokenizeChatRequest, TokenizeCompletionRequest)
from serve.responses import protocol as responses_protocol  # noqa: E402
from serve.responses.convert import chat_messages, chat_request, input_items  # noqa: E402
from serve.responses.protocol import (FunctionCallItem, FunctionCallOutputItem, FunctionTool,  # noqa: E402
                                      InputImage, InputText, MessageItem, NamedToolChoice, ReasoningConfig, ReasoningItem,
                                      ResponsesRequest, TextConfig, TextFormat, Tool)
from serve.structured import resolve_constraint  # noqa: E402

pytest_plugins = ["support.serve_helpers"]

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HERE = "serve/test_request_fields.py"
IMAGES = "serve/test_image_parts.py"
MODELS = [CompletionRequest, ChatCompletionRequest, TokenizeCompletionRequest, TokenizeChatRequest, DetokenizeRequest,
          EmbeddingRequest, PoolingRequest, ClassifyRequest, ScoreRequest, RerankRequest]
MSGS = [{"role": "user", "content": "Say something."}]

TO_SAMPLING_PARAMS = {
    "n": 3, "temperature": 0.5, "top_p": 0.5, "top_k": 3, "min_p": 0.1, "presence_penalty": 0.5,
    "frequency_penalty": 0.5, "repetition_penalty": 1.5, "seed": 7, "stop": ["x"], "stop_token_ids": [5],
    "ignore_eos": True, "min_tokens": 2, "include_stop_str_in_output": True, "skip_special_tokens": False,
    "logit_bias": {"5": 1.0}, "allowed_token_ids": [1, 2], "bad_words": ["x"], "prompt_logprobs": 2,
}
"""Fields handed to SamplingParams under the same name (a value that is not the default); their
effects are SamplingParams' own tests (tests/sample/, tests/test_llm_api.py)."""

SERVED = {
    "model": "serve/test_serve_errors.py::test_unknown_model_is_404_and_aliases_work",
    "prompt": "serve/test_serve_openai.py::test_completion_sync_stream_equals_non_stream",
    "messages": "serve/test_serve_openai.py::test_chat_sync_stream_equals_non_stream",
    "max_tokens": "serve/test_serve_openai.py::test_completion_sync_stream_equals_non_stream",
    "max_completion_tokens": "serve/test_serve_openai.py::test_chat_sync_stream_equals_non_stream",
    "stream": "serve/test_serve_openai.py::test_completion_sync_stream_equals_non_stream",
    "stream_options": "serve/test_serve_openai.py::test_completion_sync_stream_equals_non_stream",
    "logprobs": "serve/test_serve_openai.py::test_completion_logprobs_and_echo",
    "echo": "serve/test_serve_openai.py::test_completion_logprobs_and_echo",
    "top_logprobs": "serve/test_serve_openai.py::test_chat_logprobs",
    "return_token_ids": "serve/test_serve_openai.py::test_stop_token_ids_and_stop_reason",
    "return_token_strs": "serve/test_serve_openai.py::test_tokenize_detokenize_round_trip",
    "tokens": "serve/test_serve_openai.py::test_tokenize_detokenize_round_trip",
    "suffix": "serve/test_serve_errors.py::test_bad_parameters_are_400s_naming_the_parameter",
    "best_of": "serve/test_serve_errors.py::test_bad_parameters_are_400s_naming_the_parameter",
    "priority": "serve/test_serve_errors.py::test_huge_but_valid_values_are_served",
    "cache_salt": "serve/test_serve_prefix_cache.py::test_completions_report_cached_tokens_and_salt_isolates",
    "response_format": "serve/test_serve_structured.py::test_parse_with_a_pydantic_model",
    "structured_outputs": "serve/test_serve_structured.py::test_regex_choice_grammar_on_both_endpoints",
    "guided_json": "serve/test_serve_structured.py::test_regex_choice_grammar_on_both_endpoints",
    "guided_regex": "serve/test_serve_structured.py::test_regex_choice_grammar_on_both_endpoints",
    "guided_choice": "serve/test_serve_structured.py::test_regex_choice_grammar_on_both_endpoints",
    "guided_grammar": "serve/test_serve_structured.py::test_regex_choice_grammar_on_both_endpoints",
    "guided_decoding_backend": "serve/test_serve_structured.py::test_bad_constraints_are_a_400_naming_the_field",
    "guided_whitespace_pattern": f"{HERE}::test_guided_whitespace_pattern_reaches_the_constraint",
    "tools": "serve/test_serve_tools.py::test_named_tool_choice_arguments_validate",
    "tool_choice": "serve/test_serve_tools.py::test_named_tool_choice_arguments_validate",
    "parallel_tool_calls": "serve/test_serve_tools.py::test_parallel_tool_calls_false_keeps_one_call",
    "add_special_tokens": f"{HERE}::test_chat_template_fields_through_tokenize",
    "add_generation_prompt": f"{HERE}::test_chat_template_fields_through_tokenize",
    "continue_final_message": f"{HERE}::test_chat_template_fields_through_tokenize",
    "chat_template": f"{HERE}::test_chat_template_fields_through_tokenize",
    "chat_template_kwargs": f"{HERE}::test_chat_template_fields_through_tokenize",
    "documents": f"{HERE}::test_documents_reach_the_chat_template",
    "truncate_prompt_tokens": f"{HERE}::test_truncate_prompt_tokens_keeps_the_last_n",
    "return_tokens_as_token_ids": f"{HERE}::test_return_tokens_as_token_ids",
    "request_id": f"{HERE}::test_request_id_and_header_name_the_response",
    "include_reasoning": "serve/test_serve_tools.py::test_include_reasoning_false_leaves_the_reasoning_out",
    "reasoning_effort": "serve/test_responses_tools.py::test_reasoning_effort_reaches_the_chat_template",
    # /v1/embeddings, /pooling, /classify (a pooling server; truncate_prompt_tokens is also served there; the
    # chat fields of an embeddings request: serve/test_embeddings.py::test_chat_messages_embed_as_the_rendered_text)
    "input": "serve/test_embeddings.py::test_token_id_inputs",
    "encoding_format": "serve/test_embeddings.py::test_openai_client_embeddings_match_sentence_transformers",
    "dimensions": "serve/test_embeddings.py::test_openai_client_dimensions_match_sentence_transformers_truncate_dim",
    # /score and /rerank (documents is also served there; truncate_prompt_tokens too)
    "text_1": "serve/test_scoring.py::test_score_matches_the_cross_encoder",
    "text_2": "serve/test_scoring.py::test_score_matches_the_cross_encoder",
    "queries": "serve/test_scoring.py::test_score_matches_the_cross_encoder",
    "query": "serve/test_scoring.py::test_rerank_sorts_by_relevance",
    "top_n": "serve/test_scoring.py::test_rerank_sorts_by_relevance",
    "return_documents": "serve/test_scoring.py::test_rerank_sorts_by_relevance",
}
"""Fields the server itself honours -> the test of the effect (its source names the field)."""

VLLM_NO_OP = {
    "user": "OpenAI's end-user id for abuse monitoring; vLLM accepts it and does nothing with it",
    "spaces_between_special_tokens": "only slow tokenizers read it; vLLM v1's fast-tokenizer detokenizer ignores "
                                     "it too, and every tokenizer here is a fast one",
}
"""Fields vLLM also accepts without effect here, and why."""

REFUSED_VALUE = {
    "use_beam_search": True, "length_penalty": 0.5, "logits_processors": ["x"], "kv_transfer_params": {"a": 1},
    "vllm_xargs": {"a": 1}, "prompt_embeds": "AAAA", "mm_processor_kwargs": {"a": 1},
}
"""A value (not the default) for each refused field, for the 400 check."""

ENDPOINT = {
    CompletionRequest: ("/v1/completions", {"prompt": "x", "max_tokens": 1}),
    ChatCompletionRequest: ("/v1/chat/completions", {"messages": MSGS, "max_tokens": 1}),
    TokenizeCompletionRequest: ("/tokenize", {"prompt": "x"}),
    TokenizeChatRequest: ("/tokenize", {"messages": MSGS}),
    DetokenizeRequest: ("/detokenize", {"tokens": [1]}),
}


NESTED = {
    StreamOptions: {"include_usage": "serve/test_serve_openai.py::test_chat_sync_stream_equals_non_stream",
                    "continuous_usage_stats": "serve/test_serve_openai.py::test_chat_sync_stream_equals_non_stream"},
    NamedFunction: {"name": "serve/test_serve_tools.py::test_named_tool_choice_arguments_validate"},
    ChatCompletionNamedToolChoiceParam: {
        "type": "serve/test_serve_tools.py::test_bad_tools_and_tool_choice_are_400",
        "function": "serve/test_serve_tools.py::test_named_tool_choice_arguments_validate"},
    # What reaches the chat template as sent: test_message_and_tool_fields_reach_the_chat_template.
    ChatMessage: {f: f"{HERE}::test_message_and_tool_fields_reach_the_chat_template" for f in
                  ("role", "content", "name", "tool_calls", "tool_call_id")},
    TextContentPart: {f: f"{HERE}::test_message_and_tool_fields_reach_the_chat_template" for f in ("type", "text")},
    ImageContentPart: {f: f"{IMAGES}::test_bad_images_are_400s_naming_the_part_and_the_server_keeps_serving"
                       for f in ("type", "image_url")},
    ImageURL: {"url": f"{IMAGES}::test_bad_images_are_400s_naming_the_part_and_the_server_keeps_serving"},
    ChatCompletionToolParam: {f: f"{HERE}::test_message_and_tool_fields_reach_the_chat_template"
                              for f in ("type", "function")},
    FunctionDefinition: {f: f"{HERE}::test_message_and_tool_fields_reach_the_chat_template"
                         for f in ("name", "description", "parameters", "strict")},
}
"""The models nested in requests: field -> the test of its effect."""

RESPONSES = "serve/test_responses.py"
RESPONSES_TOOLS = "serve/test_responses_tools.py"
MAPPED = f"{HERE}::test_responses_fields_map_onto_the_chat_request"
"""A Responses field that becomes a chat field: that mapping's test (the chat field's effect is
the chat tests' own, named in SERVED / NESTED above)."""

RESPONSES_SERVED = {
    "model": f"{RESPONSES}::test_text_equals_chat_and_the_store_round_trip",
    "input": f"{RESPONSES}::test_text_equals_chat_and_the_store_round_trip",
    "max_output_tokens": f"{RESPONSES}::test_text_equals_chat_and_the_store_round_trip",
    "temperature": f"{RESPONSES}::test_text_equals_chat_and_the_store_round_trip",
    "instructions": MAPPED, "tool_choice": MAPPED, "parallel_tool_calls": MAPPED, "top_p": MAPPED, "seed": MAPPED,
    "tools": f"{RESPONSES_TOOLS}::test_function_call_round_trip",
    "text": f"{RESPONSES}::test_json_schema_validates",
    "reasoning": f"{RESPONSES_TOOLS}::test_reasoning_effort_reaches_the_chat_template",
    "metadata": f"{RESPONSES}::test_metadata_and_request_id_name_the_stored_response",
    "request_id": f"{RESPONSES}::test_metadata_and_request_id_name_the_stored_response",
    "store": f"{RESPONSES}::test_store_false_is_not_retrievable_and_unknown_previous_is_404",
    "stream": f"{RESPONSES}::test_stream_events_order_sequence_and_deltas",
    "background": f"{RESPONSES}::test_background_response_is_cancelled",
    "previous_response_id": f"{RESPONSES}::test_previous_response_id_continues_the_conversation",
    "include": f"{RESPONSES}::test_output_logprobs_equal_chat_logprobs_whole_and_streamed",
    "top_logprobs": f"{RESPONSES}::test_output_logprobs_equal_chat_logprobs_whole_and_streamed",
    "truncation": f"{RESPONSES}::test_truncation_auto_drops_the_oldest_items",
}
"""/v1/responses (ResponsesRequest): field -> the test of its effect."""

RESPONSES_NO_OP = {
    "user": VLLM_NO_OP["user"],
}
"""ResponsesRequest fields accepted without effect, and why."""

_ITEM = {f: MAPPED for f in ("type", "id", "status")}   # the stored input items keep id and status
NESTED.update({
    InputText: {f: MAPPED for f in ("type", "text")},
    InputImage: {f: f"{IMAGES}::test_responses_input_image_flows_through_the_chat_converter"
                 for f in ("type", "image_url", "file_id")},
    MessageItem: {**_ITEM, "role": MAPPED, "content": MAPPED},
    FunctionCallItem: {**_ITEM, "call_id": MAPPED, "name": MAPPED, "arguments": MAPPED},
    FunctionCallOutputItem: {**_ITEM, "call_id": MAPPED, "output": MAPPED},
    FunctionTool: {f: MAPPED for f in ("type", "name", "description", "parameters", "strict")},
    Tool: {"type": MAPPED},
    NamedToolChoice: {f: MAPPED for f in ("type", "name")},
    TextFormat: {f: MAPPED for f in ("type", "name", "schema_", "strict")},
    TextConfig: {"format": MAPPED},
    ReasoningConfig: {"effort": f"{RESPONSES_TOOLS}::test_reasoning_effort_reaches_the_chat_template"},
})

NESTED_NO_OP = {
    ImageURL: {"detail": "OpenAI's resolution hint, accepted without effect as vLLM does (the model's image "
                         "processor decides the resolution)"},
    InputImage: {"detail": "passed on as the chat part's image_url.detail, which vLLM accepts without effect"},
    ReasoningItem: {f: "earlier reasoning is not replayed to the model (chat templates strip earlier turns' "
                       "reasoning; vLLM drops these items too); accepted so that clients may send it back"
                    for f in ("type", "id", "summary", "content", "encrypted_content", "status")},
    TextFormat: {"description": "only the schema constrains the output (vLLM's structured outputs take the "
                                "schema alone); no chat template here reads a format description"},
    TextConfig: {"verbosity": "accepted without effect, as vLLM does: no chat template here reads a verbosity"},
    ReasoningConfig: {f: "no reasoning summaries are generated (reasoning items carry the reasoning text and an "
                         "empty summary, as vLLM's do)" for f in ("summary", "generate_summary")},
}
"""Nested fields accepted without effect, and why."""


def _request_models() -> set[type]:
    """Every pydantic model a request body is parsed into (so a new one cannot hide)."""
    import serve.protocol as p
    return {v for m in (p, responses_protocol) for v in vars(m).values() if isinstance(v, type)
            and issubclass(v, OpenAIModel) and v is not OpenAIModel and not v.__name__.startswith("_")}


def test_every_request_model_is_walked():
    assert _request_models() == set(MODELS) | {ResponsesRequest} | set(NESTED) | set(NESTED_NO_OP)


@pytest.mark.parametrize("model", sorted(set(NESTED) | set(NESTED_NO_OP), key=lambda m: m.__name__),
                         ids=lambda m: m.__name__)
def test_every_nested_field_is_classified(model):
    served, no_op = NESTED.get(model, {}), NESTED_NO_OP.get(model, {})
    unclassified = sorted(set(model.model_fields) - set(served) - set(no_op) - set(model.REFUSED))
    assert not unclassified, f"{model.__name__}: fields neither honoured nor refused: {unclassified}"
    assert not set(served) & set(no_op), f"{model.__name__}: fields classified twice"
    for field, ref in served.items():
        src = _test_source(ref)
        assert src is not None and re.search(rf"\b{field}\b", src), f"{model.__name__}.{field}: {ref}"


def test_every_responses_field_is_classified():
    fields = set(ResponsesRequest.model_fields)
    classes = [set(RESPONSES_SERVED), set(RESPONSES_NO_OP), set(ResponsesRequest.REFUSED)]
    unclassified = sorted(fields - set().union(*classes))
    assert not unclassified, f"ResponsesRequest: fields neither honoured nor refused: {unclassified}"
    assert sum(map(len, classes)) == len(set().union(*classes)), "ResponsesRequest: a field classified twice"
    assert set().union(*classes) <= fields, "the tables name fields ResponsesRequest does not have"


@pytest.mark.parametrize("field", sorted(RESPONSES_SERVED))
def test_each_served_responses_field_has_an_effect_test(field):
    src = _test_source(RESPONSES_SERVED[field])
    assert src is not None, f"{field}: no test {RESPONSES_SERVED[field]}"
    assert re.search(rf"\b{field}\b", src), f"{field}: {RESPONSES_SERVED[field]} does not mention it"


def _test_source(ref: str) -> str | None:
    path, name = ref.split("::")
    with open(os.path.join(TESTS, path)) as f:
        src = f.read()
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return "".join(ast.get_source_segment(src, n) for n in [*node.decorator_list, node])
    return None


@pytest.mark.parametrize("model", MODELS, ids=lambda m: m.__name__)
def test_every_field_is_classified(model):
    """A field that is none of honoured / vLLM's no-op / refused fails here: classify it."""
    classes = {name: [kind for kind, table in (("sampling", TO_SAMPLING_PARAMS), ("served", SERVED),
                                               ("no-op", VLLM_NO_OP), ("refused", model.REFUSED))
                      if name in table] for name in model.model_fields}
    unclassified = sorted(n for n, c in classes.items() if not c)
    assert not unclassified, f"{model.__name__}: fields neither honoured nor refused: {unclassified}"
    twice = {n: c for n, c in classes.items() if len(c) > 1}
    assert not twice, f"{model.__name__}: fields classified twice: {twice}"


@pytest.mark.parametrize("field", sorted(SERVED))
def test_each_served_field_has_an_effect_test(field):
    src = _test_source(SERVED[field])
    assert src is not None, f"{field}: no test {SERVED[field]}"
    assert re.search(rf"\b{field}\b", src), f"{field}: {SERVED[field]} does not mention it"


@pytest.mark.parametrize("field", sorted(TO_SAMPLING_PARAMS))
def test_sampling_fields_reach_sampling_params(field):
    base = CompletionRequest(prompt="x").to_sampling_params(16, {}, 1000)
    req = CompletionRequest.model_validate({"prompt": "x", field: TO_SAMPLING_PARAMS[field]})
    got = req.to_sampling_params(16, {}, 1000)
    assert getattr(got, field) != getattr(base, field), f"{field} did not reach SamplingParams"
    assert field in SamplingParams.__dataclass_fields__


REFUSED_CASES = [(m, f) for m in MODELS for f in sorted(m.REFUSED)]


@pytest.mark.parametrize("model, field", REFUSED_CASES, ids=[f"{m.__name__}-{f}" for m, f in REFUSED_CASES])
def test_refused_fields_are_a_400_naming_them(http, model, field):
    path, body = ENDPOINT[model]
    r = http.post(path, json={**body, field: REFUSED_VALUE[field]})
    assert r.status_code == 400, r.text
    err = assert_error_shape(r.json(), 400, field)
    assert field in err["message"]
    # Its default is no request for the unsupported thing: served.
    default = model.model_fields[field].default
    assert http.post(path, json={**body, field: default}).status_code == 200


def test_unknown_fields_are_named_in_a_warning(caplog):
    req = CompletionRequest.model_validate({"prompt": "x", "no_such_field": 1})
    with caplog.at_level(logging.WARNING, logger="jaxllm.serve"):
        req.check_supported()
    assert "no_such_field" in caplog.text


# ---------------------------------------------------------------------------- effect tests


def test_truncate_prompt_tokens_keeps_the_last_n(http):
    ids = list(range(100, 112))
    r = http.post("/v1/completions", json={"prompt": ids, "max_tokens": 1, "truncate_prompt_tokens": 3,
                                          "return_token_ids": True}).json()
    assert r["usage"]["prompt_tokens"] == 3
    assert r["choices"][0]["prompt_token_ids"] == ids[-3:]
    full = http.post("/v1/completions", json={"prompt": ids, "max_tokens": 1, "truncate_prompt_tokens": -1}).json()
    assert full["usage"]["prompt_tokens"] == 12
    chat = http.post("/v1/chat/completions", json={"messages": MSGS, "max_tokens": 1, "truncate_prompt_tokens": 4,
                                                   "return_token_ids": True}).json()
    assert chat["usage"]["prompt_tokens"] == 4 and len(chat["prompt_token_ids"]) == 4
    r = http.post("/v1/completions", json={"prompt": ids, "max_tokens": 1, "truncate_prompt_tokens": 10**6})
    assert_error_shape(r.json(), 400, "truncate_prompt_tokens")


def test_min_tokens_must_fit_what_the_prompt_leaves(http):
    """The context-room cap lives in the input processor alone; min_tokens above it is a 400."""
    ids = [100] * 250   # max_model_len 256: 6 tokens of room
    r = http.post("/v1/completions", json={"prompt": ids, "max_tokens": 100, "min_tokens": 10})
    assert "max_tokens=6" in assert_error_shape(r.json(), 400, "min_tokens")["message"]
    r = http.post("/v1/completions", json={"prompt": ids, "max_tokens": 100, "min_tokens": 6, "ignore_eos": True})
    assert r.json()["usage"]["completion_tokens"] == 6


def test_return_tokens_as_token_ids(http):
    body = {"prompt": "Hello", "max_tokens": 3, "temperature": 0, "logprobs": 2, "ignore_eos": True,
            "return_token_ids": True, "return_tokens_as_token_ids": True}
    c = http.post("/v1/completions", json=body).json()["choices"][0]
    assert c["logprobs"]["tokens"] == [f"token_id:{t}" for t in c["token_ids"]]
    assert all(re.fullmatch(r"token_id:\d+", k) for top in c["logprobs"]["top_logprobs"] for k in top)
    chat = http.post("/v1/chat/completions", json={
        "messages": MSGS, "max_tokens": 3, "temperature": 0, "logprobs": True, "top_logprobs": 2,
        "ignore_eos": True, "return_token_ids": True, "return_tokens_as_token_ids": True}).json()["choices"][0]
    assert [e["token"] for e in chat["logprobs"]["content"]] == [f"token_id:{t}" for t in chat["token_ids"]]


@pytest.mark.parametrize("stream", [False, True])
def test_request_id_and_header_name_the_response(http, stream):
    def ids(path, body, headers=None):
        r = http.post(path, json={**body, "stream": stream}, headers=headers or {})
        assert r.status_code == 200, r.text
        if not stream:
            return {r.json()["id"]}
        import json
        return {json.loads(line[6:])["id"] for line in r.text.splitlines()
                if line.startswith("data: {")}

    comp = {"prompt": "x", "max_tokens": 2, "request_id": "abc"}
    assert ids("/v1/completions", comp) == {"cmpl-abc"}
    assert ids("/v1/completions", comp, {"X-Request-Id": "hdr1"}) == {"cmpl-hdr1"}   # the header wins
    chat = {"messages": MSGS, "max_tokens": 2, "request_id": "abc"}
    assert ids("/v1/chat/completions", chat) == {"chatcmpl-abc"}
    assert ids("/v1/chat/completions", {**chat, "request_id": None}, {"X-Request-Id": "hdr2"}) == {"chatcmpl-hdr2"}


def test_documents_reach_the_chat_template(http):
    template = ("{% for d in documents or [] %}[{{ d.title }}: {{ d.text }}]{% endfor %}"
                "{% for m in messages %}{{ m.content }}{% endfor %}")
    body = {"messages": MSGS, "max_tokens": 1, "chat_template": template, "return_token_ids": True}
    with_docs = http.post("/v1/chat/completions", json={
        **body, "documents": [{"title": "Zebra", "text": "stripes"}]}).json()
    text = http.post("/detokenize", json={"tokens": with_docs["prompt_token_ids"]}).json()["prompt"]
    assert text == "[Zebra: stripes]Say something."
    bare = http.post("/v1/chat/completions", json=body).json()
    assert http.post("/detokenize", json={"tokens": bare["prompt_token_ids"]}).json()["prompt"] == "Say something."


def test_chat_template_fields_through_tokenize(http):
    """chat_template, chat_template_kwargs, add_generation_prompt, continue_final_message and
    add_special_tokens as the one renderer applies them."""
    template = ("{{ greeting }}{% for m in messages %}<{{ m.role }}>{{ m.content }}"
                "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")

    def text(**kw):
        ids = http.post("/tokenize", json={"messages": MSGS, "chat_template": template, **kw}).json()["tokens"]
        return http.post("/detokenize", json={"tokens": ids}).json()["prompt"]

    assert text(chat_template_kwargs={"greeting": "Hi"}) == "Hi<user>Say something.<assistant>"
    assert text(add_generation_prompt=False) == "<user>Say something."
    assert text(add_generation_prompt=False, continue_final_message=True) == "<user>Say something."
    r = http.post("/tokenize", json={"messages": MSGS, "continue_final_message": True})
    assert_error_shape(r.json(), 400, "continue_final_message")   # together with add_generation_prompt
    plain = http.post("/tokenize", json={"messages": MSGS, "chat_template": template}).json()["tokens"]
    special = http.post("/tokenize", json={"messages": MSGS, "chat_template": template,
                                           "add_special_tokens": True}).json()["tokens"]
    assert special[-len(plain):] == plain   # any special tokens the tokenizer adds come around the text


def test_message_and_tool_fields_reach_the_chat_template():
    """Every field of a message and of a tool reaches the template (set them all here)."""
    msg = ChatMessage.model_validate({
        "role": "assistant", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
        "name": "n", "tool_call_id": "t",
        "tool_calls": [{"id": "1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}]})
    d = msg.to_template_dict()
    assert set(d) == set(ChatMessage.model_fields)
    assert d["content"] == "a\nb" and d["tool_calls"][0]["function"]["arguments"] == {"x": 1}
    tool = ChatCompletionToolParam.model_validate({"type": "function", "function": {
        "name": "f", "description": "d", "parameters": {"type": "object"}, "strict": True}})
    d = tool.to_template_dict()
    assert set(d) == set(ChatCompletionToolParam.model_fields)
    assert set(d["function"]) == set(FunctionDefinition.model_fields)
    assert set(TextContentPart.model_fields) == {"type", "text"}


def test_responses_fields_map_onto_the_chat_request(caplog):
    """A Responses body becomes the chat request whose fields have their own effect tests: every
    field and item kind set here (a message's text parts, an assistant turn with its function
    call, the call's output, a developer message).  The stored input items keep the client's
    id and status."""
    weather = {"type": "function", "name": "get_weather", "description": "d", "parameters": {"type": "object"},
               "strict": True}
    schema = {"type": "object"}
    req = ResponsesRequest.model_validate({
        "model": "tiny", "instructions": "Be brief.", "input": [
            {"type": "message", "role": "user", "id": "msg_1", "status": "completed",
             "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "c"}]},
            {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{}", "id": "fc_1",
             "status": "in_progress"},
            {"type": "function_call_output", "call_id": "call_1", "output": "sunny", "id": "fco_1",
             "status": "completed"},
            {"role": "developer", "content": "d"}],
        "tools": [weather, {"type": "web_search"}], "tool_choice": {"type": "function", "name": "get_weather"},
        "parallel_tool_calls": False,
        "text": {"format": {"type": "json_schema", "name": "answer", "schema": schema, "strict": True}},
        "include": ["message.output_text.logprobs"], "top_logprobs": 2,
        "max_output_tokens": 5, "temperature": 0.5, "top_p": 0.9, "seed": 7})
    assert req.text.format.schema_ == schema
    items = input_items(req)
    assert [(i["id"][:4], i["status"]) for i in items] == [
        ("msg_", "completed"), ("msg_", "completed"), ("fc_1", "in_progress"), ("fco_", "completed"),
        ("msg_", "completed")]
    assert [items[0]["id"], items[2]["id"], items[3]["id"]] == ["msg_1", "fc_1", "fco_1"]
    with caplog.at_level(logging.WARNING, logger="jaxllm.serve"):
        chat = chat_request(req, chat_messages(req.instructions, items), stream=False)
    assert "tool type 'web_search' is not served" in caplog.text   # left out, with a warning
    assert chat.model_dump(exclude_none=True, exclude_defaults=True) == {
        "model": "tiny", "temperature": 0.5, "top_p": 0.9, "seed": 7, "max_tokens": 5,
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "a\nb"},
                     {"role": "assistant", "content": "c", "tool_calls": [
                         {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]},
                     {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
                     {"role": "system", "content": "d"}],
        "logprobs": True, "top_logprobs": 2,
        "tools": [{"type": "function", "function": {"name": "get_weather", "description": "d",
                                                    "parameters": schema, "strict": True}}],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}}, "parallel_tool_calls": False,
        "response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema,
                                                                   "strict": True}}}


def test_guided_whitespace_pattern_reaches_the_constraint():
    req = CompletionRequest.model_validate({"prompt": "x", "guided_json": {"type": "object"},
                                            "guided_whitespace_pattern": "[ ]?"})
    assert resolve_constraint(req).params.whitespace_pattern == "[ ]?"
