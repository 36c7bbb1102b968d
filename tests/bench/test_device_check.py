"""bench/device_check.py, the one prepared GPU check, tested here without a GPU.

The smoke mode runs every section with tiny shapes and interpret-mode kernels, on the kernel
tests' own inputs and the suite's tiny checkpoint; the JSON must hold every section with a
result (rows) or a recorded skip.  Without --smoke the script must
refuse a CPU backend with a non-zero exit and a message, and an exhausted budget must turn
every section into "skipped: time budget" rather than dropping it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys

import jax
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "bench", "device_check.py")
SECTIONS = ("pytest", "correctness", "attention", "sampler", "e2e_builtin", "e2e_llama1b", "large_cache")


def run(args, timeout, **env):
    e = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT, **env)
    e.pop("OUT", None)
    return subprocess.run([sys.executable, SCRIPT, *args], cwd=ROOT, env=e, capture_output=True, text=True,
                          timeout=timeout)


def run_here(args, monkeypatch, capsys):
    """The script's ``main`` in this process, on a CPU backend: the refusal and the exhausted
    budget run nothing, so a process of their own would be mostly its JAX start-up.  The
    SIGTERM handler the script installs for its own process is not installed here."""
    spec = importlib.util.spec_from_file_location("_device_check_script", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    monkeypatch.delenv("OUT", raising=False)
    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
    monkeypatch.setattr(signal, "signal", lambda *a: None)
    rc = script.main(args)
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("device_check_smoke")
    # ~30 s on a quiet 2-core machine; the limit leaves a loaded CI machine room, below
    # pytest's own 600 s (pyproject.toml), so that a hang fails here, as the smoke run's timeout.
    proc = run(["--smoke", "--out", str(out)], timeout=540)
    with open(out / "device_check.json") as f:
        data = json.load(f)
    return proc, data, out


def test_smoke_run_covers_every_section(smoke):
    proc, data, out = smoke
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert data["mode"] == "smoke" and data["result"] == "ok"
    assert data["device"]["backend"] == "cpu" and data["device"]["jax"]
    for name in SECTIONS:
        sec = data["sections"][name]
        assert sec["status"] in ("ok", "partial") or sec["status"].startswith("skipped"), (name, sec)
        if sec["status"].startswith("skipped"):
            assert sec.get("reason"), (name, sec)
        else:
            assert sec["rows"], name
            for row in sec["rows"]:
                assert row["status"] == "ok" or row["status"].startswith("skipped") and row.get("reason"), (name, row)
    # The measurements themselves, section by section.
    secs = data["sections"]
    assert secs["pytest"]["counts"]["passed"] >= 1 and secs["pytest"]["counts"]["failed"] == 0
    corr = {r["name"]: r for r in secs["correctness"]["rows"]}
    assert any("f32" in n and r["max_rel_err"] <= 1e-5 and r["kv_pages_identical"] for n, r in corr.items())
    assert any(r.get("mismatches_vs_oracle") == 0 and "gumbel" in n for n, r in corr.items())
    # The sampler rows are the kernel tests' sampler batches (8 rows each), against the oracle too.
    assert any(r.get("mismatches_vs_xla") == 0 and r.get("mismatches_vs_oracle") == 0 and r["S"] % 8 == 0
               for n, r in corr.items() if n.startswith("sample("))
    for r in secs["attention"]["rows"]:
        assert r["pallas_ms"] > 0 and r["xla_ms"] > 0 and r["floor_bytes"] > 0
        assert r["pallas_pct_peak"] is None          # no peak bandwidth for a CPU: "n/a"
    assert all(r["tokens_identical"] for r in secs["sampler"]["rows"])
    [large] = secs["large_cache"]["rows"]
    assert large["kv_pages_identical"] and large["max_rel_err"] <= large["tol"]
    for key in ("e2e_builtin", "e2e_llama1b"):
        sec = secs[key]
        # The test suite's tiny checkpoint, timed without prefix-cache hits (every repeat sends
        # the same prompts).
        assert "tests/support/tiny_models.py" in sec["weights"] and sec["engine_args"]["enable_prefix_caching"] is False
        assert [(e["backend"], e["resolved_attention"], e["resolved_sampler"]) for e in sec["engines"]] == [
            ("pallas", "pallas", "pallas"), ("xla", "xla", "xla")]
        assert all(e["memory_growth_bytes"] <= e["memory_growth_limit"] for e in sec["engines"])
        # Every planned batch size (the smoke plan has one: one step bucket per engine) has its row.
        assert data["plan"]["batches"] and [(t["batch"], t["pallas_tok_s"] > 0, t["xla_tok_s"] > 0)
                                            for t in sec["table"]] == [(b, True, True) for b in data["plan"]["batches"]]
    md = (out / "device_check.md").read_text()
    assert "| batch | pallas tok/s | xla tok/s | pallas / xla |" in md and "## Ragged paged attention" in md
    assert "| batch | pallas tok/s | xla tok/s | pallas / xla |" in proc.stdout
    assert (out / "device_check_pytest.log").exists()


def test_refuses_without_a_gpu(tmp_path, monkeypatch, capsys):
    rc, _, err = run_here(["--out", str(tmp_path)], monkeypatch, capsys)
    assert rc == 2
    assert "not 'gpu'" in err and "--smoke" in err
    data = json.loads((tmp_path / "device_check.json").read_text())
    assert data["result"].startswith("refused")


def test_exhausted_budget_skips_every_section_by_name(tmp_path, monkeypatch, capsys):
    rc, _, err = run_here(["--smoke", "--budget-s", "0", "--out", str(tmp_path)], monkeypatch, capsys)
    assert rc == 0, err[-3000:]
    data = json.loads((tmp_path / "device_check.json").read_text())
    for name in SECTIONS:
        sec = data["sections"][name]
        assert sec["status"] == "skipped: time budget" and "budget" in sec["reason"], (name, sec)
    assert "skipped: time budget" in (tmp_path / "device_check.md").read_text()
