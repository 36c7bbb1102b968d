"""The sampler's per-request device state, owned on the host: which row of the
:class:`SamplerState` each request holds, and the row writes staged for the next step.

A request gets a row (by request id, never its batch row) when the runner first sees it
and gives it back when it ends; the last row is scratch for padding rows.  Two kinds of
writes cannot happen inside the step and are staged here until :meth:`apply_staged_writes`,
which the runner calls right before the step:

* a request's bias row (logit_bias, allowed tokens, single-token bad words), once;
* the penalty state of tokens that never pass through a step (a prefix served from the KV
  cache): their prompt mask and output counts replace whatever the row held.

Otherwise a row's first step zeroes it on the device (``reset``) and every step counts its
own tokens (``sampler.update_state``).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.sample.metadata import RowParams
from jaxllm.sample.sampler import SamplerState, init_state, write_bias_row, write_penalty_row


class SamplerRows:
    def __init__(self, max_num_seqs: int, vocab_size: int, place):
        """``place``: host array -> device array with the replicated sharding of the step."""
        self.vocab_size = vocab_size
        self._place = place
        self.state: SamplerState = jax.tree.map(lambda x: place(np.asarray(x)), init_state(max_num_seqs + 1, vocab_size))
        """Donated to every step, which hands back the updated state: the runner replaces it."""
        self.scratch = max_num_seqs
        self._free = list(range(max_num_seqs - 1, -1, -1))
        self._rows: dict[str, int] = {}
        self._fresh: set[str] = set()        # rows whose first step has not been prepared yet
        self._bias: list[tuple[int, np.ndarray]] = []
        self._penalty: list[tuple[int, np.ndarray, np.ndarray]] = []
        self._write_bias = self._write_penalty = None

    def compile(self) -> None:
        """Compiles the two row writers (tiny programs, not bucketed)."""
        rep = self.state.bias.sharding
        spec = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)  # noqa: E731
        sds = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=rep)  # noqa: E731
        V = self.vocab_size
        self._write_bias = jax.jit(write_bias_row, donate_argnums=(0,), out_shardings=rep).lower(
            spec(self.state.bias), sds((), jnp.int32), sds((V,), jnp.float32)).compile()
        self._write_penalty = jax.jit(write_penalty_row, donate_argnums=(0, 1), out_shardings=rep).lower(
            spec(self.state.counts), spec(self.state.prompt_mask), sds((), jnp.int32), sds((V,), jnp.int32),
            sds((V,), jnp.bool_)).compile()

    # ------------------------------------------------------------------ rows by request id

    def add_request(self, req_id: str, params: RowParams) -> int:
        """Gives ``req_id`` a row (a request seen again after preemption gets a fresh one) and
        stages its bias row; returns the row."""
        self.remove_request(req_id)
        row = self._free.pop()
        self._rows[req_id] = row
        self._fresh.add(req_id)
        if params.bias_row is not None:
            self._bias.append((row, params.bias_row))
        return row

    def remove_request(self, req_id: str) -> None:
        row = self._rows.pop(req_id, None)
        if row is not None:
            self._free.append(row)
            self._fresh.discard(req_id)

    def row(self, req_id: str) -> int:
        return self._rows[req_id]

    def first_step(self, req_id: str, params: RowParams, token_ids: list[int], num_prompt: int,
                   num_computed: int) -> bool:
        """Called as each step is prepared; True when this is the request's first step and its
        penalty counts must be zeroed inside it.  A request admitted with ``num_computed`` > 0
        tokens from the prefix cache instead gets their counts staged as a row write."""
        if req_id not in self._fresh:
            return False
        self._fresh.discard(req_id)
        if not params.uses_penalties:
            return False
        if num_computed == 0:
            return True
        self._penalty.append((self._rows[req_id], *self._penalty_row(token_ids, num_prompt, num_computed)))
        return False

    def _penalty_row(self, token_ids: list[int], num_prompt: int, c: int) -> tuple[np.ndarray, np.ndarray]:
        """The penalty state of a request's first ``c`` tokens, as ``update_state`` would have
        counted them: prompt tokens into the mask, later ones (outputs) into the counts."""
        V = self.vocab_size
        P = min(c, num_prompt)
        mask = np.zeros(V, np.bool_)
        mask[np.asarray(token_ids[:P], np.int64)] = True
        counts = np.bincount(np.asarray(token_ids[P:c], np.int64), minlength=V).astype(np.int32)
        return counts, mask

    # ------------------------------------------------------------------ device writes

    def apply_staged_writes(self) -> None:
        """Runs the staged row writes on the device (the state is donated and replaced)."""
        put = self._place
        for row, bias_row in self._bias:
            bias = self._write_bias(self.state.bias, put(np.int32(row)), put(bias_row))
            self.state = dataclasses.replace(self.state, bias=bias)
        for row, counts_row, mask_row in self._penalty:
            counts, mask = self._write_penalty(self.state.counts, self.state.prompt_mask, put(np.int32(row)),
                                               put(counts_row), put(mask_row))
            self.state = dataclasses.replace(self.state, counts=counts, prompt_mask=mask)
        self._bias, self._penalty = [], []
