#!/usr/bin/env bash
# Sets up (scripts/setup.sh test) and runs the whole test suite.  Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh test
. .venv/bin/activate
# setup.sh built the native CPU kernels into the user's cache; the suite's own cache
# (tests/conftest.py: .jaxllm_cache/tests) starts with those libraries (keyed by source, flags
# and compiler, sealed; a damaged one is rebuilt) instead of compiling them again: ~45 CPU-s of g++.
if [ -z "${JAXLLM_CACHE_DIR:-}" ]; then
  mkdir -p .jaxllm_cache/tests/kernels
  cp -n "${XDG_CACHE_HOME:-$HOME/.cache}"/jaxllm/kernels/libjaxllm_*.so* .jaxllm_cache/tests/kernels/ 2>/dev/null || true
fi
# Two workers, whole files per worker (module fixtures such as a shared engine stay in one
# process): most tests wait on single-threaded XLA compiles, so two cores run two at once.
# JAXLLM_TEST_WORKERS=0 runs in one process.  The 40 slowest items are listed at the end: the
# suite's time is budgeted (20 minutes on a quiet 2-core machine).
# A crashed worker ends the run (--max-worker-restart=0): pytest-xdist 3.8 can wait forever
# after replacing one under --dist loadfile (pytest-dev/pytest-xdist#784, #1378).
# Files go out heaviest first (--no-loadscope-reorder keeps the order tests/conftest.py sets,
# tests/support/schedule.py), so no long file is left for the end while the other worker idles.
exec python -m pytest -n "${JAXLLM_TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder --max-worker-restart=0 \
  --durations=40 "$@"
