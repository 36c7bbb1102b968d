"""bench/embeddings.py's offline arm on a tiny random BERT: both arms embed the same texts to the
same vectors (40 inputs of 16 tokens make one step, run in a 16-wide grid program at the engine's defaults),
each repeat times every arm, and the table reports the medians; the profile puts both arms' op
time in the same categories, the linear layers and attention's matmuls found on both sides."""

from __future__ import annotations

import json
import statistics

import pytest

from bench.embeddings import CATEGORIES, build_folder, main, make_texts  # noqa: E402


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return build_folder(str(tmp_path_factory.mktemp("embeddings_bench") / "bert"), layers=1, hidden=32, heads=4,
                        ffn=64, vocab_size=200, max_positions=64)


def test_offline_bench_times_the_same_work_on_both_arms(folder, tmp_path, capsys):
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


def test_profile_puts_both_arms_ops_in_the_same_categories(folder, tmp_path, capsys):
    out_json = tmp_path / "profile.json"
    assert main(["profile", "--folder", folder, "--batch", "4", "--input-len", "16", "--repeats", "1",
                 "--output-json", str(out_json)]) == 0
    got = json.loads(out_json.read_text())
    assert got["categories"] == CATEGORIES
    jx, st = got["jaxllm_ms"], got["sentence_transformers_ms"]
    linear, attention = CATEGORIES.index("linear layers"), CATEGORIES.index("attention matmuls")
    # Both arms' dense layers and attention found by their HLO / aten names, not left in "the rest".
    for ms in (jx, st):
        assert ms[linear] > 0 and ms[attention] > 0, ms
    assert jx[CATEGORIES.index("GELU")] > 0 and jx[CATEGORIES.index("LayerNorm")] > 0, jx
    ops = got["torch_ops"]
    assert {k: ops.get(k) for k in ("aten::addmm", "aten::gelu", "aten::native_layer_norm")} == {
        "aten::addmm": "linear layers", "aten::gelu": "GELU", "aten::native_layer_norm": "LayerNorm"}, ops
    printed = capsys.readouterr().out
    assert f"| linear layers | {jx[linear]:.2f} | {st[linear]:.2f} |" in printed, printed
