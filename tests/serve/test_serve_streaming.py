"""SSE semantics that clients depend on, checked on the wire (raw sockets and a strict SSE parser).

- the chat role frame (and any completions chunk) waits for the engine's first result;
- an engine failure before the first token is the first thing a stream carries; a failure
  mid-stream becomes an error frame and ``[DONE]``; a dead engine answers 503;
- a client that disconnects has its request aborted and its KV blocks returned;
- text that may start a stop string is held back; keep-alive comments fill silences.
"""

from __future__ import annotations

import socket
import threading
import time

import httpx
import pytest

pytest.register_assert_rewrite("support.serve_helpers")  # before its import, so its asserts show values

from support.serve_helpers import (ServerThread, assert_error_shape, make_engine, parse_sse, raw_post,  # noqa: E402
                           read_http_response, wait_until)

from jaxllm.config import ServingConfig  # noqa: E402

# The shared engine and server fixtures (serve_engine, server, http, idle_engine).
pytest_plugins = ["support.serve_helpers"]

CHAT = {"messages": [{"role": "user", "content": "Tell me about XLA."}], "max_tokens": 6, "temperature": 0,
        "stream": True}
COMPLETION = {"prompt": "The quick brown fox", "max_tokens": 6, "temperature": 0, "stream": True,
              "ignore_eos": True}


def _received_within(sock, seconds: float) -> bytes:
    """Everything the server sent within ``seconds``."""
    got = b""
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        sock.settimeout(left)
        try:
            chunk = sock.recv(65536)
        except socket.timeout:
            break
        if not chunk:
            break
        got += chunk
    return got


def _before_step(runner, hook):
    """Runs ``hook`` before each of ``runner``'s device calls from now on (None: no longer).

    It wraps ``_run`` on this one runner object (an instance attribute shadowing the method),
    so the production runner carries no hook for tests."""
    runner.__dict__.pop("_run", None)
    if hook is None:
        return
    run = runner._run

    def hooked(step):
        hook()
        return run(step)

    runner._run = hooked


