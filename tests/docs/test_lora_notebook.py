"""docs/notebooks/lora_train.ipynb runs top to bottom on a tiny random Llama (LORA_NOTEBOOK_MODEL,
a few steps: LORA_NOTEBOOK_STEPS) and prints what it says it does: the loss going down, the time
of one step, the adapter saved in PEFT's two files and served beside the base.  The copy in the
repository ships with its outputs on the built-in model (scripts/run_notebook.py), where the
adapter visibly answers as trained.

The kernel inherits this process's environment (the suite's compile cache, the two variables)."""

from __future__ import annotations

import os
import re

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NOTEBOOK = os.path.join(ROOT, "docs", "notebooks", "lora_train.ipynb")


def text(nb) -> str:
    out = []
    for c in nb.cells:
        for o in c.get("outputs", []):
            if o.get("output_type") == "error":
                raise AssertionError(f"a cell raised {o.get('ename')}: {o.get('evalue')}")
            out.append(o.get("text") or o.get("data", {}).get("text/plain", ""))
    return "".join(out)


@pytest.fixture(scope="module")
def executed(tiny_llama, tmp_path_factory):
    nb = nbformat.read(NOTEBOOK, as_version=4)
    mp = pytest.MonkeyPatch()
    mp.setenv("LORA_NOTEBOOK_MODEL", tiny_llama)
    mp.setenv("LORA_NOTEBOOK_STEPS", "12")
    try:
        NotebookClient(nb, timeout=600, kernel_name="python3",
                       resources={"metadata": {"path": str(tmp_path_factory.mktemp("lora_nb"))}}).execute()
    finally:
        mp.undo()
    return text(nb)


def test_trains_saves_and_serves(executed):
    losses = [float(v) for v in re.findall(r"^step\s+\d+ loss (\S+)$", executed, re.M)]
    assert len(losses) >= 3 and losses[-1] < losses[0], executed
    assert re.search(r"one training step \(4 sequences of \d+ tokens\): \d+ ms", executed), executed
    assert "['adapter_config.json', 'adapter_model.safetensors']" in executed
    assert executed.count("  base:") == 3 and executed.count("  adapter:") == 3, executed


def test_the_saved_notebook_ships_with_its_outputs_on_the_builtin_model():
    saved = text(nbformat.read(NOTEBOOK, as_version=4))
    assert "SmolLM2-135M-Instruct 30 layers" in saved and "steps: 200" in saved
    assert len(re.findall(r"adapter: 'ANSWER: ", saved)) == 3, saved
