"""Typed request and response bodies of the OpenAI API (vLLM's dialect), and the error shape.

Requests are parsed strictly from JSON (a string is not a number, 1.0 is not an integer,
NaN and Infinity are refused) so that a malformed body is a 400 naming the field rather
than something the engine trips over later.  Every declared field is either honoured with
vLLM's meaning or in its model's ``REFUSED`` table: a request that sets a refused field is a
400 naming it (:meth:`OpenAIModel.check_supported`; tests/serve/test_request_fields.py walks
them all).  Unknown fields are accepted and ignored, as vLLM does, with vLLM's warning that
names them.  The vLLM extensions the engine supports are typed here too (top_k, min_p,
repetition_penalty, min_tokens, ignore_eos, stop_token_ids, include_stop_str_in_output,
skip_special_tokens, echo, add_generation_prompt, chat_template_kwargs, priority, cache_salt, seed,
return_token_ids, allowed_token_ids, bad_words, prompt_logprobs, structured_outputs and guided_*,
response_format on both endpoints); checks that need the
model (vocabulary, context length, --max-logprobs, cache_salt) happen once, in the engine's
input processor, whose ValueError names the parameter and becomes a 400.
"""

from __future__ import annotations

import json
import logging
import re
import time
from http import HTTPStatus
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from jaxllm.sampling_params import SamplingParams, StructuredOutputsParams

log = logging.getLogger("jaxllm.serve")

# Integers that reach the engine are bounded so that none can overflow a device array.
Int64 = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]
TokenId = Annotated[int, Field(ge=0, le=2**31 - 1)]
MAX_N = 128
"""OpenAI's limit on ``n``; also keeps one request from flooding the scheduler."""
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]
"""OpenAI's (and vLLM's) efforts: chat's ``reasoning_effort``, the Responses API's ``reasoning.effort``."""


# ---------------------------------------------------------------------------- errors


class APIError(Exception):
    """An error answered with an HTTP status and OpenAI's error body."""

    def __init__(self, status: int, message: str, param: str | None = None, err_type: str | None = None):
        super().__init__(message)
        self.status = int(status)
        self.message = message
        self.param = param
        self.err_type = err_type or error_type(status)

    def body(self) -> dict:
        return error_body(self.status, self.message, self.param, self.err_type)


def error_type(status: int) -> str:
    """vLLM's names: 400 -> BadRequestError, 404 -> NotFoundError, 500 -> InternalServerError."""
    try:
        phrase = HTTPStatus(status).phrase
    except ValueError:
        return "Error"
    name = "".join(w[:1].upper() + w[1:] for w in re.split(r"[\s-]+", phrase))
    return name if name.endswith("Error") else name + "Error"


def error_body(status: int, message: str, param: str | None = None, err_type: str | None = None) -> dict:
    return {"error": {"message": message, "type": err_type or error_type(status), "param": param,
                      "code": int(status)}}


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(HTTPStatus.BAD_REQUEST, message, param)


def validation_error(e: ValidationError) -> APIError:
    """A pydantic error as a 400 whose ``param`` is the offending top-level field."""
    errs = e.errors(include_url=False)
    if not errs:
        return bad_request("invalid request body")
    first = errs[0]
    top = first.get("loc", ())[:1]
    # The most specific error about the same field: for a union (a message's content is a string
    # or a list of parts) the first error is the string branch's, the deepest names the part.
    first = max((e for e in errs if e.get("loc", ())[:1] == top), key=lambda e: len(e.get("loc", ())))
    loc = [str(x) for x in first.get("loc", ())]
    param = loc[0] if loc else None
    where = ".".join(loc) if loc else "body"
    msg = f"{where}: {first.get('msg', 'invalid value')}"
    if first.get("type") == "model_type" and not loc:
        msg = "the request body must be a JSON object"
    if len(errs) > 1:
        msg += f" (and {len(errs) - 1} more problem{'s' if len(errs) > 2 else ''})"
    return bad_request(msg, param)


_LEADING_NAME = re.compile(r"^\s*`?([A-Za-z_][A-Za-z0-9_]*)`?\b")


