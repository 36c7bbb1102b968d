"""``jaxllm bench perplexity FILE``: the perplexity of a text under the served numerics.

    jaxllm bench perplexity FILE [--ctx-size 512] [--chunks N] [--output-json F]
                                 [engine flags: --model, --cpu-matmul, --dequantize, ...]

Computed as llama.cpp's ``llama-perplexity -f FILE -c N`` computes it
(tools/perplexity/perplexity.cpp, ``perplexity()``), so the two print comparable numbers:

* the whole file is tokenized once, with the tokenizer's special tokens (a BOS first when the
  tokenizer adds one; the built-in SmolLM2 GGUF's does not);
* it is cut into ``len // N`` non-overlapping windows of ``N`` tokens (the tail is dropped;
  ``--chunks`` keeps only the first ones), and llama.cpp asks for at least ``2 N`` tokens;
* when the tokenizer adds a BOS, each window's first token is replaced by it;
* in each window only the second half is scored: the logprob of tokens ``N/2 + 1 .. N - 1``
  given everything before them in the window (``N - N/2 - 1`` tokens a window), so every
  scored token has at least ``N/2`` tokens of context;
* ``PPL = exp(mean nll)`` over all scored tokens, ``+/-`` its standard error
  ``PPL * sqrt((mean nll^2 - mean nll^2) / (count - 1))``; the running estimate after each
  window is printed as ``[i]ppl,`` like llama.cpp's.

The logprobs are the engine's own ``prompt_logprobs`` (each window one request of ``max_tokens=1``),
so they come from the same compiled step, kernels and ``--cpu-matmul`` choice as served text.
The windows go in together, so the engine batches them as it batches any requests.  The
tokens/s reported is the windows' tokens (all ``N`` of each, as llama.cpp evaluates them) over
the wall time from the first request in to the last out, compiled programs excluded (every
bucket is compiled before, as ``bench latency`` does).
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field

from bench.offline import _check_json_path, _make_engine, _write_json


def register(subparsers) -> None:
    from jaxllm.cli import add_engine_args
    p = subparsers.add_parser(
        "perplexity", help="perplexity of a text file from prompt logprobs (as llama-perplexity computes it)",
        description="Perplexity of a text file, from the engine's prompt logprobs in non-overlapping windows "
                    "of --ctx-size tokens scored on their second half (llama.cpp's llama-perplexity).")
    d = p.add_argument_group("workload")
    d.add_argument("file", metavar="FILE", help="the text file (UTF-8)")
    d.add_argument("--ctx-size", "-c", type=int, default=512,
                   help="tokens per window (default 512, as llama-perplexity -c)")
    d.add_argument("--chunks", type=int, default=-1,
                   help="score only the first N windows (default -1: all, as llama-perplexity --chunks)")
    g = p.add_argument_group("output")
    g.add_argument("--output-json", default=None, metavar="FILE", help="also write the results to this JSON file")
    add_engine_args(p)
    p.set_defaults(func=cmd_perplexity)


# ---------------------------------------------------------------------------- the arithmetic


def windows(tokens: list[int], n_ctx: int, bos_id: int | None, n_chunks: int = -1) -> list[list[int]]:
    """llama-perplexity's chunks: ``len(tokens) // n_ctx`` windows of ``n_ctx`` tokens (the first
    ``n_chunks`` when that is not -1), each starting with ``bos_id`` in place of its first token
    when the tokenizer adds a BOS (``bos_id`` not None)."""
    n = len(tokens) // n_ctx
    if n_chunks >= 0:
        n = min(n, n_chunks)
    out = []
    for i in range(n):
        w = list(tokens[i * n_ctx:(i + 1) * n_ctx])
        if bos_id is not None:
            w[0] = bos_id
        out.append(w)
    return out


def scored_slice(n_ctx: int) -> slice:
    """The positions of a window whose tokens are scored: ``n_ctx/2 + 1 .. n_ctx - 1`` (each is
    predicted from the logits at the position before it, llama.cpp's ``first = n_ctx/2``)."""
    return slice(n_ctx // 2 + 1, n_ctx)


@dataclass
class Estimate:
    """Running sums of the negative log-likelihoods (float64, as llama.cpp's ``double``)."""

    nll: float = 0.0
    nll2: float = 0.0
    count: int = 0
    running: list[float] = field(default_factory=list)
    """The estimate after each window, in window order."""

    def add(self, nlls) -> None:
        for v in nlls:
            v = float(v)
            self.nll += v
            self.nll2 += v * v
        self.count += len(nlls)
        self.running.append(math.exp(self.nll / self.count))

    @property
    def ppl(self) -> float:
        return math.exp(self.nll / self.count)

    @property
    def stderr(self) -> float:
        """llama.cpp's ``+/-``: the standard error of the mean nll, scaled by the perplexity."""
        mean = self.nll / self.count
        var = self.nll2 / self.count - mean * mean
        if var <= 0 or self.count < 2:
            return 0.0
        return math.sqrt(var / (self.count - 1)) * self.ppl


# ---------------------------------------------------------------------------- the command


def _check_args(args) -> None:
    """Everything checkable before the model loads."""
    if not os.path.isfile(args.file):
        raise ValueError(f"perplexity: {args.file}: no such file")
    if args.ctx_size is None or args.ctx_size < 4:
        raise ValueError(f"--ctx-size must be at least 4 (half of each window is context, the other half "
                         f"is scored), got {args.ctx_size}")
    if args.chunks is None or (args.chunks < 1 and args.chunks != -1):
        raise ValueError(f"--chunks must be a positive integer, or -1 for all, got {args.chunks}")
    if args.max_model_len is not None and args.ctx_size + 1 > args.max_model_len:
        # Each window is a prompt of --ctx-size tokens that samples one token after it.
        raise ValueError(f"--ctx-size {args.ctx_size} needs --max-model-len of at least {args.ctx_size + 1} "
                         f"(the window and one sampled token), got {args.max_model_len}")
    _check_json_path(args.output_json)


def read_text(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError as e:
        raise ValueError(f"perplexity: {path} is not UTF-8 text ({e})") from None
    if not text.strip():
        raise ValueError(f"perplexity: {path} is empty")
    return text


def tokenize(tokenizer, text: str) -> tuple[list[int], int | None]:
    """(the text's tokens, the BOS id when the tokenizer adds one else None): llama.cpp's
    ``common_tokenize(ctx, text, add_special=true)``, the BOS by the tokenizer's own rule."""
    probe = tokenizer.encode("a", add_special_tokens=True)
    bare = tokenizer.encode("a", add_special_tokens=False)
    bos = tokenizer.bos_token_id
    adds_bos = bos is not None and len(probe) == len(bare) + 1 and probe[0] == bos
    tokens = tokenizer.encode(text, add_special_tokens=False)
    return ([bos] + tokens if adds_bos else tokens), (bos if adds_bos else None)


def score_windows(engine, wins: list[list[int]], n_ctx: int, on_window=None) -> Estimate:
    """Runs every window as a request with ``prompt_logprobs=0`` and folds the nll of its scored
    tokens into an :class:`Estimate` in window order (``on_window(i, estimate)`` after each)."""
    from jaxllm.engine.output_processor import OutputKind
    from jaxllm.sampling_params import SamplingParams
    sp = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    ids = [f"ppl-{i}" for i in range(len(wins))]
    index = {rid: i for i, rid in enumerate(ids)}
    for rid, w in zip(ids, wins):
        engine.add_request(rid, {"prompt_token_ids": w}, sp, kind=OutputKind.FINAL_ONLY)
    est = Estimate()
    done: dict[str, list[float]] = {}
    nxt = 0
    sl = scored_slice(n_ctx)
    try:
        while nxt < len(ids) and engine.has_unfinished_requests():
            for o in engine.step():
                if not o.finished:
                    continue
                plp = o.prompt_logprobs   # [None] + one {token: Logprob} per prompt token after the first
                w = wins[index[o.request_id]]
                if plp is None or len(plp) != n_ctx or any(e is None for e in plp[sl]):
                    raise RuntimeError(f"request {o.request_id}: the engine returned no prompt logprob for "
                                       f"some scored token (prefix cache hit: {o.num_cached_tokens} tokens)")
                done[o.request_id] = [-plp[p][w[p]].logprob for p in range(sl.start, sl.stop)]
            while nxt < len(ids) and ids[nxt] in done:
                est.add(done.pop(ids[nxt]))
                if on_window is not None:
                    on_window(nxt, est)
                nxt += 1
    except BaseException:
        engine.abort_request(ids[nxt:])
        raise
    if nxt < len(ids):
        raise RuntimeError(f"the engine stopped after {nxt} of {len(ids)} windows")
    return est


def cmd_perplexity(args) -> int:
    _check_args(args)
    text = read_text(args.file)
    if args.enable_prefix_caching:
        # A window served partly from the prefix cache would have no prompt logprobs there.
        args.enable_prefix_caching = False
    engine = _make_engine(args)
    if engine.tokenizer is None:
        raise ValueError("perplexity needs the tokenizer: drop --skip-tokenizer-init")
    if args.ctx_size + 1 > engine.max_model_len:
        raise ValueError(f"--ctx-size {args.ctx_size} needs a max model length of at least {args.ctx_size + 1} "
                         f"(the window and one sampled token); the engine's is {engine.max_model_len}")
    tokens, bos = tokenize(engine.tokenizer, text)
    if len(tokens) < 2 * args.ctx_size:
        raise ValueError(f"perplexity needs at least {2 * args.ctx_size} tokens for --ctx-size {args.ctx_size} "
                         f"(as llama-perplexity); {args.file} tokenizes to only {len(tokens)}")
    wins = windows(tokens, args.ctx_size, bos, args.chunks)
    print(f"perplexity: {len(tokens)} tokens in {args.file}; {len(wins)} windows of {args.ctx_size} "
          f"(BOS {'first in each' if bos is not None else 'not added'}), "
          f"{args.ctx_size - args.ctx_size // 2 - 1} tokens scored in each", flush=True)

    def show(i, est):
        print(f"[{i + 1}]{est.running[-1]:.4f},", end="", flush=True)

    t0 = time.perf_counter()
    est = score_windows(engine, wins, args.ctx_size, show)
    elapsed = time.perf_counter() - t0
    n_eval = len(wins) * args.ctx_size
    print()
    print(f"Final estimate: PPL = {est.ppl:.4f} +/- {est.stderr:.5f}")
    print(f"{est.count} tokens scored, {n_eval} evaluated in {elapsed:.1f} s ({n_eval / elapsed:.1f} tokens/s; "
          f"{engine.model_name})")
    _write_json(args.output_json, {
        "model": engine.model_name, "file": os.path.abspath(args.file), "ctx_size": args.ctx_size,
        "num_tokens": len(tokens), "num_windows": len(wins), "bos": bos, "scored_tokens": est.count,
        "ppl": est.ppl, "ppl_stderr": est.stderr, "running": est.running, "elapsed_time": elapsed,
        "tokens_per_second": n_eval / elapsed, "cpu_matmul": args.cpu_matmul, "dequantize": args.dequantize,
    })
    return 0

