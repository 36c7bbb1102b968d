"""The fenced code blocks of README.md and docs/*.md, and how each one is run by the suite.

A block runs the way its language says (``python``: executed; ``bash``: its commands run) unless
an HTML comment on the line before its fence declares another way::

    <!-- snippet: KIND key="value" ... -->

KINDS below lists them.  A block with no language and no annotation has no way to run, and
its test fails: a new docs block cannot go untested by accident.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import re
import shlex

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

KINDS = {
    "python": "executed in a fresh interpreter in a temp dir (server URL pointed at the shared server)",
    "shell": "its commands run in a temp dir: `jaxllm serve` is the shared server, `curl` talks to it",
    "flags": "each command's flags checked against its parser, not run (reason says why; run=N: the first N run)",
    "output-of-previous": "each line with `expect` must appear in what the previous block printed",
    "k8s": "Kubernetes YAML, parsed; with the file's earlier k8s blocks, checked against jaxllm's CLI and "
           "serve/app.py's routes (tests/support/manifests.py)",
    "skip": "not run; reason printed",
}
DEFAULT_KIND = {"python": "python", "bash": "shell", "sh": "shell"}

_FENCE = re.compile(r"^```(\S*)\s*$")
_ANNOTATION = re.compile(r"^<!--\s*snippet:\s*(\S+)(.*?)-->\s*$")
_ATTR = re.compile(r'(\w+)=(?:"((?:[^"\\]|\\.)*)"|(\S+))')


SERVER_FLAGS = ["--max-num-seqs", "4", "--max-num-batched-tokens", "32", "--max-model-len", "512"]
"""What a docs server adds to a block's ``jaxllm serve`` (smaller step buckets: fewer programs to
compile).  They are the buckets of tests/serve/test_serve_tools.py's engine on the same scripted
checkpoint (tests/support/tool_models.py), so tests/docs/test_tool_example.py's server loads its
programs from the run's compile cache when that file ran first (and the other way round)."""

BUILTIN_SERVER_FLAGS = ["--max-num-seqs", "16", "--max-num-batched-tokens", "64", "--max-model-len", "256"]
"""What the docs' shared server on the built-in model adds to ``jaxllm serve``: the engine
settings of tests/support/serve_helpers.py's ``SERVE_ENGINE`` (tests/bench/test_serve_client.py's
server on the built-in model), so that its every-bucket warm-up loads that server's programs from
the run's compile cache instead of compiling 30-layer programs of its own.  Its longest docs
request (README's ``jaxllm bench serve``: 128 + 64 tokens) fits ``--max-model-len 256``."""


@dataclasses.dataclass(frozen=True)
class Block:
    path: str          # relative to the repository root
    line: int          # 1-based line of the opening fence
    lang: str
    body: str
    kind: str | None   # None: no way to run declared
    attrs: dict

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}"


def doc_files() -> list[str]:
    return ["README.md"] + sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))


def parse_annotation(text: str) -> tuple[str, dict]:
    m = _ANNOTATION.match(text.strip())
    if not m:
        raise ValueError(f"not a snippet annotation: {text!r}")
    attrs = {k: (q if q is not None else bare) for k, q, bare in _ATTR.findall(m.group(2))}
    return m.group(1), attrs


def blocks_of(path: str) -> list[Block]:
    lines = open(os.path.join(ROOT, path), encoding="utf-8").read().splitlines()
    out, i = [], 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        start, lang = i, m.group(1)
        j = i + 1
        while j < len(lines) and not lines[j].startswith("```"):
            j += 1
        body = "\n".join(lines[start + 1:j])
        prev = start - 1
        while prev >= 0 and not lines[prev].strip():
            prev -= 1
        kind, attrs = DEFAULT_KIND.get(lang), {}
        if prev >= 0 and lines[prev].lstrip().startswith("<!-- snippet:"):
            kind, attrs = parse_annotation(lines[prev])
        out.append(Block(path, start + 1, lang, body, kind, attrs))
        i = j + 1
    return out


def all_blocks() -> list[Block]:
    return [b for f in doc_files() for b in blocks_of(f)]


def commands(body: str) -> list[str]:
    """A shell block's commands: continuation lines and open quotes joined, comments and blank
    lines dropped."""
    out, cur, continued = [], "", False
    for raw in body.splitlines():
        line = raw.rstrip()
        cur = cur + line.lstrip() if continued else (cur + "\n" + line if cur else line)
        continued = cur.endswith("\\")
        if continued:
            cur = cur[:-1].rstrip() + " "
            continue
        try:
            shlex.split(cur)
        except ValueError:   # a quote still open: the command goes on
            continue
        stripped = _strip_comment(cur).strip()
        if stripped:
            out.append(stripped)
        cur = ""
    if cur.strip():
        out.append(cur.strip())
    return out


def _strip_comment(line: str) -> str:
    """The line up to a ``#`` that starts a shell comment (outside quotes, after whitespace)."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            if ch == quote:
                quote = None
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i]
    return line


def argv_of(command: str) -> list[str]:
    """The argv of one command, leading ``VAR=value`` assignments and a trailing ``&`` removed."""
    while True:   # VAR=$(cmd ...)suffix: shlex would split the command substitution
        m = re.match(r"^[A-Za-z_][A-Za-z0-9_]*=\$\([^)]*\)\S*\s+", command)
        if not m:
            break
        command = command[m.end():]
    argv = shlex.split(command)
    while argv and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", argv[0]):
        argv = argv[1:]
    if argv and argv[-1] == "&":
        argv = argv[:-1]
    return argv
