"""Bytes an MLA decode step reads: weights plus the latent cache, against the expanded-K/V alternative.

    python bench/mla_bytes.py [--time] [--contexts 1024,4096,32768] [--batches 1,32]

The table: for DeepSeek-V3 and DeepSeek-V2-Lite at their published shapes (transformers'
config classes, read by ``models/deepseek.arch_config``) in bfloat16, one decode step of
``batch`` sequences of ``context`` tokens each reads

* the weights it multiplies by, counted from the model's parameter table (``deepseek.PARAMS``:
  every layer's attention and dense or shared MLP, the router, the routed experts a batch of
  that size is expected to hit, the LM head);
* the cache: every layer's latent and rope key per token (``deepseek.cache_kinds``: what the
  engine allocates and the absorbed attention reads), against the K and V of every head that
  a cache of expanded keys (``qk_nope + qk_rope`` per head) and values (``v_head_dim``) would
  hold and read.

``--time``: one layer's paged attention of a decode step on this machine's default device,
the absorbed latent loop (``layers/mla_attention.paged_mla_xla``) against the K/V loop
(``layers/attention.paged_attention_xla``) over expanded pages (V padded to the key width, as
that kernel takes one head dim), at DeepSeek-V2-Lite's head shapes: a measurement of the
bytes' cost, the median of 5 runs.
"""

from __future__ import annotations

import argparse
import math
import time

import numpy as np

MIB = 2**20


def _configs():
    import transformers

    from jaxllm.models import deepseek
    v3 = transformers.DeepseekV3Config()          # the defaults are DeepSeek-V3's shapes
    lite = transformers.DeepseekV2Config(
        vocab_size=102400, hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408, num_hidden_layers=27,
        num_attention_heads=16, num_key_value_heads=16, n_shared_experts=2, n_routed_experts=64,
        num_experts_per_tok=6, first_k_dense_replace=1, q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128, topk_method="greedy", max_position_embeddings=163840,
        rope_parameters={"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
                         "mscale": 0.707, "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1,
                         "rope_theta": 10000.0})
    return {"DeepSeek-V3": deepseek.arch_config(v3, "DeepseekV3ForCausalLM", "V3"),
            "DeepSeek-V2-Lite": deepseek.arch_config(lite, "DeepseekV2ForCausalLM", "V2-Lite")}


def weight_bytes(arch, batch: int, itemsize: int = 2) -> float:
    """Weights one decode step of ``batch`` tokens reads; routed experts: the expected number
    of distinct experts ``batch * k`` uniform draws hit."""
    from jaxllm.models import deepseek
    from jaxllm.models.params import GLOBAL
    E, k = arch.num_experts, arch.num_experts_per_tok
    hit = E * (1 - (1 - k / E) ** batch)
    total = arch.hidden_size * batch                      # the embedding rows
    for p in deepseek.PARAMS.present(arch, GLOBAL):
        if p.name == "lm_head":
            total += math.prod(p.shape(arch))
    for i in range(arch.num_layers):
        for p in deepseek.PARAMS.present(arch, "layer"):
            if not p.has(arch, i):
                continue
            n = math.prod(p.shape(arch))
            total += n * hit / E if p.name in deepseek.EXPERT_PARAMS else n
    return total * itemsize


def cache_bytes(arch, batch: int, context: int, itemsize: int = 2) -> tuple[int, int]:
    """(latent cache, expanded K/V cache) bytes a decode step reads over every layer."""
    from jaxllm.models import deepseek
    latent = sum(k.num_layers * k.token_bytes for k in deepseek.cache_kinds(arch, itemsize)) * batch * context
    per_head = (arch.mla.qk_nope_head_dim + arch.head_dim) + arch.mla.v_head_dim
    expanded = arch.num_layers * arch.num_heads * per_head * itemsize * batch * context
    return latent, expanded


