"""The C++ decode kernels of the Mamba mixers (``kernels/ssm_decode.cpp``): the causal
convolution and the selective scan of one token per sequence, on the states in their slots."""

from __future__ import annotations

import ctypes
from typing import Optional

import torch

from lmserve.kernels.build import load_kernel_library
from lmserve.models.args import SSMArgs


class SSMKernels:
    @staticmethod
    def create() -> Optional[SSMKernels]:
        """The kernels, or None (logged by the loader) where they cannot be built."""
        P, I, L = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64  # noqa: E741
        lib = load_kernel_library("ssm_decode", {
            "lm_conv_step": [P, P, I, P, L, P, P, P, I, I, I],
            "lm_scan_step_v1": [P, P, I, P, P, P, P, L, P, I, I, I],
            "lm_scan_step_v2": [P, P, I, P, L, P, L, P, P, P, I, I, I, I, I],
        })
        return None if lib is None else SSMKernels(lib)

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib

    def conv_step(self, x: torch.Tensor, conv: torch.Tensor, slots: torch.Tensor,
                  weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """``x`` (B, C) float32 -> silu(conv) (B, C); shifts x into the slots' inputs."""
        batch, channels = x.shape
        x = x.contiguous()
        u = torch.empty_like(x)
        self.lib.lm_conv_step(conv.data_ptr(), slots.data_ptr(), batch, x.data_ptr(), channels,
                              weight.data_ptr(), bias.data_ptr(), u.data_ptr(), channels,
                              weight.shape[1], torch.get_num_threads())
        return u

    def scan_step_v1(self, ssm: torch.Tensor, slots: torch.Tensor, u: torch.Tensor,
                     dt: torch.Tensor, A: torch.Tensor, bc: torch.Tensor) -> torch.Tensor:
        """Mamba: ``u`` and softplus'd ``dt`` (B, I), ``bc`` (B, 2N) B then C -> y (B, I)."""
        batch, inner = u.shape
        u, dt = u.contiguous(), dt.contiguous()
        bc = bc if bc.stride(1) == 1 else bc.contiguous()
        y = torch.empty_like(u)
        self.lib.lm_scan_step_v1(ssm.data_ptr(), slots.data_ptr(), batch, u.data_ptr(), dt.data_ptr(),
                                 A.data_ptr(), bc.data_ptr(), bc.stride(0), y.data_ptr(), inner,
                                 A.shape[1], torch.get_num_threads())
        return y

    def scan_step_v2(self, ssm: torch.Tensor, slots: torch.Tensor, u: torch.Tensor,
                     dt_raw: torch.Tensor, dt_bias: torch.Tensor, A: torch.Tensor,
                     s: SSMArgs) -> torch.Tensor:
        """Mamba2: ``u`` (B, conv_dim) the convolution's x, B and C; ``dt_raw`` (B, H) before
        bias and softplus -> y (B, I)."""
        u, dt_raw = u.contiguous(), dt_raw.contiguous()
        y = torch.empty(u.shape[0], s.inner)
        self.lib.lm_scan_step_v2(ssm.data_ptr(), slots.data_ptr(), u.shape[0], u.data_ptr(), u.shape[1],
                                 dt_raw.data_ptr(), dt_raw.shape[1], dt_bias.data_ptr(), A.data_ptr(),
                                 y.data_ptr(), s.num_heads, s.head_dim,
                                 s.n_groups, s.state_size, torch.get_num_threads())
        return y
