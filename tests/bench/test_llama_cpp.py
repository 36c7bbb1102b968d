"""bench/llama_cpp.py's printed tables: every measured part of a run is in them (the prefill
comparison was once only in the JSON and the progress lines)."""

from __future__ import annotations

from bench.llama_cpp import medians, render


def test_prefill_and_depth_rows_are_printed_with_their_ratios():
    res = {"args": {"repeats": 3, "output_len": 32},
           "prefill": {"512": medians([700.0, 720.0, 690.0], [350.0, 360.0, 365.0]),
                       "4096": medians([480.0, 470.0, 440.0], [250.0, 255.0, 240.0])},
           "depth": {"2048": medians([45.0, 47.0, 46.0], [40.0, 41.0, 39.0])}}
    out = render(res)
    print(out)
    assert "| 512 | 700.0 | 360.0 | 1.94x | 700.0, 720.0, 690.0 | 350.0, 360.0, 365.0 |" in out
    assert "| 4096 | 470.0 | 250.0 | 1.88x |" in out
    assert "| 2048 | 46.0 | 40.0 | 1.15x |" in out
