"""Heads at the drafter's level (the ``draft_opt`` knob, default O3; see ``draft_model.draft_opt``).

A drafter's numbers only choose which tokens are tried: the target verifies them at its own
level, so EAGLE and Medusa heads, like a draft model, may run at a faster level than the target
without changing its output. Heads come as float32 files with no blocks of their own: at a
level whose weights are the file's blocks (``native``) their matrices take int8 blocks, the
finer of the two block formats.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from lmserve.config import OptFlags
from lmserve.layers.linear import Linear, make_linear, resolve_act_dtype, resolve_weight_format


def head_weight_format(level: OptFlags) -> str:
    """How a head's float32 matrices are held at ``level`` (see the module docstring)."""
    return "int8" if level.weight_dtype == "native" else level.weight_dtype


def head_formats(level: OptFlags) -> tuple[str, str]:
    """The weight format and activations of a head's matrices at ``level``, as this machine can
    run them (a fallback where a C++ kernel is missing is logged, as for a model)."""
    return resolve_weight_format(head_weight_format(level)), resolve_act_dtype(level.act_dtype)


def head_linear(parts: Sequence[torch.Tensor], bias: Optional[torch.Tensor],
                formats: tuple[str, str]) -> Linear:
    """A head's linear layer (``parts`` stacked along the output dimension) in ``formats``
    (``head_formats``)."""
    return make_linear(list(parts), bias, *formats)  # (a list[Weight], as make_linear takes)
