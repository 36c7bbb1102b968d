"""What every endpoint shares: the engine, the serving config, model names, sampling defaults.

The engine is anything that implements ``jaxllm.engine.protocol.EngineClient`` (one engine
or data-parallel replicas); nothing here reaches past that interface.

Sampling defaults follow vLLM: ``--generation-config auto`` reads the checkpoint's
generation_config.json (``vllm`` ignores it, a folder reads that folder's), the keys vLLM
reads are kept, ``--override-generation-config`` is merged over them, and a request's own
field always wins over a default.  ``max_new_tokens`` becomes a cap on ``max_tokens``.
"""

from __future__ import annotations

import json
import logging
import os
import uuid
import weakref
from dataclasses import dataclass, field
from http import HTTPStatus

from quart import g, has_request_context, request

from jaxllm.config import GENERATION_CONFIG_KEYS, ServingConfig
from jaxllm.engine.output_processor import OutputKind
from jaxllm.engine.protocol import EngineClient, OutputStream
from jaxllm.errors import EngineDeadError
from jaxllm.request import EngineRequest
from jaxllm.sampling_params import SamplingParams
from serve.lora import LoRARegistry, load_static
from serve.metrics import Metrics
from serve.protocol import (APIError, CompletionTokenUsageInfo, PromptTokenUsageInfo, UsageInfo, bad_request,
                            error_param, now_s)

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


def resolve_parsers(config: ServingConfig) -> tuple[type | None, type | None]:
    """(tool parser class, reasoning parser class) the flags name; loads ``--tool-parser-plugin``
    first.  ValueError naming the flag when a name is unknown."""
    from serve.reasoning import ReasoningParserManager
    from serve.tool_parsers import ToolParserManager

    if config.tool_parser_plugin:
        ToolParserManager.import_tool_parser(config.tool_parser_plugin)
    tool = reasoning = None
    try:
        if config.tool_call_parser:
            tool = ToolParserManager.get_tool_parser(config.tool_call_parser)
        if config.reasoning_parser:
            reasoning = ReasoningParserManager.get_reasoning_parser(config.reasoning_parser)
    except KeyError as e:
        raise ValueError(e.args[0]) from None
    return tool, reasoning


