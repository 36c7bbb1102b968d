"""vLLM's metric names for the routers that scrape them (``jaxllm serve --metrics-compat vllm``).

llm-d's inference scheduler (the endpoint picker of the Gateway API Inference Extension,
GIE) reads five series from each pod's ``/metrics``, by vLLM's names unless told otherwise
(llm-d/llm-d-inference-scheduler at 520af47896e5f06e43d09aca281a1149187b0ffd:
``pkg/epp/server/options.go`` ``NewOptions`` and
``pkg/epp/framework/plugins/datalayer/extractor/metrics/factories.go`` ``defaultEngineConfigs``;
the same defaults in kubernetes-sigs/gateway-api-inference-extension at
25557e290ad41bec74d2313182df35d40b2c0cda, before its picker moved to llm-d):

- ``vllm:num_requests_waiting``, ``vllm:num_requests_running``, ``vllm:kv_cache_usage_perc``:
  gauges (the older reader takes ``GetGauge().GetValue()``: a counter would read as 0), the
  first series of the family (none carries a timestamp);
- ``vllm:lora_requests_info``: a gauge labelled ``max_lora``, ``running_lora_adapters``,
  ``waiting_lora_adapters`` (comma-separated names) whose value is the time it was set; the
  reader keeps the series with the largest value (``getLatestLoraMetric`` in
  ``pkg/epp/backend/metrics/metrics.go`` skips series whose two lists are empty,
  ``LoRASpec.getLatestMetric`` in ``.../extractor/metrics/loraspec.go`` does not);
- ``vllm:cache_config_info``: a gauge set to 1 whose labels ``block_size`` and
  ``num_gpu_blocks`` are read as integers.

The server keeps one registry with ``jaxllm:`` names (serve/metrics.py); this module records the
two info gauges into it and renders it under vLLM's names, so that one scrape carries one set
of series (the picker parses every pod's whole page every 50 ms by default) and apps with
different naming can share one engine.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Gauge, generate_latest
from prometheus_client.metrics_core import Metric

NAMING = ("none", "vllm")
"""``--metrics-compat``'s choices: ``none`` keeps the ``jaxllm:`` names, ``vllm`` renames."""

# vLLM's label names, which the picker looks up (``LoraInfo*MetricName`` and
# ``CacheConfig*MetricName`` in pkg/epp/backend/metrics/metrics.go).
LORA_LABELS = ("max_lora", "waiting_lora_adapters", "running_lora_adapters")
CACHE_LABELS = ("block_size", "num_gpu_blocks", "engine")

# Ours is a gauge holding the engine's running total; vLLM's is a counter (``..._total``).
_GAUGES_THAT_ARE_VLLM_COUNTERS = ("num_preemptions",)


class RouterInfo:
    """The two info gauges the routers read: LoRA adapters and the KV-cache geometry."""

    def __init__(self, registry: CollectorRegistry, prefix: str, max_lora: int = 0):
        """``max_lora``: adapter slots (0 until the engine serves LoRA: the series still exists,
        with empty adapter lists, so a scraper that expects it finds it)."""
        self._lora = Gauge(f"{prefix}:lora_requests_info", "Running stats on LoRA requests (value: when set).",
                           list(LORA_LABELS), registry=registry)
        self._lora_labels = (str(max_lora), "", "")
        self._lora.labels(*self._lora_labels).set(time.time())
        self._adapters: dict[int, tuple[int, tuple[str, ...], tuple[str, ...]]] = {}
        """engine -> (its slots, running adapters, waiting adapters): the series is the replicas' union."""
        self._cache = Gauge(f"{prefix}:cache_config_info", "The KV cache's geometry (value 1; read the labels).",
                            list(CACHE_LABELS), registry=registry)
        self._cache_labels: dict[int, tuple[str, str, str]] = {}

    def update(self, engine: int, block_size: int, num_blocks: int, max_lora: int = 0,
               running: tuple[str, ...] = (), waiting: tuple[str, ...] = ()) -> None:
        """Engine ``engine``'s latest snapshot (called under the metrics' lock); ``max_lora``,
        ``running``, ``waiting``: its adapter slots and the adapters of its running and waiting
        requests, by name."""
        self._update_lora(engine, max_lora, running, waiting)
        if block_size <= 0:
            return  # a snapshot that does not know its block size (a stand-in engine)
        labels = (str(block_size), str(num_blocks), str(engine))
        old = self._cache_labels.get(engine)
        if old == labels:
            return
        if old is not None:  # the cache was resized: one series per engine, as vLLM's
            self._cache.remove(*old)
        self._cache.labels(*labels).set(1)
        self._cache_labels[engine] = labels

    def _update_lora(self, engine: int, max_lora: int, running: tuple[str, ...], waiting: tuple[str, ...]) -> None:
        # One series, its labels the union over the replicas; vLLM sets it to the current time
        # on every iteration.  A changed label set replaces the old series (vLLM keeps every
        # set it has seen; the routers read the newest one), so the page does not grow.
        self._adapters[engine] = (max_lora, running, waiting)
        slots = max(a[0] for a in self._adapters.values())
        run = dict.fromkeys(n for a in self._adapters.values() for n in a[1])
        wait = dict.fromkeys(n for a in self._adapters.values() for n in a[2])
        labels = (str(slots), ",".join(wait), ",".join(run))   # LORA_LABELS' order
        if labels != self._lora_labels:
            self._lora.remove(*self._lora_labels)
            self._lora_labels = labels
        self._lora.labels(*labels).set(time.time())


class _Renamed:
    """A collector yielding ``registry``'s families with ``old:`` replaced by ``new:``."""

    def __init__(self, registry: CollectorRegistry, old: str, new: str):
        self._registry, self._old, self._new = registry, old + ":", new + ":"

    def collect(self):
        n = len(self._old)
        for family in self._registry.collect():
            name = self._new + family.name[n:] if family.name.startswith(self._old) else family.name
            typ, suffix = family.type, ""
            if family.name[n:] in _GAUGES_THAT_ARE_VLLM_COUNTERS:
                typ, suffix = "counter", "_total"
            out = Metric(name, family.documentation, typ, family.unit)
            out.samples = [s._replace(name=(self._new + s.name[n:] if s.name.startswith(self._old) else s.name)
                                      + suffix) for s in family.samples]
            yield out


def render_as(registry: CollectorRegistry, prefix: str, naming: str) -> bytes:
    """The text exposition of ``registry`` (``prefix:`` names) under ``naming`` (one of NAMING)."""
    if naming == "none":
        return generate_latest(registry)
    if naming != "vllm":
        raise ValueError(f"--metrics-compat must be one of {', '.join(NAMING)}, got {naming!r}")
    view = CollectorRegistry(auto_describe=False)
    view.register(_Renamed(registry, prefix, naming))
    return generate_latest(view)
