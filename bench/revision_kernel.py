"""A native CPU kernel source as another git revision has it, compiled into a temporary
library: the "base" arm of the benchmarks that time this tree's kernel against another
revision's in one process (bench/q4_1_linear.py, bench/decode_attention.py)."""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import tempfile

import jax


def build(rev: str, source: str, headers: list[str], flags: list[str]) -> ctypes.CDLL:
    """Compiles ``rev``'s ``jaxllm/cpu/<source>`` with its ``headers`` (those the revision
    has) and ``flags`` (native.py's for that source) into a temporary library; the loaded
    library, which the caller keeps while its handlers are registered."""
    root = subprocess.run(["git", "rev-parse", "--show-toplevel"], capture_output=True, text=True, check=True,
                          cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    folder = tempfile.mkdtemp(prefix="kernel_base_")
    for name in [source, *headers]:
        shown = subprocess.run(["git", "show", f"{rev}:jaxllm/cpu/{name}"], capture_output=True, text=True, cwd=root)
        if shown.returncode != 0:
            if name == source:
                raise RuntimeError(f"git show {rev}:jaxllm/cpu/{name} failed: {shown.stderr.strip()}")
            continue   # a header the revision did not have is not included by it
        with open(os.path.join(folder, name), "w") as f:
            f.write(shown.stdout)
    lib_path = os.path.join(folder, "libbase.so")
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    built = subprocess.run([cxx, *flags, f"-I{jax.ffi.include_dir()}", os.path.join(folder, source), "-o", lib_path],
                           capture_output=True, text=True)
    if built.returncode != 0:
        raise RuntimeError(f"compiling {rev}'s {source} failed: {built.stderr.strip()[-2000:]}")
    return ctypes.cdll.LoadLibrary(lib_path)


