"""Speculative decoding returns exactly the tokens plain decoding returns: greedy, seeded
sampling with top-k/top-p, penalties, min_tokens, stop strings, stop ids and max_tokens
landing inside an accepted run; in mixed batches (some requests proposing, some not), under
preemption, with prefix caching, and when rows move because requests finish mid-batch.

Random tiny models rarely repeat themselves, so ngram seldom proposes for them; most tests
plug in an oracle proposer instead (the proposer is an interface): it proposes the tokens
plain decoding produced, with every third proposal run corrupted at a random position, so
that long accepted runs, rejections and corrections all occur.  Identity must hold whatever
is proposed.  Each test checks that speculation really happened (proposals verified, some
accepted and some rejected), so an engine that never proposes cannot pass.  ngram itself is
checked on the built-in model (tests/spec_decode/test_ngram_builtin.py); draft models in
tests/spec_decode/test_spec_identity_draft.py (the same workload: tests/support/spec_workload.py)."""

from __future__ import annotations

import numpy as np
import pytest

from support.engines import SMALL_ENGINE
from support.spec_workload import (plain_outputs, repetitive, small_pool, snapshot, spec_stats,  # noqa: F401
                                    tokens, workload)   # plain_outputs: a fixture

from jaxllm import LLM, SamplingParams

# Both off-switches off: these tests need proposals in every step that can have them.
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
        "min_acceptance_rate": 0.0, "cost_model": False}

# The engine every test here shares, all of its buckets compiled at start-up (the strict guard
# then proves that no step with speculation on compiles: the every-bucket proof for
# speculation).  An 8-token budget keeps a verification bucket (5: a request verifying 4, its
# 5 rows and the prefill's 4) and 7 programs in all, where SMALL_ENGINE's 32 makes 15.
SPEC_ENGINE = {**SMALL_ENGINE, "max_num_batched_tokens": 8}

# Free KV blocks left to the preemption test: fewer than its batch needs at the 8-token
# budget, enough for any one of its requests alone (5 blocks at most, lookahead included).
PREEMPTION_BLOCKS = 5

# Requests of the workload the small pool runs: enough to preempt, and to cover every
# kind of sampling parameter (tests/support/spec_workload.py cycles six kinds).
PREEMPTION_REQUESTS = 8


class OracleProposer:
    """Proposes what plain decoding produced after the request's tokens (known from a plain
    run), corrupting one position of every third proposal; requests whose prompt it was not
    told about get no proposals."""

    def __init__(self, plain_runs, seed=0):
        # Every sample of every run (n > 1: each child continues its own output).
        self.full = [tuple(o.prompt_token_ids) + tuple(c.token_ids) for o in plain_runs for c in o.outputs]
        self.prompts = [tuple(o.prompt_token_ids) for o in plain_runs for _ in o.outputs]
        self.rng = np.random.default_rng(seed)
        self.calls = 0

    free = True

    def propose(self, requests, k):
        return {rid: self._one(r.token_ids, k) for rid, r in requests.items()}

    def _one(self, token_ids, k):
        for prompt, full in zip(self.prompts, self.full):
            if tuple(token_ids[:len(prompt)]) == prompt and tuple(token_ids) == full[:len(token_ids)]:
                d = list(full[len(token_ids):len(token_ids) + k])
                self.calls += 1
                if d and self.calls % 3 == 0:
                    j = int(self.rng.integers(len(d)))
                    d[j] = (d[j] + 1 + int(self.rng.integers(100))) % 49152
                return d
        return []

    def cost(self, k, num_requests):
        return 0.0

    def remove(self, req_id):
        pass


class oracle:
    """Swaps the engine's proposer for an OracleProposer of ``plain_runs`` while active."""

    def __init__(self, llm, plain_runs):
        self.controller = llm.llm_engine.core.runner.speculation
        self.proposer = OracleProposer(plain_runs)

    def __enter__(self):
        self.saved, self.controller.proposer = self.controller.proposer, self.proposer
        return self.proposer

    def __exit__(self, *exc):
        self.controller.proposer = self.saved


@pytest.fixture(scope="module")
def spec_llm(tiny_llama):
    return LLM(tiny_llama, **SPEC_ENGINE, speculative_config=SPEC)


def assert_speculated(llm, before=(0, 0, 0)):
    s = spec_stats(llm)
    drafts, proposed, accepted = (s.num_drafts - before[0], s.num_draft_tokens - before[1],
                                  s.num_accepted_tokens - before[2])
    assert drafts > 0 and 0 < accepted < proposed, (drafts, proposed, accepted)
    return drafts, proposed, accepted


