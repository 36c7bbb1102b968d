"""The Responses store's reliability: its bounds (size and age eviction), and a real ``jaxllm
serve`` killed with SIGKILL while stored responses and a few streams are in flight, then restarted
on the same store: with 200 concurrent responses, every one the client heard is retrievable; under a
size bound the load exceeds, the newest are retrievable, the oldest evicted, and the stored bytes fit
the bound.  The database passes sqlite's integrity check after each kill."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time

import httpx
import jsonschema
import openai
import pytest

pytest.register_assert_rewrite("support.serve_helpers")

from support.serve_helpers import assert_error_shape, free_port, wait_for_health  # noqa: E402

from jaxllm import cli  # noqa: E402
from jaxllm.config import ServingConfig  # noqa: E402
from serve.cli import serving_config_from_args  # noqa: E402
from serve.responses.store import ResponseStore, open_store  # noqa: E402

SCHEMA = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["color", "n"], "additionalProperties": False}
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _resp(i: int, pad: int = 0) -> dict:
    return {"id": f"resp_{i}", "object": "response", "status": "completed", "output": [], "pad": "x" * pad}


def test_store_bounds_evict_oldest_and_expired(tmp_path):
    store = ResponseStore(str(tmp_path / "s.sqlite3"), max_bytes=20_000, max_age_s=3600)
    for i in range(50):
        store.put(_resp(i, pad=1000), [{"id": f"msg_{i}"}], [])
    assert store.total_bytes() <= 20_000
    assert store.get("resp_49") is not None and store.get("resp_0") is None  # newest kept, oldest evicted
    kept = [i for i in range(50) if store.get(f"resp_{i}") is not None]
    assert kept == list(range(kept[0], 50)) and len(kept) >= 15
    assert store.input_items("resp_49") == [{"id": "msg_49"}]
    store.close()
    aged = ResponseStore(str(tmp_path / "s.sqlite3"), max_bytes=20_000, max_age_s=0.05)
    time.sleep(0.1)
    assert aged.get("resp_49") is None  # expired rows are not served, and the next write drops them
    aged.put(_resp(99), [], [])
    assert aged.total_bytes() == len('{"id":"resp_99","object":"response","status":"completed","output":[],"pad":""}') \
        + len("[]") * 2
    aged.close()


def _serving(*flags: str) -> ServingConfig:
    return serving_config_from_args(cli.parse_args(cli.build_parser(), ["serve", *flags]))


def test_the_bound_flags_reach_the_store_and_bad_values_name_the_flag(tmp_path, capsys):
    path = str(tmp_path / "flags.sqlite3")
    store = open_store(_serving("--responses-store", path, "--responses-store-max-bytes", "5000"))
    for i in range(20):
        store.put(_resp(i, pad=1000), [], [])
    # ~1.1 kB a row: the 5000-byte bound keeps the newest four, not the default's gigabyte.
    assert store.total_bytes() <= 5000
    assert [i for i in range(20) if store.get(f"resp_{i}") is not None] == [16, 17, 18, 19]
    store.close()
    store = open_store(_serving("--responses-store", path, "--responses-store-max-age", "0.05"))
    time.sleep(0.1)
    assert store.get("resp_19") is None  # older than the flag's 0.05 s: evicted, not the default's 30 days
    store.put(_resp(20), [], [])
    assert store.total_bytes() < 200
    store.close()
    assert open_store(_serving("--responses-store", "none")) is None
    for flag, value in (("--responses-store-max-bytes", "0"), ("--responses-store-max-age", "-1"),
                        ("--responses-store-max-age", "inf")):
        with pytest.raises(ValueError, match=f"^{flag} must be a positive number"):
            _serving(flag, value)
    with pytest.raises(SystemExit):
        _serving("--responses-store-max-bytes", "1GB")
    assert "argument --responses-store-max-bytes: invalid int value: '1GB'" in capsys.readouterr().err


def test_a_damaged_store_file_is_moved_aside_not_a_failed_start(tmp_path, caplog):
    path = tmp_path / "s.sqlite3"
    path.write_bytes(b"this is not a database" * 100)
    store = ResponseStore(str(path), max_bytes=1 << 20, max_age_s=3600)
    store.put(_resp(1), [], [])
    assert store.get("resp_1")["id"] == "resp_1"
    store.close()
    assert [p.name.split("-")[0] for p in tmp_path.glob("s.sqlite3.damaged-*")] == ["s.sqlite3.damaged"]
    assert "not a readable database" in caplog.text


def _start(ckpt: str, store: str, log, max_bytes: int):
    port = free_port()
    cmd = [sys.executable, "-m", "jaxllm.cli", "serve", ckpt, "--host", "127.0.0.1", "--port", str(port),
           "--served-model-name", "tiny", "--max-num-seqs", "4", "--max-num-batched-tokens", "32",
           "--max-model-len", "256", "--dtype", "float32", "--responses-store", store,
           "--responses-store-max-bytes", str(max_bytes), "--disable-log-requests",
           # compact JSON: the random model would pad a json_schema answer with whitespace
           "--structured-outputs-config", '{"disable_any_whitespace": true}']
    proc = subprocess.Popen(cmd, cwd=ROOT, env=dict(os.environ), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    threading.Thread(target=lambda: log.extend(proc.stdout), daemon=True).start()
    base = f"http://127.0.0.1:{port}"
    wait_for_health(proc, base, log, timeout=300)
    return proc, base


async def _concurrent_load_then_kill(base: str, proc) -> dict[str, str]:
    """200 stored responses at once, 3 long streams joining at 80 heard; SIGKILL once half the 200
    are heard, while the streams still stream.  Returns the replies heard before the kill (id -> text)."""
    done: dict[str, str] = {}
    streaming = asyncio.Event()

    async with httpx.AsyncClient(base_url=base, timeout=120, limits=httpx.Limits(max_connections=300)) as c:
        async def one(i):
            r = await c.post("/v1/responses", json={"model": "tiny", "input": f"question {i}",
                                                    "max_output_tokens": 2, "temperature": 0})
            assert r.status_code == 200, r.text
            body = r.json()
            done[body["id"]] = body["output"][0]["content"][0]["text"]

        tasks = [asyncio.ensure_future(one(i)) for i in range(200)]
        streams: list = []
        deadline = time.monotonic() + 240
        while (len(done) < 100 or not streaming.is_set()) and time.monotonic() < deadline:
            if len(done) >= 80 and not streams:  # late, so that they are still streaming at the kill
                streams = [asyncio.ensure_future(_stream(c, streaming)) for _ in range(3)]
                tasks += streams
            await asyncio.sleep(0.02)
        proc.send_signal(signal.SIGKILL)
        heard, mid_stream = dict(done), not all(s.done() for s in streams)
        await asyncio.gather(*tasks, return_exceptions=True)
    assert len(heard) >= 100 and mid_stream, "the load did not get going before the kill"
    return heard


async def _stream(c: httpx.AsyncClient, streaming: asyncio.Event) -> None:
    body = {"model": "tiny", "input": "story " * 20, "max_output_tokens": 200, "stream": True, "ignore_eos": True}
    async with c.stream("POST", "/v1/responses", json=body) as r:
        async for line in r.aiter_lines():
            if '"response.output_text.delta"' in line:
                streaming.set()


def _kill_under_load(ckpt: str, store: str, log: list[str], max_bytes: int, load):
    proc, base = _start(ckpt, store, log, max_bytes)
    try:
        heard = asyncio.run(load(base, proc))
        assert proc.wait(30) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
    return heard


def _check_store_file(store: str, max_bytes: int, retrievable: int) -> int:
    """The file passes sqlite's integrity check, holds at least the retrievable rows (more may have
    been stored but not heard at the kill) and fits the bound; returns the accounted bytes."""
    db = sqlite3.connect(store)
    assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    n, total = db.execute("SELECT COUNT(*), SUM(nbytes) FROM responses").fetchone()
    db.close()
    assert n >= retrievable
    assert total <= max_bytes
    return total


@pytest.fixture(scope="module")
def restarted(tiny_llama, tmp_path_factory):
    """A real ``jaxllm serve`` killed under 200 concurrent stored responses and 3 streams, then started
    again on the same store: (its base URL, the replies heard before the kill, the store file)."""
    store, log, bound = str(tmp_path_factory.mktemp("store") / "responses.sqlite3"), [], 1_000_000
    heard = _kill_under_load(tiny_llama, store, log, bound, _concurrent_load_then_kill)
    proc, base = _start(tiny_llama, store, log, bound)
    yield base, heard, store, bound
    proc.terminate()
    proc.wait(30)


def test_sigkill_mid_stream_then_restart_keeps_every_completed_response(restarted):
    """200 concurrent stored responses and 3 streams, SIGKILL mid-stream, restart on the same store:
    every response the client heard is retrievable with its text and input items, and the file
    passes sqlite's integrity check within the size bound."""
    base, heard, store, bound = restarted
    with httpx.Client(base_url=base, timeout=60) as c:
        for rid, text in heard.items():
            r = c.get(f"/v1/responses/{rid}")
            assert r.status_code == 200, (rid, r.text)
            assert r.json()["output"][0]["content"][0]["text"] == text
        items = c.get(f"/v1/responses/{rid}/input_items").json()
        assert items["data"][0]["content"][0]["text"].startswith("question ")
    _check_store_file(store, bound, len(heard))


