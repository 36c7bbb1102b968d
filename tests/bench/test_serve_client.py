"""``jaxllm bench serve`` (bench/serve_client.py, bench/metrics.py, bench/datasets.py, bench/plot.py).

1. TTFT starts at the first chunk that carries content: a fake SSE server (raw asyncio, chunked
   HTTP/1.1) sends the chat role frame and an empty chunk at once, the content only after a
   fixed delay; the measured TTFT must cover the delay.  Same for completions.  The same fake
   server answers HTTP 500s, error frames, cut connections and usage-less streams: each is a
   failed request (or a chunk-counted one), never a crash.
2. The arithmetic on a scripted stream: known timestamps in, known TTFT/TPOT/ITL/E2EL,
   percentiles and goodput out.
3. End to end: ``jaxllm bench serve`` through the CLI against a real server on the built-in
   model at concurrency 1, 4 and 16.
"""

from __future__ import annotations

import asyncio
import json
import threading

import numpy as np
import pytest

pytest_plugins = ["support.serve_helpers"]

from bench import serve_client  # noqa: E402
from bench.datasets import SampleRequest  # noqa: E402
from bench.metrics import StreamRecorder, calculate_metrics, goodput_count  # noqa: E402

DELAY_S = 0.4


# ---------------------------------------------------------------------------- a fake SSE server


