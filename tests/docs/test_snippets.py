"""Every fenced code block of README.md and docs/*.md runs, and what it claims to print holds.

One test per block, named by ``file:line`` (``pytest -rA`` lists them; each prints what it did).
How a block runs is declared in tests/support/snippets.py (KINDS): Python blocks are executed,
shell blocks run, ``jaxllm serve`` is ONE server on the built-in model shared by every block
that talks to it.  Documented substitutions keep the file near two minutes:

- the shared server is ``jaxllm serve`` on a free port with smaller step buckets
  (``BUILTIN_SERVER_FLAGS``: the engine settings of tests/bench/test_serve_client.py's server on
  the built-in model, whose programs the run's compile cache then already holds), and
  ``127.0.0.1:8000`` in a block becomes its address;
- README's first command (``jaxllm generate``) and its offline ``LLM()`` block run with those
  settings too (their ``sub``): the three engines compile one set of programs.  The offline
  defaults on the built-in model are CI's first-run check (scripts/first_run.sh: ``jaxllm
  generate`` in a fresh venv);
- a block annotated ``flags`` (benchmarks that take minutes, commands needing GPUs, several
  hosts or llama.cpp) has each command's flags checked against the parser it will meet:
  ``jaxllm``'s (jaxllm/cli.py) or the ``add_argument`` strings of the ``bench/`` script
  (``run="N"``: its first N commands run as written);
- a block annotated ``skip`` is not run, and its reason is printed.
"""

from __future__ import annotations

import os
import re
import stat
import subprocess
import sys

import pytest

from jaxllm import cli
from support import manifests, snippets
from support.serve_process import running_server
from support.snippets import BUILTIN_SERVER_FLAGS, KINDS, ROOT, all_blocks, argv_of, commands

BLOCKS = all_blocks()
SERVER_START_S = 600   # cold: every bucket of the built-in model compiles; warm (saved programs): seconds
RUN_S = 600
DOC_ADDRESSES = ("http://127.0.0.1:8000", "http://localhost:8000", "localhost:8000")
_printed: dict[str, str] = {}   # block where -> what it printed (for output-of-previous)


@pytest.fixture(scope="session")
def bin_dir(tmp_path_factory):
    """A folder with a ``jaxllm`` that runs this checkout's CLI on this interpreter, and ``python``
    / ``python3`` that are this interpreter (a block's ``python bench/...`` runs with the test's
    packages whether or not the venv is first on ``PATH``)."""
    d = tmp_path_factory.mktemp("bin")
    for name, args in (("jaxllm", " -m jaxllm.cli"), ("python", ""), ("python3", "")):
        shim = d / name
        shim.write_text(f'#!/bin/sh\nexec "{sys.executable}"{args} "$@"\n')
        shim.chmod(shim.stat().st_mode | stat.S_IEXEC)
    return str(d)


@pytest.fixture(scope="session")
def env(bin_dir):
    e = dict(os.environ)
    e["PATH"] = bin_dir + os.pathsep + e.get("PATH", "")
    e["PYTHONPATH"] = ROOT + (os.pathsep + e["PYTHONPATH"] if e.get("PYTHONPATH") else "")
    e.setdefault("JAXLLM_CACHE_DIR", os.path.join(ROOT, ".jaxllm_cache", "tests"))
    return e


@pytest.fixture(scope="session")
def docs_server(env, tmp_path_factory):
    """``jaxllm serve`` on the built-in model (the README's command, BUILTIN_SERVER_FLAGS added)."""
    log = tmp_path_factory.mktemp("server") / "serve.log"
    with running_server([sys.executable, "-m", "jaxllm.cli", "serve", *BUILTIN_SERVER_FLAGS], env=env, log=log,
                        timeout=SERVER_START_S, cwd=ROOT) as base:
        yield base


def _uses_server(text: str) -> bool:
    return any(a in text for a in DOC_ADDRESSES)


def _point_at(text: str, base: str) -> str:
    port = base.rsplit(":", 1)[1]
    for a in DOC_ADDRESSES:
        text = text.replace(a, a.replace("8000", port))
    return text


def _parse_jaxllm(block, argv: list[str]) -> None:
    """``jaxllm ARGV`` through the CLI's own parser; its one-line error becomes the failure."""
    try:
        cli.parse_args(cli.build_parser(), argv[1:])
    except SystemExit as e:
        raise AssertionError(f"{block.where}: `{' '.join(argv)}` is refused by jaxllm's parser (exit {e.code})") from None


