"""Cold start, before/after: ``jaxllm generate`` (process start to the printed completion) and
``jaxllm serve`` (process start to ``/health`` = 200, then its resident memory) from empty cache
folders (a fresh ``XDG_CACHE_HOME`` and ``JAXLLM_CACHE_DIR`` per run), for two source trees run
with the same venv, alternated run by run so that drift in the machine's load hits both; the
1-minute load average is printed beside each number (the machine may be shared).  With
``--warm``, each serve is started a second time on the cache the first one filled.  With
``--beside-busy``, one CPU-bound process (a pure-Python loop, one core) runs beside every start,
as a build or another service would on a developer's machine.
Results: docs/BENCHMARKS.md ("Start-up").

    python bench/cold_start.py --tree before=/path/to/old --tree after=. [--runs 3] [--warm] [--beside-busy]
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

PROMPT = "The capital of France is"


def load() -> float:
    with open("/proc/loadavg") as f:
        return float(f.read().split()[0])


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def env_for(tree: str, cache: str) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=os.path.abspath(tree), XDG_CACHE_HOME=os.path.join(cache, "xdg"),
               JAXLLM_CACHE_DIR=os.path.join(cache, "jaxllm"))
    env.pop("HF_ENDPOINT", None)
    return env


def jaxllm_cmd() -> list[str]:
    # the venv's interpreter with the tree first on PYTHONPATH: the same packages, the tree's code
    return [sys.executable, "-c", "import sys; from jaxllm.cli import main; sys.argv[0] = 'jaxllm'; sys.exit(main())"]


def generate(tree: str, cache: str, log: str) -> float:
    t0 = time.monotonic()
    with open(log, "w") as err:
        p = subprocess.run(jaxllm_cmd() + ["generate", PROMPT, "--max-tokens", "16"], env=env_for(tree, cache),
                           stdout=subprocess.PIPE, stderr=err, text=True)
    if p.returncode != 0:
        raise SystemExit(f"generate failed in {tree}: see {log}")
    return time.monotonic() - t0


def serve(tree: str, cache: str, log: str, port: int) -> tuple[float, float]:
    t0 = time.monotonic()
    with open(log, "w") as out:
        p = subprocess.Popen(jaxllm_cmd() + ["serve", "--port", str(port)], env=env_for(tree, cache),
                             stdout=out, stderr=subprocess.STDOUT)
    try:
        while True:
            if p.poll() is not None:
                raise SystemExit(f"serve exited in {tree}: see {log}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            time.sleep(0.2)
        healthy = time.monotonic() - t0
        time.sleep(5)
        return healthy, rss_mb(p.pid)
    finally:
        p.send_signal(signal.SIGINT)
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


BUSY = "while True: pass"
"""The process ``--beside-busy`` keeps running: one core, all the time, no memory to speak of."""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tree", action="append", required=True, help="NAME=PATH of a source tree")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--port", type=int, default=8791)
    ap.add_argument("--warm", action="store_true", help="start each serve again on the cache it filled")
    ap.add_argument("--beside-busy", action="store_true",
                    help="run one CPU-bound process beside every start (it is stopped at the end)")
    ap.add_argument("--logs", default=None, help="folder for the runs' logs (default: a temporary one)")
    args = ap.parse_args()
    trees = [t.split("=", 1) for t in args.tree]
    logs = args.logs or tempfile.mkdtemp(prefix="cold_start-")
    os.makedirs(logs, exist_ok=True)
    rows: dict[tuple[str, str], list[tuple[float, float]]] = {}
    busy = subprocess.Popen([sys.executable, "-c", BUSY]) if args.beside_busy else None
    try:
        measure(args, trees, logs, rows)
    finally:
        if busy is not None:
            busy.kill()
            busy.wait()
    print(f"\nlogs: {logs}" + (" (one CPU-bound process ran beside every start)" if busy else ""))
    print("\n| arm | measure | median | runs (load average at start) |\n|---|---|---|---|")
    for (name, what), vals in rows.items():
        med = statistics.median(v for v, _ in vals)
        each = ", ".join(f"{v:.1f} ({ld:.1f})" for v, ld in vals)
        print(f"| {name} | {what} | {med:.1f} | {each} |")


def measure(args, trees, logs: str, rows: dict) -> None:
    """Each run: each tree's cold generate, then its cold serve (and warm serve), alternated."""
    for run in range(args.runs):
        for name, tree in trees:
            for what in ("generate", "serve"):
                cache = tempfile.mkdtemp(prefix="cold-cache-")
                before = load()
                log = os.path.join(logs, f"{name}-{what}-{run}.log")
                if what == "generate":
                    s = generate(tree, cache, log)
                    extra = ""
                else:
                    s, mb = serve(tree, cache, log, args.port)
                    extra = f", idle RSS {mb:,.0f} MB"
                    if args.warm:
                        w_before = load()
                        w, w_mb = serve(tree, cache, log.replace(".log", "-warm.log"), args.port)
                        rows.setdefault((name, "serve warm"), []).append((w, w_before))
                        rows.setdefault((name, "serve warm RSS MB"), []).append((w_mb, w_before))
                        extra += f"; warm {w:.1f} s (load {w_before:.2f}), RSS {w_mb:,.0f} MB"
                    rows.setdefault((name, "serve RSS MB"), []).append((mb, before))
                rows.setdefault((name, what), []).append((s, before))
                print(f"run {run + 1} {name} {what} cold: {s:.1f} s (load {before:.2f}){extra}", flush=True)
                shutil.rmtree(cache, ignore_errors=True)


if __name__ == "__main__":
    main()
