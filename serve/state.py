"""What every endpoint shares: the engine, the serving config, model names, sampling defaults.

Sampling defaults follow vLLM: ``--generation-config auto`` reads the checkpoint's
generation_config.json (``vllm`` ignores it, a folder reads that folder's), the keys vLLM
reads are kept, ``--override-generation-config`` is merged over them, and a request's own
field always wins over a default.  ``max_new_tokens`` becomes a cap on ``max_tokens``.
"""

from __future__ import annotations

import json
import logging
import os
import weakref
from dataclasses import dataclass, field
from http import HTTPStatus

from jaxllm.config import GENERATION_CONFIG_KEYS, ServingConfig
from jaxllm.engine.async_engine import AsyncEngine, RequestStream
from jaxllm.sampling_params import SamplingParams
from serve.metrics import Metrics
from serve.protocol import APIError, PromptTokenUsageInfo, UsageInfo, bad_request, now_s, param_from_message

log = logging.getLogger("jaxllm.serve")


def generation_defaults(mode: str, checkpoint: dict, override: dict) -> dict:
    """The sampling defaults (SamplingParams names; ``max_tokens`` is a cap) before validation."""
    if mode == "vllm":
        src = {}
    elif mode == "auto":
        src = dict(checkpoint)
    else:
        path = os.path.join(mode, "generation_config.json")
        try:
            with open(path) as f:
                src = json.load(f)
        except (OSError, ValueError) as e:
            raise ValueError(f"--generation-config {mode}: cannot read {path} ({e})") from None
        if not isinstance(src, dict):
            raise ValueError(f"--generation-config {mode}: {path} is not a JSON object")
    out = {k: v for k, v in src.items() if k in GENERATION_CONFIG_KEYS and v is not None}
    out.update(override)
    if "max_new_tokens" in out:
        out["max_tokens"] = out.pop("max_new_tokens")
    return out


def validate_defaults(defaults: dict, check_params) -> dict:
    """Refuses defaults SamplingParams rejects; drops (with a warning) the ones the engine does
    not apply yet, so a checkpoint that sets, say, repetition_penalty still serves."""
    kept = {}
    for key, value in defaults.items():
        if key == "max_tokens":
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"generation config: max_new_tokens must be a positive integer, got {value!r}")
            kept[key] = value
            continue
        try:
            sp = SamplingParams(**{key: value})
        except (TypeError, ValueError) as e:
            raise ValueError(f"generation config: {e}") from None
        try:
            check_params(sp)
        except ValueError as e:
            log.warning("generation config sets %s=%r, which this engine cannot apply yet (%s); ignoring it",
                        key, value, e)
            continue
        kept[key] = value
    return kept


def resolve_chat_template(value: str | None) -> str | None:
    """``--chat-template``: a file's contents, or the template text itself."""
    if value is None:
        return None
    if os.path.isfile(value):
        with open(value) as f:
            return f.read()
    if "{" in value:
        return value
    raise ValueError(f"--chat-template {value!r}: no such file, and it does not look like a Jinja template")