def error_param(e: ValueError, fields: set[str], aliases: dict[str, str] | None = None) -> str | None:
    """The request field a ValueError is about, for ``param``: the one the input processor
    named (``e.param``), else the name the message starts with (SamplingParams' messages do);
    ``aliases`` maps an engine name to this endpoint's field."""
    name = getattr(e, "param", None)
    if name is None:
        m = _LEADING_NAME.match(str(e))
        name = m.group(1) if m else None
    if name is None:
        return None
    if aliases and name in aliases:
        return aliases[name]
    return name if name in fields else None


# ---------------------------------------------------------------------------- requests


class OpenAIModel(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)

    REFUSED: ClassVar[dict[str, str]] = {}
    """vLLM's fields this server does not support (yet): name -> what it would need.  Setting
    one to anything but its default is a 400 naming it."""

    def check_supported(self) -> None:
        """A 400 naming the first refused field the request sets; a warning naming the fields
        it sends that no model declares (vLLM's, word for word)."""
        for name, why in self.REFUSED.items():
            value = getattr(self, name)
            if name in self.model_fields_set and value is not None and value != type(self).model_fields[name].default:
                raise bad_request(f"{name} is not supported by this server ({why})", name)
        if self.model_extra:
            log.warning("The following fields were present in the request but ignored: %s", set(self.model_extra))


class StreamOptions(OpenAIModel):
    include_usage: bool | None = True
    continuous_usage_stats: bool | None = False


class TextContentPart(OpenAIModel):
    type: Literal["text"]
    text: str


class ImageURL(OpenAIModel):
    url: str
    """A ``data:image/...;base64,`` URL, an ``http(s)://`` URL, or ``file://`` under
    ``--allowed-local-media-path`` (jaxllm/multimodal/media.py)."""
    detail: Literal["auto", "low", "high"] | None = "auto"
    """OpenAI's resolution hint; accepted and, as in vLLM, not used (the model's processor decides)."""


class ImageContentPart(OpenAIModel):
    type: Literal["image_url"]
    image_url: ImageURL


ContentPart = Annotated[TextContentPart | ImageContentPart, Field(discriminator="type")]


class FunctionDefinition(OpenAIModel):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    """A JSON schema for the arguments (an object)."""
    strict: bool | None = None


class ChatCompletionToolParam(OpenAIModel):
    """One entry of ``tools``: only function tools exist."""

    type: Literal["function"]
    function: FunctionDefinition

    def to_template_dict(self) -> dict:
        """The tool as sent (extra keys kept), for the chat template and the parsers."""
        return self.model_dump(exclude_unset=True)


class NamedFunction(OpenAIModel):
    name: str = Field(min_length=1)


class ChatCompletionNamedToolChoiceParam(OpenAIModel):
    """``tool_choice: {"type": "function", "function": {"name": ...}}``."""

    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | ChatCompletionNamedToolChoiceParam


class ChatMessage(OpenAIModel):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None

    def images(self) -> list[tuple[int, ImageURL]]:
        """The image parts, in order, with their index in ``content``."""
        if not isinstance(self.content, list):
            return []
        return [(i, p.image_url) for i, p in enumerate(self.content) if isinstance(p, ImageContentPart)]

    def text(self) -> str | None:
        """The text parts joined with newlines (vLLM), images left out."""
        if isinstance(self.content, list):
            return "\n".join(p.text for p in self.content if isinstance(p, TextContentPart))
        return self.content

    def to_template_dict(self) -> dict:
        """The message as the chat template sees it: text parts joined with newlines (vLLM); a
        message with images keeps its parts, in order, as HF processors' templates read them
        (``{"type": "text", "text": ...}`` and ``{"type": "image"}``)."""
        d: dict[str, Any] = {"role": self.role}
        if self.images():
            d["content"] = [{"type": "image"} if isinstance(p, ImageContentPart) else {"type": "text", "text": p.text}
                            for p in self.content]
        else:
            d["content"] = self.text()
        for key in ("name", "tool_calls", "tool_call_id"):
            v = getattr(self, key)
            if v is not None:
                d[key] = v
        if self.tool_calls:
            d["tool_calls"] = [_template_tool_call(c) for c in self.tool_calls]
        return d


