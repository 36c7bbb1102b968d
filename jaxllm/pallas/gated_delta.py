"""The recurrent gated delta rule (Gated DeltaNet decode) as one Pallas kernel.

Same function as ``layers/gated_delta.recurrent_gated_delta_rule`` (and checked against its
float64 reference): per (sequence, value head) the state ``S [Dk, Dv]`` is decayed, written
with the delta rule and read by the query, token after token.

Why a kernel: a decode step of a GDN layer is bound by the bytes of its state, not by
arithmetic.  Qwen3-Next-80B keeps 32 value heads of 128 x 128 float32 per layer: 2 MiB per
sequence and layer, ~72 MiB per sequence over its 36 GDN layers, against ~6 KiB of q/k/v
per token.  XLA evaluates the update as several fusions (decay, ``S^T k``, the outer-product
write, ``S^T q``), each of which streams the state through memory again; this kernel loads a
head's state once into on-chip memory, runs all of the call's tokens on it, and stores it once,
in place (the state is aliased input to output): the floor of one read and one write.

Layout: one program per (sequence, value head), grid ``(B, H)``.  q and k come in
transposed (``[B, H, Dk, T]``, token ``t`` a column) so that every operation is an
elementwise product or a reduction over the state's rows: no in-kernel transposes or
small-K dots, which the portable Pallas subset (Triton's, Mosaic's) lowers poorly.  The
L2 normalisation, scaling, the repeat of q/k heads over their value heads and the padding
mask are the XLA front end's (``formats/gdn_inputs.prepare``), elementwise and cheap.

Where the chunked (prefill) form would pay: its inner work is already batched matmuls that
XLA maps to the MXU / tensor cores; a fused kernel (FLA's ``chunk_gated_delta_rule``) would
save the materialised ``[C, C]`` and UT-transform intermediates and keep the state on chip
across chunks.  That is worth measuring on an accelerator once prefill of long prompts shows
the GDN layers in a profile; it is not built here.

Checked only in interpret mode (``interpret=True``, the default on CPU): no accelerator was
available when it was written, so its GPU/TPU lowering is untested.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jaxllm.formats.gdn_inputs import prepare


def _kernel(qT_ref, kT_ref, v_ref, g_ref, b_ref, s_ref, o_ref, s_out_ref, *, T: int):
    # One (sequence, head): qT, kT [Dk, T]; v, o [T, Dv]; g, b [1, T]; s, s_out [Dk, Dv]
    def step(t, s):
        qc = qT_ref[:, pl.ds(t, 1)]                                    # [Dk, 1]
        kc = kT_ref[:, pl.ds(t, 1)]                                    # [Dk, 1]
        v = v_ref[pl.ds(t, 1), :]                                      # [1, Dv]
        s = s * jnp.exp(g_ref[:, pl.ds(t, 1)])                         # [Dk, Dv] decayed
        delta = (v - jnp.sum(s * kc, axis=0, keepdims=True)) * b_ref[:, pl.ds(t, 1)]   # [1, Dv]
        s = s + kc * delta
        o_ref[pl.ds(t, 1), :] = jnp.sum(s * qc, axis=0, keepdims=True)
        return s

    s_out_ref[...] = jax.lax.fori_loop(0, T, step, s_ref[...].astype(jnp.float32))


@functools.partial(jax.jit, static_argnames=("use_qk_l2norm", "scale", "interpret"))
def recurrent_gated_delta_rule_pallas(q, k, v, g, beta, state, length=None, *, use_qk_l2norm: bool = True,
                                      scale: float | None = None, interpret: bool | None = None):
    """Same arguments and results as ``layers.gated_delta.recurrent_gated_delta_rule``:
    q, k [B, T, Hk, Dk], v [B, T, H, Dv], g, beta [B, T, H], state [B, H, Dk, Dv] ->
    (o [B, T, H, Dv] float32, state [B, H, Dk, Dv] float32).  ``interpret`` None: interpret
    mode on CPU."""
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    B, T = k.shape[:2]
    q, k, v, g, beta = prepare(q, k, v, g, beta, length, use_qk_l2norm, scale)
    H, Dk, Dv = v.shape[2], k.shape[-1], v.shape[-1]
    qT, kT = (jnp.transpose(x, (0, 2, 3, 1)) for x in (q, k))         # [B, H, Dk, T]
    vh = jnp.transpose(v, (0, 2, 1, 3))                                # [B, H, T, Dv]
    gh, bh = (jnp.transpose(x, (0, 2, 1))[:, :, None, :] for x in (g, beta))   # [B, H, 1, T]
    per_head = lambda *shape: pl.BlockSpec((None, None, *shape), lambda b, h: (b, h, 0, 0))
    o, state = pl.pallas_call(
        functools.partial(_kernel, T=T),
        grid=(B, H),
        in_specs=[per_head(Dk, T), per_head(Dk, T), per_head(T, Dv), per_head(1, T), per_head(1, T),
                  per_head(Dk, Dv)],
        out_specs=[per_head(T, Dv), per_head(Dk, Dv)],
        out_shape=[jax.ShapeDtypeStruct((B, H, T, Dv), jnp.float32),
                   jax.ShapeDtypeStruct((B, H, Dk, Dv), jnp.float32)],
        input_output_aliases={5: 1},                                   # the state, in place
        interpret=interpret,
        name=f"recurrent_gated_delta_dk{Dk}_dv{Dv}_t{T}",
    )(qT, kT, vh, gh, bh, state.astype(jnp.float32))
    o = jnp.transpose(o, (0, 2, 1, 3))                                 # [B, T, H, Dv]
    if length is not None:
        o = jnp.where((jnp.arange(T)[None, :] < length[:, None])[..., None, None], o, 0.0)
    return o, state
