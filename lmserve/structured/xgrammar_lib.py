"""xgrammar, imported on first use (engines that never see a constrained request never load it),
and the one call the sampler makes into it."""

from __future__ import annotations

from typing import Any

import torch


def import_xgrammar() -> Any:
    """The xgrammar module, or an ImportError saying how to install it."""
    try:
        import xgrammar
    except ImportError as err:
        raise ImportError("structured output needs xgrammar: pip install --no-deps xgrammar==0.2.9 "
                          "apache-tvm-ffi (see scripts/setup.sh)") from err
    return xgrammar


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, indices: list[int]) -> None:
    """Set the logits of tokens ``bitmask`` disallows to -inf, in place, on rows ``indices``."""
    import_xgrammar().apply_token_bitmask_inplace(logits, bitmask, indices=indices)