def _kv_usage(base: str) -> float:
    text = httpx.get(base + "/metrics").text
    return float(next(line.split()[-1] for line in text.splitlines() if line.startswith("jaxllm:kv_cache_usage_perc")))


def test_the_official_client_against_the_restarted_serve(restarted):
    """The official ``openai`` client against the real process (test_responses.py checks the same calls
    in depth on an in-process server; tests/docs/test_tool_example.py runs tools, reasoning items and
    the agents SDK against a real one): create, stream (event order, sequence numbers, deltas equal
    the text), retrieve, delete, ``store: false``, sampled ``json_schema`` answers that validate,
    and cancel of a background response, which frees its KV."""
    base, heard, _, _ = restarted
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=60)
    assert client.responses.retrieve(next(iter(heard))).output_text == next(iter(heard.values()))
    whole = client.responses.create(model="tiny", input="Tell me", max_output_tokens=6, temperature=0)
    with client.responses.stream(model="tiny", input="Tell me", max_output_tokens=6, temperature=0) as s:
        events = list(s)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events][:2] == ["response.created", "response.in_progress"]
    assert events[-1].type == "response.incomplete"  # max_output_tokens
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == events[-1].response.output_text == whole.output_text
    assert client.responses.delete(whole.id) is None
    unstored = client.responses.create(model="tiny", input="Hi", max_output_tokens=2, store=False)
    for rid in (whole.id, unstored.id):
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(rid)
    for seed in (1, 2):  # sampled
        r = client.responses.create(model="tiny", input="Give me the data.", temperature=1.0, max_output_tokens=60,
                                    extra_body={"seed": seed}, text={"format": {"type": "json_schema", "name": "c",
                                                                                "schema": SCHEMA}})
        assert r.status == "completed", r
        jsonschema.validate(json.loads(r.output_text), SCHEMA)
    r = client.responses.create(model="tiny", input="word " * 30, max_output_tokens=200, background=True,
                                extra_body={"ignore_eos": True})
    deadline = time.monotonic() + 30
    while _kv_usage(base) == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert _kv_usage(base) > 0, "the background response never held KV"
    assert client.responses.cancel(r.id).status == "cancelled"
    assert client.responses.retrieve(r.id).status == "cancelled"
    while _kv_usage(base) > 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _kv_usage(base) == 0, "cancel did not free the KV"


