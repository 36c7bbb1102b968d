"""Times the native CPU paged attention alone on one prefill chunk of the built-in model's
shape (9 query heads over 3 KV heads of 64, float32 cache): a prompt of N tokens from
nothing, one layer, medians of a few runs.  ``python -m bench.prefill_attention 512 4096``.
Where the CPU has AVX-512, its 16-lane path and the AVX2 one are both timed, alternated.
"""

from __future__ import annotations

import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.cpu.attention import paged_attention_native
from jaxllm.layers.attention import AttentionMetadata


def time_prefill(n: int, *, Hq: int = 9, Hkv: int = 3, D: int = 64, BS: int = 16, reps: int = 5) -> float:
    """Median seconds of one layer's attention over an n-token prompt."""
    rng = np.random.default_rng(0)
    nb = -(-n // BS)
    tables = jnp.asarray(rng.permutation(np.arange(1, nb + 1)).reshape(1, nb).astype(np.int32))
    k = jnp.asarray(rng.standard_normal((nb + 1, BS, Hkv, D)).astype(np.float32))
    v = jnp.asarray(rng.standard_normal((nb + 1, BS, Hkv, D)).astype(np.float32))
    q = jnp.asarray(rng.standard_normal((n, Hq, D)).astype(np.float32))
    pos = jnp.arange(n, dtype=jnp.int32)
    md = AttentionMetadata(positions=pos, slot_mapping=pos, token_seq=jnp.zeros(n, jnp.int32), block_tables=tables,
                           seq_lens=jnp.asarray([n], jnp.int32), query_start_loc=jnp.asarray([0, n], jnp.int32))
    f = jax.jit(lambda q, k, v: paged_attention_native(q, (k, v), None, md, scale=D ** -0.5))
    f(q, k, v).block_until_ready()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        f(q, k, v).block_until_ready()
        times.append(time.perf_counter() - t)
    return float(np.median(times))


if __name__ == "__main__":
    from jaxllm.cpu import native
    wide = native.set_attention_avx512(True)
    paths = [("avx2", False), ("avx512", True)] if wide else [("avx2", False)]
    for arg in sys.argv[1:] or ["512", "4096"]:
        n = int(arg)
        flop = 4 * 9 * 64 * n * (n + 1) / 2   # q.k and p.v over the causal triangle
        got: dict[str, list[float]] = {name: [] for name, _ in paths}
        for r in range(3):   # arms alternated, medians
            for name, on in (paths if r % 2 == 0 else paths[::-1]):
                native.set_attention_avx512(on)
                got[name].append(time_prefill(n, reps=3))
        for name, ts in got.items():
            s = float(np.median(ts))
            print(f"prefill {n} {name}: {s * 1e3:.1f} ms/layer, {flop / s / 1e9:.1f} GFLOP/s")
    native.set_attention_avx512(wide)
