"""What a start-up prints, in order, at the default log level; flags that decide what it compiles."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys

from support.cli_errors import assert_one_line_error

from jaxllm.cli import main

# The native kernels build on threads started before the weights load: their lines come in any
# order with the loading's, but before the weights go to the device (the layout needs them).
KERNELS = r"native CPU kernel linear\.cc: (reusing|compiling)"

STEPS = [r"loading weights of ", r"loaded \d+ tensors, [\d.]+ MiB, in [\d.]+ s",
         r"tokenizer: \d+ tokens, in [\d.]+ s", r"weights on the device: [\d.]+ MiB", r"KV cache: \d+ blocks .*--kv-cache-memory-bytes sets it",
         r"(compiling \d+ programs \(\d+ from the cache\)|loading \d+ programs from the cache)",
         r"\d+ programs ready in [\d.]+ s: \d+ compiled, \d+ loaded from the cache"]


def assert_in_order(log: str) -> None:
    at = 0
    for step in STEPS:
        m = re.compile(step).search(log, at)
        assert m is not None, f"{step!r} missing after position {at} in:\n{log}"
        at = m.end()
    kernels, device = re.search(KERNELS, log), re.search(STEPS[3], log)
    assert kernels is not None and kernels.start() < device.start(), log


# The shared engines' sizing (support/engines.py SMALL_ENGINE, the session's tiny_llm): the
# subprocesses' programs are the ones the run's compile cache already holds, not new ones.
SIZING = ["--max-num-seqs", "4", "--max-num-batched-tokens", "32", "--max-model-len", "256", "--dtype", "float32"]


def test_generate_says_what_it_does_in_order(tiny_llama):
    r = subprocess.run([sys.executable, "-m", "jaxllm.cli", "generate", "Hello", "--model", tiny_llama,
                        "--max-tokens", "3", *SIZING],
                       capture_output=True, text=True, timeout=600,
                       env={k: v for k, v in os.environ.items() if k != "JAXLLM_LOG_LEVEL"})
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.startswith("Hello") and len(r.stdout.strip()) > len("Hello"), r.stdout
    log = r.stderr.replace("\r", "\n")
    assert_in_order(log)
    # One-shot: the prompt's bucket and the decode bucket (and their samplers), not all 9 programs.
    ready = [int(n) for n in re.findall(r"(\d+) programs ready", log)]
    assert 0 < sum(ready) <= 4, log


LLM_SCRIPT = """
import logging, sys
from jaxllm import LLM, SamplingParams
if sys.argv[2] == "configured":
    logging.basicConfig(level=logging.WARNING)   # the script's own choice wins
llm = LLM(sys.argv[1], max_num_seqs=4, max_num_batched_tokens=32, max_model_len=256, dtype="float32")
print(llm.generate(["Hello"], SamplingParams(max_tokens=3))[0].outputs[0].text != "")
"""


def test_llm_in_a_script_logs_the_same_phases_with_timestamps_and_no_bars(tiny_llama):
    # stderr is a pipe here, as in a log file: one line per phase, no bar, no cursor codes.
    run = lambda how: subprocess.run([sys.executable, "-c", LLM_SCRIPT, tiny_llama, how],  # noqa: E731
                                     capture_output=True, text=True, timeout=600)
    r = run("default")
    assert r.returncode == 0 and r.stdout.strip() == "True", r.stderr[-2000:]
    assert "\r" not in r.stderr and "\x1b" not in r.stderr and "Processed prompts" not in r.stderr, r.stderr
    assert_in_order(r.stderr)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert all(re.match(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d (INFO|WARNING) jaxllm", ln) for ln in lines), r.stderr
    # A script that set up logging itself gets what it asked for: no INFO lines from jaxllm.
    r = run("configured")
    assert r.returncode == 0 and "INFO" not in r.stderr and "loading weights" not in r.stderr, r.stderr


def test_serve_refuses_on_demand_compilation_before_loading(capsys, caplog):
    # In this process (the refusal comes before JAX starts anything): stderr holds the error,
    # the log records would hold the start-up's phases had it begun loading.
    with caplog.at_level(logging.INFO, logger="jaxllm"):
        rc = main(["serve", "--precompile", "on-demand"])
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert_one_line_error(rc, lines, "--precompile on-demand is for one-shot commands")
    assert not any("loading weights" in r.getMessage() for r in caplog.records), caplog.text


def test_a_missing_package_is_named_with_how_to_install_it():
    """A runtime install without ``gguf``: the built-in model's load names it, one line, exit 2."""
    prelude = ("import sys; sys.modules['gguf'] = None; "
               "[sys.modules.__setitem__(m, None) for m in list(sys.modules) if m.startswith('gguf.')]; "
               "from jaxllm.cli import main; sys.exit(main(sys.argv[1:]))")
    r = subprocess.run([sys.executable, "-c", prelude, "generate", "hi"], capture_output=True, text=True,
                       timeout=300)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert_one_line_error(r.returncode, lines, "'gguf'", "pip install gguf")
