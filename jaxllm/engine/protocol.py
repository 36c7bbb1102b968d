"""EngineClient: the one interface the server uses of an engine, one or data-parallel alike.

``AsyncEngine`` (one engine in a background thread) and ``DataParallelEngine`` (N of them
behind a router) both implement it, and ``serve/`` touches nothing else: a request is
processed by ``input_processor.process_inputs`` (the only validation), queued with
``add_request``, and read back from the returned :class:`OutputStream`.  (vLLM's
``EngineClient`` plays the same part.)
"""

from __future__ import annotations

from typing import AsyncIterator, Protocol

from jaxllm.engine.llm_engine import EngineStats
from jaxllm.engine.output_processor import OutputKind
from jaxllm.engine.processor import InputProcessor, PromptType
from jaxllm.outputs import RequestOutput
from jaxllm.request import EngineRequest
from jaxllm.sampling_params import SamplingParams


class OutputStream(Protocol):
    """One request's ``RequestOutput``s: ``async with stream: async for out in stream``.
    Leaving the block before the request finished aborts it (its KV blocks are freed)."""

    request_id: str

    @property
    def finished(self) -> bool: ...

    def __aiter__(self) -> "OutputStream": ...

    async def __anext__(self) -> RequestOutput: ...

    def abort(self) -> None: ...

    async def __aenter__(self) -> "OutputStream": ...

    async def __aexit__(self, *exc) -> None: ...


class EngineClient(Protocol):
    # ------------------------------------------------------------------ model facts

    @property
    def model_name(self) -> str: ...

    @property
    def tokenizer(self):
        """The HF tokenizer, or None (skip_tokenizer_init)."""

    @property
    def max_model_len(self) -> int: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def generation_config(self) -> dict:
        """The checkpoint's generation_config.json (the server's sampling defaults)."""

    @property
    def prefix_caching(self) -> bool: ...

    # ------------------------------------------------------------------ requests

    @property
    def input_processor(self) -> InputProcessor:
        """``process_inputs(request_id, prompt, params, priority=...)`` -> the request
        :meth:`add_request` takes (ValueError naming what is wrong); ``check_params``."""

    @property
    def lora_stores(self) -> tuple:
        """Every replica's adapter store (``jaxllm.lora.store.AdapterStore``), in replica order;
        empty when the engine runs without LoRA.  A runtime ``load_lora_adapter`` reads the
        adapter into each, so it reaches every replica or none."""

    def add_request(self, request: EngineRequest, *, kind: OutputKind = OutputKind.DELTA) -> OutputStream:
        """Queues a processed request.  EngineDeadError when the engine cannot take it."""

    def generate(self, prompt: PromptType, params: SamplingParams, request_id: str, *,
                 priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Processes and queues a request, yielding its output deltas."""

    def abort(self, request_id: str) -> None:
        """Ends a request (its stream receives a final output, finish_reason "abort")."""

    def abort_all(self) -> None: ...

    # ------------------------------------------------------------------ health, statistics, life

    @property
    def error(self) -> BaseException | None:
        """The exception that killed the engine, or None."""

    def check_health(self) -> None:
        """Raises EngineDeadError when the engine cannot serve requests."""

    stats_sink: object
    """Receives ``IterationStats`` from the engine thread(s): ``record(stats)`` for one engine,
    ``record(stats, engine=i)`` for data-parallel replica ``i``."""

    def stats(self) -> EngineStats:
        """The scheduler and KV pool now (summed over replicas)."""

    def replica_stats(self) -> list[EngineStats]:
        """One snapshot per engine, in the order of the metrics' ``engine`` label."""

    def stop_accepting(self) -> None: ...

    def shutdown(self, timeout: float = 10.0) -> None: ...
