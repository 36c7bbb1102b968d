#!/usr/bin/env bash
# Runs bench/device_check.py on the lent GPU machine (or here with --smoke).
#
# Via the device tool (after scripts/device_wheels.sh here, which builds .device_wheels/):
#     command:   bench/device_check.sh            (extra arguments go to device_check.py,
#                                                 e.g. --budget-s 300, --only e2e_llama1b)
#     carry:     [".device_wheels"]
#     timeout_s: 540
# Results: $OUT/device_check.json, $OUT/device_check.md, $OUT/device_check_pytest.log.
# Here: bench/device_check.sh --smoke   (CPU, tiny shapes, interpret-mode kernels).
#
# What it does: installs, from .device_wheels/ and with no index, only the packages of
# .device_wheels/manifest.txt that this Python cannot import (into a scratch --target folder,
# put on PYTHONPATH; the machine's own packages are left alone), puts the repository on
# PYTHONPATH (jaxllm is not pip-installed there), and runs the check, passing on its exit
# status (0 ok, 1 something failed, 2 refused: no GPU).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
if [[ -n "${PYTHON:-}" ]]; then
    PY=$PYTHON
elif [[ -x "$ROOT/.venv/bin/python" ]]; then
    PY=$ROOT/.venv/bin/python            # a development machine
else
    PY=python3                           # the GPU machine: the image's Python with JAX
fi
WHEELS=${DEVICE_WHEELS_DIR:-$ROOT/.device_wheels}
SITE=${DEVICE_SITE_DIR:-${TMPDIR:-/tmp}/jaxllm_device_site}
export PYTHONUNBUFFERED=1

if [[ -f "$WHEELS/manifest.txt" ]]; then
    missing=$("$PY" - "$WHEELS/manifest.txt" <<'EOF'
import importlib.util
import sys
for line in open(sys.argv[1]):
    parts = line.split()
    if len(parts) >= 2 and importlib.util.find_spec(parts[0]) is None:
        print(parts[1])     # unpinned: pip takes the newest wheel in the folder this Python can use
EOF
)
    if [[ -n "$missing" ]]; then
        echo "device_check.sh: installing from $WHEELS:" $missing >&2
        # shellcheck disable=SC2086
        if "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
                --find-links "$WHEELS" --target "$SITE" $missing; then
            export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
        else
            echo "device_check.sh: WARNING: installing from $WHEELS failed; the check records what cannot import" >&2
        fi
    else
        echo "device_check.sh: every package of $WHEELS/manifest.txt is already importable" >&2
    fi
else
    echo "device_check.sh: no $WHEELS/manifest.txt (scripts/device_wheels.sh builds it); using the installed packages" >&2
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
"$PY" "$ROOT/bench/device_check.py" "$@"
exit $?