def table(contexts, batches) -> str:
    rows = [("| model | batch | context | weights MiB | latent cache MiB | expanded K/V MiB | step, MLA MiB | "
             "step, expanded MiB | expanded / MLA |"), "|---|---|---|---|---|---|---|---|---|"]
    for name, arch in _configs().items():
        for b in batches:
            w = weight_bytes(arch, b)
            for n in contexts:
                lat, exp = cache_bytes(arch, b, n)
                rows.append(f"| {name} | {b} | {n} | {w / MIB:,.0f} | {lat / MIB:,.0f} | {exp / MIB:,.0f} | "
                            f"{(w + lat) / MIB:,.0f} | {(w + exp) / MIB:,.0f} | {(w + exp) / (w + lat):.2f}x |")
    return "\n".join(rows)


def time_layer(batch: int, context: int, block: int = 16) -> tuple[float, float, int, int]:
    """(ms absorbed latent, ms expanded K/V, latent bytes, expanded bytes) of one layer's decode
    attention at DeepSeek-V2-Lite's head shapes (16 heads, R=512, rope 64, nope 128, v 128)."""
    import jax
    import jax.numpy as jnp

    from jaxllm.layers.attention import AttentionMetadata, paged_attention_xla
    from jaxllm.layers.mla_attention import paged_mla_xla
    H, R, Dr, Dn = 16, 512, 64, 128
    nb = batch * (context // block) + 1
    rng = np.random.default_rng(0)
    tables = (1 + np.arange(nb - 1, dtype=np.int32)).reshape(batch, context // block)
    md = AttentionMetadata(positions=np.full(batch, context - 1, np.int32), slot_mapping=np.zeros(batch, np.int32),
                           token_seq=np.arange(batch, dtype=np.int32), block_tables=tables,
                           seq_lens=np.full(batch, context, np.int32),
                           query_start_loc=np.arange(batch + 1, dtype=np.int32))
    pages = jnp.asarray(rng.standard_normal((nb, block, R + Dr), np.float32), jnp.bfloat16)
    q_lat = jnp.asarray(rng.standard_normal((batch, H, R + Dr), np.float32))
    k = jnp.asarray(rng.standard_normal((nb, block, H, Dn + Dr), np.float32), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((nb, block, H, Dn + Dr), np.float32), jnp.bfloat16)   # padded to the key width
    q = jnp.asarray(rng.standard_normal((batch, H, Dn + Dr), np.float32))
    mla = jax.jit(lambda q, p: paged_mla_xla(q, p, None, md, scale=0.1, latent_dim=R))
    kv = jax.jit(lambda q, k, v: paged_attention_xla(q, (k, v), None, md, scale=0.1))

    def median_ms(fn, *args):
        fn(*args).block_until_ready()
        ts = []
        for _ in range(5):
            t0 = time.perf_counter()
            fn(*args).block_until_ready()
            ts.append(time.perf_counter() - t0)
        return 1e3 * float(np.median(ts))

    return (median_ms(mla, q_lat, pages), median_ms(kv, q, k, v), batch * context * (R + Dr) * 2,
            batch * context * H * 2 * (Dn + Dr) * 2)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="1024,4096,32768")
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--time", action="store_true", help="also time one layer's decode attention both ways")
    ap.add_argument("--time-shapes", default="1x1024,8x1024,8x4096", help="BATCHxCONTEXT pairs for --time")
    args = ap.parse_args()
    print(table([int(x) for x in args.contexts.split(",")], [int(x) for x in args.batches.split(",")]))
    if args.time:
        import jax
        print(f"\none layer's decode attention on {jax.devices()[0].device_kind} (bf16 pages, median of 5)\n")
        print("| batch | context | latent pages MiB | expanded K/V pages MiB | absorbed MLA ms | expanded K/V ms |")
        print("|---|---|---|---|---|---|")
        for shape in args.time_shapes.split(","):
            b, n = (int(x) for x in shape.split("x"))
            t_mla, t_kv, b_mla, b_kv = time_layer(b, n)
            print(f"| {b} | {n} | {b_mla / MIB:,.1f} | {b_kv / MIB:,.1f} | {t_mla:.2f} | {t_kv:.2f} |")


if __name__ == "__main__":
    main()
