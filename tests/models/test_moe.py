"""Mixture-of-experts: the MoE block against transformers' own, grouped against dense, loading.

* ``moe_mlp`` equals transformers' ``Qwen3MoeSparseMoeBlock`` (with and without
  ``norm_topk_prob``) and ``MixtralSparseMoeBlock`` (eager experts, float32), for both
  implementations, T in {1, 5, 64}, top-1 and top-2;
* the grouped implementation equals the dense one with packed-bf16 weights, with stacked
  ``[L, E, ...]`` weights and a layer index, and with padding rows;
* the grouped implementation never computes an expert no token was routed to (NaN weights in
  unrouted experts leave its output finite) and its compiled HLO has no dot of the dense
  size; the scanned model's HLO never materialises a layer's whole expert stack;
* loading: transformers' fused expert layout loads to the same arrays as the per-expert one,
  a missing / extra / misshapen expert tensor fails naming it, and configs we do not
  implement are refused naming the field.
"""

from __future__ import annotations

import json
import os
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file

from jaxllm.errors import ModelLoadError
from jaxllm.layers.moe import moe_mlp, route
from jaxllm.models.loader import load_model

D, F = 32, 48


def _weights(E: int, seed: int = 0, router_scale: float = 3.0):
    rng = np.random.default_rng(seed)
    return dict(
        router=(rng.standard_normal((E, D)) * router_scale / np.sqrt(D)).astype(np.float32),
        w_gate=(rng.standard_normal((E, F, D)) / np.sqrt(D)).astype(np.float32),
        w_up=(rng.standard_normal((E, F, D)) / np.sqrt(D)).astype(np.float32),
        w_down=(rng.standard_normal((E, D, F)) / np.sqrt(F)).astype(np.float32),
    )


