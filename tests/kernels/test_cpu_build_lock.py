"""jaxllm/cpu/native.py's ``_build``: two builds of one kernel at once run one compiler.

Two test workers (or two servers started on a fresh install) reach a kernel whose library is
not cached yet at about the same time: the second waits on the first's lock file and takes its
library instead of running the same g++ beside it.  Here the two builds are two threads (the
lock is ``flock`` on a file each opens for itself, which holds between threads as between
processes) and the compiler is a script that takes a second and counts its runs.
"""

from __future__ import annotations

import os
import stat
import threading

from jaxllm.cpu import native

FAKE_CXX = """#!/bin/sh
if [ "$1" = "--version" ]; then echo "fake-g++ 1.0"; exit 0; fi
echo run >> "{runs}"
sleep 1
for a in "$@"; do [ "$prev" = "-o" ] && echo library > "$a"; prev="$a"; done
"""


def test_concurrent_builds_of_one_kernel_compile_it_once(tmp_path, monkeypatch):
    runs = tmp_path / "runs.log"
    cxx = tmp_path / "fake-g++"
    cxx.write_text(FAKE_CXX.format(runs=runs))
    cxx.chmod(cxx.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("CXX", str(cxx))
    monkeypatch.setenv("JAXLLM_CACHE_DIR", str(tmp_path / "cache"))
    paths, barrier = [None, None], threading.Barrier(2)

    def build(i):
        barrier.wait()
        paths[i] = native._build("norm.cc")

    threads = [threading.Thread(target=build, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert paths[0] == paths[1] and paths[0].startswith(str(tmp_path / "cache" / "kernels")), paths
    assert runs.read_text().splitlines() == ["run"], "the compiler ran once per build, not once per kernel"
    assert open(paths[0]).read() == "library\n" and os.path.isfile(paths[0] + ".sha256")
    # A later build finds the sealed library and runs no compiler.
    assert native._build("norm.cc") == paths[0] and runs.read_text().splitlines() == ["run"]
