"""ngram speculation on the built-in SmolLM2-135M-Instruct behind the server: the text of
greedy and seeded requests equals plain decoding's (the session's ``builtin_llm``), and the
acceptance is reported in ``/metrics`` and by ``jaxllm bench serve``."""

from __future__ import annotations


import httpx
import pytest

from jaxllm import SamplingParams

SPEC = {"method": "ngram", "num_speculative_tokens": 1, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
        "cost_model": False}
PROMPTS = ["one two three four five six seven eight nine ten " * 3,
           "The list: apple, banana, cherry, apple, banana, cherry, apple,",
           "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return a + b\n\ndef"]
PARAMS = [dict(temperature=0), dict(temperature=0.8, top_p=0.9, top_k=40, seed=7),
          dict(temperature=0.8, seed=3, repetition_penalty=1.2, frequency_penalty=0.3)]


@pytest.fixture(scope="module")
def spec_server():
    from jaxllm.config import ServingConfig
    from support.serve_helpers import ServerThread, make_engine

    # A server builds every bucket of the 30-layer model: 4 tokens a step (two rows verifying
    # one proposal each fit) make four, (1, 1), (2, 2), (4, 2) and (4, 4) (three proposals in 8
    # tokens made six).  Several proposals verified in one step: tests/spec_decode/
    # test_spec_identity.py on the tiny models.  float32 activations, as the session's
    # builtin_llm (tests/quant/test_builtin_int8.py checks speculation on int8 activations).
    engine = make_engine(None, max_num_seqs=2, max_num_batched_tokens=4, max_model_len=256, speculative_config=SPEC,
                         cpu_matmul="native")
    srv = ServerThread(engine, ServingConfig(host="127.0.0.1", port=0))
    yield srv
    srv.stop()
    engine.shutdown()


def spec_counters(base):
    from bench import spec_metrics
    return spec_metrics.parse(httpx.get(f"{base}/metrics", timeout=30).text)


def test_served_text_equals_plain_decoding(spec_server, builtin_llm):
    # 16 tokens of each of the nine requests: drafts accepted and rejected (asserted below)
    before = spec_counters(spec_server.base)
    with httpx.Client(base_url=spec_server.base, timeout=120) as c:
        for prompt in PROMPTS:
            for p in PARAMS:
                plain = builtin_llm.generate([prompt], SamplingParams(max_tokens=16, ignore_eos=True, **p),
                                             use_tqdm=False)[0].outputs[0]
                r = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 16, "ignore_eos": True, **p})
                assert r.status_code == 200, r.text
                assert r.json()["choices"][0]["text"] == plain.text, (prompt, p)
    run = spec_counters(spec_server.base).minus(before)
    assert run.num_drafts > 0 and 0 < run.num_accepted_tokens < run.num_draft_tokens
    assert sum(run.per_pos) == run.num_accepted_tokens


def test_bench_serve_prints_the_acceptance(spec_server, tmp_path, capsys):
    from jaxllm.cli import main
    import json
    rc = main(["bench", "serve", "--base-url", spec_server.base, "--dataset-name", "random",
               "--random-input-len", "24", "--random-output-len", "24", "--num-prompts", "4", "--max-concurrency",
               "2", "--seed", "1", "--save-result", "--result-dir", str(tmp_path), "--result-filename", "out.json",
               "--disable-tqdm", "--temperature", "0"])
    out = capsys.readouterr().out
    assert rc == 0, out
    data = json.loads((tmp_path / "out.json").read_text())
    assert data["failed"] == 0
    # Random prompts still give ngram (n down to 1) something to propose at greedy.
    assert "Speculative Decoding" in out and "Acceptance length:" in out, out
    assert data["spec_decode_num_drafts"] > 0 and data["spec_decode_acceptance_length"] >= 1.0