def _x(T: int, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((T, D)).astype(np.float32)


def _hf_block(kind: str, w: dict, top_k: int, renormalize: bool):
    """transformers' own sparse MoE block with these weights, eager experts, float32."""
    import transformers
    E = w["router"].shape[0]
    if kind == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(hidden_size=D, moe_intermediate_size=F, num_experts=E,
                                          num_experts_per_tok=top_k, norm_topk_prob=renormalize)
        cls = transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock
    else:
        cfg = transformers.MixtralConfig(hidden_size=D, intermediate_size=F, num_local_experts=E,
                                         num_experts_per_tok=top_k)
        cls = transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock
    cfg._experts_implementation = "eager"
    block = cls(cfg).eval()
    with torch.no_grad():
        block.gate.weight.copy_(torch.from_numpy(w["router"]))
        block.experts.gate_up_proj.copy_(torch.from_numpy(np.concatenate([w["w_gate"], w["w_up"]], axis=1)))
        block.experts.down_proj.copy_(torch.from_numpy(w["w_down"]))
    return block


def _ours(x, w, top_k, renormalize, impl, **kw):
    f = jax.jit(lambda x, w: moe_mlp(x, w["router"], w["w_gate"], w["w_up"], w["w_down"], top_k, renormalize,
                                     impl, **kw))
    return np.asarray(f(x, w))


def _pack(w: dict) -> dict:
    return {k: jax.lax.bitcast_convert_type(jnp.asarray(v, jnp.bfloat16), jnp.uint16) for k, v in w.items()}


@pytest.mark.parametrize("kind,renormalize,top_k,T", [
    ("qwen3_moe", False, 2, 1), ("qwen3_moe", False, 2, 64), ("qwen3_moe", False, 1, 5),
    ("qwen3_moe", True, 2, 5), ("qwen3_moe", True, 1, 64),
    ("mixtral", True, 2, 1), ("mixtral", True, 2, 64),
])
def test_moe_block_matches_transformers(kind, renormalize, top_k, T):
    E = 8
    w = _weights(E, seed=T + top_k)
    x = _x(T, seed=T)
    with torch.no_grad():
        ref = _hf_block(kind, w, top_k, renormalize)(torch.from_numpy(x)[None])[0].numpy()
    for impl in ("grouped", "dense"):
        ours = _ours(x, w, top_k, renormalize, impl)
        err = np.abs(ours - ref).max() / np.abs(ref).max()
        assert err < 1e-5, f"{impl}: max relative error {err:.2e} against transformers"


@pytest.mark.parametrize("T", [1, 5, 64])
def test_grouped_equals_dense_with_packed_bf16(T):
    w = _weights(16, seed=3)
    x = _x(T, seed=4)
    packed = _pack(w)
    grouped = _ours(x, packed, 2, True, "grouped")
    dense = _ours(x, packed, 2, True, "dense")
    assert np.abs(grouped - dense).max() <= 1e-5 * np.abs(dense).max()
    # And still the model's function, to bf16 precision.
    f32 = _ours(x, w, 2, True, "dense")
    assert np.abs(grouped - f32).max() <= 3e-2 * np.abs(f32).max()


def test_stacked_layers_and_padding_rows():
    # Stacked [L, E, ...] expert weights with a (traced) layer index, as under lax.scan, and
    # rows past num_tokens (bucket padding): zero output, same result for the real rows.
    L, E, T, n = 3, 8, 12, 7
    ws = [_weights(E, seed=10 + i) for i in range(L)]
    stacked = {k: np.stack([w[k] for w in ws]) for k in ws[0]}
    x = _x(T, seed=5)
    for impl in ("grouped", "dense"):
        f = jax.jit(lambda x, s, layer, n: moe_mlp(x, s["router"][layer], s["w_gate"], s["w_up"], s["w_down"], 2,
                                                   True, impl, layer=layer, num_tokens=n))
        for layer in range(L):
            full = _ours(x, ws[layer], 2, True, "dense")
            out = np.asarray(f(x, stacked, jnp.int32(layer), jnp.int32(n)))
            np.testing.assert_allclose(out[:n], full[:n], rtol=1e-5, atol=1e-6, err_msg=f"{impl}, layer {layer}")
            assert not out[n:].any(), f"{impl}: padding rows must be zero"


def test_grouped_never_computes_unrouted_experts():
    # Experts no (real) token is routed to get NaN weights: the grouped path must not read
    # them (0 * NaN would poison the output), the dense one does.
    E, T, n = 16, 6, 4
    w = _weights(E, seed=7)
    x = _x(T, seed=8)
    _, experts = route(jnp.asarray(x), jnp.asarray(w["router"]), 2, True)
    routed = set(np.asarray(experts)[:n].ravel().tolist())
    assert len(routed) < E
    poisoned = {k: v.copy() for k, v in w.items()}
    for e in set(range(E)) - routed:
        for k in ("w_gate", "w_up", "w_down"):
            poisoned[k][e] = np.nan
    grouped = _ours(x, poisoned, 2, True, "grouped", num_tokens=jnp.int32(n))
    assert np.isfinite(grouped).all(), "the grouped path computed an expert no token was routed to"
    np.testing.assert_allclose(grouped[:n], _ours(x, w, 2, True, "dense")[:n], rtol=1e-5, atol=1e-6)
    assert np.isnan(_ours(x, poisoned, 2, True, "dense")).any()   # the guard itself works


def _dot_sizes(hlo: str) -> list[int]:
    sizes = []
    for m in re.finditer(r"= f32\[([\d,]*)\]\{[^}]*\} dot\(", hlo):
        sizes.append(int(np.prod([int(d) for d in m.group(1).split(",") if d])))
    return sizes


def test_grouped_hlo_has_no_dense_expert_dot():
    E, T, k = 8, 64, 2
    w = _weights(E)
    sds = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype)  # noqa: E731
    for impl in ("grouped", "dense"):
        hlo = jax.jit(lambda x, w: moe_mlp(x, w["router"], w["w_gate"], w["w_up"], w["w_down"], k, True, impl)).lower(
            sds(_x(T)), {n: sds(a) for n, a in w.items()}).compile().as_text()
        biggest = max(_dot_sizes(hlo))
        if impl == "dense":
            assert biggest >= E * T * F          # the check can see a dense expert dot
        else:
            assert biggest < E * T * F, f"grouped path has a dot of {biggest} elements (dense: {E * T * F})"
            assert biggest <= T * k * max(F, D)


# ------------------------------------------------------------------ whole model, loading


