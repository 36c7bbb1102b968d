"""The one chat renderer: messages -> chat template -> prompt text -> token ids.

The server's ``/v1/chat/completions`` and ``/tokenize``, ``LLM.chat`` and ``jaxllm chat`` all
render through :func:`render_chat_prompt`, so a conversation becomes the same tokens
whichever way it is sent.  As vLLM: the template places any BOS itself, so the rendered text
is encoded without adding special tokens unless asked; ``tools`` and ``documents`` reach the
template as the variables of those names (HF's ``apply_chat_template`` arguments), and
``chat_template_kwargs`` adds template variables but may not set the renderer's own arguments.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.sandbox

from jaxllm.engine.processor import InvalidRequestError
from jaxllm.engine.tokenizer import encode

RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "tools", "documents", "chat_template", "add_generation_prompt", "continue_final_message",
    "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs", "sanitize_control_tokens"})
"""``apply_chat_template``'s own arguments: not template variables ``chat_template_kwargs`` may set."""


@dataclass(frozen=True)
class RenderedPrompt:
    text: str
    token_ids: list[int]

    def engine_prompt(self) -> dict:
        """The prompt as the input processor takes it (the ids win; the text is kept for echo)."""
        return {"prompt": self.text, "prompt_token_ids": self.token_ids}


def render_chat_prompt(tokenizer, messages: list[dict], *, add_generation_prompt: bool = True,
                       continue_final_message: bool = False, chat_template: str | None = None,
                       chat_template_kwargs: dict | None = None, tools: list[dict] | None = None,
                       documents: list[dict] | None = None, add_special_tokens: bool = False) -> RenderedPrompt:
    """Applies the chat template (``chat_template``, else the tokenizer's) and encodes the text.
    Raises :class:`InvalidRequestError` naming the offending argument (``param``)."""
    if tokenizer is None:
        raise InvalidRequestError("chat needs a tokenizer (this engine runs with skip_tokenizer_init)", "messages")
    if add_generation_prompt and continue_final_message:
        raise InvalidRequestError("Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
                                  "continue_final_message")
    kwargs = dict(chat_template_kwargs or {})
    reserved = sorted(set(kwargs) & RESERVED_TEMPLATE_KWARGS)
    if reserved:
        raise InvalidRequestError(f"chat_template_kwargs cannot set {', '.join(reserved)}", "chat_template_kwargs")
    if continue_final_message:
        kwargs["continue_final_message"] = True
    if tools is not None:
        kwargs["tools"] = tools
    if documents is not None:
        kwargs["documents"] = documents
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise InvalidRequestError("the tokenizer has no chat template; pass chat_template", "chat_template")
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                             chat_template=chat_template, **kwargs)
    except Exception as e:  # jinja errors, bad message shapes
        raise InvalidRequestError(f"cannot apply the chat template: {e}", "chat_template") from None
    if not isinstance(text, str):
        raise InvalidRequestError("the chat template did not produce text", "chat_template_kwargs")
    return RenderedPrompt(text, encode(tokenizer, text, add_special_tokens=add_special_tokens))


@functools.lru_cache(maxsize=64)
def _variables(source: str) -> frozenset[str] | None:
    # HF's environment: the sandbox with loop controls; a template that needs HF's own
    # extensions (``{% generation %}``) does not parse here (None: unknown).
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(extensions=[jinja2.ext.loopcontrols])
    try:
        return frozenset(jinja2.meta.find_undeclared_variables(env.parse(source)))
    except jinja2.TemplateError:
        return None


def template_reads(tokenizer, chat_template: str | None, name: str) -> bool:
    """Whether the chat template (``chat_template``, else the tokenizer's; every one of a
    tokenizer's named templates) reads the variable ``name``.  A template that cannot be
    analysed counts as reading it: only a template known not to read a variable is reported."""
    template = chat_template if chat_template is not None else getattr(tokenizer, "chat_template", None)
    sources = list(template.values()) if isinstance(template, dict) else [template]
    for src in sources:
        if not isinstance(src, str):
            continue
        names = _variables(src)
        if names is None or name in names:
            return True
    return False
