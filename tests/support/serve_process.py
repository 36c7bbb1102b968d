"""``jaxllm serve`` as a subprocess for the docs tests: started with a command line, polled
until ``/health`` answers 200, stopped (terminate, then kill) when the block ends."""

from __future__ import annotations

import contextlib
import subprocess
import time

import httpx

from support.serve_helpers import free_port


@contextlib.contextmanager
def running_server(args: list[str], *, env: dict, log, timeout: float, cwd=None):
    """Runs ``args`` (the command line before ``--port``; the port is added) with its output in
    the file ``log``; yields the server's base URL once healthy.  Fails with the log's tail if
    it exits first or is not healthy within ``timeout`` seconds."""
    port = free_port()
    with open(log, "w") as fh:
        proc = subprocess.Popen([*args, "--port", str(port)], env=env, stdout=fh, stderr=subprocess.STDOUT, cwd=cwd)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"jaxllm serve exited {proc.returncode}:\n{log.read_text()[-3000:]}")
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"jaxllm serve not healthy after {timeout} s:\n{log.read_text()[-3000:]}")
            time.sleep(1)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
