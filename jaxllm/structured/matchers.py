"""The runner's grammar state: one llguidance matcher per constrained request, keyed by
request id, and the allowed-token bitmask of a step's rows.

A matcher advances with every token the request samples (:meth:`GrammarStates.accept`),
never with the tokens a step recomputes: a request resumed after preemption (sent again in
full, its old state dropped) gets a fresh copy of its compiled grammar that consumes the
output tokens it had already accepted, which puts it in the very state it left.  Each of
the ``n`` sequences of a request is a request id of its own, so each has its own matcher.

The bitmask is ``[S, ceil(V / 32)]`` words, bit ``v % 32`` of word ``v // 32`` set when
token ``v`` may be sampled (llguidance's layout), all ones for rows without a grammar, for
padding rows and for rows that sample nothing this step.  Ids past the tokenizer's
vocabulary (a model's padded embedding) are never allowed in a constrained row.

Reasoning: with ``reasoning_end_token_ids`` configured (and not ``enable_in_reasoning``),
a constrained request is unmasked until one of those ids is in its prompt or output; its
matcher starts with the next token.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import llguidance
import llguidance.numpy as llnp
import numpy as np

from jaxllm.outputs import SchedulerOutput
from jaxllm.sample.bitmask import mask_words
from jaxllm.structured.grammar import GrammarCompiler

log = logging.getLogger("jaxllm.structured")


@dataclass
class _Grammar:
    matcher: llguidance.LLMatcher
    active: bool
    """False while the request is still reasoning (not masked, matcher not advanced)."""
    warned: bool = False


class GrammarStates:
    def __init__(self, compiler: GrammarCompiler | None, vocab_size: int):
        self.compiler = compiler
        self.words = mask_words(vocab_size)
        cfg = compiler.config if compiler is not None else None
        self._reasoning_end = frozenset(cfg.reasoning_end_token_ids) if cfg and not cfg.enable_in_reasoning else \
            frozenset()
        self._ll_words = mask_words(compiler.n_vocab) if compiler is not None else self.words
        self._states: dict[str, _Grammar] = {}
        self._executor = None
        # EOS-only row: what a matcher in an error state (it never should be) allows.
        eos_row = np.zeros(self.words, np.uint32)
        for t in (compiler.eos_token_ids if compiler is not None else ()):
            if t < vocab_size:
                eos_row[t // 32] |= np.uint32(1 << (t % 32))
        self._eos_row = eos_row.view(np.int32)

    def __len__(self) -> int:
        return len(self._states)

    def update(self, so: SchedulerOutput) -> None:
        """Drops ended (or preempted) requests; starts a matcher for each new or resumed one."""
        for rid in so.finished_req_ids:
            self._states.pop(rid, None)
        for nr in so.scheduled_new_reqs:
            spec = nr.sampling_params.structured_outputs
            if spec is None:
                continue
            if self.compiler is None:
                raise ValueError("structured_outputs needs the engine's grammar compiler (a tokenizer)")
            outputs = list(nr.token_ids[nr.num_prompt_tokens:])
            active = True
            if self._reasoning_end and not any(t in self._reasoning_end for t in nr.token_ids[:nr.num_prompt_tokens]):
                # vLLM's rule: reasoning has ended once the end token is in the sequence (a
                # template that closes an empty reasoning block in the prompt, Qwen3 without
                # thinking, constrains from the first output token).
                ends = [i for i, t in enumerate(outputs) if t in self._reasoning_end]
                active = bool(ends)
                outputs = outputs[ends[0] + 1:] if ends else []
            g = self._states[nr.req_id] = _Grammar(self.compiler.matcher(spec), active)
            if outputs and not g.matcher.consume_tokens(outputs):
                log.warning("request %s: its grammar rejects the output it resumes with: %s", nr.req_id,
                            g.matcher.get_error())

    def masked_rows(self, rows) -> list[tuple[int, str, int]]:
        """Of ``rows`` (sampling row, request id, draft index j), those whose draw the grammar
        constrains this step."""
        return [(i, rid, j) for i, rid, j in rows if (g := self._states.get(rid)) is not None and g.active]

    def valid_prefix(self, req_id: str, drafts: list[int]) -> list[int]:
        """The longest prefix of ``drafts`` the request's grammar accepts (all of them when
        unconstrained or still reasoning: proposals past a reasoning end are not checked, so
        a reasoning request does not propose, see spec_decode/controller.py)."""
        g = self._states.get(req_id)
        if g is None or not drafts:
            return drafts
        return drafts[:g.matcher.validate_tokens(drafts)]

    def proposes(self, req_id: str) -> bool:
        """Whether the request may get speculative proposals: unconstrained, or its grammar
        is active (while reasoning, proposals past the end tag could not be checked)."""
        g = self._states.get(req_id)
        return g is None or g.active

    def fill(self, rows: list[tuple[int, str, int]], num_rows: int, drafts: dict[str, tuple[int, ...]] | None = None
             ) -> np.ndarray:
        """The step's bitmask ``[num_rows, words]`` uint32: the allowed tokens of each of
        ``rows``, all ones elsewhere.  Row j of a verification is masked as if the request's
        first j proposals (``drafts``, checked by :meth:`valid_prefix` when proposed) had been
        sampled: its matcher consumes them for the masks, then rolls back."""
        mask = np.full((num_rows, self._ll_words), -1, np.int32)
        spec = [(i, rid, j) for i, rid, j in rows if drafts and drafts.get(rid)]
        rows = [(i, rid) for i, rid, j in rows if not (drafts and drafts.get(rid))]
        for rid in dict.fromkeys(rid for _, rid, _ in spec):
            m, d = self._states[rid].matcher, drafts[rid]
            own = sorted((j, i) for i, r, j in spec if r == rid)
            consumed = 0
            for j, i in own:
                while consumed < j:
                    m.consume_token(d[consumed])
                    consumed += 1
                llnp.fill_next_token_bitmask(m, mask, i)
            if consumed:
                m.rollback(consumed)
        if len(rows) == 1:
            (i, rid), = rows
            llnp.fill_next_token_bitmask(self._states[rid].matcher, mask, i)
        elif rows:
            if self._executor is None:
                self._executor = llguidance.LLExecutor()
            llnp.fill_next_token_bitmask_par(self._executor, [(self._states[rid].matcher, i) for i, rid in rows],
                                             mask)
        if self._ll_words != self.words:
            mask = np.ascontiguousarray(mask[:, :self.words])
        for i, rid in [*rows, *((i, rid) for i, rid, _ in spec)]:
            g = self._states[rid]
            if g.matcher.is_error():
                if not g.warned:
                    log.warning("request %s: grammar error, only EOS allowed from now: %s", rid, g.matcher.get_error())
                    g.warned = True
                mask[i] = self._eos_row
        return mask.view(np.uint32)

    def accept(self, req_id: str, token: int) -> None:
        """Advances the request's matcher by the token it sampled (no-op if unconstrained)."""
        g = self._states.get(req_id)
        if g is None:
            return
        if not g.active:
            g.active = token in self._reasoning_end
            return
        if not g.matcher.consume_token(token) and not g.warned:
            log.warning("request %s: token %d rejected by its grammar: %s", req_id, token, g.matcher.get_error())
            g.warned = True
