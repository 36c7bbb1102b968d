#!/usr/bin/env bash
# First contact, measured: a fresh runtime-only venv (scripts/setup.sh), then with empty
# cache folders `jaxllm generate` twice (process start to the printed completion) and
# `jaxllm serve` twice (process start to /health = 200), with the idle server's resident
# memory.  With LLAMA_SERVER=/path/to/llama-server, the peer on the same GGUF and 2 threads,
# twice, after each jaxllm serve start.  Results: docs/BENCHMARKS.md ("Start-up").
#   bench/startup.sh [WORK_DIR] [PORT]
set -euo pipefail
cd "$(dirname "$0")/.."
work=${1:-$(mktemp -d)}
port=${2:-8765}
mkdir -p "$work"
now() { python3 -c 'import time; print(time.time())'; }
since() { python3 -c "import time; print(f'{time.time() - $1:.1f}')"; }
rss() { ps -o rss= -p "$1" | awk '{printf "%.0f MB", $1 / 1024}'; }

# serve LABEL LOG COMMAND...: start a server, time it to healthy, report its memory, stop it.
serve() {
  local label=$1 log=$2 t pid
  shift 2
  t=$(now)
  "$@" > "$log" 2>&1 &
  pid=$!
  until [ "$(curl -s -o /dev/null -w '%{http_code}' --max-time 1 "http://127.0.0.1:$port/health" || true)" = 200 ]; do
    kill -0 "$pid" 2>/dev/null || { echo "$label: the server exited:"; tail -5 "$log"; exit 1; }
    sleep 0.2
  done
  echo "$label: start to healthy $(since "$t") s"
  tr '\r' '\n' < "$log" | grep -E "KV cache:|programs ready" | sed 's/^/    /' || true
  sleep 5
  echo "    idle resident memory: $(rss "$pid")"
  curl -s "http://127.0.0.1:$port/v1/completions" -H 'Content-Type: application/json' \
       -d '{"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}' > /dev/null
  echo "    after one request: $(rss "$pid")"
  kill -INT "$pid"
  wait "$pid" || true
}

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

gguf=$("$work/venv/bin/python" -c "from jaxllm.models.builtin import builtin_gguf_path; print(builtin_gguf_path())")
for run in first second; do
  serve "jaxllm serve, $run start" "$work/serve-$run.log" \
      env -u JAXLLM_CACHE_DIR XDG_CACHE_HOME="$work/cache-serve" "$jaxllm" serve --port "$port"
  if [ -n "${LLAMA_SERVER:-}" ]; then
    serve "llama-server (same GGUF, -t 2), $run start" "$work/llama-server-$run.log" \
        "$LLAMA_SERVER" -m "$gguf" -t 2 --port "$port"
  fi
done
