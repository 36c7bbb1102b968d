"""Embeddings per second: jaxllm's pooling runner against sentence-transformers (offline) and
against llama-server ``--embeddings`` (``/v1/embeddings`` under concurrency).

    python bench/embeddings.py offline [--folder F | --layers 6 --hidden 384] [--batches 1,32,256]
                                       [--input-len 128] [--repeats 3] [--threads N]
    python bench/embeddings.py serve   [--folder F] [--concurrency 1,4,16] [--requests 64]
                                       [--threads N] [--llama-bin DIR]
    python bench/embeddings.py profile [--folder F] [--batch 32] [--input-len 128] [--repeats 3] [--threads N]

No model hub is reachable here, so the model is a random-weight BERT of a real embedder's shape
(bge-small / all-MiniLM-L6: hidden 384, 12 heads, FFN 1536, a 30522-token WordPiece vocabulary;
``--layers`` 6 by default as MiniLM-L6, 12 as bge-small) saved as a sentence-transformers folder
(Transformer + MEAN Pooling + Normalize).  Random weights cost what trained ones cost: the work
is the shapes.  Inputs are ``--input-len`` tokens each ([CLS] + random words + [SEP]).

``offline``: ``LLM(folder, runner="pooling").embed(texts)`` against
``SentenceTransformer(folder).encode(texts)`` (its default ``batch_size`` 32), float32 both; the
two arms alternate (the order flips every repeat), each timed call is preceded by one unmeasured
call of the same batch (compiles, warm caches), medians are reported.  ``--threads N`` pins the
process to N cores (``sched_setaffinity``: XLA's pool and torch's both see N) and sets
``torch.set_num_threads(N)``.

``profile``: where each arm's time goes on one batch, op by op, side by side: jaxllm's compiled
step under ``jax.profiler`` (``jaxllm.profiling``: XLA ops' self time, each op put in a category
from the HLO it runs) and ``SentenceTransformer.encode`` under ``torch.profiler`` (aten ops' self
CPU time), both in milliseconds per input, the same texts, threads and repeats.

``serve``: ``jaxllm serve F --runner pooling`` and ``llama-server --embeddings`` on the same
weights converted to an F32 GGUF (llama.cpp's ``convert_hf_to_gguf.py``), each pinned to the same
``--threads`` cores; ``--requests`` one-input ``/v1/embeddings`` requests at each concurrency,
servers alternated, embeddings per second of the whole run (median of ``--repeats``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import statistics
import subprocess
import sys
import time

import numpy as np

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
LLAMA_DIR = os.path.expanduser("~/.cache/jaxllm-peers/llama.cpp-11434.0.0")


def _ints(text: str) -> list[int]:
    out = [int(x) for x in text.split(",") if x.strip()]
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers separated by commas, got {text!r}")
    return out


def build_folder(out_dir: str, *, layers: int = 6, hidden: int = 384, heads: int = 12, ffn: int = 1536,
                 vocab_size: int = 30522, max_positions: int = 512, seed: int = 0) -> str:
    """A random-weight BERT of the given shape, with a WordPiece vocabulary of single-token words
    ``w<i>``, saved as a sentence-transformers folder (MEAN pooling + Normalize, as bge/MiniLM)."""
    import torch
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer import modules as st_models
    from transformers import BertConfig, BertModel, BertTokenizerFast
    if vocab_size <= len(SPECIALS):
        raise ValueError(f"--vocab-size must be more than {len(SPECIALS)}, got {vocab_size}")
    os.makedirs(out_dir, exist_ok=True)
    vocab = SPECIALS + [f"w{i}" for i in range(vocab_size - len(SPECIALS))]
    tok = BertTokenizerFast(vocab={w: i for i, w in enumerate(vocab)}, do_lower_case=True)
    torch.manual_seed(seed)
    bert = BertModel(BertConfig(vocab_size=vocab_size, hidden_size=hidden, num_hidden_layers=layers,
                                num_attention_heads=heads, intermediate_size=ffn,
                                max_position_embeddings=max_positions, type_vocab_size=2)).eval()
    hf_dir = out_dir.rstrip("/") + "_hf"
    bert.save_pretrained(hf_dir)
    tok.save_pretrained(hf_dir)
    transformer = st_models.Transformer(hf_dir, max_seq_length=max_positions)
    pool = st_models.Pooling(transformer.get_embedding_dimension(), pooling_mode="mean")
    SentenceTransformer(modules=[transformer, pool, st_models.Normalize()], device="cpu").save(out_dir)
    return out_dir


def make_texts(folder: str, n: int, input_len: int, seed: int = 0) -> list[str]:
    """``n`` texts of exactly ``input_len`` tokens each ([CLS] and [SEP] included) for the folder's
    ``w<i>`` vocabulary."""
    with open(os.path.join(folder, "config.json")) as f:
        vocab_size = json.load(f)["vocab_size"]
    if input_len < 3:
        raise ValueError(f"--input-len must be at least 3, got {input_len}")
    rng = random.Random(seed)
    words = vocab_size - len(SPECIALS)
    return [" ".join(f"w{rng.randrange(words)}" for _ in range(input_len - 2)) for _ in range(n)]


def pin_threads(threads: int | None) -> int:
    """Pins this process (and what it starts) to ``threads`` cores; sets torch's pool to match."""
    cores = sorted(os.sched_getaffinity(0))
    threads = threads or len(cores)
    if threads > len(cores):
        raise ValueError(f"--threads {threads}: this process may use {len(cores)} cores")
    os.sched_setaffinity(0, cores[:threads])
    import torch
    torch.set_num_threads(threads)
    return threads


