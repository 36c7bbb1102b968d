"""``jaxllm serve [MODEL]``: the OpenAI-compatible server, with vLLM's flag names.

With no model it serves the built-in SmolLM2-135M-Instruct.  Flags are checked before the
(slow) engine start, so a typo fails in a second, not after compiling.  SIGTERM or Ctrl-C
stops it gracefully: new requests are refused, streams in flight end with finish_reason
"abort" and ``[DONE]``, and the process exits within a few seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import signal

from jaxllm.cli import add_engine_args, engine_config_from_args
from jaxllm.config import ServingConfig
from serve.lora import add_lora_args, lora_config_from_args, parse_lora_modules

log = logging.getLogger("jaxllm.serve")


def register(subparsers) -> None:
    s = subparsers.add_parser(
        "serve", help="OpenAI-compatible HTTP server (completions, chat, SSE streaming)",
        description="Serve a model over vLLM's dialect of the OpenAI API.")
    add_engine_args(s, model_positional=True)
    g = s.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1; 0.0.0.0: every interface)")
    g.add_argument("--port", type=int, default=8000, help="TCP port (default 8000; 0: any free port)")
    g.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: $JAXLLM_API_KEY, else none)")
    g.add_argument("--served-model-name", nargs="+", default=None,
                   help="names the API answers to; the first is reported (default: the model argument)")
    g.add_argument("--generation-config", default="auto",
                   help="sampling defaults: auto (default: the checkpoint's generation_config.json), vllm "
                        "(none), or a folder holding a generation_config.json")
    g.add_argument("--override-generation-config", default=None,
                   help="JSON object merged over the generation config, e.g. '{\"temperature\": 0.5}'")
    g.add_argument("--sse-keep-alive-interval", type=float, default=0.0,
                   help="send ': keep-alive' after this many seconds of stream silence (0: off)")
    g.add_argument("--chat-template", default=None, help="Jinja chat template (file or text) replacing the model's")
    g.add_argument("--response-role", default="assistant", help="role of generated chat messages")
    g.add_argument("--profiler-dir", default=None, metavar="DIR",
                   help="enable POST /start_profile and /stop_profile, which record XLA traces into DIR "
                        "(open them with Perfetto, TensorBoard or xprof)")
    g.add_argument("--disable-log-stats", action="store_true",
                   help="no periodic log line (throughput, KV usage, speculative acceptance) every 10 s")
    g.add_argument("--metrics-compat", choices=("none", "vllm"), default="none",
                   help="names of the /metrics series: none (default: jaxllm:...) or vllm (vLLM's vllm:..., "
                        "which llm-d's and the Gateway API Inference Extension's routers read)")
    g.add_argument("--enable-log-requests", dest="log_requests", action="store_true", default=True,
                   help="one access line per request: method, path, status, prompt and output tokens, time "
                        "(default on)")
    g.add_argument("--disable-log-requests", dest="log_requests", action="store_false",
                   help="no access line per request")
    mg = s.add_argument_group("images in (vision-language models)")
    mg.add_argument("--limit-mm-per-prompt", default=None, metavar="JSON",
                    help="the most images one prompt may carry, e.g. '{\"image\": 4}' (default 999, vLLM's); "
                         "more is a 400")
    mg.add_argument("--allowed-local-media-path", default=None, metavar="DIR",
                    help="file:// image URLs may read from this folder (symlinks out of it refused); default: "
                         "file:// URLs are refused")
    pg = s.add_argument_group("pooling (embeddings)")
    pg.add_argument("--runner", default="auto", choices=("auto", "generate", "pooling"),
                    help="generate, or pooling: an encoder serving /v1/embeddings (default auto: pooling for an "
                         "encoder checkpoint such as BertModel)")
    pg.add_argument("--convert", default="auto", choices=("auto", "none", "embed", "classify"),
                    help="with --runner pooling, a causal decoder as an embedder (embed: last token, normalized) "
                         "or a classifier (classify: its score head, /score and /rerank); default auto: a "
                         "*ForSequenceClassification or a sentence-transformers folder converts by itself")
    pg.add_argument("--hf-overrides", default=None, metavar="JSON",
                    help="keys merged over the checkpoint's config.json (pooling runner), e.g. Qwen3-Reranker's "
                         "'{\"architectures\": [\"Qwen3ForSequenceClassification\"], \"classifier_from_token\": "
                         "[\"no\", \"yes\"], \"is_original_qwen3_reranker\": true}'")
    pg.add_argument("--pooler-config", default=None, metavar="JSON",
                    help="the pooler over the checkpoint's (sentence-transformers' modules.json), e.g. "
                         "'{\"pooling_type\": \"CLS\", \"normalize\": true}' (CLS, MEAN or LAST)")
    g.add_argument("--responses-store", default="auto", metavar="PATH",
                   help="sqlite file keeping /v1/responses for retrieval and previous_response_id (default auto: "
                        "responses.sqlite3 in the cache folder; none: keep nothing)")
    g.add_argument("--responses-store-max-bytes", type=int, default=ServingConfig.responses_store_max_bytes,
                   metavar="BYTES", help="the store's size bound: beyond it the oldest responses are evicted "
                                         "(default 1 GiB)")
    g.add_argument("--responses-store-max-age", type=float, default=ServingConfig.responses_store_max_age_s,
                   metavar="SECONDS", help="the store's age bound: older responses are evicted and no longer "
                                           "served (default 30 days, as OpenAI keeps them)")
    t = s.add_argument_group("tool calling and reasoning")
    t.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='serve tool_choice "auto" (the default when a request sends tools); needs --tool-call-parser')
    t.add_argument("--tool-call-parser", default=None, metavar="NAME",
                   help="how the model writes tool calls: hermes, llama3_json, mistral, qwen3_xml (qwen3_coder), "
                        "or a name registered by --tool-parser-plugin")
    t.add_argument("--tool-parser-plugin", default=None, metavar="FILE",
                   help="a Python file registering tool parsers (ToolParserManager.register_module)")
    t.add_argument("--reasoning-parser", default=None, metavar="NAME",
                   help="split the model's reasoning into message.reasoning: deepseek_r1, qwen3")
    add_lora_args(s)
    s.set_defaults(func=cmd_serve)


def _json_flag(value: str | None, flag: str):
    """A JSON-valued flag's value parsed (None when not given); bad JSON a ValueError naming ``flag``."""
    if not value:
        return None
    try:
        return json.loads(value)
    except ValueError as e:
        raise ValueError(f"{flag} is not valid JSON ({e})") from None


