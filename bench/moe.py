"""Mixture-of-experts decode: the grouped expert matmul against the dense loop over experts.

    python bench/moe.py                                  # the table in docs/BENCHMARKS.md
    python bench/moe.py --batches 1 8 --repeat 5 --layers 2
    python bench/moe.py --dtype bfloat16 --scan          # packed-bf16 weights, layers under lax.scan
    python bench/moe.py --block                          # + one MoE block alone, with jax.lax.ragged_dot

A random-weight Qwen3-MoE-shaped model (no checkpoint, no tokenizer): hidden 512, 8 query /
2 KV heads of 64, 32 experts of width 512, top-2 with renormalised weights, 6 layers, a
4096-token vocabulary: 159M parameters, of which the experts are 95%.  Each cell
times the jitted, decode-shaped forward (one token per sequence, every sequence with
``--context`` tokens already in a paged KV cache, the cache donated) plus the logits and a
greedy argmax: the model part of a decode step, without the engine around it.  The two
implementations (``jaxllm/layers/moe.py``) run the same inputs in alternating rounds (three
rounds of ``--repeat``/3 calls each, after an untimed call), so that drift on a shared machine
hits both; cells are medians over ``--repeat`` calls.

"grouped" reads only the routed experts (sorted assignments, one loop iteration per expert
that has tokens); "dense" runs every expert on every token and zeroes the unrouted ones.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.layers.attention import AttentionMetadata
from jaxllm.layers.moe import moe_mlp, route
from jaxllm.layers.rotary import inv_frequencies
from jaxllm.models import llama
from jaxllm.models.config import ArchConfig, RopeScaling
from jaxllm.models.kernels import Kernels
from jaxllm.models.params import LAYER
from jaxllm.models.loader import LoadedModel
from jaxllm.runner.weights import allocate_kv_cache, to_device_params

IMPLS = ("grouped", "dense")
BLOCK = 16


def make_arch(layers: int, experts: int, top_k: int, hidden: int, moe_width: int, vocab: int) -> ArchConfig:
    heads, kv_heads = hidden // 64, max(1, hidden // 256)
    return ArchConfig(
        architecture="Qwen3MoeForCausalLM", vocab_size=vocab, hidden_size=hidden, intermediate_size=moe_width,
        num_layers=layers, num_heads=heads, num_kv_heads=kv_heads, head_dim=64, rms_norm_eps=1e-6,
        rope_theta=1e6, rope_scaling=RopeScaling(), max_position_embeddings=4096, tie_word_embeddings=False,
        qk_norm=True, num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=moe_width,
        norm_topk_prob=True)


def random_model(arch: ArchConfig, seed: int = 0) -> LoadedModel:
    rng = np.random.default_rng(seed)

    def w(*shape):
        return (rng.standard_normal(shape, dtype=np.float32) * (1.0 / np.sqrt(shape[-1]))).astype(np.float32)

    layers = []
    for _ in range(arch.num_layers):
        lp = {}
        for name, shape in llama.PARAMS.shapes(arch, LAYER).items():
            lp[name] = (1.0 + 0.1 * rng.standard_normal(shape, dtype=np.float32)) if len(shape) == 1 else w(*shape)
        lp["router"] *= 3.0   # clear routing decisions
        layers.append(lp)
    glob = {"embed": w(arch.vocab_size, arch.hidden_size), "lm_head": w(arch.vocab_size, arch.hidden_size),
            "final_norm": np.ones(arch.hidden_size, np.float32)}
    return LoadedModel(name="random-moe", arch=arch, layers=layers, globals=glob,
                       rope_inv_freq=inv_frequencies(arch.head_dim, arch.rope_theta, arch.rope_scaling),
                       tokenizer=None)


def decode_inputs(S: int, context: int, seed: int = 0):
    """One decode token for each of S sequences at position ``context``; sequence i owns
    blocks [1 + i * nb, 1 + (i + 1) * nb) (block 0 is the null block)."""
    nb = -(-(context + 1) // BLOCK)
    pos = np.full(S, context, np.int32)
    tables = (1 + np.arange(S * nb, dtype=np.int32)).reshape(S, nb)
    slots = tables[np.arange(S), pos // BLOCK] * BLOCK + pos % BLOCK
    md = AttentionMetadata(positions=pos, slot_mapping=slots.astype(np.int32), token_seq=np.arange(S, dtype=np.int32),
                           block_tables=tables, seq_lens=pos + 1, query_start_loc=np.arange(S + 1, dtype=np.int32))
    ids = np.random.default_rng(seed).integers(0, 4096, size=S).astype(np.int32)
    return ids, md, 1 + S * nb


def bench_model(arch, model, batches, repeat, context, dtype, scan, matmul="xla"):
    bf16 = dtype == "bfloat16"
    params = to_device_params(model, jnp.bfloat16 if bf16 else jnp.float32, scan, packed_bf16=bf16)
    weight_bytes = sum(a.nbytes for a in jax.tree.leaves(params))
    expert_bytes = sum(a.nbytes for lp in (params["layers"] if not scan else [params["layers"]])
                       for n, a in lp.items() if n.startswith("experts_"))
    rows = []
    for S in batches:
        ids, md, num_blocks = decode_inputs(S, context)
        ids, md = jax.device_put((ids, md))
        steps, kvs = {}, {}
        for impl in IMPLS:
            def step(p, kv, ids, md, kernels=Kernels(matmul=matmul, moe=impl)):
                hidden, kv = llama.forward(arch, p, kv, ids, md, kernels)
                return kv, jnp.argmax(llama.compute_logits(arch, p, hidden, kernels), axis=-1)
            kv = allocate_kv_cache(arch.num_layers, num_blocks, BLOCK, arch.num_kv_heads, arch.head_dim,
                                   jnp.uint16 if bf16 else jnp.float32, stacked=scan)
            steps[impl] = jax.jit(step, donate_argnums=(1,)).lower(params, kv, ids, md).compile()
            for _ in range(2):   # warm-up
                kv, tok = steps[impl](params, kv, ids, md)
            tok.block_until_ready()
            kvs[impl] = kv
        times = {impl: [] for impl in IMPLS}
        rounds = min(3, repeat)
        for r in range(rounds):
            for impl in IMPLS:
                # An untimed call first: the other implementation's call (the dense one's
                # temporaries are weight-sized) must not be billed to this one.
                kvs[impl], tok = steps[impl](params, kvs[impl], ids, md)
                tok.block_until_ready()
                for _ in range(repeat // rounds + (r < repeat % rounds)):
                    t0 = time.perf_counter()
                    kvs[impl], tok = steps[impl](params, kvs[impl], ids, md)
                    tok.block_until_ready()
                    times[impl].append(time.perf_counter() - t0)
        med = {impl: statistics.median(t) for impl, t in times.items()}
        rows.append((S, med))
        print(f"  batch {S}: " + ", ".join(f"{i} {m * 1e3:.1f} ms" for i, m in med.items()), flush=True)
    return rows, weight_bytes, expert_bytes


def _ragged(x, router, wg, wu, wd, k):
    """The same MoE block through jax.lax.ragged_dot (sorted rows, group sizes): for comparison only."""
    T, D = x.shape
    E = router.shape[0]
    weights, experts = route(x, router, k, True)
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    xs = x[order // k]
    sizes = jnp.zeros((E,), jnp.int32).at[flat].add(1)
    dn = jax.lax.RaggedDotDimensionNumbers((((1,), (2,)), ((), ())), (0,), (0,))   # w [E, out, in]
    h = jax.nn.silu(jax.lax.ragged_dot_general(xs, wg, sizes, dn)) * jax.lax.ragged_dot_general(xs, wu, sizes, dn)
    y = jax.lax.ragged_dot_general(h, wd, sizes, dn)
    y = y[jnp.argsort(order)].reshape(T, k, D)
    return jnp.sum(y * weights[..., None], axis=1)


def bench_block(arch, model, batches, repeat):
    lp = {n: jnp.asarray(a) for n, a in model.layers[0].items()}
    args = (lp["router"], lp["experts_gate"], lp["experts_up"], lp["experts_down"])
    k = arch.num_experts_per_tok
    fns = {impl: jax.jit(lambda x, r, g, u, d, impl=impl: moe_mlp(x, r, g, u, d, k, True, impl)) for impl in IMPLS}
    fns["ragged_dot"] = jax.jit(lambda x, r, g, u, d: _ragged(x, r, g, u, d, k))
    print(f"\none MoE block (E={arch.num_experts}, D={arch.hidden_size}, F={arch.moe_intermediate_size}, "
          f"top-{k}, float32), median ms per call")
    print("| tokens | " + " | ".join(fns) + " |")
    print("|---:|" + "---:|" * len(fns))
    rng = np.random.default_rng(1)
    for T in batches:
        x = jnp.asarray(rng.standard_normal((T, arch.hidden_size), dtype=np.float32))
        ref = None
        cells = []
        for name, f in fns.items():
            out = f(x, *args).block_until_ready()
            ref = out if ref is None else ref
            assert np.allclose(np.asarray(out), np.asarray(ref), rtol=1e-4, atol=1e-4), name
            ts = []
            for _ in range(repeat):
                t0 = time.perf_counter()
                f(x, *args).block_until_ready()
                ts.append(time.perf_counter() - t0)
            cells.append(f"{statistics.median(ts) * 1e3:.2f}")
        print(f"| {T} | " + " | ".join(cells) + " |", flush=True)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--repeat", type=int, default=15)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--moe-width", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--context", type=int, default=128, help="tokens already in each sequence's KV cache")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--scan", action="store_true", help="layers under lax.scan (default: unrolled, CPU's default)")
    ap.add_argument("--matmul", choices=("xla", "native"), default="xla",
                    help="backend of the attention projections and LM head (experts always use XLA dots)")
    ap.add_argument("--block", action="store_true", help="also time one MoE block alone, with ragged_dot")
    args = ap.parse_args(argv)
    if args.matmul == "native":
        from jaxllm.cpu import native
        if not native.available():   # builds and registers the kernel
            ap.error("--matmul native: the native CPU kernel is not available here")
    arch = make_arch(args.layers, args.experts, args.top_k, args.hidden, args.moe_width, args.vocab)
    model = random_model(arch)
    print(f"random MoE model: {arch.num_params() / 1e6:.1f}M parameters, {args.layers} layers, "
          f"{args.experts} experts (top-{args.top_k}) of width {args.moe_width}, hidden {args.hidden}, "
          f"{args.dtype}, {'scan' if args.scan else 'unrolled'}, {args.matmul} matmuls, context {args.context}, "
          f"{jax.devices()[0].platform} x{jax.device_count()}")
    rows, wb, eb = bench_model(arch, model, args.batches, args.repeat, args.context, args.dtype, args.scan,
                               args.matmul)
    print(f"\nweights {wb / 1e6:.0f} MB, of which experts {eb / 1e6:.0f} MB ({100 * eb / wb:.0f}%)")
    print("decode step (forward + logits + argmax), output tokens/s (median ms per step)\n")
    print("| batch | grouped tok/s | dense tok/s | grouped ms/step | dense ms/step | grouped / dense |")
    print("|---:|---:|---:|---:|---:|---:|")
    for S, med in rows:
        g, d = med["grouped"], med["dense"]
        print(f"| {S} | {S / g:.1f} | {S / d:.1f} | {g * 1e3:.1f} | {d * 1e3:.1f} | {d / g:.2f}x |")
    if args.block:
        bench_block(arch, model, args.batches, args.repeat)


if __name__ == "__main__":
    main()
