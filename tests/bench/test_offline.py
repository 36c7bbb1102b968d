"""``jaxllm bench throughput|latency`` (bench/offline.py), XLA profiles (jaxllm/profiling.py) and the
server's ``POST /start_profile`` / ``POST /stop_profile`` (``jaxllm serve --profiler-dir``).

Every engine here uses tests/conftest.py's small buckets on the tiny Llama, so their compiled
steps come from the suite's persistent cache.  Traces are opened with ``jax.profiler.ProfileData``
directly (not through jaxllm/profiling.py) and must hold XLA op events of the engine's step
(``hlo_module`` jit_step) on the CPU "device" (the ``/host:CPU`` plane's XLA threads).
"""

from __future__ import annotations

import glob
import gzip
import json
import os
import re

import httpx
import pytest

from support.engines import SMALL_ENGINE  # noqa: E402

ENGINE_FLAGS = ["--max-num-seqs", str(SMALL_ENGINE["max_num_seqs"]),
                "--max-num-batched-tokens", str(SMALL_ENGINE["max_num_batched_tokens"]),
                "--max-model-len", str(SMALL_ENGINE["max_model_len"]), "--dtype", "float32"]


def run_cli(argv, capsys):
    """``jaxllm ARGV`` in this process: (exit status, stdout, stderr)."""
    from jaxllm.cli import main
    try:
        rc = main(argv)
    except SystemExit as e:  # argparse
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err


def xla_op_events(xplane_path: str) -> list[tuple[str, str, str, float]]:
    """(plane, hlo_module, hlo_op, duration_ns) of every XLA op event in an .xplane.pb."""
    from jax.profiler import ProfileData
    data = ProfileData.from_file(xplane_path)
    found = []
    for plane in data.planes:
        for line in plane.lines:
            for ev in line.events:
                stats = dict(ev.stats)
                if "hlo_op" in stats:
                    found.append((plane.name, stats.get("hlo_module", ""), stats["hlo_op"], ev.duration_ns))
    return found


def only_trace(log_dir) -> str:
    runs = glob.glob(os.path.join(str(log_dir), "plugins", "profile", "*", "*.xplane.pb"))
    assert len(runs) == 1, f"expected one trace under {log_dir}, found {runs}"
    return runs[0]


# ---------------------------------------------------------------------------- latency, profiled


def test_latency_profile_writes_a_trace_with_device_ops(tiny_llama, tmp_path, capsys):
    prof = tmp_path / "prof"
    out_json = tmp_path / "lat.json"
    rc, out, err = run_cli(["bench", "latency", "--model", tiny_llama, "--batch-size", "2", "--input-len", "8",
                            "--output-len", "4", "--num-iters-warmup", "1", "--num-iters", "2", *ENGINE_FLAGS,
                            "--profile", str(prof), "--output-json", str(out_json)], capsys)
    assert rc == 0, err
    assert re.search(r"^Avg latency: \d+\.\d+ seconds", out, re.M), out
    assert re.search(r"^99% percentile latency: \d+\.\d+ seconds", out, re.M), out
    # Batch of 2 x 8 prompt tokens fits one step (budget 32): 1 prefill step + 3 decode steps per iteration.
    assert re.search(r"^Median decode step: \d+\.\d+ ms \(6 decode steps, 2 prefill steps", out, re.M), out

    # The trace: where the output says, opened independently, with the step's XLA ops in it.
    xplane = only_trace(prof)
    assert xplane in out and "ui.perfetto.dev" in out and "tensorboard --logdir" in out
    events = xla_op_events(xplane)
    step_ops = [e for e in events if e[1] == "jit_step"]
    assert step_ops, f"no XLA op events of jit_step in {xplane}: {events[:5]}"
    assert all(plane == "/host:CPU" for plane, *_ in step_ops)   # the CPU "device"
    assert sum(d for *_, d in step_ops) > 0
    # Every measured step ran inside the trace: 2 iterations x 4 steps, each with its op events,
    # and after each step the sampler's own program (runner/step.py).
    counts = {op: sum(1 for e in step_ops if e[2] == op) for op in {e[2] for e in step_ops}}
    assert max(counts.values()) >= 8, counts
    sample_ops = [e for e in events if e[1] == "jit_sample_step"]
    sample_counts = {op: sum(1 for e in sample_ops if e[2] == op) for op in {e[2] for e in sample_ops}}
    assert sample_counts and max(sample_counts.values()) >= 8, sample_counts
    names = {op for _, _, op, _ in step_ops + sample_ops}
    perfetto = os.path.join(os.path.dirname(xplane), "perfetto_trace.json.gz")
    with gzip.open(perfetto) as f:
        trace_events = json.load(f)["traceEvents"]
    assert any((e.get("args") or {}).get("hlo_module") == "jit_step" for e in trace_events)

    # The top-ops table names ops that are in the trace, largest first.
    table = out[out.index("top XLA ops by self time"):]
    # The op column: the HLO instruction, or "kernel (ffi_call.N)" for a native kernel's custom call.
    rows = re.findall(r"^\s+(\d+\.\d+)\s+(\d+\.\d+)\s+(\d+)\s+(\d+\.\d+)\s+(?:(\w+) \()?([\w.\-]+)\)?"
                      r"\s+jit_(?:sample_)?step(?:#\d+)?\s*$", table, re.M)
    assert len(rows) >= 5, table
    assert all(r[5] in names for r in rows), (rows, sorted(names)[:10])
    # The native kernels are named by their FFI targets, never as a bare ffi_call.N.
    calls = [r for r in rows if r[5].startswith("ffi_call")]
    assert calls and all(r[4].startswith("jaxllm_") for r in calls), table
    self_ms = [float(r[0]) for r in rows]
    assert self_ms == sorted(self_ms, reverse=True)

    res = json.loads(out_json.read_text())
    assert len(res["latencies"]) == 2 and res["avg_latency"] > 0
    assert res["num_decode_steps"] == 6 and res["num_prefill_steps"] == 2 and res["median_decode_step_s"] > 0
    assert set(res["percentiles"]) == {"10", "25", "50", "75", "90", "99"}
    assert res["profile"]["xplane"] == xplane


