#!/usr/bin/env bash
# Sets up (scripts/setup.sh test) and runs the whole test suite.  Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh test
. .venv/bin/activate
exec python -m pytest "$@"
