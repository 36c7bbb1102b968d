"""Formula gate: over many draws, each token's frequency matches the softmax of the processed
logits (chi-square at a fixed significance), for plain temperature, top-k, top-p and min-p.

Each draw is one row of a big batch with its own output position, so every draw uses fresh
noise from the counter-based generator.  The expected distribution is computed here in
float64 from the raw logits (the kept set from the serial reference's truncation).

This gate catches a broken noise *formula* (see the last test: noise scaled by 1/2, i.e.
the wrong temperature, which the order gate cannot see because the reference shares the
formula), but not a broken reduction order: a tie resolved to the wrong index changes no
frequency.  That is the order gate's job (``test_order_gate.py``).
"""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

from support.sampler_harness import Row, device_tokens, reference_tokens

from jaxllm.formats import gumbel as G
from jaxllm.sample import reference as ref
from jaxllm.sample.metadata import RowParams

ALPHA = 1e-3          # fixed significance: a correct sampler fails one case in a thousand runs
V = 24
DRAWS = 20_000
LOGITS = (np.random.default_rng(7).standard_normal(V) * 1.6).astype(np.float32)

CASES = {
    "temperature": RowParams(temperature=0.8),
    "top_k": RowParams(temperature=1.0, top_k=6),
    "top_p": RowParams(temperature=1.0, top_p=0.7),
    "min_p": RowParams(temperature=1.2, min_p=0.08),
    "all": RowParams(temperature=1.3, top_k=12, top_p=0.9, min_p=0.02),
}


def expected_probs(p: RowParams) -> np.ndarray:
    """softmax(logits / T) restricted to what min_p, top-k and top-p keep, in float64."""
    kept = np.isfinite(ref.truncate_row(LOGITS / np.float32(p.temperature), p))
    z = LOGITS.astype(np.float64) / p.temperature
    w = np.where(kept, np.exp(z - z[kept].max()), 0.0)
    return w / w.sum()


def draw(p: RowParams, n: int = DRAWS, seed: int = 1234, fresh: bool = False) -> np.ndarray:
    params = RowParams(**{**p.__dict__, "seed": seed})
    rows = [Row(LOGITS, params, out_pos=i) for i in range(n)]
    return np.bincount(device_tokens(rows, fresh=fresh), minlength=V)


def chi_square_p(counts: np.ndarray, probs: np.ndarray) -> float:
    kept = probs > 0
    exp = probs[kept] * counts.sum()
    # Pool the bins expected below 5 draws (the chi-square approximation needs ~5 per bin).
    small = exp < 5
    obs_k, exp_k = counts[kept], exp
    if small.any():
        obs_k = np.append(obs_k[~small], obs_k[small].sum())
        exp_k = np.append(exp_k[~small], exp_k[small].sum())
    return float(stats.chisquare(obs_k, exp_k).pvalue)


@pytest.mark.parametrize("case", list(CASES))
def test_frequencies_match_the_processed_softmax(case):
    p = CASES[case]
    probs = expected_probs(p)
    counts = draw(p)
    assert counts[probs == 0].sum() == 0, "a token outside the kept set was drawn"
    if case != "temperature":
        assert (probs == 0).any(), "the truncation kept everything: the case tests nothing"
    pval = chi_square_p(counts, probs)
    assert pval > ALPHA, f"{case}: chi-square p = {pval:.2e}"


def test_draws_equal_the_reference_on_a_sample():
    p = RowParams(**{**CASES["all"].__dict__, "seed": 99})
    rows = [Row(LOGITS, p, out_pos=i) for i in range(200)]
    # Laid out in a batch of DRAWS rows (the rest padding): the program the frequency tests
    # compiled, not one more (a row's draw does not depend on its batch).
    assert device_tokens(rows + [None] * (DRAWS - len(rows)))[:len(rows)] == reference_tokens(rows)


def test_formula_gate_sees_a_noise_formula_the_order_gate_cannot(monkeypatch):
    """Mutation: the noise scaled by 1/2 (draws from softmax(2x), a wrong temperature).  Host
    and device share the formula, so the order gate still passes; the frequencies do not."""
    orig = G.gumbel_from_bits
    monkeypatch.setattr(G, "gumbel_from_bits", lambda *a, **k: orig(*a, **k) * 0.5)
    p = CASES["temperature"]
    # One mutated program for both gates: the order gate's 64 rows ride in the frequency
    # draw's batch (DRAWS rows in all), as rows of their own request.
    rows = [Row(LOGITS, RowParams(**{**p.__dict__, "seed": 5}), out_pos=i) for i in range(64)]
    n = DRAWS - len(rows)
    freq = [Row(LOGITS, RowParams(**{**p.__dict__, "seed": 1234}), out_pos=i) for i in range(n)]
    toks = device_tokens(freq + rows, fresh=True)
    counts = np.bincount(toks[:n], minlength=V)
    assert toks[n:] == reference_tokens(rows)                                # order gate: blind
    assert chi_square_p(counts, expected_probs(p)) < ALPHA                   # formula gate: red