def _template_tool_call(call: dict) -> dict:
    """An assistant message's tool call as chat templates read it: ``function.arguments`` as
    a mapping rather than OpenAI's JSON text (vLLM does the same; templates index into it)."""
    fn = call.get("function")
    if not isinstance(fn, dict) or not isinstance(fn.get("arguments"), str):
        return call
    try:
        args = json.loads(fn["arguments"])
    except ValueError:
        return call
    if not isinstance(args, dict):
        return call
    return {**call, "function": {**fn, "arguments": args}}


class _SamplingRequest(OpenAIModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int64 | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: Int64 | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool = False
    min_tokens: Int64 = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[TokenId] | None = None
    bad_words: list[str] | None = None
    prompt_logprobs: Int64 | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    priority: Int64 = 0
    cache_salt: str | None = None
    """vLLM extension: only requests with the same salt share cached prefix KV (tenant isolation)."""
    return_token_ids: bool | None = False
    """vLLM extension: add the token ids (and, once, the prompt's) to each choice."""
    echo: bool | None = False
    truncate_prompt_tokens: Int64 | None = Field(None, ge=-1)
    """vLLM extension: keep only the last N prompt tokens (-1: the last max_model_len)."""
    return_tokens_as_token_ids: bool | None = False
    """vLLM extension: logprobs name tokens as ``token_id:N`` (for tokens that are not valid text)."""
    request_id: str | None = None
    """vLLM extension: the basis of the response's id (the ``X-Request-Id`` header wins)."""
    # Refused (REFUSED below): what this server cannot do yet.
    use_beam_search: bool = False
    length_penalty: float = 1.0
    logits_processors: list[Any] | None = None
    kv_transfer_params: dict[str, Any] | None = None
    vllm_xargs: dict[str, Any] | None = None
    # Structured outputs (serve/structured.py): vLLM's object and its older per-kind fields.
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None
    guided_decoding_backend: str | None = None

    REFUSED: ClassVar[dict[str, str]] = {
        "use_beam_search": "beam search is not implemented",
        "length_penalty": "it applies to beam search, which is not implemented",
        "logits_processors": "custom logits processors are not loaded",
        "kv_transfer_params": "disaggregated prefill (KV transfer) is not implemented",
        "vllm_xargs": "no custom sampling extension reads them",
    }

    def truncated(self, ids: list[int], max_model_len: int) -> list[int]:
        """``truncate_prompt_tokens``: the last N of ``ids`` (-1: N is max_model_len)."""
        k = self.truncate_prompt_tokens
        if k is None:
            return ids
        if k > max_model_len:
            raise bad_request(f"truncate_prompt_tokens value ({k}) is greater than max_model_len ({max_model_len}). "
                              "Please, select a smaller truncation size.", "truncate_prompt_tokens")
        k = max_model_len if k == -1 else k
        return ids[len(ids) - k:] if k < len(ids) else ids

    def engine_prompt(self, text: str | None, ids: list[int]) -> dict:
        """The prompt as the engine takes it (with the cache salt when there is one)."""
        prompt = {"prompt": text, "prompt_token_ids": ids}
        if self.cache_salt is not None:
            prompt["cache_salt"] = self.cache_salt
        return prompt

    def check_stream_options(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options can only be set when stream is true", "stream_options")

    def include_usage(self) -> tuple[bool, bool]:
        """(final usage chunk, usage in every chunk) for a streaming request."""
        so = self.stream_options
        if so is None:
            return False, False
        inc = bool(so.include_usage)
        return inc, inc and bool(so.continuous_usage_stats)

    def _sampling_kwargs(self, max_tokens: int | None, defaults: dict, vocab_size: int,
                         structured: StructuredOutputsParams | None) -> dict:
        def pick(value, key, fallback):
            return value if value is not None else defaults.get(key, fallback)

        top_k = pick(self.top_k, "top_k", 0)
        if isinstance(top_k, int) and not isinstance(top_k, bool) and top_k >= vocab_size:
            top_k = 0  # keeping the whole vocabulary is no truncation at all
        logit_bias = None
        if self.logit_bias is not None:
            # vLLM clamps biases to [-100, 100].
            logit_bias = {k: min(max(v, -100.0), 100.0) for k, v in self.logit_bias.items()}
        return dict(
            n=self.n, temperature=pick(self.temperature, "temperature", 1.0),
            top_p=pick(self.top_p, "top_p", 1.0), top_k=top_k, min_p=pick(self.min_p, "min_p", 0.0),
            presence_penalty=pick(self.presence_penalty, "presence_penalty", 0.0),
            frequency_penalty=pick(self.frequency_penalty, "frequency_penalty", 0.0),
            repetition_penalty=pick(self.repetition_penalty, "repetition_penalty", 1.0),
            seed=self.seed, stop=self.stop, stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
            max_tokens=max_tokens, min_tokens=self.min_tokens, prompt_logprobs=self.prompt_logprobs,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens, logit_bias=logit_bias,
            allowed_token_ids=self.allowed_token_ids, bad_words=self.bad_words,
            structured_outputs=structured)


class CompletionRequest(_SamplingRequest):
    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
    max_tokens: Int64 | None = 16
    logprobs: Int64 | None = None
    suffix: str | None = None
    best_of: Int64 | None = None
    add_special_tokens: bool = True
    response_format: dict[str, Any] | None = None
    prompt_embeds: bytes | str | list[bytes | str] | None = None

    REFUSED: ClassVar[dict[str, str]] = {
        **_SamplingRequest.REFUSED, "prompt_embeds": "prompts are token ids or text; embeddings are not taken"}

    def to_sampling_params(self, max_tokens: int | None, defaults: dict, vocab_size: int,
                           structured: StructuredOutputsParams | None = None) -> SamplingParams:
        """The request's SamplingParams (built once per request); ``structured``: its resolved
        constraint (serve/structured.py:resolve_constraint)."""
        kw = self._sampling_kwargs(max_tokens, defaults, vocab_size, structured)
        kw["logprobs"] = self.logprobs
        if self.echo and self.logprobs is not None and kw["prompt_logprobs"] is None:
            kw["prompt_logprobs"] = self.logprobs  # echo with logprobs scores the prompt too (vLLM)
        return SamplingParams(**kw)


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Int64 | None = None
    max_completion_tokens: Int64 | None = None
    logprobs: bool | None = False
    top_logprobs: Int64 | None = None
    tools: list[ChatCompletionToolParam] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = True
    response_format: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, str]] | None = None
    """vLLM extension: reach the chat template as ``documents`` (retrieval-augmented templates)."""
    mm_processor_kwargs: dict[str, Any] | None = None
    reasoning_effort: ReasoningEffort | None = None
    """Reaches the chat template as the variable ``reasoning_effort`` (:meth:`template_kwargs`);
    a 400 when the template does not read it (serve/chat.py)."""
    include_reasoning: bool = True
    """vLLM extension: false leaves the reasoning (--reasoning-parser) out of the answer."""

    REFUSED: ClassVar[dict[str, str]] = {
        **_SamplingRequest.REFUSED,
        "mm_processor_kwargs": "no multimodal processor runs (text-only models)"}

    def template_kwargs(self) -> dict[str, Any] | None:
        """The chat template's extra variables: ``chat_template_kwargs`` and ``reasoning_effort``.
        vLLM's merge: the field, when set, wins over a ``reasoning_effort`` key in
        ``chat_template_kwargs`` (the typed field is the more specific request)."""
        if self.reasoning_effort is None:
            return self.chat_template_kwargs
        return {**(self.chat_template_kwargs or {}), "reasoning_effort": self.reasoning_effort}

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def to_sampling_params(self, max_tokens: int | None, defaults: dict, vocab_size: int,
                           structured: StructuredOutputsParams | None = None) -> SamplingParams:
        """As CompletionRequest's."""
        kw = self._sampling_kwargs(max_tokens, defaults, vocab_size, structured)
        if self.logprobs:
            kw["logprobs"] = self.top_logprobs or 0
        return SamplingParams(**kw)


