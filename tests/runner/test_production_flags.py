"""The suite compiles with XLA flags of its own (support.probes.TEST_XLA_FLAGS: the LLVM back end
at -O0 and the classic fusion emitter, to compile faster); users' processes compile with XLA's
defaults.  This compiles the tiny Llama's steps once with the defaults, in a fresh process and
a fresh program cache, and holds them to what the suite's engine computes: the same greedy
tokens, and every token's and prompt token's logprob within float32 rounding."""

from __future__ import annotations

import json
import subprocess

import numpy as np
from support.probes import TEST_XLA_FLAGS, probe_command, production_env
from support.production_flags import PROMPTS, run


def test_xla_defaults_compute_what_the_suites_flags_compute(tiny_llm, tiny_llama, tmp_path):
    out = tmp_path / "probe.json"
    r = subprocess.run(probe_command("production_flags_probe", tiny_llama, tmp_path / "cache", out),
                       env=production_env(), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    got = json.loads(out.read_text())
    assert not any(f.split("=", 1)[0] in got["xla_flags"] for f in TEST_XLA_FLAGS), got["xla_flags"]
    ref = run(tiny_llm, PROMPTS)
    assert got["tokens"] == ref["tokens"]
    for key in ("logprobs", "prompt_logprobs"):
        for g, w in zip(got[key], ref[key]):
            np.testing.assert_allclose(g, w, rtol=0, atol=1e-5, err_msg=key)
