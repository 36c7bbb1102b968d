"""What llm-d's endpoint picker reads from a pod's ``/metrics`` page, by its own rules.

A Python port of llm-d/llm-d-inference-scheduler at 520af47896e5f06e43d09aca281a1149187b0ffd
(the picker of the Gateway API Inference Extension): ``pkg/epp/backend/metrics/metrics.go``
(``promToPodMetrics``, ``getMetric``/``getLatestMetric``, ``getLatestLoraMetric``) and
``pkg/epp/framework/plugins/datalayer/extractor/metrics/`` (``extractor.go``, ``spec.go``,
``loraspec.go``).  The page is parsed as Prometheus text (the picker: ``expfmt.TextParser``; here
prometheus_client's parser), a family found by the exact name of its ``# TYPE`` line.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

# The picker's defaults for an engine of type "vllm" (also its default engine).
QUEUED, RUNNING, KV_USAGE = "vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc"
LORA, CACHE_INFO = "vllm:lora_requests_info", "vllm:cache_config_info"


@dataclass
class PodMetrics:
    """The picker's view of one pod (``MetricsState``'s fields that these series fill)."""

    waiting_queue_size: int
    running_requests_size: int
    kv_cache_usage_percent: float
    max_active_models: int
    active_models: set[str]
    waiting_models: set[str]
    cache_block_size: int
    cache_num_blocks: int


def families(text: str) -> dict:
    """Family name (as its ``# TYPE`` line writes it) -> family."""
    out = {}
    for fam in text_string_to_metric_families(text):
        # prometheus_client drops a counter's ``_total`` from the family name; the Go parser keeps
        # the name of the TYPE line.  The series the picker reads are gauges, kept as written.
        out[fam.name + "_total" if fam.type == "counter" else fam.name] = fam
    return out


def _series(fams: dict, name: str):
    fam = fams.get(name)
    if fam is None:
        raise AssertionError(f"metric family {name!r} not found")  # the picker's error text
    samples = [s for s in fam.samples if s.name == name]
    if not samples:
        raise AssertionError(f"no metrics available for {name!r}")
    return fam, samples


def gauge(fams: dict, name: str) -> float:
    """``getMetric``: the series with the latest timestamp (the first one when, as here, none has
    one), read with ``GetGauge().GetValue()``: a family of another type reads as 0."""
    fam, samples = _series(fams, name)
    latest = max(samples, key=lambda s: s.timestamp or 0) if any(s.timestamp for s in samples) else samples[0]
    return latest.value if fam.type == "gauge" else 0.0


def latest_lora(fams: dict, skip_empty: bool):
    """``getLatestLoraMetric`` (``skip_empty``: series whose two adapter lists are empty are
    ignored, and none left is no LoRA data) or ``LoRASpec.getLatestMetric`` (the new extractor):
    the series with the largest value, which is the time it was set."""
    _, samples = _series(fams, LORA)
    if skip_empty:
        samples = [s for s in samples
                   if s.labels.get("running_lora_adapters") or s.labels.get("waiting_lora_adapters")]
    return max(samples, key=lambda s: s.value) if samples else None


def _names(csv: str) -> set[str]:
    return {n.strip() for n in csv.split(",") if n.strip()}


def read(text: str) -> PodMetrics:
    """Everything the picker takes from ``text``; an AssertionError where it would log an error."""
    fams = families(text)
    lora = latest_lora(fams, skip_empty=False)
    _, cache = _series(fams, CACHE_INFO)
    return PodMetrics(
        waiting_queue_size=int(gauge(fams, QUEUED)), running_requests_size=int(gauge(fams, RUNNING)),
        kv_cache_usage_percent=gauge(fams, KV_USAGE),
        max_active_models=int(lora.labels["max_lora"]),  # strconv.Atoi
        active_models=_names(lora.labels["running_lora_adapters"]),
        waiting_models=_names(lora.labels["waiting_lora_adapters"]),
        cache_block_size=int(cache[0].labels["block_size"]), cache_num_blocks=int(cache[0].labels["num_gpu_blocks"]))
