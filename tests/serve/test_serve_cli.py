"""``jaxllm serve`` as a user runs it (a subprocess), and the generation-config defaults.

The subprocess test covers the CLI flags, ``JAXLLM_API_KEY``, the checkpoint's sampling
defaults with vLLM's precedence (logged once at start-up), ``max_new_tokens`` as a cap, and a
graceful SIGTERM: the stream in flight ends with finish_reason "abort" and ``[DONE]``, and
the process exits 0 within seconds.
"""

from __future__ import annotations

import json
import logging
import re
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

pytest.register_assert_rewrite("support.serve_helpers")  # before its import, so its asserts show values

from support.serve_helpers import free_port, parse_sse, wait_for_health  # noqa: E402

from jaxllm.config import ServingConfig  # noqa: E402
from jaxllm.engine.async_engine import IterationStats  # noqa: E402
from jaxllm.engine.llm_engine import EngineStats  # noqa: E402
from jaxllm.sampling_params import SamplingParams  # noqa: E402
from serve.stat_logger import StatLogger  # noqa: E402
from serve.protocol import ChatCompletionRequest, CompletionRequest  # noqa: E402
from serve.state import generation_defaults, validate_defaults  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _check_ok(sp: SamplingParams) -> None:
    pass


def _engine_stats(prompt_tokens_computed: int) -> IterationStats:
    e = EngineStats(num_running=1, num_waiting=0, num_free_blocks=5, num_blocks=10, num_preemptions=0,
                    prompt_tokens_computed=prompt_tokens_computed)
    return IterationStats(engine=e, num_prompt_tokens=0, num_generation_tokens=0, time_to_first_token=(),
                          inter_token_latency=(), finished=())


def test_prompt_throughput_counts_prefill_chunks_before_the_first_token(caplog):
    # A long chunked prefill: 512 prompt tokens per step, no request has its first token yet.
    now = [0.0]
    logger = StatLogger(10.0, clock=lambda: now[0])
    with caplog.at_level(logging.INFO, logger="jaxllm.serve"):
        for step in range(1, 11):
            logger.record(_engine_stats(512 * step))
            now[0] += 1.0
        logger.record(_engine_stats(512 * 11))   # at t=10 s: 11 chunks in the window
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "Avg prompt throughput: 563.2 tokens/s" in lines[0], lines
    with pytest.raises(ValueError, match="JAXLLM_LOG_STATS_INTERVAL"):
        ServingConfig(log_stats_interval=0)


def test_generation_defaults_follow_vllms_precedence(tmp_path):
    ckpt = {"temperature": 0.6, "top_k": 20, "top_p": 0.9, "max_new_tokens": 7, "do_sample": True,
            "eos_token_id": 2, "min_p": None}
    d = generation_defaults("auto", ckpt, {"top_p": 0.5})
    assert d == {"temperature": 0.6, "top_k": 20, "top_p": 0.5, "max_tokens": 7}
    assert generation_defaults("vllm", ckpt, {"top_p": 0.5}) == {"top_p": 0.5}
    (tmp_path / "generation_config.json").write_text(json.dumps({"repetition_penalty": 1.1, "foo": 1}))
    assert generation_defaults(str(tmp_path), ckpt, {}) == {"repetition_penalty": 1.1}
    with pytest.raises(ValueError, match="generation_config.json"):
        generation_defaults(str(tmp_path / "missing"), ckpt, {})

    # The request's own value wins, then the default, then OpenAI's.
    sp = CompletionRequest(prompt="x").to_sampling_params(16, d, vocab_size=100)
    assert (sp.temperature, sp.top_k, sp.top_p, sp.min_p) == (0.6, 20, 0.5, 0.0)
    sp = CompletionRequest(prompt="x", top_k=3, temperature=1.2).to_sampling_params(16, d, vocab_size=100)
    assert (sp.temperature, sp.top_k, sp.top_p) == (1.2, 3, 0.5)
    # Temperature 0 is greedy and clears top_p, top_k and min_p, wherever they came from.
    sp = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], temperature=0,
                               min_p=0.3).to_sampling_params(16, d, vocab_size=100)
    assert sp.greedy and (sp.top_k, sp.top_p, sp.min_p) == (0, 1.0, 0.0)
    assert CompletionRequest(prompt="x").to_sampling_params(16, {}, 100).temperature == 1.0

    # Invalid defaults stop the server; ones the engine cannot apply yet are dropped.
    with pytest.raises(ValueError, match="top_p"):
        validate_defaults({"top_p": 1.5}, _check_ok)

    def refuse_penalties(sp):
        if sp.repetition_penalty != 1.0:
            raise ValueError("repetition_penalty is not supported by this engine yet")

    assert validate_defaults({"repetition_penalty": 1.1, "temperature": 0.7}, refuse_penalties) == {"temperature": 0.7}


