"""DataParallelEngine: N engine replicas behind one server (``jaxllm serve -dp N``).

Each replica is a whole :class:`AsyncEngine` (its own engine thread, scheduler, KV cache and
compiled steps) on its own ``tensor_parallel_size`` devices: replica ``i`` is
``LLMEngine(config, replica=i)``, on devices ``[i*tp, (i+1)*tp)``.  Replicas share nothing
but the process, so N replicas serve about N times the requests of one when there are N
devices to run them (on CPU the simulated devices share the cores).

Both this class and ``AsyncEngine`` implement ``jaxllm.engine.protocol.EngineClient``, the
one interface ``serve/`` uses, so the server runs on either unchanged.  Requests are
processed once, by replica 0's input processor (the replicas run the same model and
configuration), before they are routed.  Routing: a new request goes to the replica with
the fewest unfinished requests routed to it (ties to the lowest index).  The count is kept here, keyed by request
id, and a request's slot is given back exactly once, on every way it can end: its stream
delivers the final output or an engine error, the stream is aborted or closed (a client
disconnect), ``abort``/``abort_all`` is called, or the stream is dropped unclosed.  Later
calls about that request go to the replica that owns it.  Request ids must be unique
across the server (a duplicate of an open request is refused here, since the replicas
cannot see each other's ids).

Metrics: the ``stats_sink`` set on this engine is given to every replica, wrapped so that
replica ``i`` calls ``sink.record(stats, engine=i)`` from its own thread (vLLM's ``engine``
label; ``serve.metrics.Metrics`` takes it and is thread-safe).  ``stats()`` sums the
replicas' snapshots; ``replica_stats()`` gives them one by one.
"""

from __future__ import annotations

import logging
import threading
from typing import AsyncIterator, Sequence

from jaxllm.engine.async_engine import AsyncEngine, RequestStream
from jaxllm.engine.llm_engine import EngineStats, LLMEngine
from jaxllm.engine.output_processor import OutputKind
from jaxllm.engine.processor import InputProcessor, PromptType
from jaxllm.errors import EngineDeadError
from jaxllm.outputs import RequestOutput
from jaxllm.request import EngineRequest
from jaxllm.sampling_params import SamplingParams

log = logging.getLogger("jaxllm.engine")


class _ReplicaSink:
    """Replica ``index``'s view of the server's stats sink."""

    def __init__(self, sink, index: int):
        self.sink = sink
        self.index = index

    def record(self, stats) -> None:
        self.sink.record(stats, engine=self.index)


class RoutedStream:
    """A replica's :class:`RequestStream` that gives its routing slot back when it ends.

    Same use as ``RequestStream`` (``async with stream: async for out in stream``)."""

    def __init__(self, inner: RequestStream, release):
        self.request_id = inner.request_id
        self.replica_stream = inner
        self._release = release

    @property
    def finished(self) -> bool:
        return self.replica_stream.finished

    def __aiter__(self) -> "RoutedStream":
        return self

    async def __anext__(self) -> RequestOutput:
        try:
            return await self.replica_stream.__anext__()
        finally:
            # The final output, an engine error (both mark the stream finished) or the end of
            # the iteration; a CancelledError leaves it open until the abort that follows.
            if self.replica_stream.finished:
                self._release()

    def abort(self) -> None:
        self.replica_stream.abort()
        self._release()

    async def __aenter__(self) -> "RoutedStream":
        return self

    async def __aexit__(self, *exc) -> None:
        self.abort()

    def __del__(self):
        try:
            self.abort()
        except Exception:
            pass


