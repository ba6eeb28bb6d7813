"""xgrammar, imported on first use (engines that never see a constrained request never load it),
and the one call the sampler makes into it.

xgrammar is an extra (``lmserve[structured]``): its wheel requires triton, a GPU compiler, on
Linux. Without it a constrained request is refused with ``StructuredOutputUnavailable`` (a 400
naming the extra), never a server failure.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch

from lmserve.errors import InvalidRequestError

INSTALL_HINT = ("pip install 'lmserve[structured]', or without the GPU compiler it pulls in: "
                "pip install --no-deps xgrammar==0.2.9 apache-tvm-ffi")


class StructuredOutputUnavailable(InvalidRequestError):
    """A constrained request on an install without xgrammar."""

    def __init__(self, param: str, reason: str) -> None:
        super().__init__(f"{param}: structured output needs xgrammar, which this server cannot load "
                         f"({reason}); {INSTALL_HINT}", param, "structured_output_unavailable")


def xgrammar_installed() -> bool:
    """Whether xgrammar is there to import, found without importing it (which takes seconds)."""
    try:
        return importlib.util.find_spec("xgrammar") is not None
    except (ImportError, ValueError):
        return False


def describe_structured_output() -> str:
    """A line for ``lmserve plan`` and the server's start-up: structured output on or off."""
    if xgrammar_installed():
        return "xgrammar (response_format, structured_outputs, forced tool calls)"
    return f"off: xgrammar is not installed, constrained requests get 400 ({INSTALL_HINT})"


def import_xgrammar() -> Any:
    """The xgrammar module, or an ImportError saying how to install it."""
    try:
        import xgrammar
    except ImportError as err:
        raise ImportError(f"structured output needs xgrammar: {INSTALL_HINT}") from err
    return xgrammar


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, indices: list[int]) -> None:
    """Set the logits of tokens ``bitmask`` disallows to -inf, in place, on rows ``indices``."""
    import_xgrammar().apply_token_bitmask_inplace(logits, bitmask, indices=indices)
