#!/usr/bin/env bash
# The newcomer's path, as CI tries it: a fresh venv with the runtime install only (no test
# extra, so no torch), an empty cache folder, then `jaxllm generate` on the built-in model.
# Fails unless a completion is printed.  Usage: scripts/first_run.sh [WORK_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
work=${1:-$(mktemp -d)}
mkdir -p "$work"
JAXLLM_VENV="$work/venv" scripts/setup.sh
if "$work/venv/bin/python" -c "import torch" 2>/dev/null; then
  echo "first run: torch is installed in the runtime venv; it must not be needed" >&2
  exit 1
fi
prompt="The capital of France is"
start=$(date +%s.%N)
out=$(env -u JAXLLM_CACHE_DIR XDG_CACHE_HOME="$work/cache" \
      "$work/venv/bin/jaxllm" generate "$prompt" --max-tokens 8)
end=$(date +%s.%N)
echo "$out"
completion=${out#"$prompt"}
if [ "$out" = "$completion" ] || [ -z "${completion//[[:space:]]/}" ]; then
  echo "first run: jaxllm generate printed no completion" >&2
  exit 1
fi
python3 -c "print(f'first run: jaxllm generate printed a completion in {$end - $start:.1f} s (cold cache)')"