def test_op_table_names_a_native_kernel_by_its_target(tmp_path):
    import jax
    import jax.numpy as jnp
    from jaxllm import profiling
    from jaxllm.cpu import native

    if not native.available():
        pytest.skip("the native CPU kernels are unavailable here")
    x, w = jnp.ones((4, 64)), jnp.ones((64,))
    program = jax.jit(lambda x, w: native.rms_norm(x, w, 1e-5) * 2).lower(x, w).compile()
    profiling.register_programs([program])   # what the engine's compilation does with its programs
    program(x, w).block_until_ready()
    profiling.start(str(tmp_path))
    program(x, w).block_until_ready()
    table = profiling.summarize(profiling.stop())
    assert re.search(r"jaxllm_rms_norm_f32 \(ffi_call\.\d+\)", table), table
    assert "by kind:" in table and "jaxllm_rms_norm_f32 " in table.split("by kind:")[1], table


class _FakeProgram:
    """A compiled program as kernel_names reads it: its HLO text."""

    def __init__(self, target):
        self.text = f'HloModule jit_step\n  %ffi_call.3 = f32[4] custom-call(), custom_call_target="{target}"\n'

    def as_text(self):
        return self.text


def test_an_earlier_engines_programs_do_not_rename_the_latest_ones():
    """Engines built earlier in the process (another model, other kernels) number their calls their
    own way: the latest registration names an instruction; within one registration (one
    engine's buckets) disagreeing targets are joined."""
    from jaxllm import profiling
    old, new_a, new_b = _FakeProgram("jaxllm_linear_q5_0"), _FakeProgram("jaxllm_linear_q4_1"), _FakeProgram("x")
    profiling.register_programs([old])
    profiling.register_programs([new_a])
    assert profiling.kernel_names()[("jit_step", "ffi_call.3")] == "jaxllm_linear_q4_1"
    profiling.register_programs([new_a, new_b])
    assert profiling.kernel_names()[("jit_step", "ffi_call.3")] == "jaxllm_linear_q4_1|x"
    del old, new_a, new_b


def test_summary_says_when_the_table_cannot_be_made(tmp_path):
    from jaxllm import profiling
    run = tmp_path / "plugins" / "profile" / "run1"
    run.mkdir(parents=True)
    (run / "vm.xplane.pb").write_bytes(b"not a protobuf at all")
    text = profiling.summarize(profiling.latest_trace(str(tmp_path)))
    assert text.startswith("top-ops table unavailable:") and "vm.xplane.pb" in text, text


