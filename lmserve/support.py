"""Which EngineConfig features are not built yet, so that none of them is silently ignored.

Each entry names a field, when its value asks for something missing, and what is missing.
When a feature lands, delete its line here (and its case in tests/test_config.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lmserve.config import EngineConfig

# (field, does this value need an unbuilt feature?, the feature)
_NOT_BUILT: tuple[tuple[str, Callable[[Any], bool], str], ...] = (
    ("model_lib", lambda v: v is not None, "ahead-of-time compiled model libraries"),
    ("additional_models", lambda v: any(isinstance(m, tuple) for m in v),
     "compiled libraries of additional models (model_lib)"),
)


def check_supported(config: EngineConfig) -> None:
    """Raise ``NotImplementedError`` if the config asks for a feature that is not built yet.

    The message lists every such field with its value and the missing feature, so one run
    shows everything that has to change.
    """
    missing = [
        f"{name}={getattr(config, name)!r} needs {feature}"
        for name, needs_unbuilt, feature in _NOT_BUILT
        if needs_unbuilt(getattr(config, name))
    ]
    if missing:
        raise NotImplementedError("not implemented yet: " + "; ".join(missing))