def _hold_first_step(core):
    """Installs a runner hook that blocks the next step before its device call."""
    entered, release = threading.Event(), threading.Event()

    def hold():
        entered.set()
        if not release.wait(30):
            raise RuntimeError("the test never released the held step")

    _before_step(core.runner, hold)
    return entered, release


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_nothing_reaches_the_client_before_the_engines_first_result(server, idle_engine, endpoint):
    core = idle_engine.engine.core
    path, body = (("/v1/chat/completions", CHAT) if endpoint == "chat" else ("/v1/completions", COMPLETION))
    entered, release = _hold_first_step(core)
    try:
        sock = raw_post(server.port, path, body)
        assert entered.wait(20), "the engine never started a step for the request"
        # Precondition: the held step is this request's first one, and no token exists yet.
        reqs = list(core.scheduler.requests.values())
        assert len(reqs) == 1 and reqs[0] in core.scheduler.running, reqs
        assert reqs[0].output_token_ids == []
        early = _received_within(sock, 0.75)
        # The status line and headers may go out (as vLLM's do); no body byte may.
        head, sep, body_bytes = early.partition(b"\r\n\r\n")
        assert body_bytes == b"", f"a frame reached the client before any token existed: {early!r}"
    finally:
        _before_step(core.runner, None)
        release.set()
    sock.settimeout(30)
    status, headers, raw = read_http_response(sock, early)
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    events = parse_sse(raw.decode())
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    first = chunks[0]["choices"][0]
    if endpoint == "chat":
        assert first["delta"] == {"role": "assistant", "content": ""}
        assert first["finish_reason"] is None
        assert all("role" not in c["choices"][0]["delta"] for c in chunks[1:])
        text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[1:])
    else:
        # Completions has no role frame: its first chunk already carries text.
        assert first["text"] != ""
        assert all(c["choices"][0]["text"] != "" or c["choices"][0]["finish_reason"] for c in chunks)
        text = "".join(c["choices"][0]["text"] for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert text.strip()


def test_keep_alive_comments_fill_a_silent_stream(serve_engine, idle_engine):
    srv = ServerThread(serve_engine, ServingConfig(port=0, sse_keep_alive_interval=0.1))
    core = idle_engine.engine.core
    try:
        entered, release = _hold_first_step(core)
        try:
            sock = raw_post(srv.port, "/v1/chat/completions", CHAT)
            assert entered.wait(20)
            time.sleep(0.6)
        finally:
            _before_step(core.runner, None)
            release.set()
        status, _, raw = read_http_response(sock)
        text = raw.decode()
        assert status == 200
        first_data = text.index("data: ")
        assert text[:first_data].count(": keep-alive\n\n") >= 2, text[:200]
        events = parse_sse(text)
        assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert events[-1] == "[DONE]"
    finally:
        assert srv.stop()


def _stop_string_across_tokens(http):
    """A greedy output and a 4-character stop string that starts inside one token and ends in the next."""
    r = http.post("/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 24, "temperature": 0,
                                          "ignore_eos": True, "logprobs": 0}).json()
    text, tokens = r["choices"][0]["text"], r["choices"][0]["logprobs"]["tokens"]
    offset = 0
    for j, (a, b) in enumerate(zip(tokens, tokens[1:])):
        offset += len(a)
        if j >= 2 and len(a) >= 2 and len(b) >= 2:
            stop = a[-2:] + b[:2]
            if text.find(stop) == offset - 2 and stop.strip():
                return text, stop, offset - 2
    pytest.fail("precondition: no token boundary of the greedy output gives a usable stop string")


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_stop_string_prefix_is_held_back(http, endpoint):
    text, stop, at = _stop_string_across_tokens(http)
    if endpoint == "completions":
        r = http.post("/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 24, "temperature": 0,
                                              "ignore_eos": True, "stop": [stop], "stream": True})
        events = parse_sse(r.text)
        pieces = [e["choices"][0]["text"] for e in events[:-1]]
    else:
        # The chat endpoint gets the same prompt through a template that passes it through verbatim.
        r = http.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "Once upon a time"}], "max_tokens": 24, "temperature": 0,
            "ignore_eos": True, "stop": [stop], "stream": True,
            "chat_template": "{% for m in messages %}{{ m['content'] }}{% endfor %}"})
        events = parse_sse(r.text)
        pieces = [e["choices"][0]["delta"].get("content", "") for e in events[:-1]]
    final = events[-2]["choices"][0]
    assert events[-1] == "[DONE]"
    assert final["finish_reason"] == "stop" and final["stop_reason"] == stop
    # Without hold-back the first half of the stop string would have gone out before the
    # engine saw the second half, and the streamed text would not equal the truncated text.
    assert "".join(pieces) == text[:at]


def _assert_dead(srv):
    with httpx.Client(base_url=srv.base, timeout=10) as c:
        h = c.get("/health")
        assert h.status_code == 503
        assert_error_shape(h.json(), 503)
        for body in ({**CHAT, "stream": False}, CHAT):
            r = c.post("/v1/chat/completions", json=body)
            assert r.status_code == 503, r.text
            assert_error_shape(r.json(), 503)


def test_error_before_the_first_token_is_the_first_frame(tiny_llama):
    import openai

    engine = make_engine(tiny_llama, max_num_seqs=4, max_num_batched_tokens=32)
    entered, release = threading.Event(), threading.Event()

    def fail():
        entered.set()
        release.wait(30)
        raise RuntimeError("injected device failure")

    _before_step(engine.engine.core.runner, fail)
    srv = ServerThread(engine, ServingConfig(port=0))
    try:
        # A raw client whose request is in the failing step ...
        sock = raw_post(srv.port, "/v1/chat/completions", CHAT)
        assert entered.wait(20)
        assert all(not r.output_token_ids for r in engine.engine.core.scheduler.requests.values())
        # ... and the official client, whose request is accepted while that step runs.
        got: dict = {}

        def official():
            client = openai.OpenAI(base_url=srv.base + "/v1", api_key="x", max_retries=0, timeout=30)
            chunks = []
            try:
                for ch in client.chat.completions.create(model=engine.model_name, **CHAT):
                    chunks.append(ch)
            except openai.APIError as e:
                got["error"] = e
            got["chunks"] = chunks

        t = threading.Thread(target=official)
        t.start()
        wait_until(lambda: not engine._inbox.empty(), what="the second request to reach the engine")
        release.set()
        t.join(30)
        status, _, raw = read_http_response(sock)
        assert status == 200
        events = parse_sse(raw.decode())
        assert len(events) == 2 and events[1] == "[DONE]", events
        err = assert_error_shape(events[0], 500)
        assert "injected device failure" in err["message"]
        assert got["chunks"] == [], "the stream yielded chunks before the error"
        assert isinstance(got.get("error"), openai.APIError) and "injected device failure" in got["error"].message
        _assert_dead(srv)
    finally:
        release.set()
        assert srv.stop()
        engine.shutdown()


