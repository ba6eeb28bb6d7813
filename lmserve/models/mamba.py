"""The recurrent layer of Mamba-family models: a Llama-style block whose attention is a Mamba or
Mamba2 mixer (``layers.ssm.MambaMixer``). Pure Mamba and Mamba2 blocks are just that (norm,
mixer, residual); hybrids such as Bamba add the MLP sublayer, and interleave these blocks with
attention ones (``LlamaLayer``)."""

from __future__ import annotations

from typing import Optional

import torch

from lmserve.layers.linear import ACT_TENSOR_DTYPES, MlpActs, Weight, dense_weight, make_linear
from lmserve.layers.ssm import MambaMixer
from lmserve.models.args import ModelArgs


class MixerLayer:
    """Weights under ``prefix`` in the reader's Llama-style names: ``input_layernorm``, the
    mixer under ``mamba.``, and (hybrids) ``post_attention_layernorm`` and ``mlp.*``.
    ``state_index``: this layer's place among the model's recurrent layers (its state tensors)."""

    def __init__(self, args: ModelArgs, w: dict[str, Weight], prefix: str, fmt: str, act: str,
                 mlp_act: MlpActs, state_index: int) -> None:
        assert args.ssm is not None  # a model with recurrent layers has their args
        self.mixer = MambaMixer(args.ssm, w, prefix + "mamba.", fmt, act, args.rms_norm_eps)
        self.norm1 = dense_weight(w[prefix + "input_layernorm.weight"]).float()
        self.state_index = state_index
        self.dtype = ACT_TENSOR_DTYPES[act]
        self.mlp_dtype = mlp_act.dtype
        self.eps = args.rms_norm_eps
        self.has_mlp = prefix + "mlp.down_proj.weight" in w
        if self.has_mlp:
            self.norm2 = dense_weight(w[prefix + "post_attention_layernorm.weight"]).float()
            self.gate_up = make_linear([w[prefix + "mlp.gate_proj.weight"], w[prefix + "mlp.up_proj.weight"]],
                                       None, fmt, mlp_act.gate_up)
            self.down = make_linear([w[prefix + "mlp.down_proj.weight"]], None, fmt, mlp_act.down)

    def __call__(self, x: torch.Tensor, delta: Optional[torch.Tensor], ctx, layer: int) -> torch.Tensor:
        """As ``LlamaLayer.__call__``: add ``delta`` to the residual ``x`` in place, run the
        block, return its last sublayer's output."""
        ops, i = ctx.ops, self.state_index
        h = ops.add_rms_norm(x, delta, self.norm1, self.eps, self.dtype)
        out = self.mixer(h, ctx.state_meta, ctx.states.conv[i], ctx.states.ssm[i], ctx.ssm_kernels)
        if not self.has_mlp:
            return out
        h = ops.add_rms_norm(x, out, self.norm2, self.eps, self.mlp_dtype)
        return self.down(ops.silu_mul(self.gate_up(h)))
