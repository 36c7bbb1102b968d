"""docs/FEATURES.md names, in each row's last column, the tests that prove the row: every file and
test named there must exist, so a renamed or deleted test cannot leave a row claiming a proof."""
from __future__ import annotations

import fnmatch
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_REF = re.compile(r"`((?:tests/[\w/]+\.py)?(?:::[\w*\[\].,/-]+)*)`")


def _defined_names(path: Path) -> set[str]:
    return set(re.findall(r"^\s*(?:async\s+)?(?:def|class)\s+(\w+)", path.read_text(), re.M))


def proof_references(text: str) -> list[tuple[int, str, str]]:
    """(line, file, test name or '') for every test reference in a table row's last column; a
    bare ``::name`` refers to the file named before it in the same cell."""
    refs = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.startswith("|") or line.startswith("|---"):
            continue
        proof = line.rstrip().rstrip("|").rsplit("|", 1)[-1]
        current = None
        for ref in _REF.findall(proof):
            if not ref:
                continue
            file, _, names = ref.partition("::")
            if file:
                current = file
            if current is None:
                refs.append((lineno, "", ref))
                continue
            parts = [n for n in names.split("::") if n] if names else []
            refs.append((lineno, current, parts[-1] if parts else ""))
    return refs


def missing_proofs(text: str, root: Path = ROOT) -> list[str]:
    missing = []
    for lineno, file, name in proof_references(text):
        if not file:
            missing.append(f"line {lineno}: {name!r} names no file before it")
            continue
        path = root / file
        if not path.is_file():
            missing.append(f"line {lineno}: {file} does not exist")
            continue
        if not name:
            continue
        bare = name.split("[", 1)[0]          # a parametrized id: the function's name
        names = _defined_names(path)
        if not (fnmatch.filter(names, bare) if "*" in bare else bare in names):
            missing.append(f"line {lineno}: {file} defines no test {name!r}")
    return missing


def test_every_test_a_features_row_names_exists():
    text = (ROOT / "docs" / "FEATURES.md").read_text()
    assert len(proof_references(text)) > 100    # the parser found the table's proofs
    assert missing_proofs(text) == []


def test_a_renamed_test_is_reported(tmp_path):
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_x.py").write_text("def test_kept():\n    pass\n")
    rows = ("| a | ✅ | `tests/test_x.py::test_kept`, `::test_gone`, `::test_k*` |\n"
            "| b | ✅ | `tests/test_y.py` |\n")
    assert missing_proofs(rows, tmp_path) == [
        "line 1: tests/test_x.py defines no test 'test_gone'",
        "line 2: tests/test_y.py does not exist"]
