"""The pooling engine for the server: one thread runs the encoder; requests that arrive while a
step runs are embedded together in the next one (their prompts packed into shared buckets).

It answers the model facts of ``engine/protocol.EngineClient`` that the server reads (name,
tokenizer, lengths, health, statistics); it takes no generation request.  After each step it
hands its ``stats_sink`` (the server's metrics) one finished request per prompt, as vLLM counts
pooling requests: finish reason ``stop``, its prompt tokens, queue time and latency.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time

import numpy as np

from jaxllm.engine.async_engine import EngineStoppedError, FinishedRequestStats, IterationStats
from jaxllm.engine.llm_engine import EngineStats
from jaxllm.errors import EngineDeadError
from jaxllm.pooling.engine import PoolingEngine
from jaxllm.sampling_params import SamplingParams

log = logging.getLogger("jaxllm.engine")


class AsyncPoolingEngine:
    def __init__(self, engine: PoolingEngine):
        self.engine = engine
        self.stats_sink = None
        self.error: BaseException | None = None
        self._accepting = True   # False from SIGTERM's drain (stop_accepting) or shutdown on
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="jaxllm-pooling", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ model facts

    @property
    def model_name(self) -> str:
        return self.engine.model_name

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.engine.vocab_size

    @property
    def generation_config(self) -> dict:
        return {}

    @property
    def prefix_caching(self) -> bool:
        return False

    @property
    def input_processor(self) -> "AsyncPoolingEngine":
        return self

    @property
    def lora_stores(self) -> tuple:
        """A pooling engine runs no LoRA adapters: none to load into."""
        return ()

    def check_params(self, params: SamplingParams) -> None:
        raise ValueError("a pooling model takes no sampling parameters")

    # ------------------------------------------------------------------ requests

    def tokenize(self, prompt, truncate_prompt_tokens: int | None = None, *, index: int | None = None) -> list[int]:
        return self.engine.tokenize(prompt, truncate_prompt_tokens, index=index)

    def tokenize_pair(self, first: str, second: str, truncate_prompt_tokens: int | None = None, *,
                      where: str = "input") -> tuple[list[int], list[int]]:
        return self.engine.tokenize_pair(first, second, truncate_prompt_tokens, where=where)

    async def embed_ids(self, prompts: list[list[int]], token_types: list[list[int]] | None = None) -> list[np.ndarray]:
        """Checked token-id lists -> one row each (a vector; a cross-encoder's logits), batched
        with whatever else is waiting."""
        self.check_health()
        if not self._accepting:   # after shutdown nothing would answer it: refuse, never hang
            raise EngineStoppedError("the engine is shutting down")
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        types = token_types if token_types is not None else [[0] * len(p) for p in prompts]
        self._queue.put((prompts, types, fut, loop, time.monotonic()))
        return await fut

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            batch = [item]
            stop = False
            while True:   # everything already waiting joins this step
                try:
                    more = self._queue.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    stop = True
                    break
                batch.append(more)
            flat = [p for prompts, *_ in batch for p in prompts]
            types = [t for _, ts, *_ in batch for t in ts]
            started = time.monotonic()
            try:
                vecs = self.engine.embed_ids(flat, types)
            except BaseException as e:   # the engine is dead: every waiting request is told
                log.exception("pooling step failed")
                self.error = e
                for _, _, fut, loop, _ in batch:
                    loop.call_soon_threadsafe(_fail, fut, EngineDeadError(f"the engine failed: {e!r}"))
                self._fail_waiting()
                return
            self._publish(batch, started, time.monotonic())   # before the answers: a client then reads them
            at = 0
            for prompts, _, fut, loop, _ in batch:
                loop.call_soon_threadsafe(_resolve, fut, vecs[at:at + len(prompts)])
                at += len(prompts)
            if stop:
                return

    def _fail_waiting(self) -> None:
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            if item is not None:
                _, _, fut, loop, _ = item
                loop.call_soon_threadsafe(_fail, fut, EngineDeadError(f"the engine failed: {self.error!r}"))

    def _publish(self, batch: list, started: float, ended: float) -> None:
        """One step's requests to the stats sink: each prompt a request finished with ``stop``."""
        if self.stats_sink is None:
            return
        finished = tuple(FinishedRequestStats(request_id="", finish_reason="stop", num_prompt_tokens=len(p),
                                              num_generation_tokens=0, e2e_latency=ended - t0,
                                              queue_time=started - t0)
                         for prompts, _, _, _, t0 in batch for p in prompts)
        idle = EngineStats(num_running=0, num_waiting=self._queue.qsize(), num_free_blocks=0, num_blocks=0,
                           num_preemptions=0)
        try:
            self.stats_sink.record(IterationStats(
                engine=idle, num_prompt_tokens=sum(f.num_prompt_tokens for f in finished), num_generation_tokens=0,
                time_to_first_token=(), inter_token_latency=(), finished=finished))
        except Exception:  # metrics must never take the engine down
            log.exception("stats sink failed")

    # ------------------------------------------------------------------ health, statistics, life

    def check_health(self) -> None:
        if self.error is not None:
            raise EngineDeadError(f"the engine failed: {self.error!r}")

    def replica_stats(self) -> list:
        return []

    def abort(self, request_id: str) -> None:
        pass   # an embedding request is one step: nothing to abort

    def abort_all(self) -> None:
        pass   # as abort: every queued request is one step, answered before the thread stops

    def stop_accepting(self) -> None:
        """New requests are refused (EngineStoppedError) from now on; queued ones are answered."""
        self._accepting = False

    def shutdown(self, timeout: float = 10.0) -> None:
        self._accepting = False
        self._queue.put(None)
        self._thread.join(timeout)


def _resolve(fut: asyncio.Future, value) -> None:
    if not fut.done():
        fut.set_result(value)


def _fail(fut: asyncio.Future, e: BaseException) -> None:
    if not fut.done():
        fut.set_exception(e)
