"""bench/embeddings.py's offline arm on a tiny random BERT: both arms embed the same texts to the
same vectors (jaxllm's windowed attention included: 40 inputs of 16 tokens make a 512-token step),
each repeat times every arm, and the table reports the medians."""

from __future__ import annotations

import json
import statistics

from bench.embeddings import build_folder, main, make_texts  # noqa: E402


def test_offline_bench_times_the_same_work_on_both_arms(tmp_path, capsys):
    folder = build_folder(str(tmp_path / "bert"), layers=1, hidden=32, heads=4, ffn=64, vocab_size=200,
                          max_positions=64)
    texts = make_texts(folder, 3, 16)
    assert len(texts) == 3 and all(len(t.split()) == 14 for t in texts)   # + [CLS] and [SEP]
    out_json = tmp_path / "rates.json"
    assert main(["offline", "--folder", folder, "--batches", "1,40", "--input-len", "16", "--repeats", "2",
                 "--output-json", str(out_json)]) == 0
    got = json.loads(out_json.read_text())
    assert all(d <= 1e-4 for d in got["max_abs_diff"].values()), got["max_abs_diff"]
    rates = got["rates"]
    assert set(rates) == {"1", "40"}
    for by_arm in rates.values():
        assert set(by_arm) == {"jaxllm", "sentence-transformers"}
        assert all(len(r) == 2 and min(r) > 0 for r in by_arm.values())
    printed = capsys.readouterr().out
    med = statistics.median(rates["40"]["jaxllm"])
    assert f"| 40 | {med:.1f} |" in printed, printed
