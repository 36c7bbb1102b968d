"""The float32-activation Q4_1 kernel (``jaxllm_linear_q4_1``, quant_linear.cc) of this tree
against the same kernel built from another git revision, alternated, at the built-in
model's (SmolLM2-135M) projection shapes; and its Q8_0 LM head (``jaxllm_linear_q8_0``).
``--int8``: the 8-bit-activation kernels instead (``jaxllm_dot_q4_1`` and ``_q8_0``,
quant_dot.cc: ``--cpu-matmul native-int8``) on row-major weights, as the engine lays them out
on a CPU without VNNI (with it, the engine interleaves them for ``jaxllm_dot16_*``).
``--int16``: this tree's int16-activation Q4_1 kernel (``jaxllm_dot_i16_q4_1``,
``--cpu-matmul native-int16``) against the base revision's float32 one (the LM head's row: the
float32 Q8_0 kernel on both sides, as in the engine).

    python bench/q4_1_linear.py                       # this tree vs main, M = 1 and 8
    python bench/q4_1_linear.py --base HEAD~1 --rows 1 --reps 31
    python bench/q4_1_linear.py --int8 --rows 1
    python bench/q4_1_linear.py --int16 --rows 1 8 32 256

The base revision's kernel source and headers (``git show REV:...``) are compiled into a
temporary library and registered under the targets ``jaxllm_linear_q4_1_base`` and
``_q8_0_base`` (``jaxllm_dot_..._base`` with ``--int8``).  Weights are
random valid Q4_1 blocks (the kernels' speed does not depend on the values), ``--layers``
distinct copies per shape so that the calls stream their weights rather than rereading
one copy from L2.  Each shape's row is one jitted function that runs the ``--layers``
calls one after another (each x depends on the previous call's output, so XLA cannot run
them side by side); "step" is every projection of every layer, 30 x (qkv, o, gate_up, down):
the 63.3 MiB a batch-1 decode step reads.  "lm_head" is the tied LM head, Q8_0 49152 x 576
(``jaxllm_linear_q8_0``, the other 28.7 MiB of the step), two copies called in turn.  A cell is the median
of ``--reps`` samples, the two kernels alternating sample by sample; GB/s counts the
weight bytes (d, m, qs) read per call.  The machine's read bandwidth
(bench/read_stream.c) is printed beside, measured in the same run.
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
from bench.throughput import read_bandwidth  # noqa: E402
from jaxllm.cpu import native  # noqa: E402
from jaxllm.quant import PackedWeight  # noqa: E402
from jaxllm.quant.native_matmul import linear_packed  # noqa: E402

# (name, N, K) of SmolLM2-135M's projections as the engine calls them (hidden 576, 9 query
# and 3 KV heads of 64, MLP 1536; q, k, v fused as qkv and gate, up as gate_up at load:
# jaxllm/runner/weights.py)
SHAPES = [("qkv", 960, 576), ("o", 576, 576), ("gate_up", 3072, 576), ("down", 576, 1536)]
STEP = ["qkv", "o", "gate_up", "down"]   # one layer's calls, in order
# kernel family -> (source, its Q4_1 and Q8_0 handler symbols)
KERNELS = {"linear": ("quant_linear.cc", "JaxllmLinearQ4_1", "JaxllmLinearQ8_0"),
           "dot": ("quant_dot.cc", "JaxllmDotQ4_1", "JaxllmDotQ8_0")}
HEAD = ("lm_head", 49152, 576)   # the tied embedding, Q8_0 in the built-in GGUF
_HEADERS = ["gguf_simd.h", "parallel.h", "simd.h"]


def base_target(kind: str, type_name: str) -> str:
    """The FFI target of the base revision's ``kind`` ("linear" or "dot") kernel for a type."""
    return f"jaxllm_{kind}_{type_name.lower()}_base"


def build_base(rev: str, kind: str = "linear") -> ctypes.CDLL:
    """Compiles ``rev``'s kernel source of ``kind`` (KERNELS) into a temporary library and
    registers its Q4_1 and Q8_0 handlers as ``base_target(kind, ...)``; the library (kept
    loaded by the caller)."""
    source, q4_1_symbol, q8_0_symbol = KERNELS[kind]
    lib = revision_kernel.build(rev, source, _HEADERS, native._QUANT_FLAGS)
    for type_name, symbol in (("Q4_1", q4_1_symbol), ("Q8_0", q8_0_symbol)):
        jax.ffi.register_ffi_target(base_target(kind, type_name), jax.ffi.pycapsule(getattr(lib, symbol)),
                                    platform="cpu")
    return lib


def random_q4_1(n: int, k: int, rng: np.random.Generator) -> PackedWeight:
    """A random Q4_1 weight [n, k]: small positive f16 scales, negative mins, random nibbles."""
    nb = k // 32
    d = (rng.uniform(0.5, 1.5, (n, nb)) * 1e-2).astype(np.float16).view(np.uint16)
    m = (rng.uniform(-1.5, -0.5, (n, nb)) * 8e-2).astype(np.float16).view(np.uint16)
    qs = rng.integers(0, 256, (n, nb, 16), dtype=np.uint8)
    return PackedWeight(d=jnp.asarray(d), m=jnp.asarray(m), qs=jnp.asarray(qs), type_name="Q4_1", shape=(n, k))