class DataParallelEngine:
    """N :class:`AsyncEngine` replicas behind the one interface the server uses."""

    def __init__(self, replicas: Sequence[AsyncEngine], stats_sink=None):
        """``replicas``: engines already started (see :meth:`from_config`)."""
        if not replicas:
            raise ValueError("a data-parallel engine needs at least one replica")
        self.replicas = list(replicas)
        # RLock: a dropped stream's finalizer may release its slot while this thread holds it.
        self._lock = threading.RLock()
        self._load = [0] * len(self.replicas)
        self._owner: dict[str, tuple[int, object]] = {}
        """request id -> (replica index, the token of the stream that holds the slot)."""
        self._sink = None
        self.stats_sink = stats_sink

    @classmethod
    def from_config(cls, config, stats_sink=None) -> "DataParallelEngine":
        """Builds ``config.parallel.data_parallel_size`` replicas, one after the other: each
        loads the weights and compiles its steps for its own devices.  (Not in parallel
        threads: transformers' lazy imports are not thread-safe.  On CPU each replica compiles
        anew: JAX's persistent cache keys a CPU executable by its devices.)"""
        n = config.parallel.data_parallel_size
        replicas: list[AsyncEngine] = []
        try:
            for i in range(n):
                log.info("data-parallel replica %d of %d: starting", i, n)
                replicas.append(AsyncEngine(LLMEngine(config, replica=i)))
        except BaseException:
            for r in replicas:
                r.shutdown()
            raise
        log.info("data parallel: %d replicas, each on %d device(s); requests go to the least-loaded one",
                 n, config.parallel.tensor_parallel_size)
        return cls(replicas, stats_sink)

    # ------------------------------------------------------------------ read-only views

    @property
    def tokenizer(self):
        return self.replicas[0].tokenizer

    @property
    def max_model_len(self) -> int:
        return self.replicas[0].max_model_len

    @property
    def model_name(self) -> str:
        return self.replicas[0].model_name

    @property
    def vocab_size(self) -> int:
        return self.replicas[0].vocab_size

    @property
    def supports_images(self) -> bool:
        return self.replicas[0].supports_images

    @property
    def generation_config(self) -> dict:
        return self.replicas[0].generation_config

    @property
    def prefix_caching(self) -> bool:
        return self.replicas[0].prefix_caching

    @property
    def input_processor(self) -> InputProcessor:
        """Replica 0's: every replica runs the same model and configuration."""
        return self.replicas[0].input_processor

    @property
    def lora_stores(self) -> tuple:
        """Each replica's adapter store: a runtime load reads the adapter into all of them."""
        return tuple(s for r in self.replicas for s in r.lora_stores)

    @property
    def error(self) -> BaseException | None:
        """The exception that killed the first dead replica, or None."""
        return next((r.error for r in self.replicas if r.error is not None), None)

    @property
    def stats_sink(self):
        return self._sink

    @stats_sink.setter
    def stats_sink(self, sink) -> None:
        self._sink = sink
        for i, r in enumerate(self.replicas):
            r.stats_sink = None if sink is None else _ReplicaSink(sink, i)

    def loads(self) -> list[int]:
        """Unfinished requests routed to each replica."""
        with self._lock:
            return list(self._load)

    def replica_stats(self) -> list[EngineStats]:
        return [r.stats() for r in self.replicas]

    def stats(self) -> EngineStats:
        """The replicas' snapshots summed."""
        ss = self.replica_stats()
        return EngineStats(
            num_running=sum(s.num_running for s in ss), num_waiting=sum(s.num_waiting for s in ss),
            num_free_blocks=sum(s.num_free_blocks for s in ss), num_blocks=sum(s.num_blocks for s in ss),
            num_preemptions=sum(s.num_preemptions for s in ss),
            prefix_cache_queries=sum(s.prefix_cache_queries for s in ss),
            prefix_cache_hits=sum(s.prefix_cache_hits for s in ss),
            encoder_cache_hits=sum(s.encoder_cache_hits for s in ss),
            encoder_cache_misses=sum(s.encoder_cache_misses for s in ss),
            encoder_cache_entries=sum(s.encoder_cache_entries for s in ss),
            max_loras=max(s.max_loras for s in ss),   # each replica has its own slots
            running_loras=tuple(dict.fromkeys(n for s in ss for n in s.running_loras)),
            waiting_loras=tuple(dict.fromkeys(n for s in ss for n in s.waiting_loras)))

    def check_health(self) -> None:
        """Raises EngineDeadError (naming the replica) when any replica cannot serve."""
        for i, r in enumerate(self.replicas):
            try:
                r.check_health()
            except EngineDeadError as e:
                raise type(e)(f"data-parallel replica {i} of {len(self.replicas)}: {e}") from e

    # ------------------------------------------------------------------ requests

    def add_request(self, request: EngineRequest, *, kind: OutputKind = OutputKind.DELTA) -> RoutedStream:
        """Queues a processed request on the least-loaded replica; returns the stream of its outputs.

        Raises ValueError for an id already in use (the replicas cannot see each other's ids)
        and EngineDeadError when any replica is dead.  Call from a running event loop."""
        self.check_health()
        request_id = request.request_id
        with self._lock:
            if request_id in self._owner:
                raise ValueError(f"request id {request_id!r} is already in use")
            i = min(range(len(self.replicas)), key=lambda k: (self._load[k], k))
            inner = self.replicas[i].add_request(request, kind=kind)
            token = object()
            self._owner[request_id] = (i, token)
            self._load[i] += 1
        return RoutedStream(inner, lambda: self._release(request_id, token))

    def _release(self, request_id: str, token: object | None) -> int | None:
        """Gives the request's slot back (once; only the stream holding ``token`` can, unless
        ``token`` is None).  Returns the owning replica, or None when it held no slot."""
        with self._lock:
            owner = self._owner.get(request_id)
            if owner is None or (token is not None and owner[1] is not token):
                return None
            del self._owner[request_id]
            self._load[owner[0]] -= 1
            return owner[0]

    async def generate(self, prompt: PromptType, params: SamplingParams, request_id: str, *,
                       priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Yields the request's output deltas; closing the generator early aborts the request."""
        stream = self.add_request(self.input_processor.process_inputs(request_id, prompt, params,
                                                                      priority=priority))
        async with stream:
            async for out in stream:
                yield out

    def abort(self, request_id: str) -> None:
        """Ends a request on the replica that owns it (a no-op once it has ended)."""
        i = self._release(request_id, None)
        if i is not None:
            self.replicas[i].abort(request_id)

    def abort_all(self) -> None:
        with self._lock:
            self._owner.clear()
            self._load = [0] * len(self.replicas)
        for r in self.replicas:
            r.abort_all()

    def stop_accepting(self) -> None:
        for r in self.replicas:
            r.stop_accepting()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stops every replica (each aborts what it has open), waiting at most ``timeout`` s each."""
        self.stop_accepting()
        for r in self.replicas:
            r.shutdown(timeout)