def _check_expect(block, out: str, report: list[str]) -> None:
    expect = block.attrs.get("expect")
    if expect is not None:
        assert re.search(expect, out), f"{block.where}: output does not match {expect!r}:\n{out[-2000:]}"
        report.append(f"  output matches {expect!r}")


def _substituted(block, text: str, report: list[str]) -> str:
    """The block's ``sub="OLD=>NEW; ..."`` substitutions (a smaller run of the same command)."""
    for pair in filter(None, (p.strip() for p in block.attrs.get("sub", "").split(";"))):
        old, new = pair.split("=>")
        assert old in text, f"{block.where}: substitution {old!r} not found in the block"
        text = text.replace(old, new)
        report.append(f"  substituted {old!r} -> {new!r}")
    return text


def _run(argv_or_cmd, env, cwd, shell=False):
    r = subprocess.run(argv_or_cmd, env=env, cwd=cwd, shell=shell, capture_output=True, text=True,
                       stdin=subprocess.DEVNULL,
                       timeout=RUN_S, executable="/bin/bash" if shell else None)
    return r


def run_python(block, env, tmp_path, request, report):
    code = _substituted(block, block.body, report)
    if _uses_server(code):
        base = request.getfixturevalue("docs_server")
        code = _point_at(code, base)
        report.append(f"  against the shared server {base}")
    r = _run([sys.executable, "-c", code], env, str(tmp_path))
    assert r.returncode == 0, f"{block.where}: python block failed ({r.returncode}):\n{r.stderr[-4000:]}"
    report.append(f"  executed: exit 0, {len(r.stdout.splitlines())} lines printed")
    report.append("  | " + "\n  | ".join(r.stdout.strip().splitlines()[:12]))
    return r.stdout


def run_shell(block, env, tmp_path, request, report):
    out = []
    for cmd in commands(_substituted(block, block.body, report)):
        argv = argv_of(cmd)
        if argv[:2] == ["jaxllm", "serve"]:
            _parse_jaxllm(block, argv)
            base = request.getfixturevalue("docs_server")
            report.append(f"  `{cmd}`: flags parse; served by the shared server {base}")
            continue
        if _uses_server(cmd):
            cmd = _point_at(cmd, request.getfixturevalue("docs_server"))
        r = _run(cmd, env, str(tmp_path), shell=True)
        assert r.returncode == 0, f"{block.where}: `{cmd}` exited {r.returncode}:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
        report.append(f"  `{cmd[:100]}`: exit 0, {len(r.stdout)} bytes printed")
        out.append(r.stdout)
    return "".join(out)


def _script_flags(path: str) -> str:
    return open(path, encoding="utf-8").read()


def check_flags(block, env, tmp_path, request, report):
    assert block.attrs.get("reason"), f"{block.where}: a `flags` block says why it does not run (reason=...)"
    cmds = commands(_substituted(block, block.body, report))
    n_run = int(block.attrs.get("run", 0))
    out = []
    for cmd in cmds[:n_run]:   # ``run="N"``: the first N commands do run, where docs run them (bench/...)
        r = _run(cmd, env, ROOT, shell=True)
        assert r.returncode == 0, f"{block.where}: `{cmd}` exited {r.returncode}:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
        report.append(f"  `{cmd[:100]}`: run, exit 0, printed {r.stdout.strip()[:120]!r}")
        out.append(r.stdout)
    report.append(f"  {'the rest ' if n_run else ''}not run ({block.attrs['reason']}); flags checked:")
    for cmd in cmds[n_run:]:
        argv = argv_of(cmd)
        # Shell variables of a loop stand for numbers in every docs block that uses them.
        argv = [re.sub(r"\$\w+", "1", a) for a in argv]
        if not argv or argv[0] in ("for", "do", "done", "set"):
            report.append(f"  `{cmd}`: shell syntax")
            continue
        if argv[0] == "jaxllm":
            _parse_jaxllm(block, argv)
            report.append(f"  `{' '.join(argv)[:100]}`: jaxllm's parser accepts it")
        elif argv[:2] == ["python", "-c"]:
            compile(argv[2], block.where, "exec")
            report.append(f"  `{cmd[:100]}`: the program compiles")
        elif argv[0] == "python" and argv[1].endswith(".py"):
            src = _script_flags(os.path.join(ROOT, argv[1]))
            missing = [a.split("=")[0] for a in argv[2:] if a.startswith("--") and f'"{a.split("=")[0]}"' not in src]
            assert not missing, f"{block.where}: {argv[1]} has no flags {missing}"
            report.append(f"  `{' '.join(argv)[:100]}`: {argv[1]} defines every flag")
        elif argv[0].endswith(".sh"):
            path = os.path.join(ROOT, argv[0])
            assert os.access(path, os.X_OK), f"{block.where}: {argv[0]} is not an executable script"
            report.append(f"  `{cmd[:100]}`: {argv[0]} exists")
        elif argv[:2] == ["pip", "install"]:
            report.append(f"  `{cmd[:100]}`: an install, not run")
        else:
            raise AssertionError(f"{block.where}: no way to check the flags of `{cmd}`")
    return "".join(out)


