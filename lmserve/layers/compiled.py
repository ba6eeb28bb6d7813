"""opt knob ``compile=1``: a decoder layer's torch ops around attention as ``torch.compile`` graphs.

On the torch path (``attention=torch_native``, dense float32/float16 weights) a layer is torch ops
apart from attention, whose page gathers are Python. The ops before attention (residual add,
RMSNorm, q/k/v projection) and after it (o projection, residual add, RMSNorm, gate/up, SiLU * up,
down) become two compiled graphs. They are free functions taking the weights as arguments, so
every layer shares the same two graphs instead of compiling one per layer, and the number of
tokens is left dynamic after the first shapes (torch.compile's default), so steps of different
sizes reuse them. Inductor fuses the element-wise ops; the matmuls stay torch's.

Paths with lmserve's C++ kernels (``attention=cpu_paged``, block weights) are refused by
``parse_opt``: torch.compile cannot see into them, and on O0-O3 the layers run as one C++ call
list already.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from lmserve.layers.fused import TorchOps


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    # torch's F.linear (MKL), not DenseLinear's C++ kernel, which torch.compile cannot see into.
    # So the compiled graphs' matmuls are not batch-invariant in their last bits.
    return F.linear(x.to(weight.dtype), weight, bias)


def _before_attention(x: torch.Tensor, delta: Optional[torch.Tensor], norm: torch.Tensor, eps: float,
                      dtype: torch.dtype, qkv_w: torch.Tensor, qkv_b: Optional[torch.Tensor]) -> torch.Tensor:
    """``x += delta`` in place, then q/k/v of its RMSNorm: (T, D) -> (T, (H + 2 KVH) hd)."""
    return _linear(TorchOps.add_rms_norm(x, delta, norm, eps, dtype), qkv_w, qkv_b)


def _after_attention(x: torch.Tensor, attn: torch.Tensor, o_w: torch.Tensor, o_b: Optional[torch.Tensor],
                     norm: torch.Tensor, eps: float, dtype: torch.dtype, gate_up_w: torch.Tensor,
                     down_w: torch.Tensor) -> torch.Tensor:
    """``x += o(attn)`` in place, then the MLP of its RMSNorm: (T, D) -> (T, D)."""
    h = TorchOps.add_rms_norm(x, _linear(attn, o_w, o_b), norm, eps, dtype)
    return _linear(TorchOps.silu_mul(_linear(h, gate_up_w, None)), down_w, None)


class CompiledLayerOps:
    """The two compiled graphs of a layer, shared by every layer of a model."""

    def __init__(self) -> None:
        self.before_attention = torch.compile(_before_attention)
        self.after_attention = torch.compile(_after_attention)