# ---------------------------------------------------------------------------- throughput


def test_throughput_prints_numbers_and_writes_json(tiny_llama, tmp_path, capsys):
    out_json = tmp_path / "tp.json"
    rc, out, err = run_cli(["bench", "throughput", "--model", tiny_llama, "--dataset-name", "random",
                            "--num-prompts", "5", "--input-len", "12", "--output-len", "6", "--seed", "3",
                            *ENGINE_FLAGS, "--output-json", str(out_json)], capsys)
    assert rc == 0, err
    m = re.search(r"^Throughput: (\d+\.\d+) requests/s, (\d+\.\d+) total tokens/s, (\d+\.\d+) output tokens/s$",
                  out, re.M)
    assert m, out
    assert re.search(r"^Total num prompt tokens:\s+60$", out, re.M) and re.search(
        r"^Total num output tokens:\s+30$", out, re.M), out
    assert "XLA trace" not in out   # no --profile, no trace
    res = json.loads(out_json.read_text())
    assert res["num_requests"] == 5 and res["total_num_prompt_tokens"] == 60
    assert res["total_num_output_tokens"] == 30 and res["total_num_tokens"] == 90
    el = res["elapsed_time"]
    assert el > 0
    assert res["requests_per_second"] == pytest.approx(5 / el)
    assert res["tokens_per_second"] == pytest.approx(90 / el)
    assert res["output_tokens_per_second"] == pytest.approx(30 / el)
    assert float(m.group(1)) == pytest.approx(res["requests_per_second"], abs=0.006)
    assert float(m.group(3)) == pytest.approx(res["output_tokens_per_second"], abs=0.006)
    assert res["profile"] is None


@pytest.mark.parametrize("argv, needle", [
    (["latency", "--num-iters", "0"], "--num-iters"),
    (["latency", "--batch-size", "-1"], "--batch-size"),
    (["latency", "--batch-size", "8", "--max-num-seqs", "4"], "--max-num-seqs"),
    (["latency", "--input-len", "abc"], "--input-len"),
    (["latency", "--max-model-len", "16", "--input-len", "10", "--output-len", "10"], "--input-len"),
    (["throughput", "--num-prompts", "0"], "--num-prompts"),
    (["throughput", "--output-len", "0"], "--output-len"),
    (["throughput", "--dataset-name", "sharegpt"], "--dataset-name"),
    (["throughput", "--output-json", "/no/such/folder/x.json"], "--output-json"),
    (["throughput", "--profile", "FILE"], "--profile"),
])
def test_bad_flags_exit_2_naming_the_flag(argv, needle, tmp_path, capsys):
    a_file = tmp_path / "f"
    a_file.write_text("x")
    argv = [str(a_file) if a == "FILE" else a for a in argv]
    rc, out, err = run_cli(["bench", *argv, "--model", "/no/such/model"], capsys)
    assert rc == 2, (out, err)
    assert "error:" in err and needle in err, err
    assert "Traceback" not in err


def test_serve_profiler_dir_must_be_a_folder(tmp_path, capsys):
    a_file = tmp_path / "f"
    a_file.write_text("x")
    rc, out, err = run_cli(["serve", "--port", "0", "--model", "/no/such/model", "--profiler-dir", str(a_file)],
                           capsys)
    assert rc == 2 and "--profiler-dir" in err, err


# ---------------------------------------------------------------------------- the server's endpoints


@pytest.fixture(scope="module")
def profiled_engine(tiny_llama):
    from support.serve_helpers import make_engine
    engine = make_engine(tiny_llama, **{k: SMALL_ENGINE[k] for k in
                                        ("max_num_seqs", "max_num_batched_tokens", "max_model_len")})
    yield engine
    engine.shutdown()


def _server(engine, **kw):
    from support.serve_helpers import ServerThread

    from jaxllm.config import ServingConfig
    return ServerThread(engine, ServingConfig(host="127.0.0.1", port=0, served_model_names=("tiny",), **kw))