def test_error_mid_stream_is_an_error_frame_then_done(tiny_llama):
    engine = make_engine(tiny_llama, max_num_seqs=4, max_num_batched_tokens=32)
    sched = engine.engine.core.scheduler

    def fail_after_two_tokens():
        if any(len(r.output_token_ids) >= 2 for r in sched.requests.values()):
            raise RuntimeError("injected device failure")

    _before_step(engine.engine.core.runner, fail_after_two_tokens)
    srv = ServerThread(engine, ServingConfig(port=0))
    try:
        r = httpx.post(srv.base + "/v1/chat/completions", json={**CHAT, "max_tokens": 20}, timeout=30)
        events = parse_sse(r.text)
        assert events[-1] == "[DONE]"
        assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        content = events[1:-2]
        assert len(content) >= 1 and all(e["choices"][0]["finish_reason"] is None for e in content)
        assert all("error" not in e for e in events[:-2])
        err = assert_error_shape(events[-2], 500)
        assert "injected device failure" in err["message"]
        _assert_dead(srv)
    finally:
        assert srv.stop()
        engine.shutdown()


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_aborts_and_frees_kv_blocks(server, idle_engine, stream):
    core = idle_engine.engine.core
    kv = core.kv_manager
    metrics = idle_engine.stats_sink
    assert kv.num_free_blocks == kv.num_blocks, "blocks held before the test"
    aborted, lengths = metrics.finished_count("abort"), metrics.finished_count("length")
    # Slow steps: a request that is not aborted would run for about 5 s.
    _before_step(core.runner, lambda: time.sleep(0.02))
    body = {"prompt": "word " * 40, "max_tokens": 200, "ignore_eos": True, "temperature": 0, "stream": stream}
    try:
        if stream:
            with httpx.stream("POST", server.base + "/v1/completions", json=body, timeout=30) as r:
                frames = 0
                for line in r.iter_lines():
                    frames += line.startswith("data: ")
                    if frames >= 3:
                        break
                # Precondition: the request is running and holds blocks.
                assert kv.num_free_blocks < kv.num_blocks
            # Leaving the block closed the connection mid-stream.
        else:
            # The client gives up waiting (a read timeout closes its connection).
            outcome = {}

            def impatient():
                try:
                    httpx.post(server.base + "/v1/completions", json=body, timeout=httpx.Timeout(30, read=1.5))
                except httpx.ReadTimeout as e:
                    outcome["error"] = e

            t = threading.Thread(target=impatient)
            t.start()
            # Precondition, while the request is in flight: it holds blocks.
            wait_until(lambda: kv.num_free_blocks < kv.num_blocks, timeout=5.0, what="the request to hold blocks")
            t.join(30)
            assert isinstance(outcome.get("error"), httpx.ReadTimeout)
        wait_until(lambda: kv.num_free_blocks == kv.num_blocks, timeout=3.0, what="KV blocks to return")
        assert not core.scheduler.has_unfinished_requests()
        wait_until(lambda: metrics.finished_count("abort") == aborted + 1, timeout=3.0, what="the abort")
        assert metrics.finished_count("length") == lengths, "the request ran to its end instead of being aborted"
    finally:
        _before_step(core.runner, None)