def serving_config_from_args(args: argparse.Namespace) -> ServingConfig:
    override = _json_flag(args.override_generation_config, "--override-generation-config") or {}
    api_key = args.api_key if args.api_key is not None else (os.environ.get("JAXLLM_API_KEY") or None)
    interval = os.environ.get("JAXLLM_LOG_STATS_INTERVAL") or "10"
    try:
        log_stats_interval = float(interval)
    except ValueError:
        raise ValueError(f"JAXLLM_LOG_STATS_INTERVAL must be a number of seconds, got {interval!r}") from None
    return ServingConfig(
        host=args.host, port=args.port, api_key=api_key,
        served_model_names=tuple(args.served_model_name or ()), generation_config=args.generation_config,
        override_generation_config=override, sse_keep_alive_interval=args.sse_keep_alive_interval,
        chat_template=args.chat_template, response_role=args.response_role,
        profiler_dir=None if args.profiler_dir is None else os.path.abspath(args.profiler_dir),
        enable_auto_tool_choice=args.enable_auto_tool_choice, tool_call_parser=args.tool_call_parser,
        tool_parser_plugin=args.tool_parser_plugin, reasoning_parser=args.reasoning_parser,
        disable_log_stats=args.disable_log_stats, log_stats_interval=log_stats_interval,
        log_requests=args.log_requests, metrics_compat=args.metrics_compat,
        responses_store=args.responses_store, responses_store_max_bytes=args.responses_store_max_bytes,
        responses_store_max_age_s=args.responses_store_max_age, lora_modules=parse_lora_modules(args.lora_modules),
        limit_mm_per_prompt=_json_flag(args.limit_mm_per_prompt, "--limit-mm-per-prompt") or {},
        allowed_local_media_path=args.allowed_local_media_path)


