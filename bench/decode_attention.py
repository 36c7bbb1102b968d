"""The native CPU paged attention of this tree against the same kernel built from another git
revision, alternated in one process, at batch-1 decode: one token attending over a context of
N positions, the built-in model's shape (9 query heads over 3 KV heads of 64, float32 cache,
blocks of 16), 30 layers called in turn on 30 distinct caches (each layer's K/V is cold, as
in a decode step, where the weights stream between two layers' attention).

    python bench/decode_attention.py                      # this tree vs main, N = 64 512 2048
    python bench/decode_attention.py --base HEAD~1 --contexts 256 1024 4096 --reps 21

The base revision's attention.cc and headers (``git show REV:...``) are compiled into a
temporary library and registered as ``jaxllm_paged_attention_f32_base``.  The outputs of
both kernels are compared (the max relative difference is printed: spans merged at
different points change the last bits, nothing more).  A cell is the median of ``--reps``
samples of the 30-layer chain, the two kernels alternating sample by sample; GB/s counts
the K/V bytes the token reads.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench import revision_kernel  # noqa: E402
from jaxllm.cpu import native  # noqa: E402
from jaxllm.cpu.attention import paged_attention_native  # noqa: E402
from jaxllm.layers.attention import AttentionMetadata  # noqa: E402

HQ, HKV, D, BS, LAYERS = 9, 3, 64, 16, 30
BASE_TARGET = "jaxllm_paged_attention_f32_base"
_HEADERS = ["parallel.h", "simd.h"]


def build_base(rev: str) -> ctypes.CDLL:
    """Compiles ``rev``'s attention.cc into a temporary library and registers its float32
    handler as BASE_TARGET; the library (kept loaded by the caller)."""
    lib = revision_kernel.build(rev, "attention.cc", _HEADERS, native._FLAGS)
    jax.ffi.register_ffi_target(BASE_TARGET, jax.ffi.pycapsule(lib.JaxllmPagedAttentionF32), platform="cpu")
    return lib


def _base_call(q, k, v, md, layer, scale):
    """The base kernel on the stacked cache at ``layer``, with the operands the engine passes."""
    out = jax.ShapeDtypeStruct(q.shape, jnp.float32)
    return jax.ffi.ffi_call(BASE_TARGET, out)(
        q, k, v, md.block_tables, md.token_seq, md.positions, jnp.asarray(layer, jnp.int32).reshape(()),
        jnp.zeros((0,), jnp.float32), scale=np.float32(scale), sliding_window=np.int64(0), soft_cap=np.float32(0))


def chain(base: bool, md):
    """A jitted fn(q, k, v) running the 30 layers' attention in turn (each q depends on the
    previous layer's output, so XLA cannot run them side by side)."""
    def run(q, k, v):
        for layer in range(LAYERS):
            o = _base_call(q, k, v, md, layer, D ** -0.5) if base else \
                paged_attention_native(q, (k, v), layer, md, scale=D ** -0.5)
            q = q + 1e-3 * o
        return q
    return jax.jit(run)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", default="main", help="the git revision to compare against (default main)")
    p.add_argument("--contexts", type=int, nargs="+", default=[64, 512, 2048])
    p.add_argument("--reps", type=int, default=15)
    args = p.parse_args(argv)
    if min(args.contexts) < 1:
        p.error("--contexts must be positive")
    if not native.available():
        raise SystemExit("the native CPU kernels are unavailable on this machine")
    _lib = build_base(args.base)   # noqa: F841  (kept loaded)
    rng = np.random.default_rng(0)
    print(f"attention.cc: base = {args.base}, new = this tree; batch-1 decode, {HQ} query heads over {HKV} KV heads "
          f"of {D}, float32 cache; {LAYERS} layers on distinct caches; median of {args.reps} alternated samples")
    print("| context | base us a layer | new us a layer | base GB/s | new GB/s | speed-up | max rel. diff |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for n in args.contexts:
        nb = -(-n // BS)
        # The sequence's blocks scattered over the cache, as an engine's allocator leaves them.
        tables = jnp.asarray(rng.permutation(np.arange(1, nb + 1)).reshape(1, nb).astype(np.int32))
        k = jnp.asarray(rng.standard_normal((LAYERS, nb + 1, BS, HKV, D)).astype(np.float32))
        v = jnp.asarray(rng.standard_normal((LAYERS, nb + 1, BS, HKV, D)).astype(np.float32))
        q = jnp.asarray(rng.standard_normal((1, HQ, D)).astype(np.float32))
        pos = jnp.asarray([n - 1], jnp.int32)
        md = AttentionMetadata(positions=pos, slot_mapping=pos, token_seq=jnp.zeros(1, jnp.int32),
                               block_tables=tables, seq_lens=jnp.asarray([n], jnp.int32),
                               query_start_loc=jnp.asarray([0, 1], jnp.int32))
        fns = {"base": chain(True, md), "new": chain(False, md)}
        outs = {name: np.asarray(f(q, k, v)) for name, f in fns.items()}
        diff = float(np.abs(outs["new"] - outs["base"]).max() / np.abs(outs["base"]).max())
        samples = {name: [] for name in fns}
        for _ in range(args.reps):
            for name, f in fns.items():
                t0 = time.perf_counter()
                f(q, k, v).block_until_ready()
                samples[name].append((time.perf_counter() - t0) / LAYERS)
        b, w = (statistics.median(samples[x]) for x in ("base", "new"))
        kv_bytes = 2 * n * HKV * D * 4
        print(f"| {n} | {b * 1e6:.1f} | {w * 1e6:.1f} | {kv_bytes / b / 1e9:.1f} | {kv_bytes / w / 1e9:.1f} | "
              f"{b / w:.2f}x | {diff:.1e} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