def test_scan_reads_experts_from_the_stack(tiny_checkpoints):
    # Under lax.scan the [L, E, F, D] stacks are indexed [layer, expert] in one slice: a
    # scanned-in [E, F, D] layer slice would be copied in full every layer (XLA:CPU).
    from jaxllm.layers.attention import AttentionMetadata
    from jaxllm.models import llama
    from jaxllm.runner.weights import allocate_kv_cache, to_device_params
    model = load_model(tiny_checkpoints["qwen3_moe"])
    arch = model.arch
    params = to_device_params(model, jnp.float32, True)
    kv = allocate_kv_cache(arch.num_layers, 4, 16, arch.num_kv_heads, arch.head_dim, jnp.float32, stacked=True)
    T = 4
    md = AttentionMetadata(positions=np.arange(T, dtype=np.int32), slot_mapping=np.arange(T, dtype=np.int32),
                           token_seq=np.zeros(T, np.int32), block_tables=np.arange(4, dtype=np.int32)[None],
                           seq_lens=np.array([T], np.int32), query_start_loc=np.array([0, T], np.int32))
    hlo = jax.jit(lambda p, kv, ids, md: llama.forward(arch, p, kv, ids, md)).lower(
        params, kv, np.zeros(T, np.int32), md).compile().as_text()
    E, Fe, Dm = arch.num_experts, arch.moe_intermediate_size, arch.hidden_size
    for shape in (f"f32[{E},{Fe},{Dm}]", f"f32[{E},{Dm},{Fe}]"):
        assert not re.search(re.escape(shape) + r"\{[^}]*\} (?!parameter)", hlo), \
            f"a whole layer's experts ({shape}) are materialised under scan"


def _copy(src: str, dst) -> str:
    shutil.copytree(src, dst)
    return str(dst)


def _rewrite(path: str, fn) -> None:
    f = os.path.join(path, "model.safetensors")
    tensors = load_file(f)
    tensors = fn(tensors)
    save_file(tensors, f, metadata={"format": "pt"})


def _fuse(tensors: dict, arch: str) -> dict:
    """Per-expert 2-D tensors -> transformers 5's in-memory fused 3-D layout."""
    names = {"qwen3_moe": ("mlp", "gate_proj", "up_proj", "down_proj"),
             "mixtral": ("block_sparse_moe", "w1", "w3", "w2")}[arch]
    prefix, g, u, d = names
    out = {k: v for k, v in tensors.items() if ".experts." not in k and ".gate.weight" not in k}
    layers = sorted({int(k.split(".")[2]) for k in tensors if ".experts." in k})
    for i in layers:
        pre = f"model.layers.{i}.{prefix}"
        E = len([k for k in tensors if k.startswith(f"{pre}.experts.") and k.endswith(f".{g}.weight")])

        def ex(p):
            return np.stack([tensors[f"{pre}.experts.{e}.{p}.weight"] for e in range(E)])

        out[f"model.layers.{i}.mlp.experts.gate_up_proj"] = np.concatenate([ex(g), ex(u)], axis=1)
        out[f"model.layers.{i}.mlp.experts.down_proj"] = ex(d)
        out[f"model.layers.{i}.mlp.gate.weight"] = tensors[f"{pre}.gate.weight"]
    return out


@pytest.mark.parametrize("variant", ["qwen3_moe", "mixtral"])
def test_fused_expert_layout_loads_the_same(variant, tiny_checkpoints, tmp_path):
    src = tiny_checkpoints[variant]
    fused = _copy(src, tmp_path / "fused")
    _rewrite(fused, lambda t: _fuse(t, variant))
    a, b = load_model(src), load_model(fused)
    assert a.arch == b.arch
    for la, lb in zip(a.layers, b.layers):
        assert la.keys() == lb.keys()
        for k in la:
            np.testing.assert_array_equal(la[k], lb[k], err_msg=k)
    # transformers reads the fused file as the same model (so the gate/up order is theirs).
    from support.tiny_models import load_hf
    ids = torch.tensor([[5, 17, 300, 42]])
    with torch.no_grad():
        a, b = load_hf(fused)(ids).logits.numpy(), load_hf(src)(ids).logits.numpy()
    assert np.abs(a - b).max() < 1e-5 * np.abs(b).max()


