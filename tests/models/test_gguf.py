"""GGUF loading: a tiny Llama written the way llama.cpp's converter writes it (Q/K rows
permuted for interleaved RoPE, one tensor quantized, or every matrix) loads back to the HF
weights: dequantized, or kept in its blocks."""

from __future__ import annotations


import numpy as np
import pytest

from jaxllm.errors import ModelLoadError
from jaxllm.models.loader import load_gguf
from support.tiny_models import write_gguf

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


def test_dequantize_is_refused_for_an_hf_folder(tiny_llama):
    """``--dequantize`` changes how a GGUF is held; on an HF folder it would mean nothing, so
    it is refused by name rather than ignored."""
    from jaxllm.models.loader import load_model
    with pytest.raises(ModelLoadError, match="--dequantize"):
        load_model(tiny_llama, dequantize=True)
