"""The Responses request, validated once at the edge (pydantic).  A malformed body is a 400 in
OpenAI's shape naming the top-level parameter (serve/protocol.py:validation_error)."""

from __future__ import annotations

import logging
from typing import Annotated, Any, Literal, Union

from pydantic import Discriminator, Field, Tag

from serve.protocol import Int64, OpenAIModel, ReasoningEffort

log = logging.getLogger("jaxllm.serve")

SAMPLING_EXTRAS = ("top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "stop",
                   "stop_token_ids", "ignore_eos", "min_tokens", "logit_bias", "priority")
"""vLLM's sampling fields a client may add to a Responses body (``extra_body``); passed to the chat path."""

OUTPUT_LOGPROBS = "message.output_text.logprobs"
Includable = Literal["message.output_text.logprobs", "reasoning.encrypted_content", "file_search_call.results",
                     "web_search_call.results", "web_search_call.action.sources", "message.input_image.image_url",
                     "computer_call_output.output.image_url", "code_interpreter_call.outputs"]
"""OpenAI's ``include`` values (any other is a 400 naming ``include``).  Only
``message.output_text.logprobs`` adds anything here: ``output_text`` parts (and their stream
deltas) carry the tokens' logprobs.  The others are accepted, as vLLM accepts them, because
none would change this server's output: the tool calls they detail (file search, web search,
computer use, code interpreter) never run without a tool server, input images are given back
as sent, and ``reasoning.encrypted_content`` exists so that a stateless client can send
reasoning back, which no chat template here is given (earlier reasoning is not replayed)."""


class InputText(OpenAIModel):
    # output_text appears when a client sends back an earlier assistant message.
    type: Literal["input_text", "output_text", "text"]
    text: str


class InputImage(OpenAIModel):
    """OpenAI's ``input_image`` part: an image by URL (``data:``, ``http(s)://``, ``file://``);
    it reaches the chat path as an ``image_url`` part (serve/responses/convert.py)."""
    type: Literal["input_image"]
    image_url: str | None = None
    file_id: str | None = None
    """OpenAI's Files API reference: no files API here, so a 400 naming ``input``."""
    detail: Literal["auto", "low", "high"] = "auto"


MessagePart = Annotated[InputText | InputImage, Field(discriminator="type")]


class MessageItem(OpenAIModel):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[MessagePart]
    id: str | None = None
    status: str | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "\n".join(p.text for p in self.content if isinstance(p, InputText))

    def has_images(self) -> bool:
        return isinstance(self.content, list) and any(isinstance(p, InputImage) for p in self.content)


class FunctionCallItem(OpenAIModel):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(OpenAIModel):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: str
    id: str | None = None
    status: str | None = None


class ReasoningItem(OpenAIModel):
    type: Literal["reasoning"]
    id: str | None = None
    summary: list[dict[str, Any]] = Field(default_factory=list)
    content: list[dict[str, Any]] | None = None
    encrypted_content: str | None = None
    status: str | None = None


def _item_kind(v) -> str | None:
    # A message may come without "type" (OpenAI's EasyInputMessage).
    if isinstance(v, dict):
        return v.get("type", "message")
    return getattr(v, "type", None)


InputItem = Annotated[Union[Annotated[MessageItem, Tag("message")], Annotated[FunctionCallItem, Tag("function_call")],
                            Annotated[FunctionCallOutputItem, Tag("function_call_output")],
                            Annotated[ReasoningItem, Tag("reasoning")]], Discriminator(_item_kind)]


class FunctionTool(OpenAIModel):
    type: Literal["function"]
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(OpenAIModel):
    """Any tool; only ``function`` tools reach the model (see convert.py:function_tools)."""
    type: str = Field(min_length=1)


class NamedToolChoice(OpenAIModel):
    type: Literal["function"]
    name: str = Field(min_length=1)


class TextFormat(OpenAIModel):
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(OpenAIModel):
    format: TextFormat | None = None
    verbosity: str | None = None


class ReasoningConfig(OpenAIModel):
    effort: ReasoningEffort | None = None
    """Reaches the chat template as ``reasoning_effort`` (the chat endpoint's field; a 400 naming
    ``reasoning`` when the template does not read it)."""
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: str | None = None


class ResponsesRequest(OpenAIModel):
    model: str | None = None
    input: str | list[InputItem] = ""
    instructions: str | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice = "auto"
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    max_output_tokens: Int64 | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    metadata: dict[str, str] | None = Field(None, max_length=16)
    store: bool = True
    stream: bool = False
    background: bool = False
    previous_response_id: str | None = Field(None, min_length=1)
    include: list[Includable] | None = None
    top_logprobs: Int64 | None = Field(None, ge=0, le=20)
    """With ``include: ["message.output_text.logprobs"]``: the most likely alternatives per token."""
    truncation: Literal["auto", "disabled"] = "disabled"
    user: str | None = None
    seed: Int64 | None = None
    request_id: str | None = Field(None, min_length=1)
    """The response's id (vLLM's meaning); a fresh ``resp_...`` when not sent."""

    def check_supported(self) -> None:
        """vLLM's warning names only the extra fields nothing reads (the sampling extras are read)."""
        ignored = set(self.model_extra or {}) - set(SAMPLING_EXTRAS)
        if ignored:
            log.warning("The following fields were present in the request but ignored: %s", ignored)