class FakeServer:
    """A tiny HTTP/1.1 server on its own event loop (thread): chunked SSE like hypercorn's.

    ``modes``: what the n-th POST gets (then "ok" forever): ok, nousage, 500, errframe, drop."""

    def __init__(self, modes=()):
        self.modes = list(modes)
        self.count = 0
        self.bodies: list[dict] = []
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        assert self._ready.wait(10)
        self.base = f"http://127.0.0.1:{self.port}"

    def _run(self):
        async def main():
            self.loop = asyncio.get_running_loop()
            self._stop = asyncio.Event()
            server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
            self.port = server.sockets[0].getsockname()[1]
            self._ready.set()
            async with server:
                await self._stop.wait()
        asyncio.run(main())

    def stop(self):
        self.loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(5)

    async def _handle(self, reader, writer):
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode().split("\r\n")
                method, path, _ = lines[0].split(" ")
                headers = {k.lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)}
                body = await reader.readexactly(int(headers.get("content-length", 0)))
                if method == "GET" and path == "/v1/models":
                    data = json.dumps({"object": "list", "data": [{"id": "fake-model", "root": "fake-model"}]}).encode()
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                                 b"Content-Length: %d\r\n\r\n" % len(data) + data)
                    await writer.drain()
                    continue
                req = json.loads(body)
                self.bodies.append(req)
                mode = self.modes[self.count] if self.count < len(self.modes) else "ok"
                self.count += 1
                if not await self._answer(writer, path, req, mode):
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def _answer(self, writer, path, req, mode) -> bool:
        chat = path.endswith("chat/completions")
        if mode == "500":
            data = json.dumps({"error": {"message": "boom: the fake server failed", "type": "InternalServerError",
                                         "param": None, "code": 500}}).encode()
            writer.write(b"HTTP/1.1 500 Internal Server Error\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n" % len(data) + data)
            await writer.drain()
            return True
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")

        async def send(obj):
            payload = ("data: " + (obj if isinstance(obj, str) else json.dumps(obj)) + "\n\n").encode()
            writer.write(b"%x\r\n%s\r\n" % (len(payload), payload))
            await writer.drain()

        def piece(text=None, role=None, finish=None):
            if chat:
                delta = {}
                if role is not None:
                    delta["role"] = role
                if text is not None:
                    delta["content"] = text
                return {"id": "x", "object": "chat.completion.chunk", "model": "fake-model",
                        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
            return {"id": "x", "object": "text_completion", "model": "fake-model",
                    "choices": [{"index": 0, "text": text or "", "finish_reason": finish}]}

        if chat:
            await send(piece(role="assistant"))          # the role frame, at once: not a token
            await send(piece(text=""))                   # an empty chunk: not a token either
        else:
            await send(piece(text=""))
        if mode == "errframe":
            await send({"error": {"message": "engine exploded", "type": "InternalServerError", "param": None,
                                  "code": 500}})
            await send("[DONE]")
            writer.write(b"0\r\n\r\n")
            await writer.drain()
            return True
        await asyncio.sleep(DELAY_S)
        for word in ("Hel", "lo", " world"):
            await send(piece(text=word))
            await asyncio.sleep(0.02)
        if mode == "drop":
            writer.write(b"ff\r\ndata: {\"choi")  # a chunk cut short, then the connection goes
            await writer.drain()
            return False
        await send(piece(text="" if not chat else None, finish="length"))
        if mode != "nousage":
            await send({"id": "x", "choices": [], "usage": {"prompt_tokens": 11, "completion_tokens": 3,
                                                            "total_tokens": 14}})
        await send("[DONE]")
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        return True


@pytest.fixture
def fake():
    srv = FakeServer()
    yield srv
    srv.stop()


def _send(base, backend, req=SampleRequest("hi", 2, 3)):
    import httpx

    async def go():
        async with httpx.AsyncClient(timeout=30) as client:
            payload = serve_client.build_payload(backend, "fake-model", req, True, {})
            return await serve_client.send_request(client, base + serve_client.BACKENDS[backend], payload,
                                                   req.prompt_len)
    return asyncio.run(go())


@pytest.mark.parametrize("backend", ["openai-chat", "openai"])
def test_ttft_waits_for_the_first_content_chunk(fake, backend):
    out = _send(fake.base, backend)
    assert out.success, out.error
    # The role frame and the empty chunk arrived at once; the first text DELAY_S later.
    assert out.ttft >= DELAY_S, f"TTFT {out.ttft:.3f} s counted a frame without content"
    assert out.ttft < DELAY_S + 2.0
    assert out.generated_text == "Hello world"
    assert len(out.itl) == 2 and all(0.0 < g < 1.0 for g in out.itl)
    assert out.latency == pytest.approx(out.ttft + sum(out.itl))
    assert out.output_tokens == 3 and out.usage_reported and out.prompt_len == 11
    assert out.tpot == pytest.approx((out.latency - out.ttft) / 2)
    body = fake.bodies[-1]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["ignore_eos"] is True and body["max_tokens"] == 3
    if backend == "openai-chat":
        assert body["messages"] == [{"role": "user", "content": "hi"}] and body["max_completion_tokens"] == 3
    else:
        assert body["prompt"] == "hi"


def test_failed_requests_are_counted_with_their_errors(tmp_path, capsys):
    srv = FakeServer(modes=["ok", "500", "errframe", "drop", "nousage", "ok"])
    try:
        res = tmp_path / "r.json"
        rc = serve_client.main([
            "--base-url", srv.base, "--backend", "openai-chat", "--num-prompts", "6", "--max-concurrency", "1",
            "--random-input-len", "8", "--random-output-len", "3", "--save-result", "--save-detailed",
            "--result-filename", str(res), "--disable-tqdm", "--percentile-metrics", "ttft,tpot,itl,e2el"])
    finally:
        srv.stop()
    text = capsys.readouterr().out
    assert rc == 0
    data = json.loads(res.read_text())
    assert data["completed"] == 3 and data["failed"] == 3, data["errors"]
    errors = data["errors"]
    assert errors[0] == "" and errors[4] == "" and errors[5] == ""
    assert "HTTP 500" in errors[1] and "boom" in errors[1]
    assert "engine exploded" in errors[2]
    assert errors[3], "a connection cut mid-stream must fail the request"
    assert data["failed_errors"] == [errors[1], errors[2], errors[3]]
    # The usage-less stream counts its content chunks, and the run says so.
    assert data["output_lens"] == [3, 0, 0, 0, 3, 3]
    assert data["output_tokens_source"] == "mixed"
    assert "sent no usage for 1 of 3 requests" in text
    assert "{:<40} {:<10}".format("Failed requests:", 3) in text
    assert "Tokenizer: the built-in SmolLM2-135M-Instruct" in text
    assert all(t >= DELAY_S for t, e in zip(data["ttfts"], errors) if not e)


# ---------------------------------------------------------------------------- arithmetic


def _scripted():
    chat_frames = [  # (time, frame): role frame, empty chunk, three tokens, finish-only chunk, usage, DONE
        (10.1, {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}),
        (10.2, {"choices": [{"index": 0, "delta": {"content": ""}}]}),
        (10.5, {"choices": [{"index": 0, "delta": {"content": "a"}}]}),
        (10.7, {"choices": [{"index": 0, "delta": {"reasoning_content": "b"}}]}),
        (11.0, {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"name": "f"}}]}}]}),
        (11.05, {"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}),
        (11.06, {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}}),
        (11.07, "[DONE]"),
    ]
    a = StreamRecorder(10.0, prompt_len=99)
    for t, f in chat_frames:
        a.on_frame(f, t)
    b = StreamRecorder(10.0, prompt_len=5)
    for t, f in [(10.1, {"choices": [{"text": ""}]}), (10.3, {"choices": [{"text": "x"}]}),
                 (10.4, {"choices": [{"text": "y", "finish_reason": "length"}]}),
                 (10.45, {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 2}}), (10.5, "[DONE]")]:
        b.on_frame(f, t)
    c = StreamRecorder(10.0, prompt_len=5)
    c.on_frame({"choices": [{"text": "z"}]}, 10.2)
    c.on_frame({"error": {"message": "boom", "code": 500}}, 10.3)
    c.on_frame("[DONE]", 10.3)
    return a.finish(), b.finish(), c.finish()


