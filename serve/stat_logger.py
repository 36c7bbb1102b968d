"""The server's periodic log line (vLLM's ``LoggingStatLogger``): every ``interval`` seconds
of serving, per engine, the prompt and generation throughput since the last line (prompt
tokens counted as each prefill chunk completes, so a long chunked prefill shows while it runs), the
running and waiting requests, KV-cache usage and prefix-cache hit rate, and, when
speculative decoding verified proposals, its acceptance: mean acceptance length (tokens a
verification emits: 1 + accepted per proposal run), the acceptance rate by position, and
the accepted and drafted tokens.  ``--disable-log-stats`` turns it off."""

from __future__ import annotations

import logging
import time

from jaxllm.engine.async_engine import IterationStats

log = logging.getLogger("jaxllm.serve")


class _Window:
    def __init__(self, now: float):
        self.start = now
        self.generation = 0
        self.spec = (0, 0, 0)
        self.per_pos: tuple[int, ...] = ()
        self.hits = (0, 0)
        self.prompt_computed = 0


class StatLogger:
    def __init__(self, interval: float = 10.0, clock=time.monotonic):
        self.interval = interval
        self.clock = clock
        self._windows: dict[int, _Window] = {}

    def record(self, stats: IterationStats, engine: int = 0) -> None:
        now = self.clock()
        w = self._windows.get(engine)
        s = stats.engine
        if w is None:
            w = self._windows[engine] = _Window(now)
            self._baseline(w, s)
            w.prompt_computed = 0   # the counter starts with the engine: this iteration's chunks count
        w.generation += stats.num_generation_tokens
        if now - w.start >= self.interval:
            self._log(engine, w, s, now)
            self._windows[engine] = nw = _Window(now)
            self._baseline(nw, s)

    @staticmethod
    def _baseline(w: _Window, s) -> None:
        w.spec = (s.spec_num_drafts, s.spec_num_draft_tokens, s.spec_num_accepted_tokens)
        w.per_pos = tuple(s.spec_accepted_per_pos)
        w.hits = (s.prefix_cache_queries, s.prefix_cache_hits)
        w.prompt_computed = s.prompt_tokens_computed

    def _log(self, engine: int, w: _Window, s, now: float) -> None:
        dt = max(now - w.start, 1e-9)
        queries, hits = s.prefix_cache_queries - w.hits[0], s.prefix_cache_hits - w.hits[1]
        prompt = s.prompt_tokens_computed - w.prompt_computed
        log.info("Engine %03d: Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, "
                 "Running: %d reqs, Waiting: %d reqs, KV cache usage: %.1f%%, Prefix cache hit rate: %.1f%%",
                 engine, prompt / dt, w.generation / dt, s.num_running, s.num_waiting, 100 * s.kv_cache_usage,
                 100 * hits / queries if queries else 0.0)
        drafts = s.spec_num_drafts - w.spec[0]
        if drafts <= 0:
            return
        drafted = s.spec_num_draft_tokens - w.spec[1]
        accepted = s.spec_num_accepted_tokens - w.spec[2]
        per_pos = [n - (w.per_pos[i] if i < len(w.per_pos) else 0) for i, n in enumerate(s.spec_accepted_per_pos)]
        log.info("SpecDecoding metrics: Mean acceptance length: %.2f, Accepted throughput: %.2f tokens/s, "
                 "Drafted throughput: %.2f tokens/s, Accepted: %d tokens, Drafted: %d tokens, "
                 "Per-position acceptance rate: %s, Avg Draft acceptance rate: %.1f%%",
                 1 + accepted / drafts, accepted / dt, drafted / dt, accepted, drafted,
                 ", ".join(f"{n / drafts:.3f}" for n in per_pos), 100 * accepted / drafted if drafted else 0.0)