def test_ngram_batch_equals_plain_decoding(spec_llm, plain_outputs):
    """ngram as configured, on the tiny model (it proposes for a few requests only)."""
    prompts, params = workload()
    before = snapshot(spec_llm)
    outs = spec_llm.generate(prompts, params, use_tqdm=False)
    assert tokens(outs) == tokens(plain_outputs)
    assert snapshot(spec_llm)[0] > before[0]


def test_batched_outputs_equal_plain_decoding(spec_llm, plain_outputs):
    """Half the requests propose (the oracle knows only the even ones), all in one batch."""
    prompts, params = workload()
    before = snapshot(spec_llm)
    with oracle(spec_llm, plain_outputs[::2]):
        outs = spec_llm.generate(prompts, params, use_tqdm=False)
    assert tokens(outs) == tokens(plain_outputs)
    assert_speculated(spec_llm, before)
    # Logprobs are the ones plain decoding reports (the verification's logits equal a
    # decode step's to float rounding: the kernels' sums run in another order for a
    # multi-token query).
    for a, b in zip(outs, plain_outputs):
        if b.outputs[0].logprobs is not None:
            la = [[(t, v.logprob, v.rank) for t, v in d.items()] for d in a.outputs[0].logprobs]
            lb = [[(t, v.logprob, v.rank) for t, v in d.items()] for d in b.outputs[0].logprobs]
            assert [[(t, r) for t, _, r in row] for row in la] == [[(t, r) for t, _, r in row] for row in lb]
            np.testing.assert_allclose([[v for _, v, _ in row] for row in la],
                                       [[v for _, v, _ in row] for row in lb], rtol=0, atol=1e-4)


def test_each_request_alone_equals_plain(spec_llm, plain_outputs):
    """Solo runs: every request proposes alone (no neighbours), and equals plain decoding."""
    prompts, params = workload()
    before = snapshot(spec_llm)
    with oracle(spec_llm, plain_outputs):
        for i in (0, 1, 2, 3, 5, 6):
            out = spec_llm.generate([prompts[i]], params[i], use_tqdm=False)
            assert out[0].outputs[0].token_ids == plain_outputs[i].outputs[0].token_ids, i
    assert_speculated(spec_llm, before)


def test_stops_inside_an_accepted_run(spec_llm, tiny_llm):
    """A stop id, a stop string and max_tokens that fall inside runs of accepted proposals end
    the request exactly where plain decoding does."""
    rng = np.random.default_rng(3)
    prompts = [{"prompt_token_ids": repetitive(rng, 3, 8)} for _ in range(6)]
    base = tiny_llm.generate(prompts, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), use_tqdm=False)
    tok = tiny_llm.get_tokenizer()
    params = []
    for i, o in enumerate(base):
        out = o.outputs[0].token_ids
        cut = 5 + i
        if i % 3 == 0:
            params.append(SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop_token_ids=[out[cut]]))
        elif i % 3 == 1:
            text = tok.decode(out[cut:cut + 2])
            params.append(SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[text]) if text.strip()
                          else SamplingParams(temperature=0, max_tokens=cut + 1, ignore_eos=True))
        else:
            params.append(SamplingParams(temperature=0, max_tokens=cut, ignore_eos=True))
    plain = tiny_llm.generate(prompts, params, use_tqdm=False)
    before = snapshot(spec_llm)
    with oracle(spec_llm, base):
        spec = spec_llm.generate(prompts, params, use_tqdm=False)
    assert [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason, o.outputs[0].stop_reason)
            for o in spec] == [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason,
                                o.outputs[0].stop_reason) for o in plain]
    assert_speculated(spec_llm, before)


def test_rows_move_while_drafts_are_in_flight(spec_llm, tiny_llm):
    """Requests of very different lengths finish mid-batch, so the survivors' rows move down
    between a proposal and its verification; each output equals its solo plain run."""
    rng = np.random.default_rng(7)
    prompts = [{"prompt_token_ids": repetitive(rng, 4, 6)} for _ in range(8)]
    params = [SamplingParams(temperature=0.8, seed=100 + i, top_k=30, max_tokens=3 + 5 * i, ignore_eos=True)
              for i in range(8)]
    seen = []
    runner = spec_llm.llm_engine.core.runner
    execute = runner.execute

    def recording(so):
        seen.append(so)
        return execute(so)

    runner.execute = recording
    plain = [tiny_llm.generate([p], sp, use_tqdm=False)[0] for p, sp in zip(prompts, params)]
    try:
        with oracle(spec_llm, plain):
            outs = spec_llm.generate(prompts, params, use_tqdm=False)
    finally:
        runner.execute = execute
    assert tokens(outs) == tokens(plain)
    # A request verified proposals at a different position in the batch than the step before.
    order = [list(so.num_scheduled_tokens) for so in seen]
    moved = any(rid in so.scheduled_spec_decode_tokens and rid in prev and prev.index(rid) != cur.index(rid)
                for so, prev, cur in zip(seen[1:], order, order[1:]) for rid in cur)
    assert moved


