"""The suite's layout rules: what is not a test lives in tests/support/ and is imported one way
(``support.<module>``, tests/conftest.py puts tests/ on the path once); no test edits
``sys.path`` and no test imports another test module."""

from __future__ import annotations

import os
import re

TESTS = os.path.dirname(os.path.abspath(__file__))
# Standalone scripts run from a shell: they put tests/ on their own path (dump_loaded.py also
# reads the GGUF variants that tests/models/test_gguf_families.py defines).
SCRIPTS = {os.path.join("support", "dump_loaded.py"), os.path.join("fixtures", "gguf_k", "make_fixtures.py")}
PATH_EDIT = re.compile(r"sys\.path\.(insert|append)\(")
TEST_IMPORT = re.compile(r"^\s*(from|import)\s+(tests\.|test_)", re.M)


def _python_files():
    for folder, dirs, files in os.walk(TESTS):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        for name in files:
            if name.endswith(".py"):
                yield os.path.relpath(os.path.join(folder, name), TESTS)


def test_helpers_live_in_support():
    misplaced = [p for p in _python_files()
                 if not os.path.basename(p).startswith("test_") and os.path.basename(p) != "conftest.py"
                 and not p.startswith("support" + os.sep) and p not in SCRIPTS]
    assert misplaced == [], f"helpers and probes belong in tests/support/: {misplaced}"


def test_only_conftest_puts_folders_on_the_path():
    edits = []
    for p in _python_files():
        if p == "conftest.py" or p in SCRIPTS:
            continue
        with open(os.path.join(TESTS, p)) as f:
            if PATH_EDIT.search(f.read()):
                edits.append(p)
    assert edits == [], f"import helpers as support.<module> instead of editing sys.path: {edits}"


def test_no_test_imports_another_test():
    found = []
    for p in _python_files():
        if p in SCRIPTS:
            continue
        with open(os.path.join(TESTS, p)) as f:
            found += [f"{p}: {m.group(0).strip()}" for m in TEST_IMPORT.finditer(f.read())]
    assert found == [], f"move what tests share into tests/support/: {found}"
