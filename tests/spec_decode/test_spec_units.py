"""The parts of speculative decoding that need no device: the configuration (vLLM's shape,
bad values named), the ngram proposer, the off-switch, the scheduler's cut of proposals, the
acceptance rule on the device arrays, the periodic log line and the bench's /metrics parser."""

from __future__ import annotations

import logging

import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.config import EngineConfig
from jaxllm.core.kv_cache_manager import KVCacheManager
from jaxllm.core.scheduler import Scheduler
from jaxllm.outputs import RunnerOutput
from jaxllm.request import Request
from jaxllm.sample import metadata as smd
from jaxllm.sample.sampler import accept
from jaxllm.sampling_params import SamplingParams
from jaxllm.spec_decode.config import SpeculativeConfig
from jaxllm.spec_decode.controller import SpecController, _Acceptance
from jaxllm.spec_decode.ngram import NgramProposer


# ---------------------------------------------------------------------------- configuration

def test_config_in_vllms_shape():
    c = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 3}')
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (5, 5)           # vLLM's defaults
    c = SpeculativeConfig.parse({"model": "[ngram]", "num_speculative_tokens": 2, "prompt_lookup_max": 4})
    assert (c.method, c.prompt_lookup_min, c.prompt_lookup_max) == ("ngram", 4, 4)
    c = SpeculativeConfig.parse({"model": "/some/draft", "num_speculative_tokens": 2})
    assert c.method == "draft_model"
    assert EngineConfig(speculative_config={"method": "ngram", "num_speculative_tokens": 2}).speculative_config.method \
        == "ngram"
    assert EngineConfig().speculative_config is None


