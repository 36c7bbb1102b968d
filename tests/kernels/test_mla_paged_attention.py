"""The Pallas MLA kernel (pallas/mla_paged_attention.py, interpret mode on CPU) against the
plain reference (layers/mla_attention.mla_reference) and the XLA path: a ragged step of a
prefill chunk and decodes over pages out of order, per-layer and stacked pages."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.layers.attention import AttentionMetadata
from jaxllm.layers.mla_attention import mla_reference, paged_mla_xla, write_latent
from jaxllm.pallas.mla_paged_attention import paged_mla

# Dims of at least 16 (the smallest dot the GPU lowering takes), as the compiled kernel needs.
H, R, DR, BS = 3, 32, 16, 16
LENS = (37, 5, 12)
TABLES = np.array([[9, 2, 7, 0], [1, 0, 0, 0], [13, 0, 0, 0]], np.int32)


def _case(seed=0):
    rng = np.random.default_rng(seed)
    entries = [rng.standard_normal((n, R + DR)).astype(np.float32) for n in LENS]
    pages = jnp.zeros((15, BS, R + DR), jnp.float32)   # block 0: the null block
    for s, n in enumerate(LENS):
        pos = np.arange(n)
        pages = write_latent(pages, None, jnp.asarray(TABLES[s, pos // BS] * BS + pos % BS), jnp.asarray(entries[s]))
    # The last 4 tokens of sequence 0 (a prefill chunk), the last of 1 and of 2 (decodes).
    positions = np.array([33, 34, 35, 36, 4, 11], np.int32)
    token_seq = np.array([0, 0, 0, 0, 1, 2], np.int32)
    q = rng.standard_normal((len(positions), H, R + DR)).astype(np.float32)
    return entries, pages, positions, token_seq, q


@pytest.mark.parametrize("stacked", [False, True], ids=["per-layer", "stacked"])
def test_kernel_matches_the_reference_and_the_xla_path(stacked):
    entries, pages, positions, token_seq, q = _case()
    layer = None
    if stacked:   # the layer's pages in the middle of three
        pages, layer = jnp.stack([pages * 0.5, pages, pages * 2.0]), 1
    got = np.asarray(paged_mla(jnp.asarray(q[..., :R]), jnp.asarray(q[..., R:]), pages, token_seq, positions, TABLES,
                               scale=0.3, layer=layer))   # interpret mode on CPU, compiled on a GPU
    for t, s in enumerate(token_seq):
        want = mla_reference(q[t:t + 1], entries[s], positions[t:t + 1], scale=0.3, latent_dim=R)
        np.testing.assert_allclose(got[t:t + 1], np.asarray(want), rtol=2e-5, atol=2e-6)
    md = AttentionMetadata(positions=positions, slot_mapping=np.zeros(len(positions), np.int32), token_seq=token_seq,
                           block_tables=TABLES, seq_lens=np.array(LENS, np.int32),
                           query_start_loc=np.array([0, 4, 5, 6], np.int32))
    xla = paged_mla_xla(jnp.asarray(q), pages, layer, md, scale=0.3, latent_dim=R)
    np.testing.assert_allclose(got, np.asarray(xla), rtol=2e-5, atol=2e-6)


def test_pages_of_the_wrong_width_are_refused():
    _, pages, positions, token_seq, q = _case()
    with pytest.raises(ValueError, match="expected R \\+ Dr"):
        paged_mla(jnp.asarray(q[..., :R]), jnp.asarray(q[..., R + 1:]), pages, token_seq, positions, TABLES, scale=1.0)
