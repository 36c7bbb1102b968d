"""Caches are disposable: garbage written over every cache file (converted tokenizer, native
kernels, saved programs, JAX's compilation cache), or every file truncated, and the next start
rebuilds what it needs, says so in one line naming each entry, and prints the same tokens.

Both kinds of damage in one start (a start costs a process, its imports and its compiles):
the entries of each cache alternate between them, the tokenizer's files take both."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest

from jaxllm import cache_files
from jaxllm.cpu import native

# A tiny Llama whose GGUF carries a tokenizer (converted and cached like the built-in model's).
GGUF = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures", "gguf_k",
                    "tiny-llama-Q6_K.gguf")


def _generate(cache_dir: str, cxx: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "JAXLLM_LOG_LEVEL"}
    env["JAXLLM_CACHE_DIR"] = cache_dir
    if cxx is not None:
        env["CXX"] = cxx
    r = subprocess.run([sys.executable, "-m", "jaxllm.cli", "generate", "Hello world", "--model", GGUF,
                        "--max-tokens", "6", "--max-num-seqs", "2", "--max-num-batched-tokens", "16",
                        "--max-model-len", "64"],
                       capture_output=True, text=True, timeout=900, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    return r


def _entries(cache_dir: str) -> dict[str, list[str]]:
    """The entries each cache holds (paths as the log names them)."""
    tok = os.path.join(cache_dir, "tokenizers")
    xla = os.path.join(cache_dir, "xla")
    return {
        "tokenizer": [os.path.join(tok, d) for d in os.listdir(tok)],
        "kernel": [os.path.join(cache_dir, "kernels", f) for f in os.listdir(os.path.join(cache_dir, "kernels"))
                   if f.endswith(".so")],
        "program": [os.path.join(xla, "programs", f) for f in os.listdir(os.path.join(xla, "programs"))
                    if f.endswith(".jaxexe")],
        "xla": [os.path.join(xla, f) for f in os.listdir(xla) if f.endswith("-cache")],
    }


def _stand_in_compiler(folder, built: str) -> str:
    """A C++ "compiler" that answers ``--version`` as g++ does (so the kernels' cache keys are
    the same) and "builds" a kernel by copying the library g++ built from that source: a
    rebuild of five kernels costs a copy, not minutes of g++ on a busy machine."""
    gxx = shutil.which("g++") or shutil.which("c++")
    path = os.path.join(str(folder), "cxx")
    with open(path, "w") as f:
        f.write(f"""#!/bin/sh
[ "$1" = --version ] && exec {gxx} --version
for a; do
  [ "$prev" = -o ] && out="$a"
  case "$a" in *.cc) src=$(basename "$a" .cc);; esac
  prev="$a"
done
cp {built}/libjaxllm_${{src}}_*.so "$out"
""")
    os.chmod(path, 0o755)
    return path


@pytest.fixture(scope="module")
def clean_start(tmp_path_factory):
    """A start from a fresh cache (its kernels copied from the suite's, so no compiler runs),
    and a stand-in compiler for the rebuilds."""
    assert native.available() and native.quant_available()   # built and sealed in the suite's cache
    # Only the libraries of today's sources (the suite's cache may also hold older builds,
    # which a start never opens and so never reports).
    loaded = [lib._name for lib in native._state["libs"] + native._quant_state["libs"]]
    cache = str(tmp_path_factory.mktemp("cache"))
    built = str(tmp_path_factory.mktemp("built"))
    os.makedirs(os.path.join(cache, "kernels"))
    for path in loaded:
        for name in (path, path + cache_files.SEAL_SUFFIX):
            shutil.copy(name, os.path.join(cache, "kernels"))
        shutil.copy(path, built)
    r = _generate(cache)
    entries = _entries(cache)
    for kind, paths in entries.items():
        assert paths, f"precondition: the clean start left no {kind} entry"
    return cache, r.stdout, _stand_in_compiler(tmp_path_factory.mktemp("cxx"), built)


HOWS = ("garbage", "truncated")


def _damage_file(path: str, how: str) -> None:
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        if how == "garbage":
            f.write(bytes((i * 251 + 7) % 256 for i in range(min(size, 4096))) or b"\xf6")
        else:
            f.truncate(size // 2)


def _damage(cache: str, entries: dict[str, list[str]]) -> dict[str, set[str]]:
    """Every file of the cache damaged: garbage over the converted tokenizer's JSON (what once
    stopped a start with a UnicodeDecodeError) and truncation over the tokenizer entry's other
    files; per kind, the other caches' entries (their files: a kernel's seal goes with it)
    alternating between garbage and truncation.  Returns kind -> the kinds of damage it got."""
    got: dict[str, set[str]] = {kind: set() for kind in entries}
    owner = {}                                      # entry path -> (kind, damage)
    for kind, paths in entries.items():
        for j, path in enumerate(sorted(paths)):
            owner[path] = (kind, HOWS[j % 2])
    files = sorted(os.path.join(root, name) for root, _, names in os.walk(cache) for name in names)
    for path in files:
        entry = next((e for e in owner if path == e or path.startswith(e + os.sep) or path.startswith(e + ".")),
                     None)
        kind, how = owner[entry] if entry else (None, "garbage")
        if kind == "tokenizer":
            how = "garbage" if os.path.basename(path) == "tokenizer.json" else "truncated"
        _damage_file(path, how)
        if kind:
            got[kind].add(how)
    return got


def test_a_damaged_cache_is_rebuilt_with_one_line_each(clean_start, tmp_path):
    cache, expected, cxx = clean_start
    damaged = str(tmp_path / "cache")
    shutil.copytree(cache, damaged)
    entries = _entries(damaged)
    got = _damage(damaged, entries)
    assert got == {kind: set(HOWS) for kind in entries}, f"precondition: each cache meets both damages: {got}"
    r = _generate(damaged, cxx)
    assert r.stdout == expected
    lines = r.stderr.splitlines()
    for kind, paths in entries.items():
        for path in paths:
            said = [ln for ln in lines if re.search(rf"damaged cache entry {re.escape(path)}\b", ln)]
            assert len(said) == 1, f"{kind} {path}: {said or r.stderr[-4000:]}"
    assert len(re.findall(r"native CPU kernel \S+: compiled in", r.stderr)) == len(entries["kernel"])
    # Rebuilt whole: a third start trusts every entry again.
    again = _generate(damaged)
    assert again.stdout == expected and "damaged cache entry" not in again.stderr, again.stderr[-3000:]
