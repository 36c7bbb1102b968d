"""bench/cpu_matmul_ab.py: two ``--cpu-matmul`` engines in one process, alternated; on a
packed Q4_1 checkpoint the arms run the kernels they name, and the table has a row per arm."""

from __future__ import annotations

import gguf
import pytest

from bench import cpu_matmul_ab
from jaxllm.cpu import native

from support.tiny_models import write_gguf


@pytest.mark.skipif(not native.quant_available(), reason="the native packed-block matmul did not build")
def test_both_arms_run_their_kernels_and_print_a_row_each(tiny_llama, tmp_path, capsys):
    path = str(tmp_path / "tiny-Q4_1.gguf")
    write_gguf(tiny_llama, path, matrix_type=gguf.GGMLQuantizationType.Q4_1)
    # 40 prompt tokens: the int16 kernel's prefill panels (32 rows or more) run too
    assert cpu_matmul_ab.main(["--model", path, "--rounds", "2", "--tokens", "3", "--prefill", "40"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| native")]
    assert [r.split("|")[1:3] for r in rows] == [[" native ", " native "], [" native-int16 ", " native-int16 "]]
    for r in rows:
        ms, tps = float(r.split("|")[3]), float(r.split("|")[5])
        assert ms > 0 and tps > 0
    print(out)


def test_arms_must_differ():
    with pytest.raises(SystemExit):
        cpu_matmul_ab.main(["--arms", "native", "native"])
