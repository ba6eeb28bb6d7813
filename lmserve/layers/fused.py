"""The element-wise steps of a decoder layer: residual add + RMSNorm, and SiLU(gate) * up.

``FusedOps`` runs each as one call of the C++ kernel (kernels/fused_ops.cpp); ``TorchOps`` as
torch ops, the reference path. Both update the float32 residual stream in place.
"""

from __future__ import annotations

import ctypes
from typing import Optional

import torch
import torch.nn.functional as F

from lmserve.kernels.build import load_kernel_library
from lmserve.layers.call_list import THREADS, Arg, address, float_word


class TorchOps:
    @staticmethod
    def add_rms_norm(x: torch.Tensor, delta: Optional[torch.Tensor], weight: torch.Tensor,
                     eps: float, out_dtype: torch.dtype) -> torch.Tensor:
        """``x += delta`` (in place, float32), then RMSNorm of x times weight in ``out_dtype``."""
        if delta is not None:
            x += delta.float()
        normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        return (weight * normed).to(out_dtype)

    @staticmethod
    def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` for ``gate_up`` ``(T, 2F)`` -> ``(T, F)``."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


class FusedOps:
    @staticmethod
    def create() -> Optional[FusedOps]:
        """The fused ops, or None (logged by the loader) where the kernel cannot be built."""
        P, I = ctypes.c_void_p, ctypes.c_int  # noqa: E741
        lib = load_kernel_library("fused_ops", {
            "lm_add_rms_norm": [P, P, I, P, ctypes.c_float, P, I, I, I, I],
            "lm_silu_mul": [P, P, I, I, I, I],
        })
        return None if lib is None else FusedOps(lib)

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib

    def add_rms_norm(self, x, delta, weight, eps, out_dtype):
        T, D = x.shape
        out = torch.empty(T, D, dtype=out_dtype)
        if delta is not None and delta.dtype not in (torch.float32, torch.bfloat16):
            delta = delta.float()
        delta = None if delta is None else delta.contiguous()
        self.lib.lm_add_rms_norm(*self._norm_args(
            x.data_ptr(), None if delta is None else delta.data_ptr(),
            torch.float32 if delta is None else delta.dtype, weight, eps, out.data_ptr(), out_dtype, T,
            torch.get_num_threads()))
        return out

    def packed_add_rms_norm(self, x: Arg, delta: Arg, delta_dtype: torch.dtype, weight: torch.Tensor,
                            eps: float, out: Arg, out_dtype: torch.dtype, rows: Arg) -> list[Arg]:
        """``add_rms_norm`` as a call for a ``CallList`` (``delta`` 0 for none)."""
        return [address(self.lib.lm_add_rms_norm_packed),
                *self._norm_args(x, delta, delta_dtype, weight, float_word(eps), out, out_dtype, rows, THREADS)]

    @staticmethod
    def _norm_args(x, delta, delta_dtype, weight, eps, out, out_dtype, rows, threads) -> list:
        """lm_add_rms_norm's arguments in order."""
        return [x, delta, int(delta_dtype == torch.bfloat16), weight.data_ptr(), eps, out,
                int(out_dtype == torch.bfloat16), rows, weight.shape[0], threads]

    def packed_silu_mul(self, gate_up: Arg, out: Arg, dtype: torch.dtype, rows: Arg, width: int) -> list[Arg]:
        """``silu_mul`` of ``gate_up`` (rows, 2 * width) into ``out`` as a call for a ``CallList``."""
        return [address(self.lib.lm_silu_mul_packed), gate_up, out, int(dtype == torch.bfloat16), rows,
                width, THREADS]

    def silu_mul(self, gate_up):
        if gate_up.dtype not in (torch.float32, torch.bfloat16):
            return TorchOps.silu_mul(gate_up)
        gate_up = gate_up.contiguous()
        T, F2 = gate_up.shape
        out = torch.empty(T, F2 // 2, dtype=gate_up.dtype)
        self.lib.lm_silu_mul(gate_up.data_ptr(), out.data_ptr(), int(gate_up.dtype == torch.bfloat16),
                             T, F2 // 2, torch.get_num_threads())
        return out
