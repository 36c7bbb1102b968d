"""The Pallas recurrent gated delta rule (pallas/gated_delta.py), in interpret mode, against
the float64 reference and the XLA recurrent form (tolerance 2e-5, as tests/layers/test_gated_delta.py)."""

from __future__ import annotations


import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.layers.gated_delta import (
    recurrent_gated_delta_rule,
    reference_gated_delta_rule,
)
from jaxllm.pallas.gated_delta import recurrent_gated_delta_rule_pallas
from support.gated_delta_inputs import TOL
from support.gated_delta_inputs import random_inputs as _inputs


@pytest.mark.parametrize("T,Hk,H", [(1, 2, 4), (6, 2, 4), (3, 3, 3)])
def test_matches_reference(T, Hk, H):
    q, k, v, g, beta, s0 = _inputs(40 + T, T=T, Hk=Hk, H=H)
    o, s = recurrent_gated_delta_rule_pallas(q, k, v, g, beta, s0, interpret=True)
    o_ref, s_ref = reference_gated_delta_rule(q, k, v, g, beta, s0)
    np.testing.assert_allclose(o, o_ref, **TOL)
    np.testing.assert_allclose(s, s_ref, **TOL)


def test_decode_steps_continue_the_state_and_padding():
    q, k, v, g, beta, s0 = _inputs(9, T=5)
    s = jnp.asarray(s0)
    outs = []
    for t in range(5):   # five decode steps, the state passed along
        o, s = recurrent_gated_delta_rule_pallas(*(x[:, t:t + 1] for x in (q, k, v, g, beta)), s, interpret=True)
        outs.append(o)
    o_ref, s_ref = reference_gated_delta_rule(q, k, v, g, beta, s0)
    np.testing.assert_allclose(jnp.concatenate(outs, axis=1), o_ref, **TOL)
    np.testing.assert_allclose(s, s_ref, **TOL)
    length = jnp.asarray([5, 2], jnp.int32)
    o, s = recurrent_gated_delta_rule_pallas(q, k, v, g, beta, s0, length, interpret=True)
    o_x, s_x = recurrent_gated_delta_rule(q, k, v, g, beta, s0, length)
    np.testing.assert_allclose(o, o_x, **TOL)
    np.testing.assert_allclose(s, s_x, **TOL)
