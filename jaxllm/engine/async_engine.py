"""AsyncEngine: the engine's step loop in its own thread, fed and drained from asyncio.

A blocking JAX call inside the event loop would stall every open stream, so one background
thread owns the :class:`LLMEngine`.  The event loop never touches it: it queues commands
(add, abort, abort-all, stop) that the thread applies *between* steps, so an abort frees
the request's KV blocks before the next step is scheduled.  Requests arrive already
processed (``input_processor.process_inputs`` in the caller, so a bad request is the
caller's ValueError).  Each request's outputs (``OutputKind.DELTA``, new tokens and text
since the last output, for a stream; ``FINAL_ONLY`` for a caller that wants the whole
result once) go to that request's own ``asyncio.Queue`` through
``loop.call_soon_threadsafe``; per-request state is keyed by request id.

An exception from a step marks the engine dead: every open request receives an
:class:`EngineDeadError`, and so does every later one (``check_health`` raises), instead of
waiting for outputs that will never come.

Timing statistics (time to first token, inter-token latency, queue time, end-to-end
latency, token counts) are measured in the engine thread and handed to an optional
``stats_sink`` after every iteration; the server's Prometheus metrics are one such sink.
Queue time ends at the scheduler's own SCHEDULED event for the request (reported in the
step's result), not at a poll of the scheduler's state.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Protocol

from jaxllm.engine.llm_engine import EngineStats, LLMEngine, StepResult
from jaxllm.engine.output_processor import OutputKind
from jaxllm.engine.processor import InputProcessor, PromptType
from jaxllm.errors import EngineDeadError
from jaxllm.lora.request import LoRARequest
from jaxllm.outputs import EventKind, RequestOutput
from jaxllm.request import EngineRequest
from jaxllm.sampling_params import SamplingParams

log = logging.getLogger("jaxllm.engine")

# The idle engine thread wakes at least this often (seconds), so it never sleeps unbounded.
_IDLE_POLL_S = 1.0


class EngineStoppedError(EngineDeadError):
    """The engine is shutting down (or has shut down) and takes no new requests."""


# ---------------------------------------------------------------------------- statistics


@dataclass(frozen=True)
class FinishedRequestStats:
    request_id: str
    finish_reason: str
    """'stop', 'length' or 'abort'."""
    num_prompt_tokens: int
    num_generation_tokens: int
    e2e_latency: float
    """Seconds from ``add_request`` to the end."""
    queue_time: float | None
    """Seconds from ``add_request`` until the first step that scheduled it (None: never scheduled)."""


@dataclass(frozen=True)
class IterationStats:
    """What happened in one turn of the engine loop (commands applied, then at most one step)."""

    engine: EngineStats
    num_prompt_tokens: int
    """Prompt tokens of the requests that produced their first token in this iteration."""
    num_generation_tokens: int
    time_to_first_token: tuple[float, ...]
    inter_token_latency: tuple[float, ...]
    """Seconds between consecutive outputs of a request, one entry per output."""
    finished: tuple[FinishedRequestStats, ...]


class StatsSink(Protocol):
    def record(self, stats: IterationStats) -> None:
        """Called from the engine thread; must be quick and thread-safe."""


# ---------------------------------------------------------------------------- commands


@dataclass(frozen=True)
class _Add:
    request: EngineRequest
    kind: OutputKind
    queue: asyncio.Queue
    loop: asyncio.AbstractEventLoop


@dataclass(frozen=True)
class _Abort:
    request_id: str
    queue: asyncio.Queue | None
    """Abort only if the request still belongs to this stream (None: whoever owns it)."""


_ABORT_ALL = object()
_STOP = object()


@dataclass
class _Tracked:
    """Engine-thread state of one request."""

    queue: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    arrival: float
    num_prompt_tokens: int
    scheduled: float | None = None
    """When the scheduler first admitted it (its SCHEDULED event)."""
    last_output: float | None = None
    num_generation_tokens: int = 0
    finish_reason: str | None = None


@dataclass
class _IterAccumulator:
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    finished: list[FinishedRequestStats] = field(default_factory=list)
    sends: list[tuple[asyncio.AbstractEventLoop, asyncio.Queue, object]] = field(default_factory=list)
    """Outputs for the request queues, handed over after the stats are recorded, so that a
    client that has seen its output also finds it counted in the metrics."""


# ---------------------------------------------------------------------------- the stream


class RequestStream:
    """The outputs of one request as an async iterator of ``RequestOutput`` deltas.

    Use it as ``async with stream: async for out in stream: ...``: leaving the block before
    the request finished (a client disconnect arrives as ``CancelledError``) aborts it, which
    frees its KV blocks.  A stream dropped without being closed aborts its request too.
    """

    def __init__(self, engine: "AsyncEngine", request_id: str, q: asyncio.Queue):
        self.request_id = request_id
        self._engine = engine
        self._queue = q
        self.finished = False

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self.finished = True  # the engine has already dropped the request
            raise item
        if item.finished:
            self.finished = True
        return item

    def abort(self) -> None:
        if not self.finished:
            self.finished = True
            self._engine._submit(_Abort(self.request_id, self._queue))

    async def __aenter__(self) -> "RequestStream":
        return self

    async def __aexit__(self, *exc) -> None:
        self.abort()

    def __del__(self):
        # SimpleQueue.put is safe to call from a finalizer.
        try:
            self.abort()
        except Exception:
            pass


# ---------------------------------------------------------------------------- the engine


def check_servable(config) -> None:
    """Refuses a configuration a server cannot keep its promise with (zero compiles once serving)."""
    if config.runner.precompile == "on-demand":
        raise ValueError("--precompile on-demand is for one-shot commands: a server compiles every "
                         "step bucket before its first request (use auto or all)")


class AsyncEngine:
    """An :class:`LLMEngine` driven by a background thread, for asyncio callers (the server)."""

    def __init__(self, engine: LLMEngine, stats_sink: StatsSink | None = None):
        """Compiles every bucket the engine has not yet (serving never compiles), then starts."""
        check_servable(engine.config)
        engine.compile_all()
        self.engine = engine
        self.stats_sink = stats_sink
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._error: BaseException | None = None
        self._accepting = True
        self._stats = engine.get_stats()
        self._thread = threading.Thread(target=self._run, name="jaxllm-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_config(cls, config, stats_sink: StatsSink | None = None) -> "AsyncEngine":
        return cls(LLMEngine(config), stats_sink)

    # ------------------------------------------------------------------ read-only views

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def model_name(self) -> str:
        return self.engine.model_name

    @property
    def vocab_size(self) -> int:
        return self.engine.arch.vocab_size

    @property
    def supports_images(self) -> bool:
        """A vision-language model's engine (serve/state.py reads it before taking image parts)."""
        return self.engine.supports_images

    @property
    def generation_config(self) -> dict:
        return self.engine.generation_config

    @property
    def prefix_caching(self) -> bool:
        # What runs: a hybrid model turns it off whatever the flag says (engine/core.py).
        return self.engine.core.kv_manager.enable_prefix_caching

    @property
    def input_processor(self) -> InputProcessor:
        """Turns a prompt and its parameters into the request :meth:`add_request` takes; only
        reads immutable engine facts, so any thread may call it."""
        return self.engine.input_processor

    @property
    def lora_stores(self) -> tuple:
        """This engine's adapter store, alone; empty without LoRA."""
        store = self.engine.input_processor.lora_store
        return () if store is None else (store,)

    @property
    def error(self) -> BaseException | None:
        """The exception that killed the engine, or None."""
        return self._error

    def stats(self) -> EngineStats:
        """The scheduler and KV pool after the engine thread's latest iteration."""
        return self._stats

    def replica_stats(self) -> list[EngineStats]:
        """One snapshot per engine (this one), as the metrics' ``engine`` label counts them."""
        return [self._stats]

    def check_health(self) -> None:
        """Raises EngineDeadError when the engine cannot serve requests."""
        if self._error is not None:
            raise EngineDeadError(f"the engine failed and stopped: {type(self._error).__name__}: {self._error}")
        if not self._thread.is_alive():
            raise EngineStoppedError("the engine has shut down")
        if not self._accepting:
            raise EngineStoppedError("the engine is shutting down")

    # ------------------------------------------------------------------ requests

    def add_request(self, request: EngineRequest, *, kind: OutputKind = OutputKind.DELTA) -> RequestStream:
        """Queues a processed request; returns the stream of its outputs.

        Raises EngineDeadError when the engine cannot take it; an id still in use arrives on
        the stream as a ValueError.  Call from a running event loop."""
        self.check_health()
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        self._submit(_Add(request, kind, q, loop))
        return RequestStream(self, request.request_id, q)

    async def generate(self, prompt: PromptType, params: SamplingParams, request_id: str, *,
                       priority: int = 0, lora_request: LoRARequest | None = None) -> AsyncIterator[RequestOutput]:
        """Yields the request's output deltas; closing the generator early aborts the request
        (``lora_request``: its adapter, the engine started with ``enable_lora``)."""
        stream = self.add_request(self.input_processor.process_inputs(request_id, prompt, params,
                                                                      priority=priority, lora_request=lora_request))
        async with stream:
            async for out in stream:
                yield out

    def abort(self, request_id: str) -> None:
        """Ends a request; the engine thread frees its KV blocks before the next step."""
        self._submit(_Abort(request_id, None))

    def abort_all(self) -> None:
        """Ends every open request; each stream receives a final output with finish_reason 'abort'."""
        self._submit(_ABORT_ALL)

    def stop_accepting(self) -> None:
        """New requests are refused (EngineStoppedError) from now on."""
        self._accepting = False

    def shutdown(self, timeout: float = 10.0) -> None:
        """Aborts what is open, stops the engine thread and waits for it (at most ``timeout`` s)."""
        self._accepting = False
        self._submit(_STOP)
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)
        self.engine.shutdown()   # multi-host: releases the other hosts

    def _submit(self, cmd) -> None:
        self._inbox.put(cmd)

    # ------------------------------------------------------------------ the engine thread

    def _take_commands(self, block: bool) -> list:
        cmds = []
        if block:
            try:
                cmds.append(self._inbox.get(timeout=_IDLE_POLL_S))
            except queue.Empty:
                return cmds
        while True:
            try:
                cmds.append(self._inbox.get_nowait())
            except queue.Empty:
                return cmds

    def _run(self) -> None:
        streams: dict[str, _Tracked] = {}
        engine = self.engine
        while True:
            busy = self._error is None and engine.has_unfinished_requests()
            cmds = self._take_commands(block=not busy)
            acc = _IterAccumulator()
            stop = False
            for cmd in cmds:
                if cmd is _STOP:
                    stop = True
                elif cmd is _ABORT_ALL:
                    for rid in list(streams):
                        self._abort(rid, None, streams, acc)
                elif isinstance(cmd, _Abort):
                    self._abort(cmd.request_id, cmd.queue, streams, acc)
                else:
                    self._add(cmd, streams)
            if stop:
                for rid in list(streams):
                    self._abort(rid, None, streams, acc)
                self._publish(acc, stepped=bool(cmds))
                self._flush(acc)
                return
            stepped = False
            if self._error is None and engine.has_unfinished_requests():
                try:
                    result = engine.step_with_counts()
                except Exception as e:
                    self._fail(e, streams)
                    self._publish(acc, stepped=True)
                    self._flush(acc)
                    continue
                self._deliver(result, streams, acc)
                stepped = True
            self._publish(acc, stepped=stepped or bool(cmds))
            self._flush(acc)

    def _add(self, cmd: _Add, streams: dict[str, _Tracked]) -> None:
        if self._error is not None:
            _put(cmd.loop, cmd.queue, EngineDeadError(
                f"the engine failed and stopped: {type(self._error).__name__}: {self._error}"))
            return
        req = cmd.request
        try:
            self.engine.add_engine_request(req, cmd.kind)
        except Exception as e:  # an id still in use: the caller's error, on its stream
            _put(cmd.loop, cmd.queue, e)
            return
        streams[req.request_id] = _Tracked(cmd.queue, cmd.loop, req.arrival_time, req.num_prompt_tokens)

    def _abort(self, request_id: str, owner: asyncio.Queue | None, streams: dict[str, _Tracked],
               acc: _IterAccumulator) -> None:
        tr = streams.get(request_id)
        if tr is None or (owner is not None and tr.queue is not owner):
            return  # finished already, or the id now belongs to another request
        del streams[request_id]
        finals = self.engine.abort_request(request_id)
        now = time.monotonic()
        for out in finals:
            acc.sends.append((tr.loop, tr.queue, out))
        tr.finish_reason = "abort"
        acc.finished.append(self._finished_stats(request_id, tr, now))

    def _deliver(self, result: StepResult, streams: dict[str, _Tracked], acc: _IterAccumulator) -> None:
        now = time.monotonic()
        for ev in result.events:
            tr = streams.get(ev.request_id)
            if tr is not None and tr.scheduled is None and ev.kind == EventKind.SCHEDULED:
                tr.scheduled = ev.timestamp
        for rid, n in result.new_tokens.items():
            tr = streams.get(rid)
            if tr is None or not n:
                continue
            if tr.last_output is None:
                acc.ttft.append(now - tr.arrival)
                acc.num_prompt_tokens += tr.num_prompt_tokens
            else:
                acc.itl.append(now - tr.last_output)
            tr.last_output = now
            tr.num_generation_tokens += n
            acc.num_generation_tokens += n
        for out in result.outputs:
            tr = streams.get(out.request_id)
            if tr is None:
                continue
            for c in out.outputs:
                if c.finish_reason is not None:
                    tr.finish_reason = c.finish_reason
            acc.sends.append((tr.loop, tr.queue, out))
            if out.finished:
                del streams[out.request_id]
                acc.finished.append(self._finished_stats(out.request_id, tr, now))

    @staticmethod
    def _finished_stats(request_id: str, tr: _Tracked, now: float) -> FinishedRequestStats:
        return FinishedRequestStats(
            request_id=request_id, finish_reason=tr.finish_reason or "abort",
            num_prompt_tokens=tr.num_prompt_tokens, num_generation_tokens=tr.num_generation_tokens,
            e2e_latency=now - tr.arrival,
            queue_time=None if tr.scheduled is None else tr.scheduled - tr.arrival)

    def _fail(self, exc: Exception, streams: dict[str, _Tracked]) -> None:
        log.error("engine step failed; the engine is dead and refuses new requests", exc_info=exc)
        self._error = exc
        err = EngineDeadError(f"the engine failed and stopped: {type(exc).__name__}: {exc}")
        for tr in streams.values():
            _put(tr.loop, tr.queue, err)
        streams.clear()

    @staticmethod
    def _flush(acc: _IterAccumulator) -> None:
        for loop, q, item in acc.sends:
            _put(loop, q, item)
        acc.sends.clear()

    def _publish(self, acc: _IterAccumulator, stepped: bool) -> None:
        if not stepped:
            return
        self._stats = stats = self.engine.get_stats()
        if self.stats_sink is None:
            return
        try:
            self.stats_sink.record(IterationStats(
                engine=stats, num_prompt_tokens=acc.num_prompt_tokens,
                num_generation_tokens=acc.num_generation_tokens, time_to_first_token=tuple(acc.ttft),
                inter_token_latency=tuple(acc.itl), finished=tuple(acc.finished)))
        except Exception:  # metrics must never take the engine down
            log.exception("stats sink failed")


def _put(loop: asyncio.AbstractEventLoop, q: asyncio.Queue, item) -> None:
    try:
        loop.call_soon_threadsafe(q.put_nowait, item)
    except RuntimeError:
        pass  # the caller's event loop is closed: nobody is listening any more