def test_start_stop_profile_over_http_writes_a_trace(profiled_engine, tmp_path):
    from support.serve_helpers import assert_error_shape
    prof = tmp_path / "server_prof"
    srv = _server(profiled_engine, profiler_dir=str(prof))
    try:
        with httpx.Client(base_url=srv.base, timeout=60) as http:
            r = http.post("/stop_profile")
            assert r.status_code == 400
            assert "no profile is running" in assert_error_shape(r.json(), 400)["message"]

            r = http.post("/start_profile")
            assert r.status_code == 200, r.text
            r = http.post("/start_profile")
            assert r.status_code == 400
            assert "already running" in assert_error_shape(r.json(), 400)["message"]

            r = http.post("/v1/completions", json={"model": "tiny", "prompt": [5, 6, 7, 8, 9], "max_tokens": 4,
                                                   "temperature": 0, "ignore_eos": True})
            assert r.status_code == 200, r.text

            r = http.post("/stop_profile")
            assert r.status_code == 200, r.text
            body = r.json()
            xplane = only_trace(prof)
            assert body["trace"]["xplane"] == xplane
            events = xla_op_events(xplane)
            step_ops = [e for e in events if e[1] == "jit_step"]
            assert step_ops, "the trace holds no XLA op events of the engine step"
            # The step's and the sampler's programs (runner/step.py) and, under async scheduling,
            # the token feed's (runner/token_feed.py: sampled tokens into the next step's input).
            engine_ops = {e[2] for e in events if e[1] in ("jit_step", "jit_sample_step", "jit_scatter", "jit_feed")}
            assert body["top_ops"] and {o["op"] for o in body["top_ops"]} <= engine_ops

            r = http.post("/stop_profile")
            assert r.status_code == 400
            assert_error_shape(r.json(), 400)
    finally:
        assert srv.stop()


def test_profile_routes_are_404_without_the_flag(profiled_engine):
    from support.serve_helpers import assert_error_shape
    srv = _server(profiled_engine)
    try:
        with httpx.Client(base_url=srv.base, timeout=60) as http:
            for path in ("/start_profile", "/stop_profile"):
                r = http.post(path)
                assert r.status_code == 404, (path, r.text)
                assert_error_shape(r.json(), 404)
    finally:
        assert srv.stop()


# ---------------------------------------------------------------------------- the table's arithmetic


def test_top_ops_counts_self_time_per_program():
    """A while op is charged only for what its nested ops leave uncovered; the same op name in
    two compiled programs is two rows; ops on other threads never nest."""
    from jaxllm.profiling import OpEvent, format_top_ops, top_ops

    def ev(name, start, dur, thread="xla0", program="1"):
        return OpEvent(name=name, module="jit_step", plane="/host:CPU", thread=thread, start_ns=start,
                       duration_ns=dur, program=program)

    events = [ev("while.1", 0, 100), ev("fusion.2", 10, 30), ev("fusion.3", 50, 20),
              ev("fusion.2", 200, 30), ev("dot.4", 20, 500, thread="xla1"),
              ev("fusion.2", 300, 7, program="2")]
    stats = {(o.module, o.name): o for o in top_ops(events)}
    assert stats[("jit_step#1", "while.1")].self_ns == 50 and stats[("jit_step#1", "while.1")].total_ns == 100
    assert stats[("jit_step#1", "fusion.2")].count == 2 and stats[("jit_step#1", "fusion.2")].self_ns == 60
    assert stats[("jit_step#1", "dot.4")].self_ns == 500
    assert stats[("jit_step#2", "fusion.2")].self_ns == 7
    order = [o.name for o in top_ops(events)]
    assert order[:3] == ["dot.4", "fusion.2", "while.1"]
    text = format_top_ops(top_ops(events))
    assert "by kind: dot 78%, fusion 14%, while 8%" in text and "jit_step#2" in text


def test_device_planes_win_over_host_threads():
    """With a GPU plane present, host-side op events are ignored, and xprof's derived "XLA Ops"
    line replaces the stream lines that hold the same ops as kernels (synthetic events: no GPU here)."""
    from jaxllm.profiling import OpEvent, _prefer_device

    def ev(plane, thread):
        return OpEvent(name="fusion.1", module="jit_step", plane=plane, thread=thread, start_ns=0, duration_ns=5)

    host, stream, ops = ev("/host:CPU", "xla0"), ev("/device:GPU:0", "Stream #13"), ev("/device:GPU:0", "XLA Ops")
    assert _prefer_device([host]) == [host]
    assert _prefer_device([host, stream]) == [stream]
    assert _prefer_device([host, stream, ops]) == [ops]
