"""What a pooling server's ``GET /metrics`` says about its finished requests (the pooling tests'
reading of vLLM's request counters)."""

from __future__ import annotations

import re

import httpx


def counters(base: str) -> tuple[float, float]:
    """(``jaxllm:request_success_total`` finished with ``stop``, ``jaxllm:prompt_tokens_total``), summed."""
    text = httpx.get(base + "/metrics").text
    stop = sum(float(v) for labels, v in re.findall(r"^jaxllm:request_success_total\{(.*)\} (\S+)$", text, re.M)
               if 'finished_reason="stop"' in labels)
    prompt = sum(float(v) for v in re.findall(r"^jaxllm:prompt_tokens_total\{.*\} (\S+)$", text, re.M))
    return stop, prompt