class JaxllmArm:
    name = "jaxllm"

    def __init__(self, folder: str):
        from jaxllm import LLM
        # The engine's defaults, as a user gets them (max_model_len: the model's 512 positions,
        # 1024-token steps); a program is compiled the first time a step needs it.
        self.llm = LLM(folder, runner="pooling")

    def __call__(self, texts: list[str]):
        """[N, D] float32: one embedding per text."""
        return np.array([o.outputs.embedding for o in self.llm.embed(texts, use_tqdm=False)], np.float32)


class SentenceTransformersArm:
    name = "sentence-transformers"

    def __init__(self, folder: str):
        from sentence_transformers import SentenceTransformer
        self.model = SentenceTransformer(folder, device="cpu")

    def __call__(self, texts: list[str]):
        return self.model.encode(texts, convert_to_numpy=True)


def run_offline(arms_for_batch, texts_for_batch, batches: list[int], repeats: int) -> tuple[dict, dict]:
    """({batch: {arm: [embeddings/s per repeat]}}, {batch: max |a - b| between the two arms'
    embeddings}): the arms alternate, the order flipping every repeat; each timed call follows
    one unmeasured call of the same batch, whose vectors are compared (same work, same answer)."""
    rates: dict = {}
    diffs: dict = {}
    for b in batches:
        arms = arms_for_batch(b)
        texts = texts_for_batch(b)
        rates[b] = {a.name: [] for a in arms}
        first, second = (np.asarray(a(texts), np.float32) for a in arms)   # warm: compiles, allocations
        assert first.shape == second.shape == (b, first.shape[1]), (first.shape, second.shape)
        diffs[b] = float(np.abs(first - second).max())
        for r in range(repeats):
            for a in (arms if r % 2 == 0 else arms[::-1]):
                t0 = time.perf_counter()
                done = len(a(texts))
                rates[b][a.name].append(done / (time.perf_counter() - t0))
    return rates, diffs


def table(rates: dict, key: str) -> str:
    names = list(next(iter(rates.values())))
    lines = [f"| {key} | " + " | ".join(f"{n} emb/s" for n in names) + " | jaxllm / " + names[-1] + " |",
             "|---:|" + "---:|" * (len(names) + 1)]
    for k, by_arm in rates.items():
        med = [statistics.median(by_arm[n]) for n in names]
        lines.append(f"| {k} | " + " | ".join(f"{m:.1f}" for m in med) + f" | {med[0] / med[-1]:.2f}x |")
    return "\n".join(lines)


