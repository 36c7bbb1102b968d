"""Prefix caching as the API shows it: ``usage.prompt_tokens_details.cached_tokens`` in
completions and chat (streamed and not), ``cache_salt`` isolating tenants, and the
prefix-cache metrics."""

from __future__ import annotations

import random

import pytest

pytest.register_assert_rewrite("support.serve_helpers")

from support.serve_helpers import assert_error_shape, parse_sse  # noqa: E402

pytest_plugins = ["support.serve_helpers"]


def fresh_prompt(seed: int, n: int = 40) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 5000) for _ in range(n)]


def cached(http, path: str, body: dict) -> int:
    r = http.post(path, json={"max_tokens": 2, "temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def metric(http, name: str) -> float:
    for line in http.get("/metrics").text.splitlines():
        if line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} missing")


def test_completions_report_cached_tokens_and_salt_isolates(http, idle_engine):
    prompt = fresh_prompt(1)                                  # 40 tokens: two full blocks of 16
    q0, h0 = metric(http, "jaxllm:prefix_cache_queries_total"), metric(http, "jaxllm:prefix_cache_hits_total")
    seen = [cached(http, "/v1/completions", {"prompt": prompt}),
            cached(http, "/v1/completions", {"prompt": prompt}),
            cached(http, "/v1/completions", {"prompt": prompt, "cache_salt": "tenant-a"}),
            cached(http, "/v1/completions", {"prompt": prompt, "cache_salt": "tenant-b"}),
            cached(http, "/v1/completions", {"prompt": prompt, "cache_salt": "tenant-a"})]
    assert seen == [0, 32, 0, 0, 32]
    assert metric(http, "jaxllm:prefix_cache_queries_total") - q0 == 5 * len(prompt)
    assert metric(http, "jaxllm:prefix_cache_hits_total") - h0 == 64


def test_streamed_usage_and_several_prompts(http, idle_engine):
    a, b = fresh_prompt(2), fresh_prompt(3, 20)
    cached(http, "/v1/completions", {"prompt": [a, b]})
    # Several prompts: their cached tokens add up (32 + 16).
    assert cached(http, "/v1/completions", {"prompt": [a, b]}) == 48
    r = http.post("/v1/completions", json={"prompt": a, "max_tokens": 2, "stream": True,
                                           "stream_options": {"include_usage": True}})
    events = parse_sse(r.text)
    assert events[-1] == "[DONE]"
    assert events[-2]["usage"]["prompt_tokens_details"] == {"cached_tokens": 32}


def test_chat_reports_cached_tokens_and_salt_isolates(http, idle_engine):
    messages = [{"role": "system", "content": "You are a careful assistant. " * 6},
                {"role": "user", "content": "Say something about prefix caching."}]
    first = cached(http, "/v1/chat/completions", {"messages": messages})
    again = cached(http, "/v1/chat/completions", {"messages": messages})
    salted = cached(http, "/v1/chat/completions", {"messages": messages, "cache_salt": "tenant-c"})
    assert first == 0 and again >= 32 and again % 16 == 0 and salted == 0
    r = http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2, "stream": True,
                                                "stream_options": {"include_usage": True}})
    events = parse_sse(r.text)
    assert events[-2]["usage"]["prompt_tokens_details"] == {"cached_tokens": again}


def test_empty_cache_salt_is_a_400(http):
    for path, body in (("/v1/completions", {"prompt": "hi"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
        r = http.post(path, json={**body, "cache_salt": ""})
        assert r.status_code == 400
        assert_error_shape(r.json(), 400, "cache_salt")
