"""Two local processes forming one JAX cluster generate the same tokens as one process.

Both run multihost_probe.py: one engine, tensor parallel over the cluster's two CPU
devices (one per process), joined through ``jax.distributed`` with a coordinator on a free
local port.  Host 0 schedules and generates; host 1 follows its steps.  The reference is
the suite's single-process, single-device engine on the same checkpoint and prompt.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess

from jaxllm import SamplingParams
from support.multihost_probe import PROMPT
from support.probes import probe_command, probe_env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_generate_what_one_does(tiny_checkpoints, tiny_llm, tmp_path):
    path = tiny_checkpoints["llama_gqa_untied"]
    port, out = _free_port(), str(tmp_path / "host0.json")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}   # one CPU device per process
    procs = [subprocess.Popen(probe_command("multihost_probe", path, port, i, out), env=probe_env(env),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in (0, 1)]
    try:
        logs = [p.communicate(timeout=600)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    for i, p in enumerate(procs):
        assert p.returncode == 0, f"host {i} exited {p.returncode}:\n{logs[i][-4000:]}"
    assert "host 1: released" in logs[1], logs[1][-2000:]
    with open(out) as f:
        got = json.load(f)
    assert got["devices"] == 2
    one = tiny_llm.generate([{"prompt_token_ids": PROMPT}], SamplingParams(temperature=0, max_tokens=32, ignore_eos=True),
                            use_tqdm=False)[0].outputs[0].token_ids
    assert got["tokens"] == list(one)