def test_cli_serve_defaults_api_key_and_graceful_sigterm(tiny_llama, tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    for f in os.listdir(tiny_llama):
        if f != "generation_config.json":
            os.symlink(os.path.join(tiny_llama, f), ckpt / f)
    (ckpt / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 1, "eos_token_id": 2, "temperature": 0.0, "max_new_tokens": 200}))
    port = free_port()
    # A stats line every 0.2 s, so that "nothing after server stopped" is tested against a logger that is busy.
    env = {**os.environ, "JAXLLM_API_KEY": "k3y", "JAXLLM_LOG_STATS_INTERVAL": "0.2"}
    cmd = [sys.executable, "-m", "jaxllm.cli", "serve", str(ckpt), "--host", "127.0.0.1", "--port", str(port),
           "--served-model-name", "cli-model", "--max-num-seqs", "4", "--max-num-batched-tokens", "32",
           "--max-model-len", "256", "--dtype", "float32", "--override-generation-config", '{"top_p": 0.9}']
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    base = f"http://127.0.0.1:{port}"
    auth = {"Authorization": "Bearer k3y"}
    try:
        wait_for_health(proc, base, lines, timeout=180)
        with httpx.Client(base_url=base, timeout=60) as c:
            assert c.get("/v1/models").status_code == 401
            assert [m["id"] for m in c.get("/v1/models", headers=auth).json()["data"]] == ["cli-model"]

            def complete(**kw):
                body = {"model": "cli-model", "prompt": "The weather today", "max_tokens": 12, "ignore_eos": True,
                        **kw}
                r = c.post("/v1/completions", json=body, headers=auth)
                assert r.status_code == 200, r.text
                return r.json()

            # The checkpoint's temperature 0 applies when the request sends none: greedy, unseeded.
            a, b = complete()["choices"][0]["text"], complete()["choices"][0]["text"]
            assert a == b == complete(temperature=0)["choices"][0]["text"]
            # The request's own temperature wins.
            sampled = {complete(temperature=1.0, seed=s)["choices"][0]["text"] for s in range(3)}
            assert len(sampled) > 1
            assert c.post("/v1/completions", json={"prompt": "x", "max_tokens": -1}, headers=auth).status_code == 400
            # max_new_tokens caps max_tokens (the context would allow 250 more here).
            assert complete(prompt=[5] * 6, max_tokens=1000)["usage"]["completion_tokens"] == 200

            with c.stream("POST", "/v1/completions", headers=auth,
                          json={"prompt": "Count:", "max_tokens": 200, "stream": True, "ignore_eos": True}) as r:
                assert r.status_code == 200
                raw = ""
                it = r.iter_text()
                for piece in it:
                    raw += piece
                    if raw.count("data: ") >= 3:
                        break
                t0 = time.monotonic()
                proc.send_signal(signal.SIGTERM)
                for piece in it:
                    raw += piece
        events = parse_sse(raw)
        assert events[-1] == "[DONE]"
        last = events[-2]["choices"][0]
        assert last["finish_reason"] == "abort"
        assert len(events) - 1 < 200, "the stream ran to its end instead of being aborted"
        assert proc.wait(timeout=20) == 0, "".join(lines)
        assert time.monotonic() - t0 < 10
        log = "".join(lines)
        assert "Default sampling parameters from the generation config" in log
        assert "'temperature': 0.0" in log and "'top_p': 0.9" in log and "'max_tokens': 200" in log
        assert log.count("Default sampling parameters") == 1
        assert f"http://127.0.0.1:{port}" in log
        # Logs: a timestamp on every log line, an access line per request (a client's 400 too),
        # and nothing after "server stopped".
        logged = [ln for ln in log.splitlines() if re.match(r"\S+ \S+ (INFO|WARNING|ERROR) ", ln)]
        assert logged and all(re.match(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d ", ln) for ln in logged), log
        assert re.search(r'"POST /v1/completions" 200 prompt_tokens=\d+ output_tokens=12 [\d.]+s', log), log
        assert re.search(r'"POST /v1/completions" 400 prompt_tokens=- output_tokens=- [\d.]+s', log), log
        assert re.search(r'"GET /v1/models" 401 ', log), log
        assert re.search(r"Avg prompt throughput: [1-9][\d.]* tokens/s", log), log
        assert "server stopped" in lines[-1], lines[-3:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        reader.join(5)
