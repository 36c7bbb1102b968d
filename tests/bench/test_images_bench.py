"""bench/images.py at toy size (the tests' tiny Gemma 3 VLM): every arm runs and is timed each
repeat, the table reports the medians, and the cache-off arm really encodes every request's
image while the cache-on arm encodes each distinct image once."""

from __future__ import annotations

import json
import statistics

from bench.images import main  # noqa: E402


def test_images_bench_times_every_arm_and_the_cache_arms_differ_in_encoder_runs(tmp_path, capsys):
    out_json = tmp_path / "images.json"
    assert main(["--shape", "toy", "--folder", str(tmp_path / "vl"), "--repeats", "1", "--output-len", "1",
                 "--output-json", str(out_json)]) == 0
    got = json.loads(out_json.read_text())
    assert set(got) == {"c1_on", "c1_off", "c8_on", "c8_off", "encoder_s"}
    for c in (1, 8):
        assert got[f"c{c}_on"]["encoded"] == 4, "cache on: each of the 4 images encoded once per run"
        assert got[f"c{c}_off"]["encoded"] == 16, "cache off: every request's image encoded"
    assert all(len(got[k]["rates"]) == 1 and min(got[k]["ttfts"]) > 0 for k in ("c1_on", "c8_off"))
    # the TTFT call's images all hit with the cache on (no encoder time), all encoded with it off
    assert got["c8_on"]["shares"] == [0.0] and 0 < got["c8_off"]["shares"][0] < 1
    printed = capsys.readouterr().out
    assert f"| 8 | off | {statistics.median(got['c8_off']['rates']):.2f} |" in printed, printed
