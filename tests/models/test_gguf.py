"""GGUF loading: a tiny Llama written the way llama.cpp's converter writes it (Q/K rows
permuted for interleaved RoPE, one tensor quantized, or every matrix) loads back to the HF
weights: dequantized, or kept in its blocks."""

from __future__ import annotations

import os

import numpy as np
import pytest

from jaxllm.errors import ModelLoadError
from jaxllm.models.loader import load_gguf, load_model

HF_TO_GGUF = {
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def llama_cpp_permute(w, n_head):
    """llama.cpp convert_hf_to_gguf's permutation (rotate-half -> interleaved rows)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(hf_path, out, drop=None, matrix_type=None):
    """``matrix_type``: a GGMLQuantizationType for every layer matrix (default: float32)."""
    import gguf
    from jaxllm.models.loader import read_safetensors
    loaded = load_model(hf_path)
    a = loaded.arch
    tensors = read_safetensors(os.path.join(hf_path, "model.safetensors"))
    w = gguf.GGUFWriter(out, "llama")
    w.add_block_count(a.num_layers)
    w.add_context_length(a.max_position_embeddings)
    w.add_embedding_length(a.hidden_size)
    w.add_feed_forward_length(a.intermediate_size)
    w.add_head_count(a.num_heads)
    w.add_head_count_kv(a.num_kv_heads)
    w.add_rope_freq_base(a.rope_theta)
    w.add_layer_norm_rms_eps(a.rms_norm_eps)
    w.add_vocab_size(a.vocab_size)
    for name, t in tensors.items():
        t = np.ascontiguousarray(t, dtype=np.float32)
        if name == "model.embed_tokens.weight":
            q = gguf.quants.quantize(t, gguf.GGMLQuantizationType.Q8_0)
            w.add_tensor("token_embd.weight", q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
            continue
        if name == "model.norm.weight":
            gname = "output_norm.weight"
        elif name == "lm_head.weight":
            gname = "output.weight"
        else:
            parts = name.split(".", 3)
            gname = f"blk.{parts[2]}.{HF_TO_GGUF[parts[3]]}"
            if parts[3].startswith("self_attn.q_proj"):
                t = llama_cpp_permute(t, a.num_heads)
            elif parts[3].startswith("self_attn.k_proj"):
                t = llama_cpp_permute(t, a.num_kv_heads)
        if gname == drop:
            continue
        if matrix_type is not None and t.ndim == 2 and gname.startswith("blk."):
            q = gguf.quants.quantize(t, matrix_type)
            w.add_tensor(gname, q, raw_shape=q.shape, raw_dtype=matrix_type)
        else:
            w.add_tensor(gname, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return loaded


def test_gguf_loads_to_the_hf_weights(tiny_llama, tmp_path):
    import gguf
    path = str(tmp_path / "tiny.gguf")
    hf = write_gguf(tiny_llama, path)
    g = load_gguf(path, dequantize=True)
    assert g.arch.num_heads == hf.arch.num_heads and g.arch.num_kv_heads == hf.arch.num_kv_heads
    assert not g.arch.tie_word_embeddings
    for i, (lg, lh) in enumerate(zip(g.layers, hf.layers)):
        for k in lh:
            np.testing.assert_array_equal(lg[k], lh[k], err_msg=f"layer {i} {k}")
    # The embedding went through Q8_0: equal to the gguf package's own round trip.
    emb = hf.globals["embed"].astype(np.float32)
    rt = gguf.quants.dequantize(gguf.quants.quantize(emb, gguf.GGMLQuantizationType.Q8_0),
                                gguf.GGMLQuantizationType.Q8_0)
    np.testing.assert_array_equal(g.globals["embed"], rt)
    np.testing.assert_array_equal(g.globals["lm_head"], hf.globals["lm_head"])
    np.testing.assert_array_equal(g.rope_inv_freq, hf.rope_inv_freq)


def test_gguf_packed_weights_are_the_files_blocks(tiny_llama, tmp_path):
    """Kept packed (the default), every quantized matrix is a PackedWeight holding the file's
    bytes, whose dequantization is the dequantized load's weight: the q/k rows' llama.cpp
    permutation is undone on every field of the blocks alike."""
    import gguf
    from jaxllm.quant import PackedWeight, dequantize
    path = str(tmp_path / "tiny-q8.gguf")
    write_gguf(tiny_llama, path, matrix_type=gguf.GGMLQuantizationType.Q8_0)
    packed, floats = load_gguf(path), load_gguf(path, dequantize=True)
    for i, (lp, lf) in enumerate(zip(packed.layers, floats.layers)):
        for k, w in lp.items():
            if lf[k].ndim == 1:
                assert isinstance(w, np.ndarray) and w.dtype == np.float32, k
                continue
            assert isinstance(w, PackedWeight) and w.type_name == "Q8_0", f"layer {i} {k}"
            np.testing.assert_array_equal(np.asarray(dequantize(w)), lf[k], err_msg=f"layer {i} {k}")
    assert isinstance(packed.globals["embed"], PackedWeight)
    np.testing.assert_array_equal(np.asarray(dequantize(packed.globals["embed"])), floats.globals["embed"])
    file_bytes = sum(t.data.nbytes for t in __import__("jaxllm.models.gguf_file", fromlist=["x"]).read_gguf(path).tensors)
    assert packed.weight_bytes() == file_bytes
    assert "Q8_0" in packed.formats() and "F32" in packed.formats()


def test_gguf_missing_tensor_is_named(tiny_llama, tmp_path):
    path = str(tmp_path / "broken.gguf")
    write_gguf(tiny_llama, path, drop="blk.2.ffn_up.weight")
    with pytest.raises(ModelLoadError, match=r"missing tensor 'blk\.2\.ffn_up\.weight'"):
        load_gguf(path)
