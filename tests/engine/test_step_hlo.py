"""Work the compiled step must do once, not once per layer, checked in the optimized HLO.

Like a cache copy (test_kv_in_place.py), repeated work is invisible in outputs and only
shows up as a slower step.
"""

from __future__ import annotations

import jax
import pytest


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the guard (layers/rotary.cos_sin) is CPU-only")
def test_rope_cos_sin_evaluated_once_per_step(tiny_llm):
    # XLA:CPU fuses cos(positions * inv_freq) into each layer's q and k rotation (2 per
    # layer) unless cos_sin keeps it in its own computation: at most one cosine per branch
    # of its conditional, whatever the depth.
    runner = tiny_llm.llm_engine.core.runner
    assert runner.arch.num_layers >= 2
    for bucket, compiled in runner._compiled.items():
        n = compiled.as_text().count(" cosine(")
        assert n <= 2, f"bucket {bucket}: cos evaluated in {n} places (once per layer's rope?)"
