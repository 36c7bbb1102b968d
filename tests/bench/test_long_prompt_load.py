"""bench/long_prompt_load.py in reduced form: a real ``jaxllm serve`` of the tiny Llama, two
streams, a 64-token "long" prompt under a 32-token step budget (so it is prefilled in chunks
between the streams' decode steps), and the ITL arithmetic on scripted times."""

from __future__ import annotations

import json

import pytest

from bench.long_prompt_load import main, split_itl


def test_split_itl_cuts_at_the_long_prompt():
    streams = [[0.0, 1.0, 2.0, 5.0, 6.0], [0.5, 3.5]]
    before, during = split_itl(streams, t0=2.0, t1=5.0)
    assert before == [1.0, 1.0]                 # 0->1, 1->2: the later token by t0
    assert sorted(during) == [1.0 * 3, 3.0]     # 2->5 and 0.5->3.5 end inside (2, 5]; 5->6 is after


def test_bad_flags_are_value_errors():
    with pytest.raises(ValueError, match="--long-input-len 300 does not fit --max-model-len 256"):
        main(["--long-input-len", "300", "--max-model-len", "256"])
    with pytest.raises(ValueError, match="--streams must be positive"):
        main(["--streams", "0"])


def test_long_prompt_under_load_on_a_served_tiny_model(tiny_llama, tmp_path, capsys):
    out_json = tmp_path / "long.json"
    rc = main(["--model", tiny_llama, "--budgets", "32", "--streams", "2", "--stream-input-len", "4",
               "--warm-tokens", "2", "--long-input-len", "64", "--max-model-len", "256", "--max-num-seqs", "4",
               "--serve-arg=--dtype", "--serve-arg=float32", "--kv-cache-memory-bytes", "64MiB",
               "--startup-timeout", "900", "--timeout", "300",
               "--output-json", str(out_json)])
    out = capsys.readouterr().out
    assert rc == 0
    rows = json.loads(out_json.read_text())["rows"]
    assert [r["budget"] for r in rows] == [32]
    r = rows[0]
    assert r["long_ttft_s"] > 0
    # Two streams, each with at least one gap before the long prompt was sent.
    assert r["itl_before"]["n"] >= 2 and r["itl_before"]["p50_ms"] > 0
    assert r["itl_during"]["n"] >= 1, r          # 64 tokens in 32-token chunks: the streams decode meanwhile
    assert r["itl_during"]["p99_ms"] >= r["itl_during"]["p50_ms"] > 0
    assert "long prompt of 64 tokens sent while 2 streams decode" in out
