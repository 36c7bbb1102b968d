"""Prometheus metrics of the server (``GET /metrics``), named after vLLM's with a ``jaxllm:`` prefix
(``--metrics-compat vllm``: with vLLM's ``vllm:``, for the routers that read those; serve/metrics_compat.py).

The engine thread measures (see ``jaxllm.engine.async_engine.IterationStats``) and this
module only records: it is the engine's ``stats_sink`` (``EngineClient.stats_sink``).  prometheus_client's metrics
are thread-safe, so recording happens directly in the engine thread (with ``-dp N``, in N
engine threads, each under its own ``engine`` label).  Each server has its own registry, so
several servers can live in one process (the tests run a few).
"""

from __future__ import annotations

import threading

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram

from jaxllm.engine.async_engine import IterationStats
from jaxllm.engine.llm_engine import EngineStats
from serve.metrics_compat import RouterInfo, render_as
from serve.stat_logger import StatLogger

# vLLM's buckets.
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                    240.0, 480.0, 960.0, 1920.0, 7680.0)

CONTENT_TYPE = CONTENT_TYPE_LATEST


class _EngineMetrics:
    """The children of every metric for one engine (a data-parallel replica; 0 without -dp)."""

    def __init__(self, m: "Metrics", engine: int):
        lv = (m._model, str(engine))
        self.labels = lv
        self.running = m._running.labels(*lv)
        self.waiting = m._waiting.labels(*lv)
        self.kv_usage = m._kv_usage.labels(*lv)
        self.preemptions = m._preemptions.labels(*lv)
        self.prefix_cache_queries = m._prefix_cache_queries.labels(*lv)
        self.prefix_cache_hits = m._prefix_cache_hits.labels(*lv)
        self.seen_queries = 0
        self.seen_hits = 0
        self.encoder_hits = m._encoder_hits.labels(*lv)
        self.encoder_misses = m._encoder_misses.labels(*lv)
        self.encoder_entries = m._encoder_entries.labels(*lv)
        self.seen_encoder = (0, 0)
        self.spec_drafts = m._spec_drafts.labels(*lv)
        self.spec_draft_tokens = m._spec_draft_tokens.labels(*lv)
        self.spec_accepted = m._spec_accepted.labels(*lv)
        self.spec_per_pos = m._spec_per_pos
        self.seen_spec = (0, 0, 0)
        self.seen_per_pos: list[int] = []
        self.prompt_tokens = m._prompt_tokens.labels(*lv)
        self.generation_tokens = m._generation_tokens.labels(*lv)
        self.ttft = m._ttft.labels(*lv)
        self.itl = m._itl.labels(*lv)
        self.e2e = m._e2e.labels(*lv)
        self.queue_time = m._queue_time.labels(*lv)
        # Every finish reason is exported from the start, at 0.
        self.success = {reason: m._success.labels(*lv, reason) for reason in ("stop", "length", "abort")}


