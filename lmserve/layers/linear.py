"""Linear layers in the weight formats ``opt`` selects: dense (float32/bfloat16/float16) or
blocks of 4-bit/8-bit codes multiplied by lmserve's C++ kernel (kernels/block_gemm.cpp).

Both kinds compute every output row the same way whatever the number of rows in the call, so a
token's result does not depend on its batch company.
"""

from __future__ import annotations

import ctypes
import logging
from typing import Optional, Union

import torch
import torch.nn.functional as F

from lmserve.kernels.build import load_kernel_library, why_unavailable
from lmserve.layers.blocks import BLOCK, BlockWeight

logger = logging.getLogger("lmserve")

Weight = Union[torch.Tensor, BlockWeight]
DENSE_FORMATS = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
BLOCK_FORMATS = {"int4": 4, "int8": 8}
WEIGHT_FORMATS = (*DENSE_FORMATS, *BLOCK_FORMATS, "native")


def _library() -> Optional[ctypes.CDLL]:
    lib = load_kernel_library("block_gemm")
    if lib is not None and not getattr(lib, "_lmserve_typed", False):
        P, I = ctypes.c_void_p, ctypes.c_int  # noqa: E741
        lib.lm_block_gemm.argtypes = [P, P, P, P, P, I, I, I, I, I, I]
        lib.lm_block_gemm.restype = None
        lib._lmserve_typed = True
    return lib


def block_kernel_unavailable() -> Optional[str]:
    """Why block weights cannot be used on this machine, or None."""
    reason = why_unavailable()
    if reason is None and _library() is None:
        return "the block kernel failed to build (see the log)"
    return reason


class DenseLinear:
    """``y = x @ W^T + b`` with W held dense in ``dtype``."""

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor], dtype: torch.dtype):
        self.weight = weight.to(dtype)
        self.bias = None if bias is None else bias.to(dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class BlockLinear:
    """``y = x @ W^T + b`` with W in 32-wide blocks of 4- or 8-bit codes; bfloat16 in and out."""

    def __init__(self, weight: BlockWeight, bias: Optional[torch.Tensor]):
        self.lib = _library()
        if self.lib is None:
            raise RuntimeError("the C++ block kernel is not available on this machine")
        self.w = weight
        self.n, self.k = weight.shape
        self.bias = None if bias is None else bias.to(torch.bfloat16)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(torch.bfloat16).contiguous()
        m = x.shape[0]  # (M, K)
        out = torch.empty(m, self.n, dtype=torch.bfloat16)
        zero = self.w.zero.data_ptr() if self.w.zero is not None else None
        self.lib.lm_block_gemm(x.data_ptr(), self.w.codes.data_ptr(), self.w.scale.data_ptr(), zero,
                               out.data_ptr(), 1, m, self.n, self.k, self.w.bits,
                               torch.get_num_threads())
        return out if self.bias is None else out + self.bias


Linear = Union[DenseLinear, BlockLinear]


def _dense(parts: list[Weight]) -> torch.Tensor:
    """The parts dequantized and stacked (a single dense part is returned as is, not copied)."""
    dense = [p.dequantize() if isinstance(p, BlockWeight) else p for p in parts]
    return dense[0] if len(dense) == 1 else torch.cat(dense)


def make_linear(parts: list[Weight], bias: Optional[torch.Tensor], fmt: str) -> Linear:
    """One linear layer from the weights ``parts`` stacked along the output dimension (fused
    q/k/v or gate/up), held as ``fmt`` says:

    - ``float32``/``bfloat16``/``float16``: dense, dequantized from blocks if need be;
    - ``native``: the file's 4-bit/8-bit blocks as they are; other weights dense bfloat16;
    - ``int4``/``int8``: blocks, re-rounding weights the file does not have in that many bits.
    """
    if fmt in DENSE_FORMATS:
        return DenseLinear(_dense(parts), bias, DENSE_FORMATS[fmt])
    if parts[0].shape[1] % BLOCK:
        return DenseLinear(_dense(parts), bias, torch.bfloat16)
    if fmt == "native":
        blocks = [p for p in parts if isinstance(p, BlockWeight)]
        if len(blocks) == len(parts) and len({p.bits for p in blocks}) == 1:
            return BlockLinear(BlockWeight.cat(blocks), bias)
        return DenseLinear(_dense(parts), bias, torch.bfloat16)
    bits = BLOCK_FORMATS[fmt]
    blocks = [p if isinstance(p, BlockWeight) and p.bits == bits else BlockWeight.quantize(_dense([p]), bits)
              for p in parts]
    return BlockLinear(BlockWeight.cat(blocks), bias)


def resolve_weight_format(fmt: str) -> str:
    """``fmt``, or bfloat16 (logged) when it needs the block kernel and that is unavailable here."""
    if fmt in DENSE_FORMATS:
        return fmt
    reason = block_kernel_unavailable()
    if reason is None:
        return fmt
    logger.warning("weight format %s needs the C++ block kernel, which is unavailable (%s); "
                   "using bfloat16 weights", fmt, reason)
    return "bfloat16"
