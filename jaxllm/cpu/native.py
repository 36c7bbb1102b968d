"""Builds, loads and registers the native CPU kernels (``*.cc`` here) as XLA FFI targets.

Each source is compiled once per source/compiler/flags combination with the system C++
compiler into its own shared library, cached under ``~/.cache/jaxllm/kernels``.  A source
is listed in ``_KERNELS`` with the FFI targets it exports.  ``available()`` is
False (and the XLA dot is used instead) when the CPU lacks AVX2/FMA, no compiler is
found, or the build fails; the reason is logged once.

The packed-GGUF-block matmul (``quant_linear.cc``, which also needs F16C) is built and
registered on its own by ``quant_available()``, with its own log line, so that its failure
never turns off the kernels above.

``python -m jaxllm.cpu.native`` builds them all now (scripts/setup.sh runs it, so that the
first start after an install does not wait ~15-20 s for g++ on a two-core machine).

``prefetch()`` starts every build at once on a thread pool and returns: an engine calls it
before it loads the weights, so that the compilers run while the checkpoint and tokenizer load,
every source side by side (not two groups one after the other); ``available()`` and
``quant_available()`` then wait for the builds they need.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm import cache_files
from jaxllm.paths import default_cache_dir

log = logging.getLogger("jaxllm.cpu")

_DIR = os.path.dirname(os.path.abspath(__file__))
_KERNELS = {
    # source: {FFI target name: exported handler symbol}
    "linear.cc": {"jaxllm_linear_f32": "JaxllmLinearF32", "jaxllm_linear_bf16": "JaxllmLinearBF16"},
    "attention.cc": {"jaxllm_paged_attention_f32": "JaxllmPagedAttentionF32",
                     "jaxllm_paged_attention_bf16": "JaxllmPagedAttentionBF16",
                     "jaxllm_paged_attention_int8": "JaxllmPagedAttentionInt8",
                     "jaxllm_paged_attention_fp8_e4m3": "JaxllmPagedAttentionFp8E4M3",
                     "jaxllm_paged_attention_fp8_e5m2": "JaxllmPagedAttentionFp8E5M2",
                     "jaxllm_paged_attention_vis_f32": "JaxllmPagedAttentionVisF32",
                     "jaxllm_paged_attention_vis_bf16": "JaxllmPagedAttentionVisBF16",
                     "jaxllm_paged_attention_vis_int8": "JaxllmPagedAttentionVisInt8",
                     "jaxllm_paged_attention_vis_fp8_e4m3": "JaxllmPagedAttentionVisFp8E4M3",
                     "jaxllm_paged_attention_vis_fp8_e5m2": "JaxllmPagedAttentionVisFp8E5M2"},
    "norm.cc": {"jaxllm_rms_norm_f32": "JaxllmRmsNormF32"},
    "lora.cc": {"jaxllm_lora_add_f32": "JaxllmLoraAddF32"},
    "gated_delta.cc": {"jaxllm_gdn_token_f32": "JaxllmGdnTokenF32"},
    "short_conv.cc": {"jaxllm_conv_ragged_f32": "JaxllmConvRaggedF32"},
}
# The packed-block matmuls, float32 activations (quant_linear.cc) and 8-bit activations
# (quant_dot.cc): separate from _KERNELS so they never decide ``available()``.
_QUANT_KERNELS = {
    "quant_linear.cc": {"jaxllm_linear_q8_0": "JaxllmLinearQ8_0", "jaxllm_linear_q4_0": "JaxllmLinearQ4_0",
                        "jaxllm_linear_q4_1": "JaxllmLinearQ4_1", "jaxllm_linear_q5_0": "JaxllmLinearQ5_0",
                        "jaxllm_linear_q5_1": "JaxllmLinearQ5_1", "jaxllm_linear_q4_k": "JaxllmLinearQ4_K",
                        "jaxllm_linear_q5_k": "JaxllmLinearQ5_K", "jaxllm_linear_q6_k": "JaxllmLinearQ6_K",
                        "jaxllm_linear_gguf_f16": "JaxllmLinearGgufF16",
                        "jaxllm_linear_gguf_bf16": "JaxllmLinearGgufBF16"},
    "quant_dot.cc": {"jaxllm_dot_q8_0": "JaxllmDotQ8_0", "jaxllm_dot_q4_0": "JaxllmDotQ4_0",
                     "jaxllm_dot_q4_1": "JaxllmDotQ4_1", "jaxllm_dot_q5_0": "JaxllmDotQ5_0",
                     "jaxllm_dot_q5_1": "JaxllmDotQ5_1", "jaxllm_dot16_q8_0": "JaxllmDot16Q8_0",
                     "jaxllm_dot16_q4_0": "JaxllmDot16Q4_0", "jaxllm_dot16_q4_1": "JaxllmDot16Q4_1",
                     "jaxllm_dot_i16_q4_1": "JaxllmDotI16Q4_1", "jaxllm_dot16_i16_q4_1": "JaxllmDot16I16Q4_1",
                     "jaxllm_dot16_i16_q8_0": "JaxllmDot16I16Q8_0"},
}
_HEADERS = [os.path.join(_DIR, h) for h in ("simd.h", "parallel.h", "gguf_simd.h")]
_FLAGS = ["-O3", "-mavx2", "-mfma", "-shared", "-fPIC", "-std=c++17"]
_QUANT_FLAGS = _FLAGS + ["-mf16c"]   # f16 scales -> f32 (_cvtsh_ss)
_TARGETS = {jnp.dtype(jnp.float32): "jaxllm_linear_f32", jnp.dtype(jnp.uint16): "jaxllm_linear_bf16"}
_lock = threading.Lock()
_state: dict = {}
_quant_state: dict = {}
_prefetch_lock = threading.Lock()
_builds: dict[str, Future] = {}   # source -> its build (the library's path), once prefetch() ran


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return set(next((ln for ln in f if ln.startswith("flags")), "").split())
    except OSError:
        return set()


def cpu_avx512() -> bool:
    """Whether the CPU has AVX512F and AVX512BW: where quant_linear.cc's 16-lane float32 paths
    run (engine/resolve.py picks ``--cpu-matmul auto``'s activations from these flags)."""
    return {"avx512f", "avx512bw"} <= _cpu_flags()


def cpu_vnni_without_amx() -> bool:
    """Whether the CPU has AVX-512 VNNI (the interleaved-row kernels of quant_dot.cc) but not
    AMX-INT8 (AMD Zen 4 and 5, Intel before Sapphire Rapids): where ``--cpu-matmul auto``
    rounds Q4_1's activations to int16 (engine/resolve.py)."""
    flags = _cpu_flags()
    return {"avx512f", "avx512bw", "avx512_vnni"} <= flags and "amx_int8" not in flags


def _build(source: str, flags: list[str] = _FLAGS) -> str:
    """Compiles ``source`` (a file name in this folder) once; the path of its shared library."""
    src_path = os.path.join(_DIR, source)
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        raise RuntimeError("no C++ compiler (g++) found")
    include = jax.ffi.include_dir()
    src = b""
    for path in (src_path, *_HEADERS):   # a header edit must rebuild every source
        with open(path, "rb") as f:
            src += f.read()
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout.splitlines()[0]
    key = hashlib.sha1(src + " ".join(flags + [version, include]).encode()).hexdigest()[:16]
    out_dir = os.path.join(default_cache_dir(), "kernels")
    lib = os.path.join(out_dir, f"libjaxllm_{os.path.splitext(source)[0]}_{key}.so")
    if os.path.isfile(lib) and cache_files.seal_problem(lib) is None:
        # Checked before dlopen: a truncated or overwritten library could crash the process there.
        log.info("native CPU kernel %s: reusing %s", source, lib)
        return lib
    os.makedirs(out_dir, exist_ok=True)
    # Another process may be compiling this library now (the second test worker, a second
    # server started on a fresh install): wait for its g++ and take its library rather than
    # run the same compile beside it.  The lock goes with the file's closing, or its process.
    with open(lib + ".lock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        if os.path.isfile(lib):
            problem = cache_files.seal_problem(lib)
            if problem is None:
                log.info("native CPU kernel %s: reusing %s", source, lib)
                return lib
            cache_files.report_rebuild(lib, problem, "compiling it again")
        log.info("native CPU kernel %s: compiling with %s (once; cached under %s)", source, os.path.basename(cxx),
                 out_dir)
        t0 = time.perf_counter()
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
        os.close(fd)
        r = subprocess.run([cxx, *flags, f"-I{include}", src_path, "-o", tmp], capture_output=True, text=True)
        if r.returncode != 0:
            os.unlink(tmp)
            raise RuntimeError(f"compiling {src_path} failed: {r.stderr.strip()[-2000:]}")
        os.replace(tmp, lib)
        cache_files.seal(lib)   # after the rename: a library without its seal is never trusted
    log.info("native CPU kernel %s: compiled in %.1f s", source, time.perf_counter() - t0)
    return lib


def prefetch() -> None:
    """Starts building every kernel this CPU can run, each in its own compiler process, and
    returns at once (once per process; a no-op off the CPU backend or when a build is cached,
    since ``_build`` then only checks the cached library).  Failures surface later, in
    ``available()`` / ``quant_available()``, with their usual log line."""
    with _prefetch_lock:
        if _builds or jax.default_backend() != "cpu":
            return
        have = _cpu_flags()
        jobs = []
        if {"avx2", "fma"} <= have:
            jobs += [(src, _FLAGS) for src in _KERNELS]
        if {"avx2", "fma", "f16c"} <= have:
            jobs += [(src, _QUANT_FLAGS) for src in _QUANT_KERNELS]
        if not jobs:
            return
        # One thread per source: each thread only waits on its g++, which the OS spreads over the cores.
        pool = ThreadPoolExecutor(max_workers=len(jobs), thread_name_prefix="jaxllm-kernel-build")
        for src, flags in jobs:
            _builds[src] = pool.submit(_build, src, flags)
        pool.shutdown(wait=False)   # the threads end with their builds


def build_all() -> int:
    """Builds (or finds cached) every kernel this CPU can run and registers them; the number
    of kernel groups that are unavailable (0 when all are ready)."""
    prefetch()
    return sum(not ok for ok in (available(), quant_available()))


def _built(source: str, flags: list[str]) -> str:
    """The library of ``source``: the prefetched build's, else built now."""
    with _prefetch_lock:
        future = _builds.get(source)
    return future.result() if future is not None else _build(source, flags)


def _load(state: dict, kernels: dict, flags: list[str], cpu_flags: set[str], unavailable: str) -> bool:
    """Builds ``kernels`` (source -> {FFI target: symbol}) with ``flags`` and registers their
    targets, once per ``state``; logs ``unavailable`` with the reason when that fails."""
    with _lock:
        if "ok" in state:
            return state["ok"]
        ok = False
        if jax.default_backend() != "cpu":
            reason = "not a CPU backend"
        elif not cpu_flags <= _cpu_flags():
            reason = f"the CPU lacks {'/'.join(sorted(f.upper() for f in cpu_flags))}"
        else:
            try:
                # Each source is its own compiler process: a first start builds them side by side.
                with ThreadPoolExecutor(max_workers=len(kernels)) as pool:
                    paths = list(pool.map(lambda src: _built(src, flags), kernels))
                libs = []
                for path, targets in zip(paths, kernels.values()):
                    lib = ctypes.cdll.LoadLibrary(path)
                    for name, symbol in targets.items():
                        jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
                    libs.append(lib)
                state["libs"] = libs   # kept alive: XLA holds raw pointers into them
                ok, reason = True, ""
            except (RuntimeError, OSError, AttributeError) as e:
                reason = str(e)
        if not ok:
            log.warning("%s (%s)", unavailable, reason)
        state["ok"] = ok
        return ok


def available() -> bool:
    """Builds and registers the kernels on first call; True when they can be used."""
    return _load(_state, _KERNELS, _FLAGS, {"avx2", "fma"},
                 "native CPU kernels unavailable; using XLA's dot and attention")


def quant_available() -> bool:
    """Builds and registers the packed-block matmuls (quant_linear.cc, quant_dot.cc) on first
    call; True when their ``jaxllm_linear_*`` and ``jaxllm_dot_*`` targets can be called."""
    return _load(_quant_state, _QUANT_KERNELS, _QUANT_FLAGS, {"avx2", "fma", "f16c"},
                 "native packed-block matmul unavailable; using the XLA dequantize path")


def set_attention_avx512(on: bool) -> bool:
    """Selects attention.cc's 16-lane AVX-512 scores and P.V (the default where the CPU has
    AVX512F/BW) or its 8-lane AVX2 ones, for every later call; returns whether AVX-512 is now
    in use.  For tests and benchmarks, which run both paths on one machine."""
    if not available():
        raise RuntimeError("the native CPU kernels are unavailable")
    lib = _state["libs"][list(_KERNELS).index("attention.cc")]
    return bool(lib.jaxllm_attention_set_avx512(int(on)))


def set_quant_avx512(on: bool) -> bool:
    """Selects quant_linear.cc's AVX-512 tiles (the default where the CPU has AVX512F/BW) or
    its 8-lane AVX2 ones, for every later call; returns whether AVX-512 is now in use.  For
    tests and benchmarks, which run both paths on one machine."""
    if not quant_available():
        raise RuntimeError("the native packed-block matmul is unavailable")
    lib = _quant_state["libs"][list(_QUANT_KERNELS).index("quant_linear.cc")]
    return bool(lib.jaxllm_quant_linear_set_avx512(int(on)))


def set_quant_dot_vnni(on: bool) -> bool:
    """Selects quant_dot.cc's AVX-512 VNNI tiles (the default where the CPU has
    AVX512F/BW/VNNI) or its AVX2 ones, for every later call; returns whether VNNI is now in
    use.  For tests and benchmarks, which run both paths on one machine."""
    if not quant_available():
        raise RuntimeError("the native packed-block matmul is unavailable")
    lib = _quant_state["libs"][list(_QUANT_KERNELS).index("quant_dot.cc")]
    return bool(lib.jaxllm_quant_dot_set_avx512(int(on)))


def quant_dot_vnni() -> bool:
    """Whether the CPU runs quant_dot.cc's AVX-512 VNNI kernels, the interleaved-row ones
    (``jaxllm_dot16_*``) among them, whatever ``set_quant_dot_vnni`` selected."""
    if not quant_available():
        return False
    lib = _quant_state["libs"][list(_QUANT_KERNELS).index("quant_dot.cc")]
    return bool(lib.jaxllm_quant_dot_has_vnni())


def set_quant_dot_amx(on: bool) -> bool:
    """Selects AMX for the interleaved-row kernels' calls of 32 rows or more (prefill; the
    default where the CPU has AMX-INT8 and the kernel grants the process its tile state) or
    the VNNI tiles, for every later call; returns whether AMX is now in use.  Both give the
    same bits."""
    if not quant_available():
        raise RuntimeError("the native packed-block matmul is unavailable")
    lib = _quant_state["libs"][list(_QUANT_KERNELS).index("quant_dot.cc")]
    return bool(lib.jaxllm_quant_dot_set_amx(int(on)))


def quant_dot_amx() -> bool:
    """Whether the interleaved-row kernels can run on AMX here, whatever ``set_quant_dot_amx``
    selected."""
    if not quant_available():
        return False
    lib = _quant_state["libs"][list(_QUANT_KERNELS).index("quant_dot.cc")]
    return bool(lib.jaxllm_quant_dot_has_amx())


def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """RMSNorm of float32 ``x [..., D]`` by ``w [D]`` (norm.cc): every row summed in one order
    whatever the number of rows, unlike XLA's reduction (see norm.cc)."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1]).astype(jnp.float32)
    out = jax.ffi.ffi_call("jaxllm_rms_norm_f32", jax.ShapeDtypeStruct(x2.shape, jnp.float32))(
        x2, w.astype(jnp.float32), eps=np.float32(eps))
    return out.reshape(shape)


def linear(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [M, K] (any float dtype) . w[N, K]^T -> [M, N] float32, with ``w`` in the panel
    layout (cpu/layout.py): float32, bfloat16, or bfloat16 bits as uint16 (how bf16 weights
    are stored on CPU, see formats/storage.py)."""
    if w.dtype == jnp.bfloat16:
        w = jax.lax.bitcast_convert_type(w, jnp.uint16)
    target = _TARGETS[jnp.dtype(w.dtype)]
    out = jax.ShapeDtypeStruct((x.shape[0], w.shape[0]), jnp.float32)
    return jax.ffi.ffi_call(target, out)(x.astype(jnp.float32), w)


def lora_add(ys: list, x: jax.Array, a: jax.Array, bs: list, slots: jax.Array, layer, ranks: jax.Array,
             outs: list[int], cols: list[int], r0s: list[int]) -> list:
    """``ys`` (n_y x [T, N_i] float32, the projections of ``x``) plus the LoRA deltas of the
    projections whose ``A`` is ``a`` (lora.cc, one call: shrink, then every expand):

    ``ys[outs[j]][:, cols[j]:cols[j] + O_j] += xa[:, r0s[j]:r0s[j] + r] @ B_j[slot, layer][:r]``, with
    ``xa = x @ A[slot, layer][rows r0s[j]...]`` per token, ``r = ranks[slot]`` ([S] int32: each
    slot's adapter's rank; A's rows and B's rows past it are zero padding, not read).

    x [T, in] float32; a [S, L, C, in] float32 (transposed: every slot and layer, read in
    place), C = parts of ``R`` rows; bs: B_j [S, L, R, O_j] float32; slots [T] int32 (a slot
    outside [0, S): no delta); layer: an int or int32 scalar.  ``ys``' buffers are reused for
    the results."""
    R = bs[0].shape[-2]
    args = [x, a, slots.astype(jnp.int32), jnp.asarray(layer, jnp.int32), ranks.astype(jnp.int32), *bs, *ys]
    first_y = 5 + len(bs)
    out = [jax.ShapeDtypeStruct(y.shape, jnp.float32) for y in ys]
    return list(jax.ffi.ffi_call("jaxllm_lora_add_f32", out,
                                 input_output_aliases={first_y + i: i for i in range(len(ys))})(
        *args, cols=np.asarray(cols, np.int64), outs=np.asarray(outs, np.int64), part=np.int64(R),
        r0s=np.asarray(r0s, np.int64)))


def gdn_token(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array, rows: jax.Array,
              fresh: jax.Array, states: jax.Array) -> tuple[jax.Array, jax.Array]:
    """One token of each of S sequences through the gated delta rule (gated_delta.cc), on
    their state rows in place: q, k [S, H, Dk] (normalised, q scaled, one per value head),
    v [S, H, Dv], g (log decay), beta [S, H]; rows [S] int32 each sequence's row of ``states``
    (out of range: a padding sequence, zero output, nothing written); fresh [S] it starts from
    zeros, not from its row; states [R, H, Dk, Dv] float32 -> (o [S, H, Dv], states).  The
    function of layers/gated_delta.py's ``_token_step`` on each sequence's row."""
    S, H, Dv = v.shape
    f32 = lambda x: x.astype(jnp.float32)   # noqa: E731
    o, states = jax.ffi.ffi_call("jaxllm_gdn_token_f32",
                                 (jax.ShapeDtypeStruct((S, H, Dv), jnp.float32),
                                  jax.ShapeDtypeStruct(states.shape, jnp.float32)),
                                 input_output_aliases={7: 1})(
        f32(q), f32(k), f32(v), f32(g), f32(beta), rows.astype(jnp.int32), fresh.astype(jnp.int32), states)
    return o, states


def conv_ragged(x: jax.Array, weight: jax.Array, states: jax.Array, rows: jax.Array, start: jax.Array,
                length: jax.Array, fresh: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The causal depthwise conv of a ragged step's flat tokens on the sequences' state rows in
    place (short_conv.cc), before the activation: x [T, C], weight [C, K], states
    [R, K - 1, C] float32; rows, start, length, fresh [S]: sequence s's row of ``states`` (out
    of range: none, read as zeros, not written), its tokens ``x[start:start + length]``, and
    whether it starts from zeros -> (y [T, C] float32, zero on tokens of no sequence; states).
    The function of layers/short_conv.py's ``conv_prefill_ragged`` (activation off) on each
    sequence's row."""
    i32 = lambda a: a.astype(jnp.int32)   # noqa: E731
    y, states = jax.ffi.ffi_call("jaxllm_conv_ragged_f32",
                                 (jax.ShapeDtypeStruct(x.shape, jnp.float32),
                                  jax.ShapeDtypeStruct(states.shape, jnp.float32)),
                                 input_output_aliases={6: 1})(
        x.astype(jnp.float32), weight.astype(jnp.float32).T, i32(rows), i32(start), i32(length), i32(fresh), states)
    return y, states


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%Y-%m-%d %H:%M:%S")
    raise SystemExit(build_all())
