"""docs/notebooks/quickstart.ipynb runs top to bottom (nbclient, a kernel on this interpreter)
and says sensible things: the engine's start-up phases logged with timestamps, text generated
without compiling (as the notebook says), logprobs that are log-probabilities, a plausible
sentence scored above its scrambled version, the functional forward agreeing with the
engine's prompt logprobs, and a profile whose trace exists and whose op table names the native
kernels.  The copy in the repository ships with its outputs (scripts/run_notebook.py).

The kernel inherits this process's environment, so it shares the suite's compile cache
(``JAXLLM_CACHE_DIR``, set by tests/conftest.py).
"""

from __future__ import annotations

import os
import re
import sys

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NOTEBOOK = os.path.join(ROOT, "docs", "notebooks", "quickstart.ipynb")
TIMEOUT_S = 600  # per cell; the first engine start compiles every bucket of the built-in model


def cell_text(cell) -> str:
    parts = []
    for out in cell.get("outputs", []):
        if out.get("output_type") == "stream":
            parts.append(out.get("text", ""))
        elif out.get("output_type") in ("execute_result", "display_data"):
            parts.append(out.get("data", {}).get("text/plain", ""))
    return "".join(parts)


@pytest.fixture(scope="module")
def executed(tmp_path_factory):
    nb = nbformat.read(NOTEBOOK, as_version=4)
    workdir = tmp_path_factory.mktemp("notebook")
    # "python3" is ipykernel's own spec; jupyter_client runs its "python" as sys.executable.
    client = NotebookClient(nb, timeout=TIMEOUT_S, kernel_name="python3",
                            resources={"metadata": {"path": str(workdir)}})
    client.execute()
    return nb


def code_cells(nb):
    return [c for c in nb.cells if c.cell_type == "code"]


def find(nb, needle: str) -> str:
    hits = [cell_text(c) for c in code_cells(nb) if needle in c.source]
    assert hits, f"no code cell contains {needle!r}"
    return hits[0]


def test_every_cell_ran_without_error(executed):
    cells = code_cells(executed)
    assert cells
    for i, c in enumerate(cells):
        assert c.get("execution_count") is not None, f"cell {i} did not run"
        errors = [o for o in c.get("outputs", []) if o.get("output_type") == "error"]
        assert not errors, f"cell {i} raised: {errors[0].get('ename')}: {errors[0].get('evalue')}"
    # The kernel was this interpreter.
    assert cell_text(cells[0]).splitlines()[0] == sys.executable


def test_the_saved_notebook_ships_with_its_outputs():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    cells = code_cells(nb)
    assert all(c.get("execution_count") is not None for c in cells), "run scripts/run_notebook.py"
    assert all(cell_text(c) for c in cells), "a code cell of the saved notebook has no output"
    assert not any(o.get("output_type") == "error" for c in cells for o in c.get("outputs", []))


def test_start_up_is_logged_without_bars_or_cursor_codes(executed):
    start = find(executed, "llm = LLM(")
    stamp = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d INFO jaxllm[.\w]*: "
    for phase in ("loading weights of", "tokenizer: ", "native CPU kernel", "KV cache: ", r"\d+ programs ready in"):
        assert re.search(stamp + phase, start), (phase, start)
    assert "engine ready in" in start
    for c in code_cells(executed):
        assert "\x1b[" not in cell_text(c), cell_text(c)


def test_outputs_are_sane(executed):
    gen = find(executed, "llm.generate(prompts")
    # The notebook says generating never compiles: it counted JAX's traces and compiles around it.
    assert "traced while generating: 0 compiled while generating: 0" in gen, gen
    lines = [ln for ln in gen.splitlines() if " -> " in ln]
    assert len(lines) == 2 and all(ln.split(" -> ", 1)[1] not in ("''", "") for ln in lines), gen
    assert "Paris" in lines[0], gen   # greedy SmolLM2 knows this one
    assert re.search(r"^chat: '.+'", gen, re.M), gen

    lps = find(executed, "logprobs=3")
    values = [float(v) for v in re.findall(r"^\s*'.*?'\s+(-?\d+\.\d+)\s+top:", lps, re.M)]
    assert len(values) == 5 and all(v <= 0 for v in values), lps

    sc = find(executed, "def score(text)")
    ll = dict(re.findall(r"^'(.+?)'\s+log-likelihood\s+(-?\d+\.\d+)", sc, re.M))
    assert len(ll) == 3, sc
    assert float(ll["The cat sat on the mat."]) > float(ll["Mat the on sat cat the."]), ll

    fn = find(executed, "functional.load()")
    m = re.search(r"max \|functional - engine\| prompt logprob: (\S+)", fn)
    assert m and float(m.group(1)) < 1e-3, fn
    assert "logits (1, " in fn and "49152) float32" in fn, fn

    prof = find(executed, "profiling.start(log_dir)")
    m = re.search(r"^\s+(/\S+\.xplane\.pb)\s", prof, re.M)
    assert m and os.path.isfile(m.group(1)), prof
    assert "ui.perfetto.dev" in prof
    assert "top XLA ops by self time" in prof and "jit_step" in prof, prof
    # The native kernels are named by their FFI targets, not as bare ffi_call.N rows.
    table = prof[prof.index("top XLA ops by self time"):]
    assert re.search(r"jaxllm_\w+ \(ffi_call\.\d+\)", table), table
    assert not re.search(r"\s(ffi_call\.\d+)\s+jit_", table), table