@pytest.mark.parametrize("variant,drop", [
    ("qwen3_moe", "model.layers.0.mlp.experts.3.up_proj.weight"),
    ("mixtral", "model.layers.1.block_sparse_moe.experts.2.w2.weight"),
    ("qwen3_moe", "model.layers.1.mlp.gate.weight"),
])
def test_missing_expert_tensor_is_named(variant, drop, tiny_checkpoints, tmp_path):
    path = _copy(tiny_checkpoints[variant], tmp_path / "ckpt")
    _rewrite(path, lambda t: {k: v for k, v in t.items() if k != drop})
    with pytest.raises(ModelLoadError, match=re.escape(f"missing tensor '{drop}'")):
        load_model(path)


def test_missing_projection_of_every_expert_is_named(tiny_checkpoints, tmp_path):
    path = _copy(tiny_checkpoints["qwen3_moe"], tmp_path / "ckpt")
    _rewrite(path, lambda t: {k: v for k, v in t.items() if not k.startswith("model.layers.1.mlp.experts.")
                              or not k.endswith("down_proj.weight")})
    expect = "missing tensor 'model.layers.1.mlp.experts.0.down_proj.weight'"
    with pytest.raises(ModelLoadError, match=re.escape(expect)):
        load_model(path)


@pytest.mark.parametrize("extra,shape,expect", [
    ("model.layers.0.mlp.experts.8.gate_proj.weight", (32, 64), "unexpected tensor 'model.layers.0.mlp.experts.8"),
    ("model.layers.0.mlp.gate_proj.weight", (160, 64), "unexpected tensor 'model.layers.0.mlp.gate_proj.weight'"),
    ("model.layers.0.mlp.experts.gate_up_proj", (8, 64, 64), "a second time"),
])
def test_extra_expert_tensor_is_named(extra, shape, expect, tiny_checkpoints, tmp_path):
    path = _copy(tiny_checkpoints["qwen3_moe"], tmp_path / "ckpt")
    _rewrite(path, lambda t: {**t, extra: np.zeros(shape, np.float32)})
    with pytest.raises(ModelLoadError, match=re.escape(expect)):
        load_model(path)


def test_misshapen_expert_tensor_is_named(tiny_checkpoints, tmp_path):
    path = _copy(tiny_checkpoints["qwen3_moe"], tmp_path / "ckpt")
    name = "model.layers.0.mlp.experts.5.down_proj.weight"
    _rewrite(path, lambda t: {**t, name: np.zeros((64, 31), np.float32)})
    with pytest.raises(ModelLoadError, match=re.escape(f"tensor '{name}'") + ".*shape"):
        load_model(path)


def _edit_config(path: str, **changes) -> None:
    f = os.path.join(path, "config.json")
    with open(f) as fh:
        cfg = json.load(fh)
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    with open(f, "w") as fh:
        json.dump(cfg, fh)


@pytest.mark.parametrize("variant,changes,field", [
    ("qwen3_moe", dict(decoder_sparse_step=2), "decoder_sparse_step"),
    ("qwen3_moe", dict(mlp_only_layers=[1]), "mlp_only_layers"),
    ("qwen3_moe", dict(shared_expert_intermediate_size=64), "shared_expert_intermediate_size"),
    ("mixtral", dict(num_experts_per_tok=5), "num_experts_per_tok"),
])
def test_unsupported_moe_config_is_refused(variant, changes, field, tiny_checkpoints, tmp_path):
    path = _copy(tiny_checkpoints[variant], tmp_path / "ckpt")
    _edit_config(path, **changes)
    with pytest.raises(ModelLoadError, match=field):
        load_model(path)


def test_older_config_spellings(tiny_checkpoints, tmp_path):
    # Qwen3-MoE configs on the Hub say "num_experts" (transformers 5.24 writes num_local_experts).
    path = _copy(tiny_checkpoints["qwen3_moe"], tmp_path / "ckpt")
    with open(os.path.join(path, "config.json")) as fh:
        n = json.load(fh)["num_local_experts"]
    _edit_config(path, num_local_experts=None, num_experts=n)
    assert load_model(path).arch == load_model(tiny_checkpoints["qwen3_moe"]).arch
    mixtral = load_model(tiny_checkpoints["mixtral"]).arch    # saved with "head_dim": null
    assert mixtral.head_dim == mixtral.hidden_size // mixtral.num_heads and mixtral.norm_topk_prob