def test_metric_arithmetic_on_a_scripted_stream():
    a, b, c = _scripted()
    assert a.success and a.ttft == pytest.approx(0.5) and a.latency == pytest.approx(1.0)
    assert a.itl == pytest.approx([0.2, 0.3]) and a.output_tokens == 3 and a.prompt_len == 7
    assert a.tpot == pytest.approx(0.25) and a.generated_text == "ab"
    assert b.success and b.ttft == pytest.approx(0.3) and b.itl == pytest.approx([0.1])
    assert b.latency == pytest.approx(0.4) and b.tpot == pytest.approx(0.1)
    assert not c.success and "boom" in c.error

    m = calculate_metrics([a, b, c], dur_s=2.0, percentiles=[50.0, 99.0], goodput_slos_ms={"ttft": 400})
    assert (m.completed, m.failed, m.total_input, m.total_output) == (2, 1, 12, 5)
    assert m.output_lens == [3, 2, 0]
    assert m.request_throughput == pytest.approx(1.0)
    assert m.output_throughput == pytest.approx(2.5)
    assert m.total_token_throughput == pytest.approx(8.5)
    assert m.mean_ttft_ms == pytest.approx(400) and m.median_ttft_ms == pytest.approx(400)
    assert m.std_ttft_ms == pytest.approx(100)
    assert dict(m.percentiles_ttft_ms) == pytest.approx({50.0: 400, 99.0: 498})
    assert m.mean_tpot_ms == pytest.approx(175) and dict(m.percentiles_tpot_ms)[99.0] == pytest.approx(248.5)
    assert m.median_itl_ms == pytest.approx(200) and dict(m.percentiles_itl_ms)[99.0] == pytest.approx(298)
    assert m.mean_e2el_ms == pytest.approx(700) and dict(m.percentiles_e2el_ms)[99.0] == pytest.approx(994)
    assert m.request_goodput == pytest.approx(0.5)  # only b's TTFT (300 ms) is within 400 ms
    assert goodput_count([a, b, c], {"tpot": 200}) == 1 and goodput_count([a, b, c], {"e2el": 1000}) == 2
    assert goodput_count([a, b, c], {"ttft": 500, "tpot": 250, "e2el": 1000}) == 2
    assert m.max_concurrent_requests == 2 and m.usage_reported == 2
    from bench.metrics import tokens_over_time
    t, tps = tokens_over_time([a, b, c])
    assert tps.sum() == pytest.approx(5.0) and list(t) == [0.0, 1.0]  # 1 s buckets over [10.0, 11.0]
    assert m.max_output_tokens_per_s == pytest.approx(tps.max())
    assert list(tokens_over_time([b])[1]) == pytest.approx([2.0])

    text, keys = serve_client.summary_text(m, duration=2.0, max_concurrency=4, request_rate=float("inf"),
                                           selected_metrics=["ttft", "itl"], goodput=True)
    assert set(keys) == {"mean_ttft_ms", "median_ttft_ms", "std_ttft_ms", "p50_ttft_ms", "p99_ttft_ms",
                         "mean_itl_ms", "median_itl_ms", "std_itl_ms", "p50_itl_ms", "p99_itl_ms"}
    assert keys["p99_ttft_ms"] == pytest.approx(498)
    assert "{:<40} {:<10.2f}".format("P99 TTFT (ms):", 498.0) in text
    assert "{:<40} {:<10.2f}".format("Request goodput (req/s):", 0.5) in text
    assert "TPOT" not in text and text.startswith("============ Serving Benchmark Result ============\n")

    # No usage at all: the content chunks are the tokens.
    d = StreamRecorder(0.0)
    for t, text_ in [(0.1, ""), (0.2, "p"), (0.3, "q")]:
        d.on_frame({"choices": [{"text": text_}]}, t)
    d = d.finish()
    assert d.success and d.output_tokens == 2 and not d.usage_reported and d.ttft == pytest.approx(0.2)
    # A stream with only a role frame and an empty chunk produced nothing.
    e = StreamRecorder(0.0)
    e.on_frame({"choices": [{"delta": {"role": "assistant", "content": ""}}]}, 0.1)
    e.on_frame("[DONE]", 0.2)
    assert not e.finish().success


