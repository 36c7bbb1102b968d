"""jaxllm.functional: the dense, cache-free forward for notebooks, against transformers.

For a tiny random-weight checkpoint of every variant (GQA, tied/untied heads, llama3 and
linear RoPE scaling, sliding window shorter than the prompt, q/k/v bias, q/k norm), the
logits of a batch of two different 40-token sequences equal transformers' within 1e-4
relative, row by row.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from support.tiny_models import VARIANTS, load_hf

from jaxllm import functional


def batch_ids(seed: int, B: int = 2, L: int = 40) -> np.ndarray:
    return np.random.default_rng(seed).integers(3, 5000, size=(B, L)).astype(np.int32)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_logits_match_transformers(variant, tiny_checkpoints):
    path = tiny_checkpoints[variant]
    params, forward = functional.load(path)
    ids = batch_ids(seed=3)
    ours = np.asarray(forward(params, ids))
    assert ours.shape == (2, 40, forward.arch.vocab_size) and ours.dtype == np.float32
    with torch.no_grad():
        ref = load_hf(path)(torch.tensor(ids.astype(np.int64))).logits.numpy()
    for b in range(ids.shape[0]):
        rel = np.abs(ours[b] - ref[b]).max() / np.abs(ref[b]).max()
        assert rel < 1e-4, f"{variant} row {b}: max relative logit error {rel:.2e}"


def test_forward_is_a_plain_jitted_function(tiny_llama):
    """Same params and tokens -> same logits; a row does not depend on its neighbour; the
    function lowers like any jitted function."""
    import jax
    params, forward = functional.load(tiny_llama)
    ids = batch_ids(seed=4)
    both = np.asarray(forward(params, ids))
    alone = np.asarray(forward(params, ids[1:]))
    # Equal up to float32 rounding: XLA blocks a matmul of 2 rows differently from one of 1
    # (ulp-level differences, up to ~2e-5 on logits of magnitude ~4 on this machine); a row
    # that saw its neighbour would differ by O(1).
    scale = np.abs(alone[0]).max()
    assert np.abs(both[1] - alone[0]).max() <= 1e-5 * scale, np.abs(both[1] - alone[0]).max() / scale
    assert "dot_general" in forward.lower(params, ids).as_text()
    # Differentiable in the weights (research use): a finite, non-zero gradient.
    g = jax.grad(lambda p: forward(p, ids[:, :8])[0, -1, 5])(params)
    assert np.isfinite(np.asarray(g["embed"])).all() and np.abs(np.asarray(g["final_norm"])).max() > 0


def test_bfloat16_close_to_float32(tiny_llama):
    p32, f32 = functional.load(tiny_llama)
    p16, f16 = functional.load(tiny_llama, dtype="bfloat16")
    ids = batch_ids(seed=5, B=1, L=16)
    a, b = np.asarray(f32(p32, ids)), np.asarray(f16(p16, ids))
    rel = np.abs(a - b).max() / np.abs(a).max()
    assert rel < 5e-2, rel
    assert not np.array_equal(a, b)   # it really ran in bfloat16
    with pytest.raises(ValueError, match="dtype"):
        functional.load(tiny_llama, dtype="float64")