@dataclass
class ServerState:
    engine: EngineClient
    config: ServingConfig
    served_names: tuple[str, ...]
    defaults: dict
    metrics: Metrics
    chat_template: str | None
    created: int = field(default_factory=now_s)
    accepting: bool = True
    """False once shutdown began: new requests get a 503."""
    open_streams: "weakref.WeakSet[OutputStream]" = field(default_factory=weakref.WeakSet)
    """This app's requests (several apps may share one engine); touched only on the event loop."""
    tool_parser: type | None = None
    """``--tool-call-parser``'s class (one instance per choice), or None."""
    reasoning_parser: type | None = None
    """``--reasoning-parser``'s class (one instance per choice), or None."""
    loras: LoRARegistry | None = None
    """The LoRA adapters a request may name in ``model`` (serve/lora.py)."""

    @classmethod
    def create(cls, engine: EngineClient, config: ServingConfig, metrics: Metrics | None = None) -> "ServerState":
        names = config.served_model_names or (engine.model_name,)
        raw = generation_defaults(config.generation_config, engine.generation_config,
                                  config.override_generation_config)
        defaults = validate_defaults(raw, engine.input_processor.check_params)
        if defaults:
            log.info("Default sampling parameters from the generation config: %s. A request's own values win; "
                     "--generation-config vllm ignores the checkpoint's.", defaults)
        else:
            log.info("No default sampling parameters from the generation config; OpenAI's defaults apply.")
        if metrics is None:
            metrics = Metrics(names[0], None if config.disable_log_stats else config.log_stats_interval)
        tool_parser, reasoning_parser = resolve_parsers(config)
        loras = LoRARegistry(engine.lora_stores, names[0])
        load_static(loras, config.lora_modules)
        return cls(engine=engine, config=config, served_names=tuple(names), defaults=defaults, metrics=metrics,
                   chat_template=resolve_chat_template(config.chat_template), tool_parser=tool_parser,
                   reasoning_parser=reasoning_parser, loras=loras)

    # ------------------------------------------------------------------ requests

    def process(self, request_id: str, prompt: dict, params: SamplingParams, priority: int,
                model: str | None = None) -> EngineRequest:
        """The engine's input processor: the one validation of a request (ValueError naming
        what is wrong, for the handler to answer with a 400).  ``model``: the request's, which
        may name a LoRA adapter."""
        return self.engine.input_processor.process_inputs(request_id, prompt, params, priority=priority,
                                                          lora_request=None if self.loras is None else self.loras.get(model))

    def request_id(self, prefix: str, body_id: str | None) -> str:
        """The request's id, in responses and logs (vLLM's rule): ``<prefix>-<base>``, the base
        being the ``X-Request-Id`` header, else the body's ``request_id``, else a random one.
        Kept on ``quart.g.request_id`` for the request's log lines."""
        base = body_id or uuid.uuid4().hex
        if has_request_context():
            base = request.headers.get("X-Request-Id") or base
        rid = f"{prefix}-{base}"
        if has_request_context():
            g.request_id = rid
        log.debug("request %s received", rid)
        return rid

    def add_requests(self, requests: list[EngineRequest], stream: bool) -> list[OutputStream]:
        """Queues processed requests, all or none: a stream receives DELTA outputs, anything
        else the whole result once (FINAL_ONLY).  503 when the server or the engine cannot
        take them."""
        if not self.accepting:
            raise APIError(HTTPStatus.SERVICE_UNAVAILABLE, "the server is shutting down")
        kind = OutputKind.DELTA if stream else OutputKind.FINAL_ONLY
        streams: list[OutputStream] = []
        try:
            for r in requests:
                streams.append(self.engine.add_request(r, kind=kind))
        except BaseException as e:
            for s in streams:
                s.abort()
            if isinstance(e, EngineDeadError):
                raise APIError(HTTPStatus.SERVICE_UNAVAILABLE, str(e)) from None
            raise
        self.open_streams.update(streams)
        return streams

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
        if name is not None and name not in self.served_names and (self.loras is None or self.loras.get(name) is None):
            raise APIError(HTTPStatus.NOT_FOUND, f"The model `{name}` does not exist.", "model")

    def require_tokenizer(self, what: str) -> object:
        if self.tokenizer is None:
            raise bad_request(f"{what} needs a tokenizer, and this server runs without one")
        return self.tokenizer

    def max_tokens(self, requested: int | None) -> int | None:
        """The request's max_tokens capped by the generation config's max_new_tokens (None: no
        cap).  What is left of the context is the input processor's rule (the one place it lives)."""
        vals = [v for v in (requested, self.defaults.get("max_tokens")) if v is not None]
        return min(vals) if vals else None

    @property
    def prefix_caching(self) -> bool:
        return self.engine.prefix_caching

    @property
    def supports_images(self) -> bool:
        """Whether the model takes images (the engine's ``supports_images``; an engine without
        the attribute serves a text-only model)."""
        return bool(getattr(self.engine, "supports_images", False))

    def usage(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None,
              reasoning_tokens: int | None = None) -> UsageInfo:
        """OpenAI's usage; ``prompt_tokens_details.cached_tokens`` when prefix caching is on and
        ``cached_tokens`` is given (vLLM reports it in final usage, not in per-chunk usage);
        ``completion_tokens_details.reasoning_tokens`` when ``reasoning_tokens`` is given."""
        u = UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                      total_tokens=prompt_tokens + completion_tokens)
        if cached_tokens is not None and self.prefix_caching:
            u.prompt_tokens_details = PromptTokenUsageInfo(cached_tokens=cached_tokens)
        if reasoning_tokens is not None:
            u.completion_tokens_details = CompletionTokenUsageInfo(reasoning_tokens=reasoning_tokens)
        return u

    def value_error(self, e: ValueError, fields: set[str], aliases: dict[str, str] | None = None) -> APIError:
        return bad_request(str(e), error_param(e, fields, aliases))
