"""The Llama family's parameter table (models/llama.py PARAMS) against the checkpoints it
describes: every name it gives is a tensor the checkpoint holds and maps back to the same
parameter, and each entry's logical axes fit its shape."""

from __future__ import annotations

import os

import pytest

from support.tiny_models import VARIANTS

from jaxllm.models import llama
from jaxllm.models.loader import NameMap, load_model, read_safetensors
from jaxllm.models.params import GLOBAL, LAYER


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_table_names_are_the_checkpoints_tensors(variant, tiny_checkpoints):
    path = tiny_checkpoints[variant]
    model = load_model(path)
    arch = model.arch
    names = NameMap(arch, "hf")
    expected = set()
    for p in llama.PARAMS.present(arch):
        if not p.from_checkpoint:
            continue
        per_expert = any("{expert}" in pat for pat in p.patterns(arch, "hf") if isinstance(pat, str))
        for layer in [None] if p.scope == GLOBAL else range(arch.num_layers):
            for expert in range(arch.num_experts) if per_expert else [None]:
                name = names.name(p.name, layer, expert or 0)
                assert names.lookup(name) == [(p, layer, expert, None)], name
                expected.add(name)
    saved = set(read_safetensors(os.path.join(path, "model.safetensors")))
    saved.discard("lm_head.weight" if arch.tie_word_embeddings else "")
    assert saved == expected
    shapes = {**llama.PARAMS.shapes(arch, GLOBAL), **llama.PARAMS.shapes(arch, LAYER)}
    assert {k: v.shape for k, v in model.globals.items()} == {
        k: s for k, s in llama.PARAMS.shapes(arch, GLOBAL).items() if k != "rope_inv_freq"}
    assert {k: v.shape for k, v in model.layers[0].items()} == llama.PARAMS.shapes(arch, LAYER)
    assert model.rope_inv_freq.shape == shapes["rope_inv_freq"]
    for p in llama.PARAMS.present(arch):
        assert len(p.axes) == len(shapes[p.name]), p.name
    for group in llama.PARAMS.fused:
        parts = [llama.PARAMS[n] for n in group.parts]
        assert len({(q.kind, q.native(arch), q.axes[1:]) for q in parts}) == 1, group.name
        assert group.axes[1:] == parts[0].axes[1:], group.name


def test_gguf_names_round_trip(tiny_checkpoints):
    arch = load_model(tiny_checkpoints["qwen2_qkv_bias"]).arch
    names = NameMap(arch, "gguf")
    assert names.name("q_bias", 2) == "blk.2.attn_q.bias" and names.name("embed") == "token_embd.weight"
    for p in llama.PARAMS.present(arch):
        if p.from_checkpoint:
            layer = None if p.scope == GLOBAL else 1
            assert names.lookup(names.name(p.name, layer)) == [(p, layer, None, None)]
    assert names.lookup("blk.1.attn_q.weight.extra") == [] and names.lookup("blk.x.attn_q.weight") == []


def test_fused_expert_tensor_names_give_chunks(tiny_checkpoints):
    arch = load_model(tiny_checkpoints["mixtral"]).arch
    hits = NameMap(arch, "hf").lookup("model.layers.1.mlp.experts.gate_up_proj")
    assert [(p.name, layer, expert, (c.index, c.count, c.axis)) for p, layer, expert, c in hits] == [
        ("experts_gate", 1, None, (0, 2, 1)), ("experts_up", 1, None, (1, 2, 1))]
    # Mixtral's blocks under either prefix.
    for prefix in ("block_sparse_moe", "mlp"):
        (p, layer, expert, chunk), = NameMap(arch, "hf").lookup(f"model.layers.0.{prefix}.experts.3.w2.weight")
        assert (p.name, layer, expert, chunk) == ("experts_down", 0, 3, None)
