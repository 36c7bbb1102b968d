"""Engine settings the suite shares: small buckets keep compile time low."""

from __future__ import annotations

# Every test engine uses these unless it says otherwise (strict compile guard: a step that
# traces or compiles after warm-up fails the test that caused it).
SMALL_ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=256, dtype="float32",
                    strict_compile_guard=True, show_progress=False, precompile="all")

# For a test about what its engine computes, not about warm-up: only the buckets its steps run
# are compiled (on demand, as the offline ``LLM`` does by default); the strict guard still
# fails a step that traces or compiles a bucket already made.  Every-bucket warm-up has its own
# tests (tests/runner/test_compile.py) and every server compiles all buckets.
ONE_SHOT_ENGINE = {**SMALL_ENGINE, "precompile": "auto"}

# The built-in model's 30 unrolled layers make each program slow to compile: its offline engines
# compile the buckets their tests run (the offline default, strict guard on).  Its every-bucket
# warm-up as served is tests/bench/test_serve_client.py's server.
BUILTIN_ENGINE = {**ONE_SHOT_ENGINE, "max_num_batched_tokens": 64}
