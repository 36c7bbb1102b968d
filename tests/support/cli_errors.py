"""Runs the ``jaxllm`` command line in a subprocess and checks its error contract: exit status 2
and one line naming the problem, never a traceback."""

from __future__ import annotations

import subprocess
import sys


def cli(*args, timeout=600):
    r = subprocess.run([sys.executable, "-m", "jaxllm.cli", *args], capture_output=True, text=True, timeout=timeout)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip() and "compiling" not in ln]
    return r.returncode, lines, r.stdout


def assert_one_line_error(rc, lines, *needles):
    assert rc == 2, lines
    assert not any("Traceback" in ln for ln in lines), "\n".join(lines)
    errors = [ln for ln in lines if ": error: " in ln]
    assert len(errors) == 1, lines
    for n in needles:
        assert n in errors[0], errors[0]
