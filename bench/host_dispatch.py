"""The host's share of a batch-1 decode step: the flat step call against the compiled
object's own call, alternated in one engine.

    python bench/host_dispatch.py                      # the built-in model, 6 rounds of 256 tokens
    python bench/host_dispatch.py --rounds 10 --tokens 512

On a CPU backend the engine's Python thread shares the cores with the step's kernels, so its
time per token is paid in decode speed.  Each round generates ``--tokens`` tokens at batch 1
(one request, temperature 0, EOS ignored) once per arm, in turn:

* ``compiled``: the step and sampler programs called as ``jax.stages.Compiled`` objects (the
  weights' pytree flattened and each argument's signature checked per call) and the
  outputs read with ``jax.device_get`` (what the runner did before runner/flat_call.py);
* ``flat``: the runner as it is: the programs' executables called on flat arrays, the weights
  flattened once, the outputs read by ``np.asarray``.

Printed per arm: the median over rounds of the wall time per token and of the engine thread's
CPU time per token (``time.thread_time``).  Both arms must produce the same tokens (checked).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time

import jax

from jaxllm import LLM, SamplingParams
from jaxllm.parallel import mesh as pmesh
from jaxllm.runner import flat_call


@contextlib.contextmanager
def arm(name: str):
    """The runner as it was before the flat call (``compiled``), or as it is (``flat``)."""
    if name == "flat":
        yield
        return
    fast, to_host = flat_call.FlatProgram.fast, pmesh.to_host
    flat_call.FlatProgram.fast = property(lambda self: False)
    pmesh.to_host = jax.device_get
    try:
        yield
    finally:
        flat_call.FlatProgram.fast, pmesh.to_host = fast, to_host


def measure(llm: LLM, rounds: int, tokens: int, prompt: str = "Tell me a story about a cat.") -> dict:
    """Per arm, the rounds' (wall ms per token, engine-thread CPU ms per token)."""
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    results: dict[str, list[tuple[float, float]]] = {"compiled": [], "flat": []}
    seen = {}
    for name in results:      # warm-up: every program of both arms has run once
        with arm(name):
            llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    for _ in range(rounds):
        for name in results:
            with arm(name):
                t, c = time.perf_counter(), time.thread_time()
                out = llm.generate([prompt], params)
                results[name].append(((time.perf_counter() - t) / tokens * 1e3, (time.thread_time() - c) / tokens * 1e3))
            ids = tuple(out[0].outputs[0].token_ids)
            if seen.setdefault("ids", ids) != ids:
                raise AssertionError(f"arm {name} generated other tokens than the first run")
    return results


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="a model (default: the built-in one)")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=256)
    args = ap.parse_args(argv)
    llm = LLM(args.model, max_model_len=max(512, args.tokens + 64))
    results = measure(llm, args.rounds, args.tokens)
    print(f"batch 1, {args.tokens} tokens a round, {args.rounds} rounds, arms alternated; medians:")
    print("| arm | wall ms/token | engine thread CPU ms/token | rounds (wall) |")
    print("|---|---:|---:|---|")
    for name, rows in results.items():
        wall = statistics.median(w for w, _ in rows)
        cpu = statistics.median(c for _, c in rows)
        print(f"| {name} | {wall:.2f} | {cpu:.2f} | {' / '.join(f'{w:.2f}' for w, _ in rows)} |")
    w0 = statistics.median(w for w, _ in results["compiled"])
    w1 = statistics.median(w for w, _ in results["flat"])
    print(f"flat / compiled speed: {w0 / w1:.3f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
