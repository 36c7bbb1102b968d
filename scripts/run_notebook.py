"""Executes a notebook top to bottom (nbclient, a kernel on this interpreter) and saves it with
its outputs, so that what the docs show is what running them prints.

    python scripts/run_notebook.py [NOTEBOOK] [--output PATH]

NOTEBOOK defaults to docs/notebooks/quickstart.ipynb, saved in place; cells run in a temporary
folder.  The test suite runs the same notebook into a temporary copy (tests/docs/test_notebook.py).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import nbformat
from nbclient import NotebookClient

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT = os.path.join(ROOT, "docs", "notebooks", "quickstart.ipynb")


def execute(path: str, timeout_s: int = 900) -> nbformat.NotebookNode:
    """The notebook at ``path``, executed in a temporary folder (not saved)."""
    nb = nbformat.read(path, as_version=4)
    with tempfile.TemporaryDirectory(prefix="jaxllm_notebook_") as workdir:
        # "python3" is ipykernel's own spec; jupyter_client runs its "python" as sys.executable.
        NotebookClient(nb, timeout=timeout_s, kernel_name="python3",
                       resources={"metadata": {"path": workdir}}).execute()
    return nb


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebook", nargs="?", default=DEFAULT)
    parser.add_argument("--output", help="where to save the executed notebook (default: in place)")
    args = parser.parse_args(argv)
    if not os.path.isfile(args.notebook):
        parser.error(f"no notebook at {args.notebook}")
    t0 = time.perf_counter()
    nb = execute(args.notebook)
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
              if o.get("output_type") == "error"]
    out = args.output or args.notebook
    nbformat.write(nb, out)
    print(f"{out}: executed in {time.perf_counter() - t0:.0f} s, {len(errors)} cell errors", file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