class TokenizeCompletionRequest(OpenAIModel):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenizeChatRequest(OpenAIModel):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ChatCompletionToolParam] | None = None
    return_token_strs: bool | None = False
    mm_processor_kwargs: dict[str, Any] | None = None

    REFUSED: ClassVar[dict[str, str]] = {"mm_processor_kwargs": "no multimodal processor runs (text-only models)"}


class DetokenizeRequest(OpenAIModel):
    model: str | None = None
    tokens: list[TokenId]


# ---------------------------------------------------------------------------- responses


def now_s() -> int:
    return int(time.time())


class PromptTokenUsageInfo(BaseModel):
    cached_tokens: int = 0


class EmbeddingRequest(OpenAIModel):
    """``POST /v1/embeddings`` (serve/embeddings.py): OpenAI's fields, vLLM's ``truncate_prompt_tokens``,
    and vLLM's chat form (``messages`` instead of ``input``, rendered by the chat template)."""

    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]] | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    """Matryoshka truncation: a 400 naming it on a model without Matryoshka support."""
    user: str | None = None
    truncate_prompt_tokens: int | None = None
    messages: list[ChatMessage] | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = False
    continue_final_message: bool = False
    add_special_tokens: bool | None = None
    """None: vLLM's default for the form, True for ``input`` text, False for ``messages`` (the
    template writes the special tokens it wants)."""