def test_preemption_keeps_outputs_equal(spec_llm, plain_outputs):
    """A KV pool too small for the batch: requests are preempted (their proposals' state
    dropped) and recomputed.  The pool is spec_llm's own with all but PREEMPTION_BLOCKS free
    blocks held out (its programs, not a second engine's)."""
    # The workload's first PREEMPTION_REQUESTS requests (every kind of sampling parameter, a
    # random prompt among them) overflow the small pool; each is checked against its own
    # plain run (a per-request guarantee), and the pool really preempts (asserted).
    prompts, params = workload()
    n = PREEMPTION_REQUESTS
    core = spec_llm.llm_engine.core
    preemptions, before = core.scheduler.num_preemptions, snapshot(spec_llm)
    with oracle(spec_llm, plain_outputs), small_pool(spec_llm, PREEMPTION_BLOCKS):
        outs = spec_llm.generate(prompts[:n], params[:n], use_tqdm=False)
        assert core.kv_manager.num_free_blocks == PREEMPTION_BLOCKS
    assert core.scheduler.num_preemptions > preemptions
    assert tokens(outs) == tokens(plain_outputs[:n])
    assert_speculated(spec_llm, before)
    assert core.kv_manager.num_free_blocks == core.kv_manager.num_blocks


def test_prefix_cache_hits_still_propose(spec_llm, plain_outputs):
    """Prompts served from the prefix cache (the workload ran before on this engine) still get
    proposals, and equal plain decoding."""
    prompts, params = workload()
    spec_llm.generate(prompts, params, use_tqdm=False)
    kv = spec_llm.llm_engine.core.kv_manager
    hits, before = kv.prefix_cache_hits, snapshot(spec_llm)
    with oracle(spec_llm, plain_outputs):
        outs = spec_llm.generate(prompts, params, use_tqdm=False)
    assert kv.prefix_cache_hits > hits
    assert tokens(outs) == tokens(plain_outputs)
    assert_speculated(spec_llm, before)


def test_n_samples_each_verify_their_own_proposals(spec_llm, tiny_llm):
    """n = 3 seeded samples of one prompt: each child is its own request id with its own
    proposals, and each equals its plain counterpart."""
    rng = np.random.default_rng(5)
    prompt = {"prompt_token_ids": repetitive(rng, 3, 5)}
    params = SamplingParams(n=3, temperature=0.9, seed=21, top_p=0.95, max_tokens=24, ignore_eos=True)
    plain = tiny_llm.generate([prompt], params, use_tqdm=False)
    before = snapshot(spec_llm)
    with oracle(spec_llm, plain):
        out = spec_llm.generate([prompt], params, use_tqdm=False)
    assert [c.token_ids for c in out[0].outputs] == [c.token_ids for c in plain[0].outputs]
    assert len({tuple(c.token_ids) for c in plain[0].outputs}) == 3
    assert_speculated(spec_llm, before)


def test_structured_outputs_with_proposals(spec_llm, tiny_llm):
    """Constrained requests: proposals are cut to the prefix the grammar accepts, each row of a
    verification is masked as if the proposals before it had been sampled, and the output
    equals plain decoding's (and obeys the grammar)."""
    import json
    import re

    from jaxllm.sampling_params import StructuredOutputsParams as SO
    person = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 150}},
              "required": ["name", "age"], "additionalProperties": False}
    email = r"[a-z]{2,6}@(foo|bar)\.(com|org)"
    prompts = ["A person:", "An email:", "A person:", "Free text:"]
    params = [SamplingParams(temperature=0, max_tokens=40, structured_outputs=SO(json=person, disable_any_whitespace=True)),
              SamplingParams(temperature=0.9, seed=4, max_tokens=30, structured_outputs=SO(regex=email)),
              SamplingParams(temperature=1.0, seed=9, max_tokens=40,
                             structured_outputs=SO(json=person, disable_any_whitespace=True)),
              SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)]
    plain = tiny_llm.generate(prompts, params, use_tqdm=False)
    before = snapshot(spec_llm)
    with oracle(spec_llm, plain) as o:
        out = spec_llm.generate(prompts, params, use_tqdm=False)
    assert tokens(out) == tokens(plain)
    assert json.loads(out[0].outputs[0].text)["age"] >= 0
    assert re.fullmatch(email, out[1].outputs[0].text)
    assert_speculated(spec_llm, before)
    assert o.calls > 0
