"""The native CPU matmul over packed GGUF blocks against the XLA dequantize-then-dot path.

    python bench/quant_matmul.py                       # 576x1536 (the built-in model's down projection)
    python bench/quant_matmul.py --rows 1 32 --shape 1536 576

Random weights quantized by ``gguf.quants.quantize`` and packed (``jaxllm/quant``); the
K-quants (Q4_K, Q5_K, Q6_K), which it cannot quantize, are random valid super-blocks (random
quants and sub-block scales, small f16 scales), and are left out when K is not a multiple
of 256.  Each cell
is the median per call of ``--reps`` samples of ``--inner`` back-to-back jitted calls
(``bench/harness.time_compiled``), the two paths alternating type by type.
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import quantize

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.harness import time_compiled  # noqa: E402
from jaxllm.cpu import native  # noqa: E402
from jaxllm.quant import block_size, matmul, pack  # noqa: E402
from jaxllm.quant.native_matmul import (INT8_ACTIVATION_TYPES, NATIVE_TYPES, can_interleave,  # noqa: E402
                                        interleave_rows, linear_packed)


def _weight(type_name: str, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Raw GGUF bytes [n, k / block * type_size] of a random weight of ``type_name``."""
    if block_size(type_name) != 256:   # the 32-weight types, F16, BF16: the gguf package quantizes them
        w = rng.standard_normal((n, k), dtype=np.float32) * 0.05
        return quantize(w, GGMLQuantizationType[type_name])
    size, type_size = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
    raw = rng.integers(0, 256, (n, k // size, type_size), dtype=np.uint8)
    scale = (rng.uniform(0.5, 1.5, (n, k // size, 2)) * 1e-3).astype(np.float16).view(np.uint8)
    if type_name == "Q6_K":
        raw[..., -2:] = scale.reshape(n, k // size, 4)[..., :2]           # d
    else:
        raw[..., :4] = scale.reshape(n, k // size, 4)                      # d, dmin
    return raw.reshape(n, -1)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", type=int, nargs=2, default=(576, 1536), metavar=("N", "K"))
    p.add_argument("--rows", type=int, nargs="+", default=[1], help="rows of x (batch sizes)")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--inner", type=int, default=5)
    args = p.parse_args(argv)
    if not native.quant_available():
        print("native packed-block matmul unavailable here (see the jaxllm.cpu warning)")
        return 1
    n, k = args.shape
    rng = np.random.default_rng(0)
    native_f, xla_f = jax.jit(linear_packed), jax.jit(matmul)
    int8_f = jax.jit(lambda x, pw: linear_packed(x, pw, int8_activations=True))
    # quant_linear.cc's two tile paths, where the CPU has AVX-512 (chosen at run time), and
    # quant_dot.cc's (8-bit activations: VNNI where the CPU has it, else AVX2)
    isas = ["avx512", "avx2"] if native.set_quant_avx512(True) else ["avx2"]
    dots = ["vnni", "avx2"] if native.set_quant_dot_vnni(True) else ["avx2"]
    # the interleaved-row VNNI kernel: what the engine runs for these types on such a CPU
    dots = (["vnni16"] if native.quant_dot_vnni() else []) + dots
    # and its AMX path (calls of 32 rows or more, where the CPU has AMX-INT8)
    dots = (["amx16"] if native.quant_dot_amx() else []) + dots
    print(f"x [M, {k}] @ W[{n}, {k}]^T, median us per call")
    print("| type | M | " + " | ".join(f"native {i.upper()}" for i in isas) + " | "
          + " | ".join(f"int8 activations {i.upper()}" for i in dots) + " | XLA dequantize + dot | XLA / native |")
    print("|---|---:|" + "---:|" * (len(isas) + len(dots) + 2))
    for type_name in NATIVE_TYPES:
        if k % block_size(type_name):
            print(f"| {type_name} | - | K={k} is not a multiple of {block_size(type_name)} | | |")
            continue
        pw = pack(_weight(type_name, n, k, rng), type_name, (n, k))
        iw = jax.device_put(interleave_rows(pw)) if can_interleave(pw) else None
        for m in args.rows:
            x = jnp.asarray(rng.standard_normal((m, k), dtype=np.float32))

            def us(f):
                return time_compiled(lambda: f(x, pw), warmup=2, reps=args.reps, inner=args.inner)["median_s"] * 1e6
            nat = []
            for isa in isas:
                native.set_quant_avx512(isa == "avx512")
                nat.append(us(native_f))
            native.set_quant_avx512(True)
            dot = []
            for isa in dots if type_name in INT8_ACTIVATION_TYPES else ():
                if isa in ("vnni16", "amx16"):   # only the types and shapes it takes
                    native.set_quant_dot_amx(isa == "amx16")
                    t = None if iw is None or (isa == "amx16" and m < 32) else time_compiled(
                        lambda: int8_f(x, iw), warmup=2, reps=args.reps, inner=args.inner)["median_s"]
                    native.set_quant_dot_amx(True)
                    dot.append("" if t is None else f"{t * 1e6:.0f}")
                    continue
                native.set_quant_dot_vnni(isa == "vnni")
                dot.append(f"{us(int8_f):.0f}")
            native.set_quant_dot_vnni(True)
            dot += [""] * (len(dots) - len(dot))
            xla = us(xla_f)
            print(f"| {type_name} | {m} | " + " | ".join(f"{t:.0f}" for t in nat) + " | " + " | ".join(dot)
                  + f" | {xla:.0f} | {xla / nat[0]:.1f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