def random_q8_0(n: int, k: int, rng: np.random.Generator) -> PackedWeight:
    """A random Q8_0 weight [n, k]: small f16 scales of either sign, random int8 quants."""
    d = (rng.uniform(-1.5, 1.5, (n, k // 32)) * 1e-3).astype(np.float16).view(np.uint16)
    qs = rng.integers(0, 256, (n, k // 32, 32), dtype=np.uint8)
    return PackedWeight(d=jnp.asarray(d), qs=jnp.asarray(qs), type_name="Q8_0", shape=(n, k))


def _call(kind: str, base: bool, x: jax.Array, pw: PackedWeight, int16: bool = False) -> jax.Array:
    if not base:
        return linear_packed(x, pw, int8_activations=kind == "dot", int16_activations=int16 and pw.type_name == "Q4_1")
    out = jax.ShapeDtypeStruct((x.shape[0], pw.shape[0]), jnp.float32)
    fields = (pw.d, pw.qs) if pw.type_name == "Q8_0" else (pw.d, pw.m, pw.qs)
    return jax.ffi.ffi_call(base_target(kind, pw.type_name), out)(x, *fields)


def chain(kind: str, base: bool, int16: bool = False):
    """A jitted fn(x0 [M, max K], weights) calling the ``kind`` kernel (the base revision's
    or this tree's; ``int16``: this tree's int16-activation one for Q4_1) on each weight in
    turn; call i's x is x0's first K columns plus a term of call i - 1's output (a true
    dependency)."""
    def run(x0, weights):
        prev = jnp.zeros((x0.shape[0], 1), jnp.float32)
        for pw in weights:
            y = _call(kind, base, x0[:, :pw.shape[1]] + 1e-3 * prev, pw, int16)   # [M, N]
            prev = y[:, :1]
        return prev
    return jax.jit(run)


def time_alternated(fns: dict, args: tuple, reps: int, inner: int) -> dict:
    """Median seconds per call of each fn(*args), the fns alternating sample by sample."""
    for f in fns.values():
        jax.block_until_ready(f(*args))
        jax.block_until_ready(f(*args))
    samples = {name: [] for name in fns}
    for _ in range(reps):
        for name, f in fns.items():
            t0 = time.perf_counter()
            for _ in range(inner):
                r = f(*args)
            jax.block_until_ready(r)
            samples[name].append((time.perf_counter() - t0) / inner)
    return {name: statistics.median(s) for name, s in samples.items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", default="main", help="the git revision to compare against (default main)")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8], help="rows of x (batch sizes)")
    p.add_argument("--layers", type=int, default=30, help="distinct weight copies per shape (the model has 30)")
    p.add_argument("--reps", type=int, default=21)
    p.add_argument("--inner", type=int, default=3)
    p.add_argument("--no-bandwidth", action="store_true", help="skip the read_stream.c measurement")
    p.add_argument("--no-head", action="store_true", help="skip the Q8_0 LM head's row")
    p.add_argument("--int8", action="store_true",
                   help="the 8-bit-activation kernels (quant_dot.cc, --cpu-matmul native-int8)")
    p.add_argument("--int16", action="store_true",
                   help="this tree's int16-activation Q4_1 kernel (--cpu-matmul native-int16) against the "
                        "base revision's float32 one")
    args = p.parse_args(argv)
    if args.int8 and args.int16:
        p.error("--int8 and --int16 compare different kernels: give one")
    if not native.quant_available():
        print("native packed-block matmul unavailable here (see the jaxllm.cpu warning)")
        return 1
    kind = "dot" if args.int8 else "linear"
    lib = build_base(args.base, kind)   # noqa: F841  (kept loaded: XLA holds a pointer into it)
    rng = np.random.default_rng(0)
    weights = {name: [random_q4_1(n, k, rng) for _ in range(args.layers)] for name, n, k in SHAPES}
    cases = [(name, weights[name]) for name, _, _ in SHAPES]
    cases.append(("step", [weights[name][layer] for layer in range(args.layers) for name in STEP]))
    if not args.no_head:
        cases.append((HEAD[0], [random_q8_0(HEAD[1], HEAD[2], rng) for _ in range(2)]))
    fns = {"base": chain(kind, base=True), "new": chain(kind, base=False, int16=args.int16)}
    if not args.no_bandwidth:
        bw, why = read_bandwidth()
        print(f"read stream (bench/read_stream.c, both cores): "
              + (f"{bw / 1e9:.1f} GB/s" if bw else f"unmeasured ({why})"))
    new = "this tree's jaxllm_dot_i16_q4_1 (int16 activations)" if args.int16 else "this tree"
    print(f"{KERNELS[kind][0]}: base = {args.base}, new = {new}; median of {args.reps} alternated samples; "
          f"us per call, GB/s of weight bytes")
    print("| shape | N x K | M | base us | new us | base GB/s | new GB/s | speed-up |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for m in args.rows:
        x0 = jnp.asarray(rng.standard_normal((m, 1536), dtype=np.float32))
        for name, ws in cases:
            t = time_alternated(fns, (x0, ws), args.reps, args.inner)
            calls = len(ws)
            nbytes = sum(w.nbytes for w in ws) / calls
            shape = "all 4" if name == "step" else f"{ws[0].shape[0]} x {ws[0].shape[1]}"
            us = {k: v / calls * 1e6 for k, v in t.items()}
            print(f"| {name} | {shape} | {m} | {us['base']:.1f} | {us['new']:.1f} | "
                  f"{nbytes / us['base'] / 1e3:.1f} | {nbytes / us['new'] / 1e3:.1f} | "
                  f"{us['base'] / us['new']:.2f}x |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
