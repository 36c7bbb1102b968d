"""Runs the tiny checkpoints (but ``NOT_SWEPT``) sharded over 1, 2 (and some over 4) simulated CPU
devices; writes what it saw.  Also the helpers the other tensor-parallel probes share (``run``,
``engine_tokens``, ``probe_main``, ``run_probe``).

    XLA_FLAGS=--xla_force_host_platform_device_count=4 python -m support.tp_probe CKPT_ROOT OUT.npz

Run in its own process by test_tensor_parallel.py: the device count must be set before
JAX starts, and the rest of the suite runs on one device.  For each variant and mesh size
(4 devices: ``TP4``; expert parallelism: ``EP``): the prompt's logits through the paged cache,
32 greedy tokens decoded one step at a time, the shard shapes the
weights and cache really have, and whether the compiled forward communicates; and the engine's
tokens (``ENGINE``).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from jaxllm.layers.attention import AttentionMetadata
from jaxllm.models.kernels import Kernels
from jaxllm.models.loader import load_model
from jaxllm.models.registry import get_model_module
from jaxllm.parallel import mesh as pmesh
from jaxllm.parallel import sharding as psh
from jaxllm.runner.weights import allocate_kv_cache, to_device_params
from support.probes import probe_command, probe_env

BLOCK = 8
NOT_SWEPT = ("llama_linear_rope_mha", "mistral_sliding", "qwen2_qkv_bias", "qwen3_qk_norm", "mixtral")
"""Variants left out of the tp sweep (each variant is two compiles, tp=1 and tp=2), because a
sharded run elsewhere splits the same parameters (the families share their attention and MLP
parameter definitions) with the same feature on the split heads:

- llama_linear_rope_mha: multi-head attention with KV heads that split is the GQA Llama case
  again (its rope scaling is not sharded);
- mistral_sliding: the sliding window on split heads is Gemma 2's, Gemma 3's and GPT-OSS's tp2
  cells (test_tp_families.py: XLA, and Pallas per device for Gemma 2 and GPT-OSS);
- qwen2_qkv_bias: q/k/v biases split with their heads is GPT-OSS's tp2 cell (q/k/v/o biases);
- qwen3_qk_norm: the per-head q/k norm on split heads is Gemma 3's tp2 cell (and Qwen3-Next's
  full-attention layers, test_gdn_tp.py);