def test_sse_parser_splits_events_anywhere():
    p = serve_client.SSEParser()
    raw = b'data: {"a": 1}\r\n\r\n: keep-alive\n\ndata: [DONE]\n\ndata: x\ndata: y\n\ndata: {"tail": 2}'
    got = []
    for i in range(len(raw)):  # one byte at a time
        got += p.feed(raw[i:i + 1])
    got += p.close()
    assert got == ['{"a": 1}', "[DONE]", "x\ny", '{"tail": 2}']


def test_arrivals_follow_the_rate():
    async def times(rate, burst, n=40):
        import time
        t0 = time.perf_counter()
        return [time.perf_counter() - t0 async for _ in serve_client.arrivals(n, rate, burst, seed=1)]
    inf = asyncio.run(times(float("inf"), 1.0))
    assert max(inf) < 0.05
    poisson = asyncio.run(times(100.0, 1.0))
    assert 0.35 <= poisson[-1] <= 0.6  # rescaled so the last arrives at n / rate = 0.4 s
    assert np.all(np.diff(poisson) >= -1e-3)


@pytest.mark.parametrize("argv, needle", [
    (["--dataset-name", "sharegpt"], "--dataset-path"),
    (["--dataset-name", "sharegpt", "--dataset-path", "/nonexistent.json"], "--dataset-path"),
    (["--dataset-path", "x.json"], "--dataset-path"),
    (["--goodput", "ttft=500"], "--goodput"),
    (["--goodput", "latency:5"], "--goodput"),
    (["--goodput", "ttft:fast"], "--goodput"),
    (["--percentile-metrics", "ttft,foo"], "--percentile-metrics"),
    (["--metric-percentiles", "99,101"], "--metric-percentiles"),
    (["--random-range-ratio", "1.5"], "--random-range-ratio"),
    (["--max-concurrency", "0"], "--max-concurrency"),
    (["--request-rate", "0"], "--request-rate"),
    (["--backend", "openai-chat", "--endpoint", "/v1/completions"], "--endpoint"),
    (["--backend", "vllm"], "--backend"),
    (["--base-url", "localhost:8000"], "--base-url"),
    (["--tokenizer", "/no/such/tokenizer"], "--tokenizer"),
])
def test_bad_flags_exit_2_naming_the_flag(argv, needle, capsys):
    from jaxllm.cli import main
    with pytest.raises(SystemExit) as e:
        main(["bench", "serve", "--port", "9", *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "error:" in err and needle in err, err


def test_unreachable_server_is_a_clear_error(capsys):
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    rc = serve_client.main(["--port", str(port), "--num-prompts", "1", "--disable-tqdm"])
    assert rc == 1
    assert "cannot list the server's models" in capsys.readouterr().err


def test_datasets(tmp_path):
    from bench import datasets
    tok = datasets.load_builtin_tokenizer()
    rnd = datasets.sample_random(tok, 5, input_len=32, output_len=7, range_ratio=0.0, seed=3)
    assert len(rnd) == 5 and all(r.expected_output_len == 7 for r in rnd)
    assert all(abs(len(tok.encode(r.prompt, add_special_tokens=False)) - 32) <= 2 for r in rnd)
    assert rnd == datasets.sample_random(tok, 5, input_len=32, output_len=7, seed=3)  # seeded
    ranged = datasets.sample_random(tok, 50, input_len=40, output_len=20, range_ratio=0.5, seed=0)
    assert all(10 <= r.expected_output_len <= 30 for r in ranged)
    assert len({r.expected_output_len for r in ranged}) > 3

    share = tmp_path / "sharegpt.json"
    conv = [{"conversations": [{"from": "human", "value": f"Question number {i}: why is the sky blue today?"},
                               {"from": "gpt", "value": "Because of Rayleigh scattering of sunlight. " * (i + 1)}]}
            for i in range(4)]
    conv.append({"conversations": [{"from": "human", "value": "alone"}]})  # no reply: skipped
    share.write_text(json.dumps(conv))
    got = datasets.sample_sharegpt(tok, str(share), 6, seed=0)
    assert len(got) == 6  # 4 usable pairs, oversampled
    for r in got:
        i = int(r.prompt.split("number ")[1].split(":")[0])
        assert r.expected_output_len == len(tok(conv[i]["conversations"][1]["value"]).input_ids)
        assert r.prompt_len == len(tok(r.prompt).input_ids)

    pre = datasets.sample_prefix_repetition(tok, 6, prefix_len=16, suffix_len=8, num_prefixes=2, output_len=5)
    assert len(pre) == 6 and all(r.expected_output_len == 5 for r in pre)
    ids = [tok.encode(r.prompt, add_special_tokens=False) for r in pre]
    heads = {tuple(i[:12]) for i in ids}
    assert len(heads) == 2  # two shared prefixes


# ---------------------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def builtin_server():
    from jaxllm.config import ServingConfig
    from support.serve_helpers import ServerThread, make_engine

    engine = make_engine(None, max_num_seqs=16, max_num_batched_tokens=64, max_model_len=256)
    srv = ServerThread(engine, ServingConfig(host="127.0.0.1", port=0))
    yield srv
    srv.stop()
    engine.shutdown()


@pytest.mark.parametrize("concurrency", [1, 4, 16])
def test_bench_serve_end_to_end(builtin_server, tmp_path, concurrency, capsys):
    from jaxllm.cli import main
    num = max(4, concurrency)
    plot = tmp_path / "serve.png"
    backend = "openai-chat" if concurrency == 4 else "openai"
    rc = main(["bench", "serve", "--base-url", builtin_server.base, "--backend", backend,
               "--dataset-name", "random", "--random-input-len", "24", "--random-output-len", "6",
               "--num-prompts", str(num), "--max-concurrency", str(concurrency), "--seed", str(concurrency),
               "--save-result", "--result-dir", str(tmp_path), "--result-filename", "out.json",
               "--plot", str(plot), "--goodput", "ttft:60000", "tpot:60000", "--disable-tqdm"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "Tokenizer: the built-in SmolLM2-135M-Instruct (the server serves it)" in out
    assert "============ Serving Benchmark Result ============" in out
    data = json.loads((tmp_path / "out.json").read_text())
    assert data["failed"] == 0 and data["completed"] == num, data["failed_errors"]
    for key in ("date", "backend", "model_id", "tokenizer_id", "num_prompts", "request_rate", "burstiness",
                "max_concurrency", "duration", "completed", "failed", "total_input_tokens", "total_output_tokens",
                "request_throughput", "request_goodput", "output_throughput", "total_token_throughput",
                "mean_ttft_ms", "median_ttft_ms", "std_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms",
                "p99_tpot_ms", "mean_itl_ms", "median_itl_ms", "p99_itl_ms", "max_output_tokens_per_s",
                "max_concurrent_requests"):
        assert key in data, key
    assert data["model_id"] == "SmolLM2-135M-Instruct" and data["max_concurrency"] == concurrency
    assert data["total_output_tokens"] == 6 * num  # ignore_eos: every request runs to max_tokens
    assert data["output_tokens_source"] == "usage"
    assert data["request_goodput"] == pytest.approx(data["request_throughput"])
    assert 1 <= data["max_concurrent_requests"] <= concurrency
    assert 0 < data["median_ttft_ms"] and 0 < data["median_tpot_ms"] and 0 < data["median_itl_ms"]
    assert plot.stat().st_size > 10_000