def pooling_config_from_args(args: argparse.Namespace):
    """The pooling runner's config when ``--runner`` (or ``auto`` and the checkpoint) asks for it, else None."""
    from jaxllm.pooling.config import PoolingEngineConfig
    from jaxllm.pooling.engine import uses_pooling_runner

    pooler = _json_flag(args.pooler_config, "--pooler-config")
    overrides = _json_flag(args.hf_overrides, "--hf-overrides")
    model = args.model_pos or args.model
    if not uses_pooling_runner(model, args.runner, pooler, args.convert, overrides):
        return None
    sizes = {k: getattr(args, k) for k in ("max_num_batched_tokens", "max_num_seqs") if getattr(args, k) is not None}
    # A server builds every bucket before it takes a request.
    return PoolingEngineConfig(model=model, pooler_config=pooler or {}, max_model_len=args.max_model_len,
                               precompile="all", compile_cache_dir=args.compile_cache_dir,
                               convert=args.convert, hf_overrides=overrides or {},
                               attention_backend=args.attention_backend, async_scheduling=args.async_scheduling,
                               **sizes)


def _serve_pooling(config, serving: ServingConfig) -> int:
    from jaxllm.pooling.async_engine import AsyncPoolingEngine
    from jaxllm.pooling.engine import PoolingEngine

    _log_startup_at_info()
    return _listen_and_serve(lambda: AsyncPoolingEngine(PoolingEngine(config)), serving)


def _log_startup_at_info() -> None:
    # The address, the sampling defaults and the engine's start-up line (KV cache size, prefix
    # caching, policy) are worth seeing at the default log level.
    for logger in (log, logging.getLogger("jaxllm.engine")):
        if logger.getEffectiveLevel() > logging.INFO:
            logger.setLevel(logging.INFO)


def _listen_and_serve(make_engine, serving: ServingConfig) -> int:
    """Binds the port (a busy port fails now, not after compiling), builds the engine, serves
    until SIGTERM / Ctrl-C, and shuts the engine down."""
    from serve.app import listen

    sock = listen(serving.host, serving.port)
    try:
        engine = make_engine()
    except BaseException:
        sock.close()
        raise
    try:
        asyncio.run(_serve(engine, serving, sock))
    finally:
        engine.shutdown()
    # Last: the engine (and its periodic stats line) has stopped, so nothing is logged after it.
    log.info("server stopped")
    return 0


def with_reasoning_end(engine_config, serving: ServingConfig):
    """With ``--reasoning-parser``, structured outputs (and required / named tool calls) start
    after the parser's end tag, unless ``--structured-outputs-config`` says where already."""
    from serve.state import resolve_parsers
    _, reasoning = resolve_parsers(serving)
    so = engine_config.structured_outputs_config
    tag = getattr(reasoning, "end_tag", "")
    if not tag or so.reasoning_end_token_ids or so.reasoning_end_tag:
        return engine_config
    return dataclasses.replace(engine_config, structured_outputs_config=dataclasses.replace(so, reasoning_end_tag=tag))


def cmd_serve(args: argparse.Namespace) -> int:
    from jaxllm.engine.async_engine import AsyncEngine, check_servable
    from jaxllm.engine.dp_engine import DataParallelEngine
    from jaxllm.engine.llm_engine import LLMEngine
    from serve.state import resolve_chat_template, resolve_parsers

    if args.model_pos and args.model and args.model_pos != args.model:
        raise ValueError(f"the model is given twice ({args.model_pos!r} and --model {args.model!r}); give it once")
    serving = serving_config_from_args(args)
    pooling = pooling_config_from_args(args)
    if pooling is not None:
        return _serve_pooling(pooling, serving)
    resolve_chat_template(serving.chat_template)
    resolve_parsers(serving)  # an unknown parser or a broken plugin fails now
    engine_config = with_reasoning_end(engine_config_from_args(args), serving)
    engine_config = dataclasses.replace(engine_config, lora=lora_config_from_args(args))
    check_servable(engine_config)   # now, not after loading the model
    _log_startup_at_info()
    pc = engine_config.parallel
    if pc.multi_host and pc.host_index not in (None, 0):
        # Host 0 schedules and serves HTTP; this host runs its steps on its own devices.
        log.info("host %d of %d: following host 0's steps (host 0 serves HTTP)", pc.host_index, pc.num_hosts)
        LLMEngine(engine_config).follow()
        log.info("host 0 stopped; exiting")
        return 0
    if pc.data_parallel_size > 1:
        return _listen_and_serve(lambda: DataParallelEngine.from_config(engine_config), serving)
    return _listen_and_serve(lambda: AsyncEngine(LLMEngine(engine_config)), serving)


async def _serve(engine, serving: ServingConfig, sock) -> None:
    from serve.app import run_server

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await run_server(engine, serving, stop, sock=sock)