def cmd_offline(args) -> int:
    threads = pin_threads(args.threads)
    folder = args.folder or build_folder(os.path.join(args.workdir, f"bert{args.layers}x{args.hidden}"),
                                         layers=args.layers, hidden=args.hidden,
                                         heads=args.heads, ffn=4 * args.hidden)
    st = SentenceTransformersArm(folder)
    rates, diffs = run_offline(lambda b: [JaxllmArm(folder), st],
                               lambda b: make_texts(folder, b, args.input_len, seed=b), args.batches, args.repeats)
    print(f"# offline, {args.input_len}-token inputs, float32, {threads} thread(s), {args.repeats} repeats, "
          f"medians; model {folder}; max |jaxllm - sentence-transformers| {max(diffs.values()):.2e}")
    print(table(rates, "inputs"))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"rates": {str(k): v for k, v in rates.items()},
                       "max_abs_diff": {str(k): v for k, v in diffs.items()}}, f, indent=2)
    return 0


# --- profile ----------------------------------------------------------------------------------

CATEGORIES = ["linear layers", "attention matmuls", "softmax", "GELU", "LayerNorm", "other reductions",
              "elementwise (bias, residual, mask, scale)", "copies, transposes, gathers", "loops and the rest"]

# aten op -> category (torch's SDPA is one op: its matmuls and softmax together).
TORCH_CATEGORY = {"aten::addmm": 0, "aten::mm": 0, "aten::linear": 0, "aten::matmul": 0,
                  "aten::bmm": 1, "aten::baddbmm": 1, "aten::_scaled_dot_product_flash_attention_for_cpu": 1,
                  "aten::_scaled_dot_product_attention_math": 1, "aten::scaled_dot_product_attention": 1,
                  "aten::softmax": 2, "aten::_softmax": 2, "aten::gelu": 3, "aten::native_layer_norm": 4,
                  "aten::layer_norm": 4, "aten::sum": 5, "aten::mean": 5, "aten::add": 6, "aten::add_": 6,
                  "aten::mul": 6, "aten::div": 6, "aten::sub": 6, "aten::where": 6, "aten::clamp": 6,
                  "aten::copy_": 7, "aten::contiguous": 7, "aten::clone": 7, "aten::index_select": 7,
                  "aten::embedding": 7, "aten::cat": 7, "aten::to": 7, "aten::_to_copy": 7}


def hlo_bodies(hlo: str) -> tuple[dict[str, tuple[str, str]], dict[str, str]]:
    """({instruction: (shape, the computation it calls or "")}, {computation: its text}) of an
    HLO module's text (``compiled.as_text()``)."""
    insts, bodies, name = {}, {}, None
    for line in hlo.splitlines():
        head = re.match(r"(?:ENTRY )?%([\w.\-]+) \(.*\{$", line)
        if head:
            name = head.group(1)
            bodies[name] = ""
            continue
        m = re.match(r"\s*(?:ROOT )?%([\w.\-]+) = (\S+?)(?:\{[\d,]*\})? [\w\-]+\(", line)
        if m:
            calls = re.search(r"calls=%([\w.\-]+)", line)
            insts[m.group(1)] = (m.group(2), calls.group(1) if calls else "")
        if name is not None:
            bodies[name] += line + "\n"
    return insts, bodies


def xla_category(op: str, insts: dict, bodies: dict) -> int:
    """The index in ``CATEGORIES`` of XLA op ``op`` (an HLO instruction of the step), from what
    its fused computation computes: a dot with a 2-D result is a linear layer, a batched one
    attention's; else its costliest kind of work."""
    shape, calls = insts.get(op, ("", ""))
    body = bodies.get(calls, "") if calls else ""
    if not body:   # not a fusion: the opcode is the op's own name
        body = " " + re.sub(r"[.\d]+$", "", op) + "("
    if " dot(" in body:
        return 0 if shape.count(",") == 1 else 1
    for needle, cat in ((" exponential(", 2), (" erf(", 3), (" rsqrt(", 4), (" reduce(", 5)):
        if needle in body:
            return cat
    if re.search(r" (gather|scatter|dynamic-slice|dynamic-update-slice|transpose|copy|slice|concatenate|pad)\(",
                 body):
        return 7
    if re.search(r" (add|subtract|multiply|divide|select|maximum|compare)\(", body):
        return 6
    return 8