WAVE = 4  # responses sent together; a wave starts only once the client heard every reply of the last


async def _waves_then_kill(base: str, proc) -> list[list[tuple[str, str] | None]]:
    """Stored responses in waves of ``WAVE``, 3 long streams joining near the end; SIGKILL once >= 48
    are heard, while a wave and the streams are in flight.  Returns each wave's (id, text) replies
    (None for one not heard before the kill).

    Waves make the store's order knowable from the client: every reply of wave j was stored before
    the client heard it, so before any request of wave j+1 was sent.  Replies heard from many
    concurrent requests carry no such order (a CI run heard the store's newest ones late)."""
    waves: list[list[tuple[str, str] | None]] = []
    streaming = asyncio.Event()

    async with httpx.AsyncClient(base_url=base, timeout=120) as c:
        async def one(i, wave):
            r = await c.post("/v1/responses", json={"model": "tiny", "input": f"question {i}",
                                                    "max_output_tokens": 2, "temperature": 0})
            assert r.status_code == 200, r.text
            body = r.json()
            wave[i % WAVE] = (body["id"], body["output"][0]["content"][0]["text"])

        streams: list = []
        heard, mid_stream = 0, False
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            heard = len(waves) * WAVE
            if heard >= 40 and not streams:  # late, so that they are still streaming at the kill
                streams = [asyncio.ensure_future(_stream(c, streaming)) for _ in range(3)]
            wave: list = [None] * WAVE
            waves.append(wave)
            tasks = [asyncio.ensure_future(one(heard + k, wave)) for k in range(WAVE)]
            if heard >= 48 and streaming.is_set():
                while not any(wave) and time.monotonic() < deadline:  # kill mid-wave
                    await asyncio.sleep(0.01)
                proc.send_signal(signal.SIGKILL)
                snapshot = list(wave)
                mid_stream = not all(s.done() for s in streams)
                await asyncio.gather(*tasks, *streams, return_exceptions=True)
                waves[-1] = snapshot
                break
            await asyncio.gather(*tasks)
    assert heard >= 48 and mid_stream, "the load did not get going before the kill"
    return waves