class PoolingRequest(EmbeddingRequest):
    """``POST /pooling`` (serve/pooling_api.py): the embeddings request's fields; the answer is the
    pooler's raw output."""


class ClassifyRequest(OpenAIModel):
    """``POST /classify`` (serve/pooling_api.py): vLLM's ``ClassificationRequest``."""

    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    truncate_prompt_tokens: int | None = None
    user: str | None = None


class ScoreRequest(OpenAIModel):
    """``POST /score`` (serve/scoring.py): vLLM's ``text_1`` / ``text_2`` or ``queries`` / ``documents``."""

    model: str | None = None
    text_1: str | list[str] | None = None
    text_2: str | list[str] | None = None
    queries: str | list[str] | None = None
    documents: str | list[str] | None = None
    truncate_prompt_tokens: int | None = None
    user: str | None = None


class RerankRequest(OpenAIModel):
    """``POST /rerank``, ``/v1/rerank``, ``/v2/rerank`` (serve/scoring.py): Jina's and Cohere's shape."""

    model: str | None = None
    query: str
    documents: list[str]
    top_n: int | None = Field(default=None, ge=0)
    """The best n results (None or 0: all)."""
    return_documents: bool = True
    truncate_prompt_tokens: int | None = None
    user: str | None = None


class CompletionTokenUsageInfo(BaseModel):
    reasoning_tokens: int = 0


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    total_tokens: int = 0
    completion_tokens: int = 0
    prompt_tokens_details: PromptTokenUsageInfo | None = None
    """Set (with the prompt tokens served from the prefix cache) when prefix caching is on."""
    completion_tokens_details: CompletionTokenUsageInfo | None = None
    """Set on chat completions with a ``--reasoning-parser`` (vLLM's rule): the output tokens
    that were reasoning (serve/reasoning/base.py:ReasoningParser.reasoning_span)."""


class CompletionLogProbs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionResponseChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None
    prompt_logprobs: list[dict[str, Any] | None] | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None


class CompletionResponseStreamChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None


class _StreamChunk(BaseModel):
    """Chunks are dumped with only the fields that were set; ``object`` always counts as set."""

    def model_post_init(self, context: Any) -> None:
        self.model_fields_set.add("object")


class CompletionStreamResponse(_StreamChunk):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionResponseStreamChoice]
    usage: UsageInfo | None = None


class ChatCompletionLogProb(BaseModel):
    token: str
    logprob: float = -9999.0
    bytes: list[int] | None = None


class ChatCompletionLogProbsContent(ChatCompletionLogProb):
    top_logprobs: list[ChatCompletionLogProb] = Field(default_factory=list)


class ChatCompletionLogProbs(BaseModel):
    content: list[ChatCompletionLogProbsContent] | None = None


class ChatResponseMessage(BaseModel):
    role: str
    content: str | None = None
    refusal: str | None = None
    tool_calls: list[dict[str, Any]] = Field(default_factory=list)
    reasoning: str | None = None
    """With ``--reasoning-parser``: the model's reasoning, apart from ``content`` (vLLM's name
    since 0.11; it was ``reasoning_content`` before)."""


class ChatCompletionResponseChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None
    prompt_logprobs: list[dict[str, Any] | None] | None = None
    prompt_token_ids: list[int] | None = None


class DeltaMessage(BaseModel):
    role: str | None = None
    content: str | None = None
    reasoning: str | None = None
    tool_calls: list[dict[str, Any]] | None = None


class ChatCompletionResponseStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class ChatCompletionStreamResponse(_StreamChunk):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionResponseStreamChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "jaxllm"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str