def profile_jaxllm(folder: str, texts: list[str], repeats: int, workdir: str) -> list[float]:
    """Self time (ms) per category of ``repeats`` embeds of ``texts`` by jaxllm (warmed first)."""
    from jaxllm import profiling
    arm = JaxllmArm(folder)
    arm(texts)
    profiling.start(os.path.join(workdir, "jaxllm-profile"))
    for _ in range(repeats):
        arm(texts)
    stats = profiling.top_ops(profiling.stop())
    insts, bodies = {}, {}
    for exe in arm.llm.pooling_engine.runner._compiled.values():
        i, b = hlo_bodies(exe.as_text())
        insts.update(i)
        bodies.update(b)
    ms = [0.0] * len(CATEGORIES)
    for o in stats:
        ms[xla_category(o.name, insts, bodies)] += o.self_ns / 1e6
    return ms


def profile_torch(folder: str, texts: list[str], repeats: int, seen: dict | None = None) -> list[float]:
    """Self CPU time (ms) per category of ``repeats`` ``encode`` calls of ``texts`` (warmed first);
    ``seen`` gets each aten op's category name."""
    from torch.profiler import ProfilerActivity, profile
    arm = SentenceTransformersArm(folder)
    arm(texts)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(repeats):
            arm(texts)
    ms = [0.0] * len(CATEGORIES)
    for e in prof.key_averages():
        if e.key.startswith("aten::"):
            ms[TORCH_CATEGORY.get(e.key, 8)] += e.self_cpu_time_total / 1e3
            if seen is not None:
                seen[e.key] = CATEGORIES[TORCH_CATEGORY.get(e.key, 8)]
    return ms


def cmd_profile(args) -> int:
    threads = pin_threads(args.threads)
    folder = args.folder or build_folder(os.path.join(args.workdir, f"bert{args.layers}x{args.hidden}"),
                                         layers=args.layers, hidden=args.hidden,
                                         heads=args.heads, ffn=4 * args.hidden)
    texts = make_texts(folder, args.batch, args.input_len, seed=args.batch)
    per = args.repeats * len(texts)
    jx = [m / per for m in profile_jaxllm(folder, texts, args.repeats, args.workdir)]
    seen: dict = {}
    st = [m / per for m in profile_torch(folder, texts, args.repeats, seen)]
    print(f"# self time by op, ms per input: {args.batch} inputs of {args.input_len} tokens, float32, "
          f"{threads} thread(s), {args.repeats} repeats; model {folder}")
    print("| ops | jaxllm ms | sentence-transformers ms | difference ms |\n|---|---:|---:|---:|")
    for name, a, b in zip(CATEGORIES + ["all"], jx + [sum(jx)], st + [sum(st)]):
        print(f"| {name} | {a:.2f} | {b:.2f} | {a - b:+.2f} |")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"categories": CATEGORIES, "jaxllm_ms": jx, "sentence_transformers_ms": st, "torch_ops": seen},
                      f, indent=2)
    return 0


# --- serve ------------------------------------------------------------------------------------

def convert_gguf(folder: str, out: str) -> str:
    """The folder's BERT as an F32 GGUF through llama.cpp's converter (its pre-tokenizer check
    knows real vocabularies only: this one's is a plain WordPiece, llama.cpp's "default")."""
    code = (f"import sys; sys.path[:0] = [{LLAMA_DIR + '/src'!r}, {LLAMA_DIR + '/src/gguf-py'!r}]\n"
            "import conversion.base as b\n"
            "b.TextModel.get_vocab_base_pre = lambda self, tok: 'default'\n"
            "import convert_hf_to_gguf as c\n"
            f"sys.argv = ['convert', {folder!r}, '--outfile', {out!r}, '--outtype', 'f32']\n"
            "c.main()\n")
    subprocess.run([sys.executable, "-c", code], check=True, stdout=subprocess.DEVNULL)
    return out


@contextlib.contextmanager
def server(cmd: list[str], port: int, log_path: str, timeout: float = 600):
    import httpx
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        try:
            t0 = time.time()
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"{cmd[0]} exited {proc.returncode}; see {log_path}")
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                        break
                if time.time() - t0 > timeout:
                    raise RuntimeError(f"{cmd[0]} not healthy after {timeout} s; see {log_path}")
                time.sleep(1)
            yield f"http://127.0.0.1:{port}"
        finally:
            proc.terminate()
            proc.wait(30)


async def load(base: str, model: str, texts: list[str], concurrency: int) -> float:
    """Embeddings per second of ``len(texts)`` one-input requests, ``concurrency`` in flight."""
    import httpx
    queue = list(texts)
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=concurrency)) as client:
        async def worker():
            while queue:
                text = queue.pop()
                r = await client.post(f"{base}/v1/embeddings", json={"model": model, "input": text})
                r.raise_for_status()
                assert len(r.json()["data"]) == 1
        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return len(texts) / (time.perf_counter() - t0)