def output_of_previous(block, env, tmp_path, request, report):
    i = BLOCKS.index(block)
    prev = BLOCKS[i - 1]
    assert prev.where in _printed, f"{block.where}: the block before ({prev.where}) did not run first"
    out = _printed[prev.where]
    for line in block.body.splitlines():
        if line.strip():
            assert line.strip() in out, f"{block.where}: {line.strip()!r} not in what {prev.where} printed:\n{out[-2000:]}"
    report.append(f"  every line appears in what {prev.where} printed")
    return out


def check_k8s(block, env, tmp_path, request, report):
    # A route block refers to the pods of the file's Deployment block above it.
    upto = [b for b in BLOCKS[:BLOCKS.index(block) + 1] if b.path == block.path and b.kind == "k8s"]
    report.extend(manifests.check(block.where, "\n---\n".join(b.body for b in upto)))
    return ""


RUNNERS = {"python": run_python, "shell": run_shell, "flags": check_flags, "output-of-previous": output_of_previous,
           "k8s": check_k8s}
assert set(RUNNERS) | {"skip"} == set(KINDS)


@pytest.mark.parametrize("block", BLOCKS, ids=[b.where for b in BLOCKS])
def test_block(block, env, tmp_path, request):
    report = [f"{block.where} ({block.lang or 'no language'}): {block.kind}"]
    try:
        if block.kind is None:
            pytest.fail(f"{block.where}: a ```{block.lang} block with no way to run: annotate it "
                        f"(<!-- snippet: KIND ... -->, KIND one of {sorted(KINDS)})")
        if block.kind not in KINDS:
            pytest.fail(f"{block.where}: unknown snippet kind {block.kind!r} (one of {sorted(KINDS)})")
        if block.kind == "skip":
            assert block.attrs.get("reason"), f"{block.where}: a skipped block says why (reason=...)"
            report.append(f"  skipped: {block.attrs['reason']}")
            return
        out = RUNNERS[block.kind](block, env, tmp_path, request, report)
        _check_expect(block, out, report)
        _printed[block.where] = out
    finally:
        print("\n".join(report))


# The reader of blocks and commands itself (tests/support/snippets.py).

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
    monkeypatch.setattr(sys.modules[__name__], "BLOCKS", [prev, out])
    monkeypatch.setitem(_printed, prev.where, "hello there\nworld\n")
    output_of_previous(out, None, None, None, [])
    monkeypatch.setitem(_printed, prev.where, "hello there\n")
    with pytest.raises(AssertionError, match="'world' not in what d.md:1 printed"):
        output_of_previous(out, None, None, None, [])


@pytest.mark.parametrize("old, new, error", [
    ("path: /health, port: http}\n            periodSeconds: 5",
     "path: /ready, port: http}\n            periodSeconds: 5", "readinessProbe path /ready is not a GET route"),
    ("targetPort: 8000", "targetPort: 8080", "Service jaxllm-qwen3 sends to port 8080"),
    ('"--metrics-compat", "vllm"', '"--metrics-compat", "none"', "need --metrics-compat vllm"),
    ('"--host", "0.0.0.0"', '"--host", "127.0.0.1"', "--host 0.0.0.0"),
    ("mountPath: /cache", "mountPath: /var/cache", "not on a mounted volume"),
    ('"--served-model-name"', '"--served-model-names"', "refused by jaxllm's parser"),
])
def test_k8s_manifests_that_drift_from_the_server_are_refused(old, new, error):
    """The deployment doc's manifests pass; each drift from the server they deploy is named."""
    text = "\n---\n".join(b.body for b in BLOCKS if b.path == "docs/deployment.md" and b.kind == "k8s")
    manifests.check("doc", text)
    assert old in text
    with pytest.raises(AssertionError, match=re.escape(error)):
        manifests.check("doc", text.replace(old, new))