@pytest.mark.parametrize("value, needle", [
    ("{", "not valid JSON"),
    ({"method": "ngram"}, "num_speculative_tokens is required"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be"),
    ({"method": "eagle", "num_speculative_tokens": 2}, "'eagle' is not available"),
    ({"method": "magic", "num_speculative_tokens": 2}, "unknown method 'magic'"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "prompt_lookup_min=4 is larger"),
    ({"method": "ngram", "num_speculative_tokens": 2, "speculative_disable_by_batch_size": 4}, "unknown key"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "needs \"model\""),
    ({"method": "ngram", "num_speculative_tokens": 2, "min_acceptance_rate": 2}, "min_acceptance_rate"),
])
def test_bad_config_is_refused_by_name(value, needle):
    with pytest.raises(ValueError, match="--speculative-config") as e:
        SpeculativeConfig.parse(value)
    assert needle in str(e.value)


def test_speculative_config_flag():
    from jaxllm import cli
    p = cli.build_parser()
    args = p.parse_args(["serve", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4}'])
    cfg = cli.engine_config_from_args(args).speculative_config
    assert (cfg.method, cfg.num_speculative_tokens) == ("ngram", 4)
    args = p.parse_args(["generate", "--speculative-config", "nope", "hi"])
    with pytest.raises(ValueError, match="--speculative-config: not valid JSON"):
        cli.engine_config_from_args(args)


def test_draft_model_with_another_vocabulary_is_refused(tiny_llama, tmp_path):
    from jaxllm import LLM
    from support.tiny_models import build_tiny
    other = build_tiny("small_vocab", str(tmp_path / "small_vocab"),
                       variants={"small_vocab": ("LlamaConfig", dict(vocab_size=512, tie_word_embeddings=True))})
    with pytest.raises(ValueError, match="--speculative-config: the draft model .* 512 tokens"):
        LLM(tiny_llama, speculative_config={"model": other, "num_speculative_tokens": 2},
            max_num_seqs=2, max_num_batched_tokens=16, max_model_len=64)


# ---------------------------------------------------------------------------- ngram

class Req:
    """What a proposer reads of a request (spec_decode/proposer.ProposalRequest)."""

    def __init__(self, token_ids):
        self.token_ids = token_ids


def ngram(p, rid, toks, k):
    return p.propose({rid: Req(toks)}, k)[rid]


def test_ngram_proposes_what_followed_the_latest_longest_match():
    p = NgramProposer(1, 3)
    toks = [1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 5, 1, 2, 3]
    # The suffix [1, 2, 3] last occurred before [7, 8, 5, ...]; never matches itself.
    assert ngram(p, "a", toks, 3) == [7, 8, 5]
    assert ngram(p, "a", toks + [7], 2) == [8, 5]                         # the index grows
    assert ngram(p, "b", [4, 5, 6], 3) == []                              # nothing repeats
    # Shorter n only when the longer ones do not occur.
    assert ngram(NgramProposer(1, 3), "c", [5, 1, 2, 6, 2], 2) == [6, 2]
    assert ngram(NgramProposer(2, 3), "c", [5, 1, 2, 6, 2], 2) == []
    # A continuation running into the end is cut there.
    assert ngram(NgramProposer(1, 1), "d", [4, 4], 3) == [4]
    assert p.free and p.cost(4, 2) == 0.0                                 # asked first, priced as found


def test_controller_off_switch_pauses_a_request_that_rejects():
    cfg = SpeculativeConfig(method="ngram", num_speculative_tokens=4, acceptance_window=2, min_acceptance_rate=0.5,
                            probe_interval=10)

    class Always:
        free = True

        def propose(self, requests, k):
            return {rid: [1] * k for rid in requests}

        def cost(self, k, n):
            return 0.0

        def remove(self, rid):
            pass

    class Step:
        def __init__(self, drafts):
            self.req_ids, self.drafts = ("r",), (tuple(drafts),)

    class Grammars:
        def proposes(self, rid):
            return True

        def valid_prefix(self, rid, d):
            return d

    class States(dict):
        pass

    states = States(r=type("S", (), {"token_ids": [5, 6]})())
    ctl = SpecController(cfg, Always())
    drafts, proposing = (), []
    for _ in range(40):
        # Every verification accepts nothing: 1 token comes back.
        res = ctl.propose(RunnerOutput(["r"], [[3]]), Step(drafts), states, Grammars())
        drafts = tuple(res.draft_token_ids.get("r", ()))
        proposing.append(bool(drafts))
    # A verification rejected at once judges 1 token: two fill the window at rate 0, so the
    # request is off for 10 steps, then one probe pair, then off for 20.
    assert proposing[:3] == [True, True, False]
    assert sum(proposing) < 10
    assert proposing.index(True, 3) == 12          # steps 3..12 paused (index i is step i + 1)


def test_cost_model_picks_the_k_that_pays():
    """Expected output tokens per measured second: with a step time flat in T (memory-bound)
    the longest proposals win; when every extra token costs a full step's time (compute-bound),
    k = 0; a bucket not measured yet counts as cheap, so it is tried."""
    cfg = SpeculativeConfig(method="ngram", num_speculative_tokens=4)
    ctl = SpecController(cfg, NgramProposer(1, 1))
    for rid in ("a", "b"):
        acc = ctl._acceptance[rid] = _Acceptance()
        for _ in range(20):
            acc.observe(4, 2, cfg, 0)       # positions 0, 1 always accepted, 2, 3 never
    # Position 3 was never judged (position 2 was always rejected first): it stays at 1/2.
    assert ctl._acceptance["a"].tried == [20, 20, 20, 0]
    assert ctl._acceptance["a"].expected_accepted(4) == pytest.approx(21 / 22 + (21 / 22) ** 2 + (21 / 22) ** 2 / 22
                                                                      + (21 / 22) ** 2 / 22 / 2)
    # A new request starts from every request's rates (here 21/22, 21/22, 1/22 and the unjudged
    # 1/2), not from 1/2.
    ctl._all = ctl._acceptance["a"]
    g = [21 / 22, 21 / 22, 1 / 22, 1 / 2]
    assert _Acceptance().expected_accepted(4, ctl._all) == pytest.approx(
        g[0] + g[0] * g[1] + g[0] * g[1] * g[2] + g[0] * g[1] * g[2] * g[3])
    assert _Acceptance().expected_accepted(2) == pytest.approx(0.5 + 0.25)
    ctl._all = _Acceptance()
    ctl.step_cost = lambda T, rows: 0.01                               # flat
    assert ctl._choose_k(2, ["a", "b"]) == 4
    ctl.step_cost = lambda T, rows: 0.01 * T                           # every token costs a step
    assert ctl._choose_k(2, ["a", "b"]) == 0
    ctl.step_cost = lambda T, rows: 0.01 if T <= 6 else 0.05           # k = 2 is the last cheap one
    assert ctl._choose_k(2, ["a", "b"]) == 2
    ctl.step_cost = lambda T, rows: 0.01 if T == 2 else None           # nothing measured beyond k = 0
    assert ctl._choose_k(2, ["a", "b"]) == 4
    assert SpecController(SpeculativeConfig(method="ngram", num_speculative_tokens=3, cost_model=False),
                          NgramProposer(1, 1), lambda T, rows: 0.01 * T)._choose_k(2, ["a"]) == 3


def test_acceptance_counts_each_position_given_the_ones_before():
    """A verification judges its proposals up to the first rejection: a position after it was
    never compared, so it is not a failure.  Counting it as one made the expected accepted
    tokens of a long proposal a product of unconditional rates (positions 4-7 here at 1/2
    instead of 1 once reached), and the cost model then never proposed at k = 8."""
    cfg = SpeculativeConfig(method="ngram", num_speculative_tokens=8)
    acc = _Acceptance()
    for a in (3, 8, 3, 8):
        acc.observe(8, a, cfg, 0)
    assert acc.tried == [4, 4, 4, 4, 2, 2, 2, 2]
    assert acc.ok == [4, 4, 4, 2, 2, 2, 2, 2]
    # Positions 0-2 always accepted, 3 half the time, 4-7 always once reached.
    p = [5 / 6, 5 / 6, 5 / 6, 3 / 6, 3 / 4, 3 / 4, 3 / 4, 3 / 4]
    want, run = 0.0, 1.0
    for x in p:
        run *= x
        want += run
    assert acc.expected_accepted(8) == pytest.approx(want)


def test_off_switch_judges_the_rate_of_the_tokens_verification_reached():
    """k = 8 proposals of which 1 is accepted every time (an acceptance length of 2: twice the
    tokens per step) are 1 of 2 judged tokens, not 1 of 8: the request keeps proposing at
    min_acceptance_rate 0.25.  Proposals rejected at once still switch it off."""
    cfg = SpeculativeConfig(method="ngram", num_speculative_tokens=8, acceptance_window=16,
                            min_acceptance_rate=0.25, probe_interval=10)
    good, bad = _Acceptance(), _Acceptance()
    for step in range(40):
        good.observe(8, 1, cfg, step)
        bad.observe(8, 0, cfg, step)
    assert good.off_until == 0
    assert bad.off_until > 39


def test_cost_model_counts_the_tokens_ngram_found():
    """ngram proposes before the cost model chooses k, so a step is priced with the proposals
    it will verify: here one request found 4 tokens and the other none.  Priced as k each
    (T = 2 + 2k), k = 2 is the last cheap one and request a's 4 tokens would be cut to 2;
    priced as found (T = 2 + k), all 4 are verified in a cheap step."""
    cfg = SpeculativeConfig(method="ngram", num_speculative_tokens=4)

    class Found:
        free = True

        def propose(self, requests, k):
            return {rid: [9, 9, 9, 9][:k] if rid == "a" else [] for rid in requests}

        def cost(self, k, n):
            return 0.0

        def remove(self, rid):
            pass

    class Step:
        req_ids, drafts = ("a", "b"), ((), ())

    class Grammars:
        def proposes(self, rid):
            return True

        def valid_prefix(self, rid, d):
            return d

    states = {rid: type("S", (), {"token_ids": [5, 6]})() for rid in ("a", "b")}
    ctl = SpecController(cfg, Found(), lambda T, rows: 0.01 if T <= 6 else 0.05)
    for rid in ("a", "b"):
        acc = ctl._acceptance[rid] = _Acceptance()
        for _ in range(20):
            acc.observe(4, 4, cfg, 0)           # every proposal accepted so far
    assert ctl._choose_k(2, ["a", "b"]) == 2                    # priced as k tokens each
    res = ctl.propose(RunnerOutput(["a", "b"], [[3], [3]]), Step(), states, Grammars())
    assert res.draft_token_ids == {"a": [9, 9, 9, 9]}
    assert ctl.last_k == 4


def test_cost_model_counts_the_draft_models_steps():
    """A draft model's k steps are part of what k costs: with a flat target step, where
    proposals are free k = 4 wins; a draft step of 0.4 target steps per proposed token makes
    the third and fourth proposal (rarely accepted) cost more than they bring."""
    class Draft:
        free = False

        def __init__(self):
            self.asked, self.measured = [], True

        def cost(self, k, n):
            self.asked.append((k, n))
            return 0.004 * k if self.measured else None

    cfg = SpeculativeConfig(method="ngram", num_speculative_tokens=4)
    draft = Draft()
    ctl = SpecController(cfg, draft, lambda T, rows: 0.01)
    for rid in ("a", "b"):
        acc = ctl._acceptance[rid] = _Acceptance()
        for _ in range(20):
            acc.observe(4, 2, cfg, 0)
    assert ctl._choose_k(2, ["a", "b"]) == 2
    assert (4, 2) in draft.asked            # asked for the two proposing requests
    draft.measured = False                  # not measured yet: only the target's step counts
    assert ctl._choose_k(2, ["a", "b"]) == 4


# ---------------------------------------------------------------------------- scheduler

def make_scheduler(budget=16, max_model_len=64):
    kv = KVCacheManager(64, 4, enable_prefix_caching=False)
    return Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=budget, max_model_len=max_model_len)


def decode_one(s, req, proposals):
    so = s.schedule()
    s.update_from_output(so, RunnerOutput([req.request_id], [[7]], draft_token_ids={req.request_id: proposals}))
    return so


def test_scheduler_verifies_proposals_and_rolls_back_rejected_kv():
    s = make_scheduler()
    req = Request("a", [1, 2, 3, 4, 5], SamplingParams(max_tokens=20, ignore_eos=True), max_tokens=20)
    s.add_request(req)
    decode_one(s, req, [8, 9, 10])                    # the prefill samples 7 and proposes 3 tokens
    so = s.schedule()
    assert so.num_scheduled_tokens == {"a": 4} and so.scheduled_spec_decode_tokens == {"a": [8, 9, 10]}
    computed = req.num_computed_tokens
    # 8 accepted, 9 rejected (the correction 4 comes back): 2 of the 4 positions stay computed.
    s.update_from_output(so, RunnerOutput(["a"], [[8, 4]]))
    assert req.output_token_ids[-2:] == [8, 4]
    assert req.num_computed_tokens == computed + 2 == req.num_tokens - 1
    assert s.spec_stats.num_draft_tokens == 3 and s.spec_stats.num_accepted_tokens == 1
    assert s.spec_stats.accepted_per_pos == [1, 0, 0]


@pytest.mark.parametrize("limit, expect", [("budget", 2), ("max_model_len", 1), ("max_tokens", 3)])
def test_scheduler_cuts_proposals_to_what_fits(limit, expect):
    s = make_scheduler(budget=3 if limit == "budget" else 16, max_model_len=8 if limit == "max_model_len" else 64)
    max_tokens = 5 if limit == "max_tokens" else 20
    req = Request("a", [1, 2, 3, 4, 5, 6], SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                  max_tokens=max_tokens)
    s.add_request(req)
    if limit == "budget":
        while req.num_computed_tokens < 6:
            s.update_from_output(s.schedule(), RunnerOutput(["a"], [[7]], draft_token_ids={"a": [1, 2, 3, 4]}))
    else:
        decode_one(s, req, [1, 2, 3, 4, 5, 6])
    so = s.schedule()
    # budget 3: 1 + 2 proposals; max_model_len 8 with 7 tokens: the last position is 7, so 1;
    # max_tokens 5 with 1 output: at most 4 more tokens, 1 + 3.
    assert len(so.scheduled_spec_decode_tokens["a"]) == expect


def test_a_stop_inside_an_accepted_run_ends_the_request_there():
    s = make_scheduler()
    req = Request("a", [1, 2, 3], SamplingParams(max_tokens=20, stop_token_ids=[9], ignore_eos=True), max_tokens=20)
    s.add_request(req)
    decode_one(s, req, [8, 9, 10])
    so = s.schedule()
    outs = s.update_from_output(so, RunnerOutput(["a"], [[8, 9, 10, 11]]))
    assert outs[0].new_token_ids == [8, 9] and outs[0].finish_reason == "stop" and outs[0].stop_reason == 9
    assert s.kv.num_free_blocks == s.kv.num_blocks


# ---------------------------------------------------------------------------- acceptance rule

def test_accept_emits_up_to_and_including_the_first_rejection():
    a = smd.empty_metadata(8, 3)
    # rows 0-3: one request proposing [5, 6, 7]; rows 4-6: another proposing [1, 2]; row 7 plain.
    a["draft_next"][:7] = [5, 6, 7, -1, 1, 2, -1]
    a["group_start"][:7] = [0, 0, 0, 0, 4, 4, 4]
    md = smd.to_metadata(a)
    drawn = jnp.asarray([5, 6, 9, 3, 4, 2, 8, 0], jnp.int32)   # first: rejects at row 2; second: at row 4
    assert np.asarray(accept(drawn, md)).tolist() == [True, True, True, False, True, False, False, True]
    drawn = jnp.asarray([5, 6, 7, 3, 1, 2, 8, 0], jnp.int32)   # every proposal accepted: bonus rows too
    assert np.asarray(accept(drawn, md)).all()


# ---------------------------------------------------------------------------- reporting

def test_periodic_log_line_reports_acceptance(caplog):
    from jaxllm.engine.async_engine import IterationStats
    from jaxllm.engine.llm_engine import EngineStats
    from serve.stat_logger import StatLogger

    now = [0.0]
    logger = StatLogger(10.0, clock=lambda: now[0])

    def stats(drafts, proposed, accepted, per_pos, gen):
        e = EngineStats(num_running=2, num_waiting=1, num_free_blocks=5, num_blocks=10, num_preemptions=0,
                        spec_num_drafts=drafts, spec_num_draft_tokens=proposed,
                        spec_num_accepted_tokens=accepted, spec_accepted_per_pos=per_pos)
        return IterationStats(engine=e, num_prompt_tokens=0, num_generation_tokens=gen, time_to_first_token=(),
                              inter_token_latency=(), finished=())

    with caplog.at_level(logging.INFO, logger="jaxllm.serve"):
        logger.record(stats(10, 40, 20, (8, 6, 4, 2), 0))
        now[0] = 5.0
        logger.record(stats(20, 80, 50, (18, 14, 10, 8), 50))
        assert not caplog.records
        now[0] = 10.0
        logger.record(stats(30, 120, 70, (26, 20, 14, 10), 50))
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "Avg generation throughput: 10.0 tokens/s" in text and "KV cache usage: 50.0%" in text
    # Since the first record: 20 verifications, 80 proposed, 50 accepted.
    assert "Mean acceptance length: 3.50" in text and "Accepted: 50 tokens, Drafted: 80 tokens" in text
    assert "Per-position acceptance rate: 0.900, 0.700, 0.500, 0.400" in text


def test_bench_reads_the_servers_counters():
    from bench import spec_metrics
    from serve.metrics import Metrics
    from jaxllm.engine.llm_engine import EngineStats

    m = Metrics("m")
    e = lambda d, t, a, p: EngineStats(num_running=0, num_waiting=0, num_free_blocks=1, num_blocks=1,  # noqa: E731
                                       num_preemptions=0, spec_num_drafts=d,
                                       spec_num_draft_tokens=t, spec_num_accepted_tokens=a, spec_accepted_per_pos=p)
    m.update_engine(e(4, 16, 6, (3, 2, 1, 0)))
    before = spec_metrics.parse(m.render().decode())
    m.update_engine(e(10, 40, 20, (8, 6, 4, 2)))
    run = spec_metrics.parse(m.render().decode()).minus(before)
    assert (run.num_drafts, run.num_draft_tokens, run.num_accepted_tokens) == (6, 24, 14)
    assert run.per_pos == (5, 4, 3, 2)
    lines, keys = spec_metrics.summary(run)
    assert keys["spec_decode_acceptance_length"] == pytest.approx(1 + 14 / 6)
    assert spec_metrics.parse("# nothing here\n") is None


# ---------------------------------------------------------------------------- step buckets and their cost

def test_verification_fills_a_bucket_of_its_own():
    """With k = 4, b requests verifying 4 proposals each fill T = 5b (b = 1, 2, 4, 8): as vLLM
    rounds its CUDA-graph sizes to multiples of 1 + k, so a batch-1 verification computes 5
    rows, not the 8 of the next power of two.  Without speculation nothing is added."""
    from jaxllm.runner import buckets as bk
    plain = bk.step_buckets(512, 8)
    spec = bk.step_buckets(512, 8, 8 * 5, num_speculative_tokens=4)
    assert sorted({t for t, _ in spec} - {t for t, _ in plain}) == [5, 10, 20, 40]
    assert bk.pick(5, 5, spec) == (5, 5)
    assert bk.pick(10, 10, spec) == (10, 10)
    assert bk.pick(6, 6, spec) == (8, 8)
    # A decode of 5 requests fits the new bucket too; prefill steps keep max_num_seqs rows.
    assert bk.pick(40, 1, spec) == (40, 8)
    assert bk.verification_buckets(16, 8, 4) == [5, 10]        # below max_num_batched_tokens
    assert bk.verification_buckets(4096, 256, 1) == [2, 4, 8, 16, 32, 64, 128]   # below LINEAR_STEP


def test_an_engines_buckets_with_speculation_hold_its_verifications(tiny_llm):
    """The engine's step configuration passes its k to the buckets."""
    import dataclasses
    cfg = dataclasses.replace(tiny_llm.llm_engine.core.runner.cfg, num_speculative_tokens=4)
    assert cfg.max_num_seqs == 4
    assert (5, 5) in cfg.buckets and (10, 10) in cfg.buckets and (20, 20) in cfg.buckets


def test_a_bucket_costs_at_most_what_a_bigger_one_measured():
    """The cost model reads a bucket's moving average, capped by any bigger bucket's: a rarely
    run bucket whose few runs were slow must not look dearer than a step that holds more."""
    from jaxllm.runner import buckets as bk
    from jaxllm.runner.model_runner import ModelRunner

    class R:
        buckets = bk.step_buckets(64, 4, 4 * 5, num_speculative_tokens=4)
        step_seconds = {(1, 1): 0.007, (2, 2): 0.017, (5, 5): 0.010, (8, 8): 0.015}

    r = R()
    assert ModelRunner.measured_step_seconds(r, 1, 1) == 0.007
    assert ModelRunner.measured_step_seconds(r, 2, 2) == 0.010        # (5, 5) holds it for less
    assert ModelRunner.measured_step_seconds(r, 4, 4) is None         # (4, 4) not measured: tried
    assert ModelRunner.measured_step_seconds(r, 8, 8) == 0.015


def test_a_buckets_first_run_is_not_averaged(tiny_llama):
    """A program's first run is cold (its code and buffers touched for the first time: about
    2x a warm step on the built-in model); averaging it in made buckets that run rarely (a
    verification of 1 + k tokens at batch 1) look dear for the rest of the run, and the cost
    model stopped proposing.  The runner averages from the second run on."""
    from jaxllm import LLM
    from support.engines import SMALL_ENGINE
    # Synchronous scheduling, as under speculation (the only reader of these timings): the
    # engine then runs its steps through ``execute``, which times them (async ``dispatch``
    # returns before the step ends and times nothing).
    llm = LLM(tiny_llama, **SMALL_ENGINE, async_scheduling=False)
    runner = llm.llm_engine.core.runner
    runs: dict = {}
    orig = runner.execute

    def counting(so):
        if so.total_num_scheduled_tokens:
            from jaxllm.runner.buckets import pick
            from jaxllm.runner.inputs import num_rows
            b = pick(so.total_num_scheduled_tokens, num_rows(so), runner.buckets)
            runs[b] = runs.get(b, 0) + 1
        return orig(so)

    runner.execute = counting
    llm.generate([{"prompt_token_ids": [3, 4, 5, 6, 7]}], SamplingParams(max_tokens=6, ignore_eos=True),
                 use_tqdm=False)
    assert runs and any(n == 1 for n in runs.values()) and any(n > 2 for n in runs.values())
    assert set(runner.step_seconds) == {b for b, n in runs.items() if n > 1}