- mixtral: the experts' width split is qwen3_moe's tp2 cell here (and GLM-4-MoE's,
  DeepSeek-V2's and GPT-OSS's); its softmax top-k routing is computed whole on every device."""
TP4 = {("llama_gqa_untied", False), ("qwen3_moe", True)}
"""The (variant, expert parallel) runs also made on 4 devices; the other variants run at tp=2
only (each program is a compile).  tp=4 adds two things tp=2 does not show: KV heads fewer
than the shards, replicated (llama_gqa_untied's 2; llama3_rope_tied's 1 KV head is replicated
at tp=2 already), and experts spread 2 to a device (qwen3_moe's 8).  Row- and column-parallel
splits, the all-reduce and the family features are each shown by tp=2 on every variant."""
EP = ("qwen3_moe",)
"""The MoE variant that also runs with expert parallelism (at tp=2; at tp=4 per ``TP4``): the
expert-parallel dispatch is the same code for Mixtral's 4 experts (2 to a device at tp=2, as
qwen3_moe's 8 at tp=4), and Mixtral's own routing runs at tp=2 without it."""
ENGINE = (("qwen3_moe", 2, True),)
"""The engine end to end on this probe's devices: Qwen3-MoE with expert parallelism (the
dispatch under chunked prefill).  The plain tp=2 engine on the tiny Llama is the multi-host
engine's (test_multihost.py: this PROMPT, tp=2 over two processes, 32 greedy tokens equal one
device's) and the other families' (test_tp_families.py, test_gdn_tp.py, test_mla_tp.py)."""
PROMPT = np.random.default_rng(1).integers(3, 5000, size=24).astype(np.int32)
STEPS = 32


def run(path: str, tp: int, expert_parallel: bool, scan: bool, attention: str = "xla", prompt=PROMPT) -> dict:
    model = load_model(path)
    arch = model.arch
    mesh = pmesh.make_mesh(jax.devices()[:tp])
    rules = psh.rules_for(arch, tp, expert_parallel)
    params = to_device_params(model, jnp.float32, scan, False, mesh, rules)
    total = len(prompt) + STEPS
    nb = -(-total // BLOCK)
    table = np.random.default_rng(0).permutation(nb + 3)[:nb].astype(np.int32)   # pages out of order
    module = get_model_module(arch.architecture)
    if hasattr(module, "allocate_cache"):      # the family's cache, laid out as the runner lays it out
        kv = module.allocate_cache(arch, nb + 3, BLOCK, jnp.float32, scan,
                                   make=lambda s, d, sharding: jax.device_put(jnp.zeros(s, d), sharding),
                                   sharding=lambda axes: NamedSharding(mesh, psh.spec(axes, rules)))
    else:
        kv_sh = NamedSharding(mesh, psh.kv_spec(rules, scan))
        kv = allocate_kv_cache(arch.num_layers, nb + 3, BLOCK, arch.num_kv_heads, arch.head_dim, jnp.float32, scan,
                               make=lambda s, d: jax.device_put(jnp.zeros(s, d), kv_sh))

    kernels = Kernels(attention=attention, moe="expert_parallel" if expert_parallel else "grouped")

    def fwd(p, kv, ids, md):
        hidden, kv = module.forward(arch, p, kv, ids, md, kernels)
        return module.compute_logits(arch, p, hidden, kernels), kv

    rep = pmesh.replicated(mesh)
    jitted = jax.jit(fwd, donate_argnums=(1,), out_shardings=(rep, jax.tree.map(lambda a: a.sharding, kv)))

    def args_at(lo, hi, ids):
        pos = np.arange(lo, hi, dtype=np.int32)
        md = AttentionMetadata(
            positions=pos, slot_mapping=(table[pos // BLOCK] * BLOCK + pos % BLOCK).astype(np.int32),
            token_seq=np.zeros(hi - lo, np.int32), block_tables=table[None, :],
            seq_lens=np.array([hi], np.int32), query_start_loc=np.array([0, hi - lo], np.int32))
        return pmesh.place_tree((np.asarray(ids, np.int32), md), rep)

    # One token per call, prompt included: one compiled shape per run keeps the probe cheap
    # (chunked prefill under tensor parallelism is what the engine runs below exercise).  The
    # program is compiled once, ahead of time: every call runs it, and its text is what the
    # partitioner made of it (the collectives read below).
    with jax.set_mesh(mesh):
        compiled = jitted.lower(params, kv, *args_at(0, 1, prompt[:1])).compile()
    hlo = "" if tp == 1 else compiled.as_text()
    logits = []
    for i in range(len(prompt)):
        lg, kv = compiled(params, kv, *args_at(i, i + 1, prompt[i:i + 1]))
        logits.append(np.asarray(lg))
    logits = np.concatenate(logits)
    tokens = [int(logits[-1].argmax())]
    for i in range(STEPS - 1):
        n = len(prompt) + i
        lg, kv = compiled(params, kv, *args_at(n, n + 1, [tokens[-1]]))
        tokens.append(int(np.asarray(lg)[0].argmax()))
    layers = params["layers"]
    lp = {k: v for k, v in (layers.items() if isinstance(layers, dict) else layers[0].items())}
    shards = {k: list(v.addressable_shards[0].data.shape) for k, v in lp.items()}
    shards["embed"] = list(params["embed"].addressable_shards[0].data.shape)
    shards["kv"] = list(jax.tree.leaves(kv)[0].addressable_shards[0].data.shape)
    shards["cache"] = [list(a.addressable_shards[0].data.shape) for a in jax.tree.leaves(kv)]
    # Result shapes of every all-gather: what the partitioner had to assemble whole.
    gathered = sorted({m.group(1) for m in re.finditer(r"= \w+\[([\d,]*)\][^=]*? all-gather\(", hlo)})
    return {"logits": logits, "tokens": tokens, "shards": shards,
            "all_reduce": "all-reduce" in hlo, "all_gathers": [[int(d) for d in g.split(",") if d] for g in gathered]}


def engine_tokens(path: str, tp: int, ep: bool = False, scan: bool = True, prompt=PROMPT) -> list[int]:
    """The whole serving path (chunked prefill, the buckets it runs compiled ahead of time with
    the sharded cache, donated sharded cache, sampler) at ``tp``; the strict compile guard fails
    a step that traces or compiles a bucket already made.  (Every bucket up front at tp=2: the
    multi-host engine, test_multihost.py.)"""
    from jaxllm import LLM, SamplingParams
    llm = LLM(path, skip_tokenizer_init=True, tensor_parallel_size=tp, enable_expert_parallel=ep, max_num_seqs=1,
              max_num_batched_tokens=4, max_model_len=64, dtype="float32", scan_layers=scan, strict_compile_guard=True,
              show_progress=False)
    out = llm.generate([{"prompt_token_ids": prompt.tolist()}],
                       SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True), use_tqdm=False)
    return list(out[0].outputs[0].token_ids)


def probe_main(measure) -> None:
    """A probe script's body: ``OUT.npz CKPT...`` from argv; ``measure(path)`` yields (key,
    result) for one checkpoint (a :func:`run` result, whose logits go to OUT.npz, or
    ``{"tokens": ...}``); the rest is written to OUT.npz.json."""
    from jaxllm.config import default_cache_dir
    from jaxllm.runner import compile as cc
    cc.enable_persistent_cache(os.path.join(default_cache_dir(), "xla"))
    out, paths = sys.argv[1], sys.argv[2:]
    arrays, meta = {}, {}
    for path in paths:
        for key, r in measure(path):
            if "logits" in r:
                arrays[key] = r.pop("logits")
            meta[key] = r
            print(key, r["tokens"][:6], r.get("shards", ""), flush=True)
    np.savez(out, **arrays)
    with open(out + ".json", "w") as f:
        json.dump(meta, f)


def run_probe(name: str, root, paths: list[str], devices: int = 2) -> tuple[dict, dict]:
    """Runs probe ``support.<name>`` over ``paths`` in its own process on ``devices``
    simulated CPU devices (the count is fixed before JAX starts) -> (arrays, meta)."""
    out = os.path.join(str(root), "probe.npz")
    env = probe_env(XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
    r = subprocess.run(probe_command(name, out, *paths), env=env, capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    with open(out + ".json") as f:
        return dict(np.load(out)), json.load(f)


def main():
    from jaxllm.config import default_cache_dir
    from jaxllm.runner import compile as cc
    cc.enable_persistent_cache(os.path.join(default_cache_dir(), "xla"))
    root, out = sys.argv[1], sys.argv[2]
    arrays, meta = {}, {}
    for name in sorted(os.listdir(root)):
        if name in NOT_SWEPT:
            continue
        path = os.path.join(root, name)
        runs = [(1, False), (2, False)] + [(4, ep) for ep in (False, True) if (name, ep) in TP4]
        runs += [(2, True)] if name in EP else []
        for tp, ep in runs:
            key = f"{name}/tp{tp}{'/ep' if ep else ''}"
            try:
                r = run(path, tp, ep, scan=name != "llama_gqa_untied")
            except ValueError as e:       # a configuration the rules refuse, reported as such
                meta[key] = {"error": str(e)}
                continue
            arrays[key] = r.pop("logits")
            meta[key] = r
            print(key, r["tokens"][:6], r["shards"].get("q"), flush=True)
    r = run(os.path.join(root, "llama_gqa_untied"), 2, False, scan=True, attention="pallas")
    arrays["llama_gqa_untied/tp2/pallas"] = r.pop("logits")
    meta["llama_gqa_untied/tp2/pallas"] = r
    for name, tp, ep in ENGINE:
        key = f"engine/{name}/tp{tp}{'/ep' if ep else ''}"
        meta[key] = {"tokens": engine_tokens(os.path.join(root, name), tp, ep)}
        print(key, meta[key]["tokens"][:6], flush=True)
    np.savez(out, **arrays)
    with open(out + ".json", "w") as f:
        json.dump(meta, f)


if __name__ == "__main__":
    main()
