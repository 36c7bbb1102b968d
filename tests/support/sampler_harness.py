"""Runs the device sampler on hand-made rows, and the serial reference on the same rows."""

from __future__ import annotations

from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.sample import metadata as smd
from jaxllm.sample import reference as ref
from jaxllm.sample import sampler as sm


@dataclass
class Row:
    """One request at one step: its raw logits and everything the sampler reads for it."""

    logits: np.ndarray                      # [V] float32
    params: smd.RowParams
    out_pos: int = 0
    counts: np.ndarray | None = None        # [V] output-token counts
    prompt_mask: np.ndarray | None = None   # [V] bool
    suppress: list[int] = field(default_factory=list)


_JIT: dict = {}


def device_tokens(rows: list[Row | None], *, sort_baseline: bool = False, fp64: bool = False,
                  fresh: bool = False) -> list[int]:
    """Tokens the compiled sampler draws for ``rows`` laid out as batch rows (None: a padding
    row).  Each row gets its own state slot, in reverse order, so slots never equal rows.
    ``sort_baseline``: the sampler with the sort-based truncation (``ref.sample_reference``)."""
    S = len(rows)
    V = next(r.logits.shape[0] for r in rows if r is not None)
    R = S + 1
    counts = np.zeros((R, V), np.int32)
    prompt = np.zeros((R, V), bool)
    bias = np.zeros((R, V), np.float32)
    logits = np.zeros((S, V), np.float32)
    a = smd.empty_metadata(S)
    a["slot"][:] = R - 1
    for i, r in enumerate(rows):
        if r is None:
            continue
        slot = S - 1 - i
        logits[i] = r.logits
        if r.counts is not None:
            counts[slot] = r.counts
        if r.prompt_mask is not None:
            prompt[slot] = r.prompt_mask
        if r.params.bias_row is not None:
            bias[slot] = r.params.bias_row
        smd.fill_row(a, i, r.params, slot=slot, out_pos=r.out_pos, num_prompt=0, reset=False,
                     suppress=r.suppress, num_logprobs=-1)
    state = sm.SamplerState(jnp.asarray(counts), jnp.asarray(prompt), jnp.asarray(bias))
    key = (sort_baseline, fp64)
    if fresh or key not in _JIT:
        if sort_baseline:
            _JIT[key] = jax.jit(lambda l, m, s: ref.sample_reference(l, m, s, fp64=fp64))
        else:
            _JIT[key] = jax.jit(lambda l, m, s: sm.sample(l, m, s, max_logprobs=0, fp64=fp64).token_ids)
    f = _JIT[key] if not fresh else _JIT.pop(key)
    return np.asarray(f(jnp.asarray(logits), smd.to_metadata(a), state)).tolist()


def reference_tokens(rows: list[Row], fp64: bool = False) -> list[int]:
    return [ref.sample_row(r.logits, r.params, r.out_pos, r.counts, r.prompt_mask, r.suppress, fp64=fp64)
            for r in rows]


def tie_pair(seed: int, out_pos: int, V: int) -> tuple[int, int] | None:
    """Two vocabulary indices whose noise is identical for (seed, out_pos), if any."""
    from jaxllm.formats.gumbel import gumbel_noise_np
    g = gumbel_noise_np(seed, out_pos, V)
    order = np.argsort(g, kind="stable")
    same = np.flatnonzero(g[order][1:] == g[order][:-1])
    if same.size == 0:
        return None
    i, j = sorted((int(order[same[0]]), int(order[same[0] + 1])))
    return i, j


def one_row(V, p, logits):
    """Logits [1, V], the metadata of one row with params ``p`` (3 logprobs), a fresh state."""
    a = smd.empty_metadata(1)
    smd.fill_row(a, 0, p, slot=0, out_pos=0, num_prompt=0, reset=False, suppress=[], num_logprobs=3)
    return jnp.asarray(logits[None]), smd.to_metadata(a), sm.init_state(2, V)
