"""Helpers and fixtures for the server tests: real hypercorn servers on 127.0.0.1 (ephemeral
ports) in threads, raw HTTP on sockets, a strict SSE parser.

Test modules load this file as a plugin (``pytest_plugins = ["support.serve_helpers"]``) rather than
through a conftest.py: a second module named ``conftest`` would replace tests/conftest.py in
sys.modules, and the suite's ``from support.engines import SMALL_ENGINE`` would find the wrong one.
One engine on the tiny Llama is shared by the session (several apps can serve it at once: the
API-key app is a second app on the same engine); tests that kill their engine on purpose
build their own.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import httpx
import pytest

# The shared server batches up to 16 requests per step, so the 64-stream test queues too.
# (tests/conftest.py's SMALL_ENGINE with more sequences; the strict compile guard stays on.)
SERVE_ENGINE = dict(max_num_seqs=16, max_num_batched_tokens=64, max_model_len=256, dtype="float32",
                    strict_compile_guard=True, show_progress=False)
START_TIMEOUT_S = 60


class ServerThread:
    """``run_server`` on its own event loop in a daemon thread; ``stop()`` is bounded."""

    def __init__(self, engine, config):
        from serve.app import run_server

        self.engine = engine
        self.config = config
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self.error: BaseException | None = None

        async def main():
            self._loop = asyncio.get_running_loop()
            self._stop = asyncio.Event()

            def ready(host, port):
                self.port = port
                self._ready.set()

            await run_server(engine, config, self._stop, on_ready=ready)

        def target():
            try:
                asyncio.run(main())
            except BaseException as e:  # surfaced by start()
                self.error = e
                self._ready.set()

        self._thread = threading.Thread(target=target, name="test-server", daemon=True)
        self._thread.start()
        if not self._ready.wait(START_TIMEOUT_S) or self.error is not None:
            raise RuntimeError(f"server did not start: {self.error!r}")
        self.base = f"http://127.0.0.1:{self.port}"

    def stop(self, timeout: float = 15.0) -> bool:
        """Triggers the graceful shutdown; returns whether the server thread ended in time."""
        if self._loop is not None and self._stop is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout)
        return not self._thread.is_alive()


def make_engine(path, **overrides):
    from jaxllm.config import EngineConfig
    from jaxllm.engine.async_engine import AsyncEngine
    from jaxllm.engine.llm_engine import LLMEngine

    return AsyncEngine(LLMEngine(EngineConfig.from_kwargs(model=path, **{**SERVE_ENGINE, **overrides})))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_health(proc, base: str, lines: list[str], timeout: float) -> None:
    """Polls ``base``/health until the server subprocess ``proc`` answers 200; fails with its
    output (``lines``, filled by a reader thread) if it exits or ``timeout`` s pass."""
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, "".join(lines)
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "server did not come up:\n" + "".join(lines)
        time.sleep(0.2)


def wait_until(cond, timeout: float = 20.0, what: str = "condition"):
    import time
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.01)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def parse_sse(raw: str) -> list:
    """A strict SSE reader: every event is ``data: ...`` lines then a blank line; comments skipped.

    Returns the decoded JSON objects, with the string "[DONE]" for the terminator.
    """
    assert raw.endswith("\n\n"), f"stream does not end with a blank line: {raw[-80:]!r}"
    events = []
    for block in raw.split("\n\n")[:-1]:
        lines = [ln for ln in block.split("\n") if not ln.startswith(":")]
        if not lines:
            continue  # a keep-alive comment
        assert all(ln.startswith("data: ") for ln in lines), f"not a data frame: {block!r}"
        data = "\n".join(ln[len("data: "):] for ln in lines)
        events.append("[DONE]" if data == "[DONE]" else json.loads(data))
    return events


def raw_post(port: int, path: str, body, headers: dict | None = None, timeout: float = 30.0):
    """Sends an HTTP/1.1 POST on a plain socket (``Connection: close``); returns the socket."""
    import socket
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
    head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n{extra}Connection: close\r\n\r\n")
    sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    sock.sendall(head.encode() + data)
    return sock


def read_http_response(sock, already: bytes = b"") -> tuple[int, dict, bytes]:
    """Reads to EOF; returns (status, lower-cased headers, body with chunked encoding removed)."""
    buf = already
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            break
        buf += chunk
    sock.close()
    head, _, body = buf.partition(b"\r\n\r\n")
    lines = head.decode("latin1").split("\r\n")
    status = int(lines[0].split(" ")[1])
    headers = {}
    for ln in lines[1:]:
        k, _, v = ln.partition(":")
        headers[k.strip().lower()] = v.strip()
    if headers.get("transfer-encoding") == "chunked":
        out, rest = b"", body
        while rest:
            size_line, _, rest = rest.partition(b"\r\n")
            size = int(size_line.split(b";")[0], 16)
            if size == 0:
                break
            out, rest = out + rest[:size], rest[size + 2:]
        body = out
    return status, headers, body


def assert_error_shape(resp_json, status: int, param=...):
    """OpenAI's error body: {"error": {"message", "type", "param", "code"}}, code == status."""
    assert set(resp_json) == {"error"}, resp_json
    err = resp_json["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"], err
    assert isinstance(err["type"], str) and err["type"], err
    assert err["code"] == status, err
    assert err["param"] is None or isinstance(err["param"], str), err
    if param is not ...:
        assert err["param"] == param, err
    return err


# ---------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="session")
def serve_engine(tiny_llama):
    engine = make_engine(tiny_llama)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="session")
def server(serve_engine):
    from jaxllm.config import ServingConfig

    srv = ServerThread(serve_engine, ServingConfig(host="127.0.0.1", port=0, served_model_names=("tiny", "tiny-alias")))
    yield srv
    srv.stop()


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.base, timeout=60) as c:
        yield c


@pytest.fixture
def idle_engine(serve_engine):
    """Waits until the shared engine has nothing in flight (a previous test's aborts applied)."""
    wait_until(lambda: serve_engine.stats().num_running == 0 and serve_engine.stats().num_waiting == 0,
               what="the shared engine to drain")
    return serve_engine