def cmd_serve(args) -> int:
    threads = pin_threads(args.threads)
    folder = args.folder or build_folder(os.path.join(args.workdir, f"bert{args.layers}x{args.hidden}"),
                                         layers=args.layers, hidden=args.hidden,
                                         heads=args.heads, ffn=4 * args.hidden)
    gguf = convert_gguf(folder, os.path.join(args.workdir, "bert-f32.gguf"))
    top = max(args.concurrency)
    # jaxllm at its defaults (max_model_len: the model's 512 positions, 1024-token steps);
    # llama-server needs its slots and context sized for the run.
    jax_cmd = [sys.executable, "-m", "jaxllm.cli", "serve", folder, "--runner", "pooling", "--port", "18181",
               "--precompile", "all"]
    llama_cmd = [os.path.join(args.llama_bin, "llama-server"), "-m", gguf, "--embeddings", "--pooling", "mean",
                 "--port", "18182", "-t", str(threads), "-tb", str(threads), "-np", str(top),
                 "-c", str(top * args.input_len), "-b", str(top * args.input_len), "-ub", str(top * args.input_len)]
    rates = {c: {"jaxllm": [], "llama-server": []} for c in args.concurrency}
    logs = {n: os.path.join(args.workdir, f"{n}.log") for n in ("jaxllm", "llama-server")}
    with server(jax_cmd, 18181, logs["jaxllm"]) as jx, server(llama_cmd, 18182, logs["llama-server"]) as ls:
        bases = [("jaxllm", jx, folder), ("llama-server", ls, "bert")]
        import httpx
        probe = make_texts(folder, 1, args.input_len, seed=99)[0]   # same weights, same answer
        vecs = [np.array(httpx.post(f"{base}/v1/embeddings", json={"model": m, "input": probe}, timeout=600)
                         .json()["data"][0]["embedding"]) for _, base, m in bases]
        diff = float(np.abs(vecs[0] - vecs[1]).max())
        for c in args.concurrency:
            texts = make_texts(folder, args.requests, args.input_len, seed=c)
            for _, base, model in bases:   # warm
                asyncio.run(load(base, model, texts[:c], c))
            for r in range(args.repeats):
                for name, base, model in (bases if r % 2 == 0 else bases[::-1]):
                    rates[c][name].append(asyncio.run(load(base, model, texts, c)))
    print(f"# /v1/embeddings, {args.requests} one-input requests of {args.input_len} tokens, float32, "
          f"{threads} thread(s), {args.repeats} repeats, medians; model {folder}; "
          f"max |jaxllm - llama-server| {diff:.2e}")
    print(table(rates, "concurrency"))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({str(k): v for k, v in rates.items()}, f, indent=2)
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python bench/embeddings.py", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    for name, fn in (("offline", cmd_offline), ("serve", cmd_serve), ("profile", cmd_profile)):
        s = sub.add_parser(name)
        s.set_defaults(fn=fn)
        s.add_argument("--folder", default=None, help="a sentence-transformers folder (default: build a random "
                                                      "BERT of --layers x --hidden)")
        s.add_argument("--layers", type=int, default=6)
        s.add_argument("--hidden", type=int, default=384)
        s.add_argument("--heads", type=int, default=12)
        s.add_argument("--workdir", default="/tmp/jaxllm-bench-embeddings")
        s.add_argument("--input-len", type=int, default=128)
        s.add_argument("--repeats", type=int, default=3)
        s.add_argument("--threads", type=int, default=None, help="cores for both arms (default: all allowed)")
        s.add_argument("--output-json", default=None)
    sub.choices["offline"].add_argument("--batches", type=_ints, default=[1, 32, 256])
    sub.choices["profile"].add_argument("--batch", type=int, default=32)
    sub.choices["serve"].add_argument("--concurrency", type=_ints, default=[1, 4, 16])
    sub.choices["serve"].add_argument("--requests", type=int, default=64)
    sub.choices["serve"].add_argument("--llama-bin", default=os.path.join(LLAMA_DIR, "build/bin"))
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
