"""``jaxllm serve --metrics-compat vllm``: the series llm-d's endpoint picker (the Gateway API
Inference Extension's) reads, checked by the picker's own parsing rules (tests/support/gie_metrics.py):
names, types, labels, values, the running count and KV usage moving with a request in flight,
and the waiting count with a request past ``max_num_seqs``.
One more app on the session's shared engine (support/serve_helpers.py)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time

import httpx
import pytest

pytest.register_assert_rewrite("support.gie_metrics", "support.serve_helpers")

from support import gie_metrics as gie  # noqa: E402
from support.serve_helpers import ServerThread, wait_until  # noqa: E402

pytest_plugins = ["support.serve_helpers"]


@pytest.fixture(scope="module")
def vllm_server(serve_engine):
    from jaxllm.config import ServingConfig

    srv = ServerThread(serve_engine, ServingConfig(host="127.0.0.1", port=0, served_model_names=("tiny",),
                                                   metrics_compat="vllm"))
    yield srv
    srv.stop()


def scrape(server) -> str:
    r = httpx.get(server.base + "/metrics", timeout=30)
    assert r.status_code == 200
    return r.text


@contextlib.contextmanager
def held_steps(runner, after: int):
    """``runner``'s device calls after the first ``after`` wait until the block is left (an
    instance attribute shadowing ``_run``, so the production runner carries no hook): a request
    stays in flight for as long as the test needs.  Yields the number of calls so far."""
    run, gate, calls = runner._run, threading.Event(), [0]

    def held(step):
        calls[0] += 1
        if calls[0] > after:
            gate.wait(30)
        return run(step)

    runner._run = held
    try:
        yield calls
    finally:
        gate.set()
        runner.__dict__.pop("_run", None)


def test_every_series_the_picker_reads_is_there_with_its_type_and_labels(vllm_server, server, idle_engine):
    text = scrape(vllm_server)
    fams = gie.families(text)
    for name in (gie.QUEUED, gie.RUNNING, gie.KV_USAGE):
        assert fams[name].type == "gauge", name  # a counter would read as 0
        assert [s.labels for s in fams[name].samples] == [{"model_name": "tiny", "engine": "0"}], name
    (lora,) = fams[gie.LORA].samples
    assert fams[gie.LORA].type == "gauge"
    assert lora.labels == {"max_lora": "0", "running_lora_adapters": "", "waiting_lora_adapters": ""}
    assert abs(lora.value - time.time()) < 600, "the LoRA series' value is the time it was set"
    (cache,) = fams[gie.CACHE_INFO].samples
    kv = idle_engine.engine.core.kv_manager
    assert cache.labels == {"block_size": str(kv.block_size), "num_gpu_blocks": str(kv.num_blocks), "engine": "0"}
    assert cache.value == 1

    assert gie.read(text) == gie.PodMetrics(
        waiting_queue_size=0, running_requests_size=0, kv_cache_usage_percent=0.0, max_active_models=0,
        active_models=set(), waiting_models=set(), cache_block_size=kv.block_size, cache_num_blocks=kv.num_blocks)
    # The older reader ignores a series whose adapter lists are both empty: no LoRA data, no error.
    assert gie.latest_lora(fams, skip_empty=True) is None

    # vLLM's names throughout (its preemptions are a counter), one set of series per page.
    assert fams["vllm:num_preemptions_total"].type == "counter"
    assert "vllm:time_to_first_token_seconds" in fams and "vllm:request_success_total" in fams
    assert not [n for n in fams if n.startswith("jaxllm:")]
    # The default server on the same engine keeps jaxllm's names.
    default = gie.families(scrape(server))
    assert "jaxllm:num_requests_waiting" in default and "jaxllm:cache_config_info" in default
    assert not [n for n in default if n.startswith("vllm:")]


def test_running_and_kv_usage_move_with_a_request_in_flight(vllm_server, idle_engine):
    before = gie.read(scrape(vllm_server))
    body = {"model": "tiny", "prompt": "word " * 20, "max_tokens": 100, "ignore_eos": True, "temperature": 0,
            "stream": True}
    with held_steps(idle_engine.engine.core.runner, after=3) as calls:
        with httpx.stream("POST", vllm_server.base + "/v1/completions", json=body, timeout=30) as r:
            # Keep the iterator: a dropped one closes the connection (and the request is aborted).
            lines = r.iter_lines()
            frames = 0
            while frames < 2:
                frames += next(lines).startswith("data: ")
            # The engine thread now waits in its 4th device call, the request in the running batch.
            wait_until(lambda: calls[0] > 3, timeout=10.0, what="the engine to reach the held step")
            text = scrape(vllm_server)
        # Leaving the blocks closed the stream (the request is aborted), then let the engine go on.
    during = gie.read(text)
    assert (before.running_requests_size, during.running_requests_size) == (0, 1)
    assert before.kv_cache_usage_percent == 0.0 < during.kv_cache_usage_percent <= 1.0
    assert during.waiting_queue_size == 0
    wait_until(lambda: idle_engine.stats().num_running == 0, timeout=10.0, what="the aborted request to end")
    after = gie.read(scrape(vllm_server))
    assert (after.running_requests_size, after.kv_cache_usage_percent) == (0, 0.0)


def test_waiting_counts_a_request_past_max_num_seqs(vllm_server, idle_engine):
    """One more stream than the scheduler seats: the gauge reads it waiting, then 0 once all end."""
    seats = idle_engine.engine.core.scheduler.max_num_seqs
    body = {"model": "tiny", "prompt": "word", "max_tokens": 200, "ignore_eos": True, "temperature": 0,
            "stream": True}

    async def load() -> tuple[gie.PodMetrics, gie.PodMetrics]:
        async with httpx.AsyncClient(base_url=vllm_server.base, timeout=60,
                                     limits=httpx.Limits(max_connections=seats + 8)) as c:
            async def stream():
                async with c.stream("POST", "/v1/completions", json=body) as r:
                    async for _ in r.aiter_lines():
                        pass

            tasks = [asyncio.ensure_future(stream()) for _ in range(seats + 1)]
            deadline = time.monotonic() + 30
            while idle_engine.stats().num_waiting == 0 and time.monotonic() < deadline:
                await asyncio.sleep(0.005)
            # 200 tokens each: the seated streams are far from done when the page is read.
            during = gie.read((await c.get("/metrics")).text)
            for t in tasks:
                t.cancel()   # a closed stream aborts its request, seated or waiting
            await asyncio.gather(*tasks, return_exceptions=True)
        wait_until(lambda: idle_engine.stats().num_running + idle_engine.stats().num_waiting == 0, timeout=30.0,
                   what="the aborted requests to end")
        return during, gie.read(httpx.get(vllm_server.base + "/metrics", timeout=30).text)

    during, after = asyncio.run(load())
    assert (during.running_requests_size, during.waiting_queue_size) == (seats, 1)
    assert (after.running_requests_size, after.waiting_queue_size) == (0, 0)


def test_the_flag_reaches_the_server_config_and_a_wrong_value_is_named():
    from jaxllm import cli
    from jaxllm.config import ServingConfig
    from serve.cli import serving_config_from_args

    args = cli.parse_args(cli.build_parser(), ["serve", "--metrics-compat", "vllm"])
    assert serving_config_from_args(args).metrics_compat == "vllm"
    assert ServingConfig().metrics_compat == "none"
    with pytest.raises(ValueError, match="--metrics-compat must be none or vllm, got 'prometheus'"):
        ServingConfig(metrics_compat="prometheus")
