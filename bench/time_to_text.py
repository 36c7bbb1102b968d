"""Runs a command and prints how long it took to its first line on stdout and to its exit
(bench/startup.sh: "process start to printed text").

    python bench/time_to_text.py LABEL STDERR_LOG -- COMMAND...
"""

import subprocess
import sys
import time


def main(argv: list[str]) -> int:
    label, log, sep, *cmd = argv
    if sep != "--" or not cmd:
        raise SystemExit("usage: time_to_text.py LABEL STDERR_LOG -- COMMAND...")
    t0 = time.monotonic()
    with open(log, "w") as err:
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True)
        first = p.stdout.readline()
        t_text = time.monotonic() - t0
        p.communicate()
    print(f"{label}: text after {t_text:.1f} s, exit after {time.monotonic() - t0:.1f} s: {first.strip()!r}")
    return p.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
