#!/usr/bin/env bash
# Builds .device_wheels/: the Python packages bench/device_check.py imports besides JAX, as
# wheels, so that bench/device_check.sh can install them on the lent GPU machine, which reaches
# no package registry.  Run it here (PyPI reachable), then carry the folder:
#
#     scripts/device_wheels.sh [--verify]       # writes .device_wheels/ (git-ignored)
#     device tool run: command "bench/device_check.sh", carry [".device_wheels"], timeout_s 540
#
# Which packages: the distributions whose modules are loaded by the check's import path (the
# engine with a tokenizer-less LLM, transformers' AutoConfig reading a config.json, pytest and
# the two kernel test modules), found by importing them here in .venv, minus what jax[cuda12]
# brings (jax, jaxlib, numpy, ml_dtypes, opt_einsum, scipy) and what is optional there (torch,
# accelerate, ...).  Versions are the ones installed in .venv (what the project is tested with).
# Pure-Python wheels once; binary ones for CPython 3.11-3.13 on manylinux x86_64 (abi3 once;
# jax >= 0.10 needs Python >= 3.11; the GPU machine's was 3.12 when last seen).
# The list of "import name -> distribution==version" goes to .device_wheels/manifest.txt, which
# device_check.sh reads to install only what the machine lacks.
#
# --verify: installs the folder with --no-index --no-deps into a scratch venv (plus numpy from
# PyPI) and imports transformers/tokenizers/pytest there, to prove the folder is complete.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
OUTDIR=${DEVICE_WHEELS_DIR:-$ROOT/.device_wheels}
PY=${PYTHON:-$ROOT/.venv/bin/python}
VERIFY=0
[[ "${1:-}" == "--verify" ]] && VERIFY=1
[[ -x "$PY" ]] || { echo "device_wheels: no $PY (run scripts/setup.sh or set PYTHON)" >&2; exit 1; }

rm -rf "$OUTDIR"
mkdir -p "$OUTDIR"
probe_dir=$(mktemp -d)
trap 'rm -rf "$probe_dir"' EXIT

# 1. The import closure, as "import_name dist version" lines.
PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" "$PY" - "$probe_dir" > "$OUTDIR/manifest.txt" <<'EOF'
import importlib.metadata as md
import json
import os
import sys

probe = sys.argv[1]
with open(os.path.join(probe, "config.json"), "w") as f:
    json.dump({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
               "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 1,
               "intermediate_size": 96, "vocab_size": 128}, f)
import jaxllm.llm, jaxllm.engine.detokenizer          # noqa: E401,F401  the engine's import path
from transformers import AutoConfig
AutoConfig.from_pretrained(probe)                      # the HF-folder loader
import pytest, pytest_timeout                          # noqa: E401,F401
sys.path.insert(0, "tests")
import kernels.test_ragged_paged_attention, kernels.test_gumbel_argmax   # noqa: E401,F401

PROVIDED = {"jax", "jaxlib", "numpy", "ml-dtypes", "opt-einsum", "scipy", "jaxllm", "etils"}
OPTIONAL = {"torch", "accelerate", "sympy", "mpmath", "protobuf", "setuptools", "networkx", "nvidia-ml-py"}
norm = lambda n: n.lower().replace("_", "-")               # noqa: E731
seen = {}
pd = md.packages_distributions()
for top in sorted({m.split(".")[0] for m in sys.modules}):
    for dist in pd.get(top, []):
        if norm(dist) in PROVIDED or norm(dist) in OPTIONAL:
            continue
        seen.setdefault(norm(dist), (top, md.version(dist)))
for dist, (top, ver) in sorted(seen.items()):
    print(f"{top} {dist} {ver or ''}".rstrip())
EOF
echo "device_wheels: $(wc -l < "$OUTDIR/manifest.txt") distributions:" $(awk '{print $2}' "$OUTDIR/manifest.txt")

# 2. Download: every requirement for each CPython version (pure wheels land once).
reqs=()
while read -r _top dist ver; do
    reqs+=("${dist}${ver:+==$ver}")
done < "$OUTDIR/manifest.txt"
platforms=(--platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64
           --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_34_x86_64
           --platform manylinux1_x86_64)
status=0
for pyver in 3.12 3.11 3.13; do
    common=(download -q --no-deps --only-binary=:all: --python-version "$pyver" --implementation cp "${platforms[@]}"
            -d "$OUTDIR")
    if ! "$PY" -m pip "${common[@]}" "${reqs[@]}" 2>/dev/null; then
        # One at a time, to name what has no wheel for this Python.
        for r in "${reqs[@]}"; do
            if ! "$PY" -m pip "${common[@]}" "$r" >/dev/null 2>&1; then
                # The pinned version may not exist for this Python: take the newest that does.
                if "$PY" -m pip "${common[@]}" "${r%%==*}" >/dev/null 2>&1; then
                    echo "device_wheels: python $pyver: $r has no wheel, took the newest ${r%%==*} instead" >&2
                else
                    echo "device_wheels: python $pyver: no wheel for $r" >&2
                    [[ "$pyver" == 3.12 ]] && status=1      # the GPU machine's Python (seen: 3.12)
                fi
            fi
        done
    fi
done
size=$(du -sh "$OUTDIR" | cut -f1)
echo "device_wheels: $(ls "$OUTDIR"/*.whl | wc -l) wheels, $size in $OUTDIR"
bytes=$(du -sb "$OUTDIR" | cut -f1)
if (( bytes > 48 * 1024 * 1024 )); then
    echo "device_wheels: $OUTDIR is over 48 MiB: with the working tree it may not fit the 64 MiB the device tool carries" >&2
    status=1
fi

# 3. Optional proof: the folder alone (no index, no deps) makes the imports work.
if (( VERIFY )); then
    venv=$(mktemp -d)
    "$PY" -m venv "$venv"
    "$venv/bin/pip" install -q numpy
    "$venv/bin/pip" install -q --no-index --no-deps --find-links "$OUTDIR" "${reqs[@]}"
    "$venv/bin/python" - "$probe_dir" <<'EOF'
import sys
from transformers import AutoConfig
cfg = AutoConfig.from_pretrained(sys.argv[1])
import tokenizers.decoders, pytest, pytest_timeout   # noqa: E401,F401
print("device_wheels --verify: transformers", __import__("transformers").__version__, "reads a config;",
      "tokenizers", tokenizers.__version__, "and pytest", pytest.__version__, "import")
EOF
    "$venv/bin/python" -m pytest --version
    rm -rf "$venv"
fi
exit $status
