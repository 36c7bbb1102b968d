"""tests/docs/snippets.py reads blocks, annotations and shell commands as the docs write them,
and test_snippets.py's ``output-of-previous`` compares against what the block before printed."""

from __future__ import annotations

import pytest

import snippets
import test_snippets


def _blocks(tmp_path, monkeypatch, text):
    (tmp_path / "doc.md").write_text(text)
    monkeypatch.setattr(snippets, "ROOT", str(tmp_path))
    return snippets.blocks_of("doc.md")


def test_blocks_kinds_and_annotations(tmp_path, monkeypatch):
    text = ('```python\nprint(1)\n```\n\n'
            '<!-- snippet: skip reason="a diagram, not code" -->\n\n```\nA -> B\n```\n'
            '```\nno way to run\n```\n'
            '<!-- snippet: shell sub="--n 32=>--n 4; x=>y" expect="\\"ok\\"" -->\n```bash\necho ok\n```\n')
    b = _blocks(tmp_path, monkeypatch, text)
    assert [(x.line, x.lang, x.kind) for x in b] == [(1, "python", "python"), (7, "", "skip"), (10, "", None),
                                                     (14, "bash", "shell")]
    assert b[1].attrs == {"reason": "a diagram, not code"}
    assert b[3].attrs == {"sub": "--n 32=>--n 4; x=>y", "expect": '\\"ok\\"'}


def test_commands_join_continuations_and_open_quotes():
    body = ("jaxllm serve   # a comment\n"
            "curl -s URL -d '{\n  \"a\": 1}'\n"
            "jaxllm bench serve --x 1 \\\n    --y 2\n\n"
            "echo '# not a comment'\n")
    assert snippets.commands(body) == ["jaxllm serve", "curl -s URL -d '{\n  \"a\": 1}'",
                                       "jaxllm bench serve --x 1 --y 2", "echo '# not a comment'"]
    assert snippets.argv_of("A=$(x | tail -1)/bin B=2 python bench/x.py --k 1 &") == ["python", "bench/x.py",
                                                                                    "--k", "1"]


def test_output_of_previous_compares_with_what_was_printed(monkeypatch):
    prev = snippets.Block("d.md", 1, "bash", "echo", "shell", {})
    out = snippets.Block("d.md", 5, "", "hello\n  world", "output-of-previous", {})
    monkeypatch.setattr(test_snippets, "BLOCKS", [prev, out])
    monkeypatch.setitem(test_snippets._printed, prev.where, "hello there\nworld\n")
    test_snippets.output_of_previous(out, None, None, None, [])
    monkeypatch.setitem(test_snippets._printed, prev.where, "hello there\n")
    with pytest.raises(AssertionError, match="'world' not in what d.md:1 printed"):
        test_snippets.output_of_previous(out, None, None, None, [])
