"""lmserve: an LLM inference and serving engine in Python on PyTorch."""

from __future__ import annotations

import importlib
from typing import Any

from lmserve.openmp import configure_libgomp

configure_libgomp()  # before anything imports torch (lmserve/openmp.py says why)

__all__ = ["AsyncEngine", "Engine", "EngineConfig", "SamplingParams", "StructuredOutputsParams"]
__version__ = "0.1.0"

# Imported when first used, so that a process that needs only a part (a tensor-parallel rank
# loads no tokenizer, no transformers, no server) starts in a fraction of the time.
_HOMES = {"AsyncEngine": "lmserve.engine.async_engine", "Engine": "lmserve.engine.engine",
          "EngineConfig": "lmserve.config", "SamplingParams": "lmserve.sampling_params",
          "StructuredOutputsParams": "lmserve.structured.params"}


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'lmserve' has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOMES[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
