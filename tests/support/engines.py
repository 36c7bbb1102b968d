"""Engine settings the suite shares: small buckets keep compile time low."""

from __future__ import annotations

# Every test engine uses these unless it says otherwise (strict compile guard: a step that
# traces or compiles after warm-up fails the test that caused it).
SMALL_ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=256, dtype="float32",
                    strict_compile_guard=True, show_progress=False, precompile="all")

# The built-in model's 30 unrolled layers make each program slow to compile: its offline engines
# compile the buckets their tests run (the offline default, strict guard on).  Its every-bucket
# warm-up as served is tests/bench/test_serve_client.py's server.
BUILTIN_ENGINE = {**SMALL_ENGINE, "max_num_batched_tokens": 64, "precompile": "auto"}
