"""Host side of the sampler: a request's sampling parameters as the per-row numbers the
compiled step reads, and the numpy arrays of one step.

Everything here is numpy (the runner builds a step's inputs on the host; an eager jnp op on
a new shape would trace after warm-up).  ``RowParams`` is shared with the serial reference
(``reference.py``), so both sides see the very same float32 parameters.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from jaxllm.formats.gumbel import split_seed
from jaxllm.sample.sampler import SUPPRESS_WIDTH, SamplingMetadata
from jaxllm.sampling_params import SamplingParams


def log_min_p(min_p: float) -> np.float32:
    """min_p as the device compares it: x - max < log(min_p) (float32, -inf when off)."""
    return np.float32(math.log(min_p)) if min_p > 0 else np.float32(-np.inf)


@dataclass
class RowParams:
    """One request's sampling parameters, resolved for the device (float32 where it reads them)."""

    temperature: float = 0.0          # 0: greedy
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int = 0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_tokens: int = 0
    stop_ids: tuple[int, ...] = ()    # suppressed while fewer than min_tokens outputs exist
    bias_row: np.ndarray | None = None  # [V] f32: logit_bias, -inf where not allowed / banned
    bad_word_seqs: list[tuple[int, ...]] = field(default_factory=list)   # multi-token bad words
    num_logprobs: int = -1
    num_prompt_logprobs: int = -1

    @classmethod
    def from_sampling_params(cls, sp: SamplingParams, seed: int, vocab_size: int) -> "RowParams":
        bad = [tuple(b) for b in (sp.bad_words_token_ids or [])]
        single = sorted({b[0] for b in bad if len(b) == 1})
        multi = [b for b in bad if len(b) > 1]
        bias_row = None
        if sp.allowed_token_ids is not None or sp.logit_bias or single:
            bias_row = np.zeros(vocab_size, np.float32)
            if sp.allowed_token_ids is not None:
                bias_row[:] = -np.inf
                bias_row[np.asarray(sp.allowed_token_ids, np.int64)] = 0.0
            bias_row[np.asarray(single, np.int64)] = -np.inf
            for tok, b in (sp.logit_bias or {}).items():
                bias_row[tok] += np.float32(b)                           # -inf stays -inf
        stop_ids = tuple(sorted(sp.all_stop_token_ids)) if sp.min_tokens > 0 else ()
        return cls(temperature=0.0 if sp.greedy else float(sp.temperature), top_k=int(sp.top_k),
                   top_p=float(sp.top_p), min_p=float(sp.min_p), seed=int(seed),
                   repetition_penalty=float(sp.repetition_penalty), presence_penalty=float(sp.presence_penalty),
                   frequency_penalty=float(sp.frequency_penalty), min_tokens=int(sp.min_tokens),
                   stop_ids=stop_ids, bias_row=bias_row, bad_word_seqs=multi,
                   num_logprobs=-1 if sp.logprobs is None else int(sp.logprobs),
                   num_prompt_logprobs=-1 if sp.prompt_logprobs is None else int(sp.prompt_logprobs))

    @property
    def uses_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def suppressed(self, output_tokens: list[int]) -> list[int]:
        """Ids set to -inf before the next draw: stop ids under min_tokens (vLLM's min_tokens
        processor) and the last token of every multi-token bad word whose other tokens end
        the output so far (vLLM applies bad words to the output tokens only)."""
        out = list(self.stop_ids) if len(output_tokens) < self.min_tokens else []
        for seq in self.bad_word_seqs:
            n = len(seq) - 1
            if len(output_tokens) >= n and tuple(output_tokens[len(output_tokens) - n:]) == seq[:-1]:
                out.append(seq[-1])
        return out


def suppress_capacity_error(sp: SamplingParams) -> str | None:
    """Why a request cannot fit the fixed-width per-step suppression list, or None."""
    n_stop = len(sp.all_stop_token_ids) if sp.min_tokens > 0 else 0
    n_bad = sum(1 for b in (sp.bad_words_token_ids or []) if len(b) > 1)
    if n_stop + n_bad > SUPPRESS_WIDTH:
        what = "bad_words" if n_bad else "stop_token_ids"
        return (f"{what}: with min_tokens={sp.min_tokens}, {n_stop} stop token ids (EOS included) and "
                f"{n_bad} multi-token bad words may be suppressed in one step; the most is {SUPPRESS_WIDTH}")
    return None


def empty_metadata(S: int, draft_width: int = 0) -> dict[str, np.ndarray]:
    """Padding rows: greedy, no logprobs, nothing tracked, each its own group (slot filled in
    by the caller); ``draft_width``: the most proposals a request verifies (0: no speculation)."""
    return dict(temperature=np.zeros(S, np.float32), top_k=np.zeros(S, np.int32), top_p=np.ones(S, np.float32),
                log_min_p=np.full(S, -np.inf, np.float32), seed_lo=np.zeros(S, np.uint32),
                seed_hi=np.zeros(S, np.uint32), out_pos=np.zeros(S, np.int32), num_logprobs=np.full(S, -1, np.int32),
                slot=np.zeros(S, np.int32), reset=np.zeros(S, bool), track=np.zeros(S, bool),
                num_prompt=np.zeros(S, np.int32), repetition_penalty=np.ones(S, np.float32),
                presence_penalty=np.zeros(S, np.float32), frequency_penalty=np.zeros(S, np.float32),
                use_bias=np.zeros(S, bool), suppress=np.full((S, SUPPRESS_WIDTH), -1, np.int32),
                count_fed=np.ones(S, bool), count_extra=np.full((S, draft_width), -1, np.int32),
                view_extra=np.full((S, draft_width), -1, np.int32), draft_next=np.full(S, -1, np.int32),
                group_start=np.arange(S, dtype=np.int32))


def fill_row(a: dict[str, np.ndarray], i: int, p: RowParams, *, slot: int, out_pos: int, num_prompt: int,
             reset: bool, suppress: list[int], num_logprobs: int) -> None:
    """Writes row ``i`` of the arrays of :func:`empty_metadata` for a request with params ``p``."""
    a["temperature"][i] = p.temperature
    a["top_k"][i] = p.top_k
    a["top_p"][i] = p.top_p
    a["log_min_p"][i] = log_min_p(p.min_p)
    a["seed_lo"][i], a["seed_hi"][i] = split_seed(p.seed)
    a["out_pos"][i] = out_pos
    a["num_logprobs"][i] = num_logprobs
    a["slot"][i] = slot
    a["reset"][i] = reset
    a["track"][i] = p.uses_penalties
    a["num_prompt"][i] = num_prompt
    a["repetition_penalty"][i] = p.repetition_penalty
    a["presence_penalty"][i] = p.presence_penalty
    a["frequency_penalty"][i] = p.frequency_penalty
    a["use_bias"][i] = p.bias_row is not None
    if suppress:
        ids = suppress[:SUPPRESS_WIDTH]
        a["suppress"][i, :len(ids)] = ids


def to_metadata(a: dict[str, np.ndarray]) -> SamplingMetadata:
    return SamplingMetadata(**a)