@dataclass
class ServerState:
    engine: AsyncEngine
    config: ServingConfig
    served_names: tuple[str, ...]
    defaults: dict
    metrics: Metrics
    chat_template: str | None
    created: int = field(default_factory=now_s)
    accepting: bool = True
    """False once shutdown began: new requests get a 503."""
    open_streams: "weakref.WeakSet[RequestStream]" = field(default_factory=weakref.WeakSet)
    """This app's requests (several apps may share one engine); touched only on the event loop."""

    @classmethod
    def create(cls, engine: AsyncEngine, config: ServingConfig, metrics: Metrics | None = None) -> "ServerState":
        names = config.served_model_names or (engine.model_name,)
        raw = generation_defaults(config.generation_config, engine.generation_config,
                                  config.override_generation_config)
        defaults = validate_defaults(raw, engine.engine.input_processor.check_params)
        if defaults:
            log.info("Default sampling parameters from the generation config: %s. A request's own values win; "
                     "--generation-config vllm ignores the checkpoint's.", defaults)
        else:
            log.info("No default sampling parameters from the generation config; OpenAI's defaults apply.")
        if metrics is None:
            metrics = Metrics(names[0])
        return cls(engine=engine, config=config, served_names=tuple(names), defaults=defaults, metrics=metrics,
                   chat_template=resolve_chat_template(config.chat_template))

    # ------------------------------------------------------------------ requests

    def add_request(self, request_id: str, prompt: dict, params: SamplingParams, priority: int) -> RequestStream:
        """Queues a request in the engine (ValueError / EngineDeadError propagate to the handler)."""
        if not self.accepting:
            raise APIError(HTTPStatus.SERVICE_UNAVAILABLE, "the server is shutting down")
        stream = self.engine.add_request(request_id, prompt, params, priority=priority)
        self.open_streams.add(stream)
        return stream

    def begin_shutdown(self) -> int:
        """Refuses new requests and aborts this app's requests in flight: each of their streams
        still receives a final output (finish_reason "abort") and ends normally.  Returns how many."""
        self.accepting = False
        n = 0
        for stream in list(self.open_streams):
            if not stream.finished:
                self.engine.abort(stream.request_id)
                n += 1
        return n

    # ------------------------------------------------------------------ helpers for handlers

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def model_name(self) -> str:
        return self.served_names[0]

    def check_model(self, name: str | None) -> None:
        if name is not None and name not in self.served_names:
            raise APIError(HTTPStatus.NOT_FOUND, f"The model `{name}` does not exist.", "model")

    def require_tokenizer(self, what: str) -> object:
        if self.tokenizer is None:
            raise bad_request(f"{what} needs a tokenizer, and this server runs without one")
        return self.tokenizer

    def check_prompt_len(self, n: int, param: str) -> None:
        if n == 0:
            raise bad_request("The prompt cannot be empty.", param)
        if n >= self.max_model_len:
            raise bad_request(
                f"This model's maximum context length is {self.max_model_len} tokens. However, your request has "
                f"{n} input tokens, which leaves no room for output. Please reduce the length of the input.",
                param)

    def max_tokens(self, prompt_len: int, requested: int | None) -> int:
        """vLLM's rule: the smallest of what is left of the context, the request's max_tokens and
        the generation config's max_new_tokens."""
        vals = [self.max_model_len - prompt_len, requested, self.defaults.get("max_tokens")]
        return min(v for v in vals if v is not None)

    @property
    def prefix_caching(self) -> bool:
        return self.engine.engine.config.cache.enable_prefix_caching

    def usage(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> UsageInfo:
        """OpenAI's usage; ``prompt_tokens_details.cached_tokens`` when prefix caching is on and
        ``cached_tokens`` is given (vLLM reports it in final usage, not in per-chunk usage)."""
        u = UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                      total_tokens=prompt_tokens + completion_tokens)
        if cached_tokens is not None and self.prefix_caching:
            u.prompt_tokens_details = PromptTokenUsageInfo(cached_tokens=cached_tokens)
        return u

    def value_error(self, e: ValueError, fields: set[str], aliases: dict[str, str] | None = None) -> APIError:
        msg = str(e)
        return bad_request(msg, param_from_message(msg, fields, aliases))


class Choices:
    """A non-streaming response's choices, each the sum of its DELTA outputs (text pieces, token
    ids, logprobs, and the finish reason once it ends)."""

    def __init__(self, num: int):
        self.texts: list[list[str]] = [[] for _ in range(num)]
        self.token_ids: list[list[int]] = [[] for _ in range(num)]
        self.logprobs: list[list] = [[] for _ in range(num)]
        self.finish: list[str | None] = [None] * num
        self.stop_reason: list[int | str | None] = [None] * num

    def add(self, i: int, out) -> None:
        """Adds one ``CompletionOutput`` delta to choice ``i``."""
        self.texts[i].append(out.text)
        self.token_ids[i].extend(out.token_ids)
        if out.logprobs is not None:
            self.logprobs[i].extend(out.logprobs)
        if out.finish_reason is not None:
            self.finish[i], self.stop_reason[i] = out.finish_reason, out.stop_reason

    def text(self, i: int) -> str:
        return "".join(self.texts[i])

    @property
    def num_tokens(self) -> int:
        return sum(len(t) for t in self.token_ids)