# One stored response of the wave load (its JSON, input items and conversation) takes 1.1 to 2.8 kB
# (measured: 1141..2728 bytes), so the bound holds 11 to 26 of them.  The kill comes after >= 48 are
# heard, so the load overflows it for certain and the oldest are evicted while it runs; and the newest
# complete wave with the one in flight (8 rows, at most 22 kB) fits, so it must survive.
STORE_BOUND = 30_000


def test_sigkill_under_a_size_bound_keeps_the_newest_responses(tiny_llama, tmp_path):
    """Under a size bound the load exceeds, SIGKILL mid-stream, restart: the store's accounted bytes
    fit the bound, the newest responses are retrievable and the oldest are a 404 in OpenAI's shape."""
    store, log = str(tmp_path / "responses.sqlite3"), []
    waves = _kill_under_load(tiny_llama, store, log, STORE_BOUND, _waves_then_kill)
    proc, base = _start(tiny_llama, store, log, STORE_BOUND)
    try:
        with httpx.Client(base_url=base, timeout=60) as c:
            kept_per_wave = []  # how many of each wave's heard replies are still retrievable
            for wave in waves:
                kept = 0
                for rid, text in filter(None, wave):
                    r = c.get(f"/v1/responses/{rid}")
                    if r.status_code == 404:
                        assert_error_shape(r.json(), 404, "response_id")
                        continue
                    assert r.status_code == 200, (rid, r.text)
                    assert r.json()["output"][0]["content"][0]["text"] == text
                    kept += 1
                kept_per_wave.append(kept)
    finally:
        proc.terminate()
        proc.wait(30)
    complete = kept_per_wave[:-1]  # the last wave was in flight at the kill
    # The store evicts in the order it stored, which is wave order: once a wave is (partly) kept,
    # every later complete wave is whole, and the newest complete wave always is.
    first = next(j for j, k in enumerate(complete) if k)
    assert complete[first + 1:] == [WAVE] * (len(complete) - first - 1), kept_per_wave
    assert complete[-1] == WAVE, ("the newest responses were evicted", kept_per_wave)
    assert complete[0] == 0, ("the oldest responses survived the size bound", kept_per_wave)
    assert _check_store_file(store, STORE_BOUND, sum(kept_per_wave)) > STORE_BOUND // 2  # evicted to the bound, not emptied
