"""The runner's side of speculative decoding: after each step, which requests propose and
what (a proposer: spec_decode/ngram.py, spec_decode/draft_model.py), and the off-switch.

Everything is keyed by request id, never batch row (rows are rebuilt every step).  A request
proposes after every step that sampled for it, unless:

- its grammar is not active yet (structured outputs after reasoning): proposals past the
  end of reasoning could not be checked; a constrained request's proposals are cut to the
  prefix its grammar accepts;
- its proposals have been rarely accepted: over its last ``acceptance_window`` judged
  tokens fewer than ``min_acceptance_rate`` were accepted.  A verification judges its
  proposals up to the first rejected one (those after it are dropped unseen), so the rate is
  the chance that a proposed token is right given the ones before it were, the same for any
  k: at k = 8 an acceptance length of 3 is 2 accepted of 3 judged, not of 8 proposed (which
  would switch off a request that speculation makes faster).  It then stops proposing for
  ``probe_interval`` steps, twice as long after every further failed probe (at most 16
  times), so a workload speculation cannot help pays for a few probes only.

With ``cost_model`` on (the default) the step's k is also chosen by cost: verifying k more
tokens per request makes the step bigger, and on hardware that is compute-bound at that size
(a CPU at a few requests) it costs more than the accepted tokens save.  For each k the
expected output tokens of the step (1 per request, plus each request's expected accepted
proposals from its per-position acceptance so far, smoothed towards every request's) are divided by the
measured time of the bucket that step would run in (the runner's moving average per bucket;
a bucket not measured yet counts as cheap, so it gets tried), plus what proposing k tokens
costs when the proposer says (a draft model's k steps: its ``cost(k, requests)``), and the
best k caps every request's proposals.  k = 0 proposes nothing this step.  A proposer that
costs nothing to ask (ngram) proposes first, so the choice counts the tokens it actually
found: a request with 2 proposals adds 2 tokens to the step at any k >= 2, one with none adds
nothing.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Callable

from jaxllm.outputs import RunnerOutput, SchedulerOutput
from jaxllm.spec_decode.config import SpeculativeConfig
from jaxllm.spec_decode.draft_model import DraftModelProposer, DraftSetup
from jaxllm.spec_decode.ngram import NgramProposer
from jaxllm.spec_decode.proposer import Proposer


@dataclasses.dataclass
class _Acceptance:
    window: deque = dataclasses.field(default_factory=deque)   # (proposed, accepted) per verification
    proposed: int = 0
    accepted: int = 0
    off_until: int = 0
    """The step from which the request proposes again."""
    backoff: int = 0
    tried: list = dataclasses.field(default_factory=list)   # per proposal position: verified ...
    ok: list = dataclasses.field(default_factory=list)      # ... and accepted, since the request began

    def expected_accepted(self, k: int, prior: "_Acceptance | None" = None) -> float:
        """Expected accepted tokens of a k-token proposal: sum over j of P(first j+1 accepted),
        the product of each position's rate given the ones before it were accepted.  That
        rate is this request's, pulled towards ``prior``'s (every request's so far, itself
        pulled towards 1/2 by one pseudo-verification each way, so it is never 0 or 1) by two
        pseudo-verifications, so a new request starts from what the workload has shown."""
        e, p = 0.0, 1.0
        for j in range(k):
            t, o = (self.tried[j], self.ok[j]) if j < len(self.tried) else (0, 0)
            g = 0.5
            if prior is not None and j < len(prior.tried):
                g = (prior.ok[j] + 1) / (prior.tried[j] + 2)
            p *= (o + 2 * g) / (t + 2)
            e += p
        return e

    def count(self, proposed: int, accepted: int) -> None:
        """One verification: positions up to the first rejection were judged (``tried``), the
        first ``accepted`` of them accepted; the ones after it went unseen."""
        if len(self.tried) < proposed:
            self.tried += [0] * (proposed - len(self.tried))
            self.ok += [0] * (proposed - len(self.ok))
        for j in range(min(proposed, accepted + 1)):
            self.tried[j] += 1
        for j in range(accepted):
            self.ok[j] += 1

    def observe(self, proposed: int, accepted: int, cfg: SpeculativeConfig, step: int) -> None:
        self.count(proposed, accepted)
        judged = min(proposed, accepted + 1)     # up to the first rejection: the rest went unseen
        self.window.append((judged, accepted))
        self.proposed += judged
        self.accepted += accepted
        while self.window and self.proposed - self.window[0][0] >= cfg.acceptance_window:
            p, a = self.window.popleft()
            self.proposed -= p
            self.accepted -= a
        if self.proposed >= cfg.acceptance_window and self.accepted < cfg.min_acceptance_rate * self.proposed:
            self.backoff = min(max(1, 2 * self.backoff), 16)
            self.off_until = step + cfg.probe_interval * self.backoff
            # The probe after the pause is judged on its own proposals.
            self.window.clear()
            self.proposed = self.accepted = 0
        elif self.proposed >= cfg.acceptance_window:
            self.backoff = 0


class SpecController:
    def __init__(self, cfg: SpeculativeConfig, proposer: Proposer,
                 step_cost: Callable[[int, int], float | None] | None = None):
        """``step_cost``: (tokens, rows) -> measured seconds of the bucket such a step runs in,
        or None (the runner's per-bucket moving average); None: the cost model always picks k."""
        self.cfg = cfg
        self.proposer = proposer
        self._acceptance: dict[str, _Acceptance] = {}
        self._all = _Acceptance()
        """Every request's per-position acceptance: the prior of a request's own."""
        self._step = 0
        self.step_cost = step_cost
        self.last_k: int | None = None
        """The k the cost model chose for the next step (None: not consulted)."""

    def _choose_k(self, num_sampling: int, asking: list[str], found: dict[str, int] | None = None) -> int:
        """The k that maximises expected output tokens per second of the next step; ``found``:
        how many tokens each asking request has proposed already (None: k each)."""
        K = self.cfg.num_speculative_tokens
        if not self.cfg.cost_model or self.step_cost is None:
            return K
        best_k, best, known = 0, -1.0, None
        for k in range(K + 1):
            n = {rid: k if found is None else min(k, found[rid]) for rid in asking}
            T = num_sampling + sum(n.values())
            cost = self.step_cost(T, T)
            if cost is None:
                cost = known if known is not None else 1.0   # not measured: as cheap as the last known
            else:
                known = cost
            cost += self.proposer.cost(k, len(asking)) or 0.0
            tokens = num_sampling + sum(self._acceptance[rid].expected_accepted(n[rid], self._all) for rid in asking)
            if tokens / cost > best:
                best_k, best = k, tokens / cost
        return best_k

    def update(self, so: SchedulerOutput) -> None:
        """Drops the state of requests that ended or were preempted."""
        for rid in so.finished_req_ids:
            self._acceptance.pop(rid, None)
            self.proposer.remove(rid)

    def propose(self, result: RunnerOutput, step, states, grammars) -> RunnerOutput:
        """``result`` with ``draft_token_ids`` for the requests that propose; ``step``: the
        PreparedStep just run (its verified proposals), ``states``: the runner's RequestStates."""
        self._step += 1
        k = self.cfg.num_speculative_tokens
        drafts: dict[str, list[int]] = {}
        verified = dict(zip(step.req_ids, step.drafts))
        asking: list[str] = []
        for rid, toks in zip(result.req_ids, result.sampled_token_ids):
            if not toks:
                continue
            acc = self._acceptance.get(rid)
            if acc is None:
                acc = self._acceptance[rid] = _Acceptance()
            if verified.get(rid):
                acc.observe(len(verified[rid]), len(toks) - 1, self.cfg, self._step)
                self._all.count(len(verified[rid]), len(toks) - 1)
            if self.cfg.min_acceptance_rate > 0 and self._step < acc.off_until:
                continue
            if grammars.proposes(rid):
                asking.append(rid)
        if not asking:
            return result
        num_sampling = sum(1 for t in result.sampled_token_ids if t)
        if not self.proposer.free:
            # A model: k is chosen by what its k steps cost, then it proposes that many.
            k = self.last_k = self._choose_k(num_sampling, asking)
            if k == 0:
                return result
        got = self.proposer.propose({rid: states[rid] for rid in asking}, k)
        for rid in asking:
            d = grammars.valid_prefix(rid, (got.get(rid) or [])[:k])
            if d:
                drafts[rid] = d
        if self.proposer.free and drafts:
            # Free to ask (ngram): k proposed, the cost model cuts what was found.
            k = self.last_k = self._choose_k(num_sampling, list(drafts), {rid: len(d) for rid, d in drafts.items()})
            drafts = {rid: d[:k] for rid, d in drafts.items()} if k else {}
        return dataclasses.replace(result, draft_token_ids=drafts) if drafts else result


def make_controller(cfg: SpeculativeConfig, step_cost: Callable[[int, int], float | None] | None = None,
                    draft: DraftSetup | None = None) -> SpecController:
    """The runner's controller for ``cfg`` with its method's proposer; ``step_cost``: the
    runner's measured step time (SpecController); ``draft``: what the draft model of
    ``draft_model`` runs on (the runner builds it)."""
    if cfg.method == "ngram":
        proposer: Proposer = NgramProposer(cfg.prompt_lookup_min, cfg.prompt_lookup_max)
    elif draft is None:
        raise ValueError("--speculative-config: method draft_model needs the draft model's runner")
    else:
        proposer = DraftModelProposer(draft)
    return SpecController(cfg, proposer, step_cost)
