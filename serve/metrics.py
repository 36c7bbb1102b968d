"""Prometheus metrics of the server (``GET /metrics``), named after vLLM's with a ``jaxllm:`` prefix.

The engine thread measures (see ``jaxllm.engine.async_engine.IterationStats``) and this
module only records: it is the AsyncEngine's ``stats_sink``.  prometheus_client's metrics
are thread-safe, so recording happens directly in the engine thread.  Each server has its
own registry, so several servers can live in one process (the tests run a few).
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from jaxllm.engine.async_engine import IterationStats
from jaxllm.engine.llm_engine import EngineStats

# vLLM's buckets.
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                    240.0, 480.0, 960.0, 1920.0, 7680.0)

CONTENT_TYPE = CONTENT_TYPE_LATEST


class Metrics:
    def __init__(self, model_name: str):
        self.registry = r = CollectorRegistry()
        labels = ["model_name"]
        self._model = model_name
        self.running = Gauge("jaxllm:num_requests_running", "Requests holding KV blocks (in the running batch).",
                             labels, registry=r).labels(model_name)
        self.waiting = Gauge("jaxllm:num_requests_waiting", "Requests waiting to be scheduled.",
                             labels, registry=r).labels(model_name)
        self.kv_usage = Gauge("jaxllm:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = full).",
                              labels, registry=r).labels(model_name)
        self.preemptions = Gauge("jaxllm:num_preemptions", "Preemptions since start.",
                                 labels, registry=r).labels(model_name)
        self.prefix_cache_queries = Counter(
            "jaxllm:prefix_cache_queries", "Prefix cache queries, in prompt tokens looked up.",
            labels, registry=r).labels(model_name)
        self.prefix_cache_hits = Counter(
            "jaxllm:prefix_cache_hits", "Prefix cache hits, in prompt tokens served from the cache.",
            labels, registry=r).labels(model_name)
        self._seen_queries = 0
        self._seen_hits = 0
        self.prompt_tokens = Counter("jaxllm:prompt_tokens", "Prompt tokens prefilled.",
                                     labels, registry=r).labels(model_name)
        self.generation_tokens = Counter("jaxllm:generation_tokens", "Tokens generated.",
                                         labels, registry=r).labels(model_name)
        self._success = Counter("jaxllm:request_success", "Finished requests, by finish reason.",
                                labels + ["finished_reason"], registry=r)
        self.ttft = Histogram("jaxllm:time_to_first_token_seconds", "Time to first token.",
                              labels, buckets=_TTFT_BUCKETS, registry=r).labels(model_name)
        self.itl = Histogram("jaxllm:inter_token_latency_seconds", "Time between consecutive outputs.",
                             labels, buckets=_ITL_BUCKETS, registry=r).labels(model_name)
        self.e2e = Histogram("jaxllm:e2e_request_latency_seconds", "Arrival to finish.",
                             labels, buckets=_LATENCY_BUCKETS, registry=r).labels(model_name)
        self.queue_time = Histogram("jaxllm:request_queue_time_seconds", "Arrival to first scheduled.",
                                    labels, buckets=_LATENCY_BUCKETS, registry=r).labels(model_name)
        # Every finish reason is exported from the start, at 0.
        for reason in ("stop", "length", "abort"):
            self._success.labels(model_name, reason)

    def update_engine(self, s: EngineStats) -> None:
        self.running.set(s.num_running)
        self.waiting.set(s.num_waiting)
        self.kv_usage.set(s.kv_cache_usage)
        self.preemptions.set(s.num_preemptions)
        # The engine keeps running totals; the counters advance by what is new.
        if s.prefix_cache_queries > self._seen_queries:
            self.prefix_cache_queries.inc(s.prefix_cache_queries - self._seen_queries)
            self._seen_queries = s.prefix_cache_queries
        if s.prefix_cache_hits > self._seen_hits:
            self.prefix_cache_hits.inc(s.prefix_cache_hits - self._seen_hits)
            self._seen_hits = s.prefix_cache_hits

    def record(self, stats: IterationStats) -> None:
        """The AsyncEngine's stats sink (called from the engine thread)."""
        self.update_engine(stats.engine)
        if stats.num_prompt_tokens:
            self.prompt_tokens.inc(stats.num_prompt_tokens)
        if stats.num_generation_tokens:
            self.generation_tokens.inc(stats.num_generation_tokens)
        for v in stats.time_to_first_token:
            self.ttft.observe(v)
        for v in stats.inter_token_latency:
            self.itl.observe(v)
        for f in stats.finished:
            self._success.labels(self._model, f.finish_reason).inc()
            self.e2e.observe(f.e2e_latency)
            if f.queue_time is not None:
                self.queue_time.observe(f.queue_time)

    def finished_count(self, reason: str) -> float:
        v = self.registry.get_sample_value("jaxllm:request_success_total",
                                           {"model_name": self._model, "finished_reason": reason})
        return v or 0.0

    def render(self) -> bytes:
        return generate_latest(self.registry)
