"""The Quart application of ``jaxllm serve`` and the hypercorn loop that runs it.

Routes (vLLM's): ``POST /v1/completions``, ``POST /v1/chat/completions``, and on a pooling model
``POST /v1/embeddings`` (serve/embeddings.py), ``POST /score``, ``POST /rerank`` (``/v1/rerank``,
``/v2/rerank``; serve/scoring.py), ``POST /pooling``, ``POST /classify`` (serve/pooling_api.py),
``GET /v1/models``,
``POST /v1/responses`` with ``GET`` / ``DELETE /v1/responses/{id}``, ``POST
/v1/responses/{id}/cancel`` and ``GET /v1/responses/{id}/input_items`` (serve/responses/),
``GET /health``, ``GET /version``, ``POST /tokenize``, ``POST /detokenize``, ``GET /metrics``, with
runtime LoRA updating allowed ``POST /v1/load_lora_adapter`` / ``POST /v1/unload_lora_adapter``
(serve/lora.py), and with ``--profiler-dir DIR`` ``POST /start_profile`` / ``POST /stop_profile`` (an XLA trace of
whatever the engine runs in between, written under DIR; see ``jaxllm/profiling.py``).
Every error, including a 404 route or a 405 method, is answered in OpenAI's shape
``{"error": {"message", "type", "param", "code"}}``.  With an API key, ``/v1/*`` needs
``Authorization: Bearer <key>`` (401 otherwise); ``/health``, ``/metrics`` and the rest stay open.

The app talks to its engine only through ``jaxllm.engine.protocol.EngineClient`` (one
engine or data-parallel replicas alike) and does not own it (several apps may share one):
whoever built the engine shuts it down.  ``run_server`` serves until its stop event is set
(SIGTERM or SIGINT in the CLI), then refuses new requests, aborts this app's requests in
flight (each stream ends with finish_reason "abort" and ``[DONE]``) and lets hypercorn
close within ``graceful_timeout``.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import socket
import time
from http import HTTPStatus
from typing import Callable

import pydantic_core
from pydantic import BaseModel, ValidationError
from quart import Quart, Response, g, request
from quart.wrappers.response import DataBody
from werkzeug.exceptions import HTTPException

import jaxllm
from jaxllm import profiling
from jaxllm.config import ServingConfig
from jaxllm.engine.protocol import EngineClient
from jaxllm.engine.tokenizer import encode
from jaxllm.errors import EngineDeadError
from jaxllm.pooling.async_engine import AsyncPoolingEngine
from serve import chat, completions, embeddings, lora, pooling_api, scoring
from serve.images import image_parts
from serve.responses import handler as responses
from serve.responses.protocol import ResponsesRequest
from serve.responses.store import open_store
from serve.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from serve.metrics import Metrics
from serve.protocol import (APIError, ChatCompletionRequest, ClassifyRequest, CompletionRequest, DetokenizeRequest,
                            DetokenizeResponse, EmbeddingRequest, ModelCard, ModelList, PoolingRequest, RerankRequest,
                            ScoreRequest, TokenizeChatRequest, TokenizeCompletionRequest, TokenizeResponse, bad_request,
                            error_body, validation_error)
from serve.state import ServerState

log = logging.getLogger("jaxllm.serve")


def json_response(obj, status: int = 200) -> Response:
    if isinstance(obj, BaseModel):
        body = obj.model_dump_json()  # a NaN logprob becomes null rather than invalid JSON
    else:
        body = json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    return Response(body, status=status, mimetype="application/json")


def error_response(e: APIError) -> Response:
    return json_response(e.body(), e.status)


async def _json_body():
    body = await request.get_data(cache=True)
    if not body:
        raise bad_request("the request body is empty; send a JSON object")
    try:
        # Standard JSON only: NaN and Infinity are not JSON, wherever they appear.
        return pydantic_core.from_json(body, allow_inf_nan=False)
    except ValueError as e:
        raise bad_request(f"the request body is not valid JSON: {e}") from None


def _validate(model: type[BaseModel], obj):
    try:
        req = model.model_validate(obj)
    except ValidationError as e:
        raise validation_error(e) from None
    req.check_supported()
    return req


async def _access_record(response: Response) -> str:
    """One access line: method, path, status, prompt and output tokens (from a JSON answer's
    ``usage``; a stream's are counted when it ends, so shown as ``-``), and the time to answer."""
    prompt = output = "-"
    if response.mimetype == "application/json" and isinstance(response.response, DataBody):
        try:
            usage = json.loads(await response.get_data()).get("usage") or {}
            prompt = usage.get("prompt_tokens", prompt)
            output = usage.get("completion_tokens", output)
        except (ValueError, AttributeError):
            pass
    seconds = time.perf_counter() - g.get("jaxllm_t0", time.perf_counter())
    return (f'{request.remote_addr or "-"} "{request.method} {request.path}" {response.status_code} '
            f"prompt_tokens={prompt} output_tokens={output} {seconds:.3f}s")


async def _parse(model: type[BaseModel]):
    return _validate(model, await _json_body())


def build_app(engine: EngineClient, config: ServingConfig | None = None) -> Quart:
    config = config or ServingConfig()
    metrics = engine.stats_sink if isinstance(engine.stats_sink, Metrics) else None
    state = ServerState.create(engine, config, metrics)
    if engine.stats_sink is None:
        engine.stats_sink = state.metrics

    rstate = responses.ResponsesState(open_store(config))

    app = Quart("jaxllm.serve")
    app.extensions["jaxllm"] = state
    app.extensions["jaxllm.responses"] = rstate
    app.config["MAX_CONTENT_LENGTH"] = 16 * 1024 * 1024

    @app.before_request
    async def _start_clock():
        g.jaxllm_t0 = time.perf_counter()

    @app.before_request
    async def _read_body():
        # The whole body is read before any answer, early ones (401, 404, 405) included: hypercorn
        # closes a keep-alive connection whose request body was not fully received when the
        # response ended, and the client's next request on it would then fail.
        await request.get_data(cache=True)

    @app.before_request
    async def _authenticate():
        if config.api_key is None or not request.path.startswith("/v1") or request.method == "OPTIONS":
            return None
        header = request.headers.get("Authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), config.api_key.encode()):
            return json_response(error_body(HTTPStatus.UNAUTHORIZED, "Unauthorized: a valid API key is required "
                                            "(Authorization: Bearer <key>)"), HTTPStatus.UNAUTHORIZED)
        return None

    @app.after_request
    async def _access_line(response: Response):
        if config.log_requests:
            log.info("%s", await _access_record(response))
        return response

    @app.errorhandler(APIError)
    async def _api_error(e: APIError):
        return error_response(e)

    @app.errorhandler(HTTPException)
    async def _http_error(e: HTTPException):
        status = e.code or 500
        return json_response(error_body(status, e.description or HTTPStatus(status).phrase), status)

    @app.errorhandler(EngineDeadError)
    async def _engine_dead(e: EngineDeadError):
        return json_response(error_body(HTTPStatus.SERVICE_UNAVAILABLE, str(e)), HTTPStatus.SERVICE_UNAVAILABLE)

    @app.errorhandler(Exception)
    async def _unexpected(e: Exception):
        log.exception("unhandled error on %s %s", request.method, request.path)
        return json_response(error_body(HTTPStatus.INTERNAL_SERVER_ERROR, f"{type(e).__name__}: {e}"),
                             HTTPStatus.INTERNAL_SERVER_ERROR)

    def _reply(result):
        return result if isinstance(result, Response) else json_response(result)

    pooling = isinstance(engine, AsyncPoolingEngine)

    def _generation_only(endpoint: str):
        if pooling:
            raise bad_request(f"{state.model_name} is a pooling model: it does not serve {endpoint}; "
                              "use /v1/embeddings (or /score, /rerank, /classify, /pooling)", "model")

    @app.post("/v1/completions")
    async def _completions():
        _generation_only("/v1/completions")
        req = await _parse(CompletionRequest)
        return _reply(await completions.create_completion(state, req))

    @app.post("/v1/chat/completions")
    async def _chat():
        _generation_only("/v1/chat/completions")
        req = await _parse(ChatCompletionRequest)
        return _reply(await chat.create_chat_completion(state, req))

    def _pooling_only(endpoint: str):
        if not pooling:
            raise APIError(HTTPStatus.NOT_FOUND, f"{state.model_name} generates: {endpoint} needs a pooling model "
                                                 "(jaxllm serve MODEL --runner pooling)")

    @app.post("/v1/embeddings")
    async def _embeddings():
        _pooling_only("/v1/embeddings")
        req = await _parse(EmbeddingRequest)
        return _reply(await embeddings.create_embedding(state, engine, req))

    @app.post("/pooling")
    async def _pooling():
        _pooling_only("/pooling")
        req = await _parse(PoolingRequest)
        return _reply(await pooling_api.create_pooling(state, engine, req))

    @app.post("/classify")
    async def _classify():
        _pooling_only("/classify")
        req = await _parse(ClassifyRequest)
        return _reply(await pooling_api.create_classify(state, engine, req))

    @app.post("/score")
    @app.post("/v1/score")
    async def _score():
        _pooling_only("/score")
        req = await _parse(ScoreRequest)
        return _reply(await scoring.create_score(state, engine, req))

    @app.post("/rerank")
    @app.post("/v1/rerank")
    @app.post("/v2/rerank")
    async def _rerank():
        _pooling_only("/rerank")
        req = await _parse(RerankRequest)
        return _reply(await scoring.create_rerank(state, engine, req))

    @app.post("/v1/responses")
    async def _responses():
        _generation_only("/v1/responses")
        req = await _parse(ResponsesRequest)
        return _reply(await responses.create_response(state, rstate, req))

    @app.get("/v1/responses/<rid>")
    async def _get_response(rid):
        return json_response(responses.retrieve(rstate, rid))

    @app.delete("/v1/responses/<rid>")
    async def _delete_response(rid):
        return json_response(responses.delete(rstate, rid))

    @app.post("/v1/responses/<rid>/cancel")
    async def _cancel_response(rid):
        return json_response(await responses.cancel(state, rstate, rid))

    @app.get("/v1/responses/<rid>/input_items")
    async def _input_items(rid):
        args = request.args
        try:
            limit = int(args.get("limit", "20"))
        except ValueError:
            raise bad_request(f"limit must be an integer, got {args.get('limit')!r}", "limit") from None
        if not 1 <= limit <= 100:
            raise bad_request(f"limit must be between 1 and 100, got {limit}", "limit")
        order = args.get("order", "desc")
        if order not in ("asc", "desc"):
            raise bad_request(f"order must be asc or desc, got {order!r}", "order")
        return json_response(responses.list_input_items(rstate, rid, limit, order, args.get("after")))

    @app.get("/v1/models")
    async def _models():
        cards = [ModelCard(id=name, created=state.created, root=engine.model_name,
                           max_model_len=state.max_model_len) for name in state.served_names]
        cards += [ModelCard(id=lr.lora_name, created=state.created, root=lr.lora_path, parent=state.model_name,
                            max_model_len=state.max_model_len) for lr in state.loras.items()]
        return json_response(ModelList(data=cards))

    @app.get("/health")
    async def _health():
        engine.check_health()  # EngineDeadError -> 503
        if not state.accepting:
            raise APIError(HTTPStatus.SERVICE_UNAVAILABLE, "the server is shutting down")
        return Response("", status=200)

    @app.get("/version")
    async def _version():
        return json_response({"version": jaxllm.__version__})

    @app.get("/metrics")
    async def _metrics():
        for i, stats in enumerate(engine.replica_stats()):
            state.metrics.update_engine(stats, engine=i)
        return Response(state.metrics.render(config.metrics_compat), status=200, content_type=METRICS_CONTENT_TYPE)

    @app.post("/tokenize")
    async def _tokenize():
        obj = await _json_body()
        # vLLM's two request shapes: {"prompt": ...} or {"messages": [...]}.
        has_messages = isinstance(obj, dict) and "messages" in obj
        req = _validate(TokenizeChatRequest if has_messages else TokenizeCompletionRequest, obj)
        state.check_model(req.model)
        tok = state.require_tokenizer("/tokenize")
        if isinstance(req, TokenizeChatRequest):
            image_parts(state, req.messages)  # a text-only model's 400, as on /v1/chat/completions
            _, ids = chat.render_messages(
                state, req.messages, add_generation_prompt=req.add_generation_prompt,
                continue_final_message=req.continue_final_message, chat_template=req.chat_template,
                chat_template_kwargs=req.chat_template_kwargs, tools=req.tools,
                add_special_tokens=req.add_special_tokens)
        else:
            ids = encode(tok, req.prompt, add_special_tokens=req.add_special_tokens)
        strs = tok.convert_ids_to_tokens(ids) if req.return_token_strs else None
        return json_response(TokenizeResponse(count=len(ids), max_model_len=state.max_model_len, tokens=ids,
                                              token_strs=strs))

    @app.post("/detokenize")
    async def _detokenize():
        req = await _parse(DetokenizeRequest)
        state.check_model(req.model)
        tok = state.require_tokenizer("/detokenize")
        bad = [t for t in req.tokens if t >= state.engine.vocab_size]
        if bad:
            raise bad_request(f"token id {bad[0]} is out of vocabulary (size {state.engine.vocab_size})", "tokens")
        return json_response(DetokenizeResponse(prompt=tok.decode(req.tokens)))

    if config.profiler_dir is not None:
        _add_profiler_routes(app, config.profiler_dir)
    if state.loras.enabled and lora.runtime_updates_allowed():
        lora.add_runtime_routes(app, state.loras, _json_body, state.served_names)
    return app


class _ProfilingState:
    profiling: bool = False


def _add_profiler_routes(app: Quart, profiler_dir: str) -> None:
    """vLLM's ``POST /start_profile`` and ``POST /stop_profile``; without ``--profiler-dir`` the
    routes do not exist (404).  Starting twice or stopping without a start is a 400."""
    # Whether this app started the trace that runs now (jax allows one per process).
    state = app.extensions["jaxllm.profiling"] = _ProfilingState()

    @app.post("/start_profile")
    async def _start_profile():
        try:
            await asyncio.to_thread(profiling.start, profiler_dir)
        except profiling.ProfilerError as e:
            raise bad_request(str(e)) from None
        state.profiling = True
        log.info("profiling started: XLA trace into %s", profiler_dir)
        return json_response({"status": "started", "profiler_dir": profiler_dir})

    @app.post("/stop_profile")
    async def _stop_profile():
        if not state.profiling:
            raise bad_request("no profile is running; POST /start_profile first")
        try:
            trace = await asyncio.to_thread(profiling.stop)
        except profiling.ProfilerError as e:
            raise bad_request(str(e)) from None
        finally:
            state.profiling = False
        body = {"status": "stopped", "trace": trace.to_json()}
        try:
            ops = await asyncio.to_thread(profiling.top_ops, trace)
        except profiling.ProfilerError as e:
            body["top_ops_error"] = str(e)
            table = f"top-ops table unavailable: {e}"
        else:
            body["top_ops"] = [{"op": o.name, "module": o.module, "calls": o.count, "self_ms": o.self_ns / 1e6}
                               for o in ops[:20]]
            table = profiling.format_top_ops(ops)
        log.info("profiling stopped.\n%s\n%s", trace.describe(), table)
        return json_response(body)


def listen(host: str, port: int) -> socket.socket:
    """The listening socket; ValueError (naming the address) when it cannot be had."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        return socket.create_server((host, port), family=family, backlog=1024)
    except OSError as e:
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None


async def run_server(engine: EngineClient, config: ServingConfig, stop: asyncio.Event, *,
                     sock: socket.socket | None = None,
                     on_ready: Callable[[str, int], None] | None = None) -> None:
    """Serves ``engine`` over HTTP until ``stop`` is set, then shuts the server down gracefully.

    ``sock``: an already listening socket (the CLI binds before the slow engine start, so a
    busy port fails at once); by default one is opened on ``config.host:config.port``."""
    from hypercorn.asyncio import serve as hypercorn_serve
    from hypercorn.config import Config as HypercornConfig

    app = build_app(engine, config)
    if sock is None:
        sock = listen(config.host, config.port)
    host, port = sock.getsockname()[:2]
    hc = HypercornConfig()
    # Hypercorn takes over the listening socket (it closes it when it stops).
    hc.bind = [f"fd://{sock.detach()}"]
    hc.graceful_timeout = config.graceful_timeout
    hc.accesslog = None
    hc.errorlog = logging.getLogger("hypercorn.error")

    state: ServerState = app.extensions["jaxllm"]

    async def shutdown_trigger():
        await stop.wait()
        n = state.begin_shutdown()
        log.info("shutting down: refusing new requests, aborted %d in flight", n)
        prof = app.extensions.get("jaxllm.profiling")
        if prof is not None and prof.profiling:  # a profile left running: write it rather than lose it
            prof.profiling = False
            try:
                trace = await asyncio.to_thread(profiling.stop)
                log.info("stopped the running profile.\n%s", trace.describe())
            except profiling.ProfilerError as e:
                log.warning("could not stop the running profile: %s", e)

    shown = f"[{host}]" if ":" in host else host
    log.info("serving %s on http://%s:%d", state.model_name, shown, port)
    if on_ready is not None:
        on_ready(host, port)
    await hypercorn_serve(app, hc, shutdown_trigger=shutdown_trigger)