class Metrics:
    """Every metric carries vLLM's labels ``model_name`` and ``engine`` (the data-parallel
    replica, ``"0"`` with one engine): with ``-dp N`` each replica's engine thread records its
    own series, and a dashboard sums over ``engine`` for the server's totals."""

    PREFIX = "jaxllm"

    def __init__(self, model_name: str, log_stats_interval: float | None = None):
        """``log_stats_interval``: seconds between the periodic log lines (serve/stat_logger.py), None: none."""
        self.stat_logger = None if log_stats_interval is None else StatLogger(log_stats_interval)
        self.registry = r = CollectorRegistry()
        labels = ["model_name", "engine"]
        self._model = model_name
        self._lock = threading.Lock()
        self._engines: dict[int, _EngineMetrics] = {}
        self._running = Gauge("jaxllm:num_requests_running", "Requests holding KV blocks (in the running batch).",
                              labels, registry=r)
        self._waiting = Gauge("jaxllm:num_requests_waiting", "Requests waiting to be scheduled.",
                              labels, registry=r)
        self._kv_usage = Gauge("jaxllm:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = full).",
                               labels, registry=r)
        self._preemptions = Gauge("jaxllm:num_preemptions", "Preemptions since start.", labels, registry=r)
        self._prefix_cache_queries = Counter(
            "jaxllm:prefix_cache_queries", "Prefix cache queries, in prompt tokens looked up.", labels, registry=r)
        self._prefix_cache_hits = Counter(
            "jaxllm:prefix_cache_hits", "Prefix cache hits, in prompt tokens served from the cache.",
            labels, registry=r)
        # A vision-language model's encoder cache (runner/vision.py), in images.
        self._encoder_hits = Counter("jaxllm:encoder_cache_hits", "Images served from the encoder cache.",
                                     labels, registry=r)
        self._encoder_misses = Counter("jaxllm:encoder_cache_misses", "Images run through the vision encoder.",
                                       labels, registry=r)
        self._encoder_entries = Gauge("jaxllm:encoder_cache_entries", "Images held in the encoder cache.",
                                      labels, registry=r)
        self._spec_drafts = Counter("jaxllm:spec_decode_num_drafts",
                                    "Speculative verifications that had proposals.", labels, registry=r)
        self._spec_draft_tokens = Counter("jaxllm:spec_decode_num_draft_tokens", "Proposed tokens verified.",
                                          labels, registry=r)
        self._spec_accepted = Counter("jaxllm:spec_decode_num_accepted_tokens", "Proposed tokens accepted.",
                                      labels, registry=r)
        self._spec_per_pos = Counter("jaxllm:spec_decode_num_accepted_tokens_per_pos",
                                     "Proposed tokens accepted, by position in the proposal.",
                                     labels + ["position"], registry=r)
        self._prompt_tokens = Counter("jaxllm:prompt_tokens", "Prompt tokens prefilled.", labels, registry=r)
        self._generation_tokens = Counter("jaxllm:generation_tokens", "Tokens generated.", labels, registry=r)
        self._success = Counter("jaxllm:request_success", "Finished requests, by finish reason.",
                                labels + ["finished_reason"], registry=r)
        self._ttft = Histogram("jaxllm:time_to_first_token_seconds", "Time to first token.",
                               labels, buckets=_TTFT_BUCKETS, registry=r)
        self._itl = Histogram("jaxllm:inter_token_latency_seconds", "Time between consecutive outputs.",
                              labels, buckets=_ITL_BUCKETS, registry=r)
        self._e2e = Histogram("jaxllm:e2e_request_latency_seconds", "Arrival to finish.",
                              labels, buckets=_LATENCY_BUCKETS, registry=r)
        self._queue_time = Histogram("jaxllm:request_queue_time_seconds", "Arrival to first scheduled.",
                                     labels, buckets=_LATENCY_BUCKETS, registry=r)
        self._router_info = RouterInfo(r, self.PREFIX)
        self._for(0)

    def _for(self, engine: int) -> _EngineMetrics:
        m = self._engines.get(engine)
        if m is None:
            with self._lock:
                m = self._engines.get(engine)
                if m is None:
                    m = self._engines[engine] = _EngineMetrics(self, engine)
        return m

    def update_engine(self, s: EngineStats, engine: int = 0) -> None:
        """Called from engine ``engine``'s thread and from the event loop (``GET /metrics``)."""
        m = self._for(engine)
        with self._lock:  # the counters' check-then-advance must not interleave
            m.running.set(s.num_running)
            m.waiting.set(s.num_waiting)
            m.kv_usage.set(s.kv_cache_usage)
            m.preemptions.set(s.num_preemptions)
            self._router_info.update(engine, s.block_size, s.num_blocks, s.max_loras, s.running_loras,
                                     s.waiting_loras)
            # The engine keeps running totals; the counters advance by what is new.
            if s.prefix_cache_queries > m.seen_queries:
                m.prefix_cache_queries.inc(s.prefix_cache_queries - m.seen_queries)
                m.seen_queries = s.prefix_cache_queries
            if s.prefix_cache_hits > m.seen_hits:
                m.prefix_cache_hits.inc(s.prefix_cache_hits - m.seen_hits)
                m.seen_hits = s.prefix_cache_hits
            enc = (s.encoder_cache_hits, s.encoder_cache_misses)
            for counter, new, seen in zip((m.encoder_hits, m.encoder_misses), enc, m.seen_encoder):
                if new > seen:
                    counter.inc(new - seen)
            m.seen_encoder = tuple(max(a, b) for a, b in zip(enc, m.seen_encoder))
            m.encoder_entries.set(s.encoder_cache_entries)
            spec = (s.spec_num_drafts, s.spec_num_draft_tokens, s.spec_num_accepted_tokens)
            for counter, new, seen in zip((m.spec_drafts, m.spec_draft_tokens, m.spec_accepted), spec, m.seen_spec):
                if new > seen:
                    counter.inc(new - seen)
            m.seen_spec = tuple(max(a, b) for a, b in zip(spec, m.seen_spec))
            for pos, n in enumerate(s.spec_accepted_per_pos):
                seen = m.seen_per_pos[pos] if pos < len(m.seen_per_pos) else 0
                if n > seen:
                    m.spec_per_pos.labels(*m.labels, str(pos)).inc(n - seen)
            if len(s.spec_accepted_per_pos) >= len(m.seen_per_pos):
                m.seen_per_pos = list(s.spec_accepted_per_pos)

    def record(self, stats: IterationStats, engine: int = 0) -> None:
        """The engine's stats sink (called from engine ``engine``'s thread)."""
        self.update_engine(stats.engine, engine)
        if self.stat_logger is not None:
            self.stat_logger.record(stats, engine)
        m = self._for(engine)
        if stats.num_prompt_tokens:
            m.prompt_tokens.inc(stats.num_prompt_tokens)
        if stats.num_generation_tokens:
            m.generation_tokens.inc(stats.num_generation_tokens)
        for v in stats.time_to_first_token:
            m.ttft.observe(v)
        for v in stats.inter_token_latency:
            m.itl.observe(v)
        for f in stats.finished:
            (m.success.get(f.finish_reason) or self._success.labels(*m.labels, f.finish_reason)).inc()
            m.e2e.observe(f.e2e_latency)
            if f.queue_time is not None:
                m.queue_time.observe(f.queue_time)

    def finished_count(self, reason: str, engine: int | None = None) -> float:
        """Requests finished with ``reason``: by engine ``engine``, or by all of them (None)."""
        with self._lock:
            engines = list(self._engines) if engine is None else [engine]
        return sum(self.registry.get_sample_value(
            "jaxllm:request_success_total",
            {"model_name": self._model, "engine": str(e), "finished_reason": reason}) or 0.0 for e in engines)

    def render(self, naming: str = "none") -> bytes:
        """The text exposition; ``naming``: ``--metrics-compat`` (``vllm``: vLLM's names)."""
        return render_as(self.registry, self.PREFIX, naming)
