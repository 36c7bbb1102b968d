#!/usr/bin/env bash
# First contact, measured: a fresh runtime-only venv (scripts/setup.sh), then with empty
# cache folders `jaxllm generate` twice and `jaxllm serve` twice (start to /health = 200),
# and the idle server's resident memory.  Results: docs/BENCHMARKS.md ("Start-up").
#   bench/startup.sh [WORK_DIR] [PORT]
set -euo pipefail
cd "$(dirname "$0")/.."
work=${1:-$(mktemp -d)}
port=${2:-8765}
mkdir -p "$work"
now() { python3 -c 'import time; print(time.time())'; }
since() { python3 -c "import time; print(f'{time.time() - $1:.1f}')"; }

t=$(now)
JAXLLM_VENV="$work/venv" scripts/setup.sh > "$work/setup.log" 2>&1
echo "scripts/setup.sh (fresh venv): $(since "$t") s"
jaxllm=$work/venv/bin/jaxllm

for run in first second; do
  env -u JAXLLM_CACHE_DIR XDG_CACHE_HOME="$work/cache-generate" python3 bench/time_to_text.py \
      "jaxllm generate, $run run" "$work/generate-$run.log" -- \
      "$jaxllm" generate "The capital of France is" --max-tokens 16
  tr '\r' '\n' < "$work/generate-$run.log" | grep -E "programs ready" | sed 's/^/    /'
done

for run in first second; do
  t=$(now)
  env -u JAXLLM_CACHE_DIR XDG_CACHE_HOME="$work/cache-serve" \
      "$jaxllm" serve --port "$port" > "$work/serve-$run.log" 2>&1 &
  pid=$!
  until [ "$(curl -s -o /dev/null -w '%{http_code}' --max-time 1 "http://127.0.0.1:$port/health" || true)" = 200 ]; do
    kill -0 "$pid" 2>/dev/null || { echo "the server exited:"; tail -5 "$work/serve-$run.log"; exit 1; }
    sleep 0.2
  done
  echo "jaxllm serve, $run start to healthy: $(since "$t") s"
  tr '\r' '\n' < "$work/serve-$run.log" | grep -E "KV cache:|programs ready" | sed 's/^/    /'
  sleep 5
  echo "    idle resident memory: $(ps -o rss= -p "$pid" | awk '{printf "%.0f MB", $1 / 1024}')"
  curl -s "http://127.0.0.1:$port/v1/completions" -H 'Content-Type: application/json' \
       -d '{"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}' > /dev/null
  echo "    after one request: $(ps -o rss= -p "$pid" | awk '{printf "%.0f MB", $1 / 1024}')"
  kill -INT "$pid"
  wait "$pid" || true
done
