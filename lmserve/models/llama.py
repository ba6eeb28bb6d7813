"""Llama-family decoder (Llama, Mistral, Qwen2) over a flat batch of tokens from many sequences.

There is no batch dimension: ``T`` tokens of all scheduled sequences sit back to back, and the
attention backend knows which tokens belong to which sequence and where their KV pages are.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch

from lmserve.attention.base import AttentionBackend
from lmserve.cache.kv import KVCache
from lmserve.layers.blocks import BlockWeight
from lmserve.layers.fused import FusedOps, TorchOps
from lmserve.layers.linear import ACT_TENSOR_DTYPES, Weight, make_linear
from lmserve.layers.rotary import RotaryEmbedding
from lmserve.models.args import ModelArgs


@dataclass
class ForwardContext:
    """What every layer of one step shares: attention metadata, rotary angles, the KV cache."""

    backend: AttentionBackend
    attn_meta: object
    ops: Union[TorchOps, FusedOps]  # residual add + RMSNorm, SiLU * up
    cos: torch.Tensor  # (T, hd)
    sin: torch.Tensor  # (T, hd)
    kv: KVCache


class LlamaLayer:
    """One decoder block with fused q/k/v and gate/up projections.

    The residual stream stays float32; matmul inputs are ``act`` (float32 on the reference
    path; bfloat16, or int8 quantized inside the matmul, on the fast ones) into q/k/v and o, and
    ``mlp_act`` into the MLP, so rounding does not pile up over the layers.
    """

    def __init__(self, args: ModelArgs, w: dict[str, Weight], prefix: str, fmt: str, act: str,
                 mlp_act: str):
        def get(name: str) -> Weight:
            return w[prefix + name]

        attn = "self_attn."
        qkv_bias = None
        if args.attention_bias:
            qkv_bias = torch.cat([get(attn + f"{p}_proj.bias") for p in "qkv"])
        self.qkv = make_linear([get(attn + f"{p}_proj.weight") for p in "qkv"], qkv_bias, fmt, act)
        # Llama configs with attention_bias=True also have an o_proj bias
        self.o = make_linear([get(attn + "o_proj.weight")], w.get(prefix + attn + "o_proj.bias"), fmt, act)
        self.gate_up = make_linear([get("mlp.gate_proj.weight"), get("mlp.up_proj.weight")], None, fmt,
                                   mlp_act)
        self.down = make_linear([get("mlp.down_proj.weight")], None, fmt, mlp_act)
        self.norm1 = get("input_layernorm.weight").float()
        self.norm2 = get("post_attention_layernorm.weight").float()
        self.dtype = ACT_TENSOR_DTYPES[act]  # into q/k/v (and so into o: attention returns qkv's dtype)
        self.mlp_dtype = ACT_TENSOR_DTYPES[mlp_act]  # into gate/up (and so into down)
        self.eps = args.rms_norm_eps

    def __call__(self, x: torch.Tensor, delta: Optional[torch.Tensor], ctx: ForwardContext,
                 layer: int) -> torch.Tensor:
        """Add the previous sublayer's output ``delta`` to the residual ``x`` (T, D) in place, run
        the block, and return its MLP output, which the next norm adds in turn."""
        ops = ctx.ops
        qkv = self.qkv(ops.add_rms_norm(x, delta, self.norm1, self.eps, self.dtype))
        attn = ctx.backend.forward(
            ctx.attn_meta, qkv, ctx.cos, ctx.sin, ctx.kv.k[layer], ctx.kv.v[layer]
        )  # (T, H * hd)
        h = ops.add_rms_norm(x, self.o(attn), self.norm2, self.eps, self.mlp_dtype)
        return self.down(ops.silu_mul(self.gate_up(h)))


class LlamaModel:
    """The whole decoder: embedding, layers, final norm and the language-model head."""

    def __init__(self, args: ModelArgs, weights: dict[str, Weight], weight_format: str,
                 act_dtype: str, mlp_act_dtype: Optional[str] = None):
        """``weight_format``: how matmul weights are held, see ``make_linear``; ``act_dtype``:
        activations entering the attention projections and the head (float32, bfloat16, int8);
        ``mlp_act_dtype``: entering the MLP (None: act_dtype)."""
        self.args = args
        self.dtype = ACT_TENSOR_DTYPES[act_dtype]
        embed = weights["model.embed_tokens.weight"]
        dense_embed = embed.dequantize() if isinstance(embed, BlockWeight) else embed
        self.embed = dense_embed.to(self.dtype)  # (V, D), looked up by token id
        self.layers = [
            LlamaLayer(args, weights, f"model.layers.{i}.", weight_format, act_dtype,
                       mlp_act_dtype or act_dtype)
            for i in range(args.num_layers)
        ]
        self.norm = weights["model.norm.weight"].float()
        head = weights.get("lm_head.weight")
        if head is None or args.tie_word_embeddings:
            head = embed
        self.lm_head = make_linear([head], None, weight_format, act_dtype)
        if head is embed and getattr(self.lm_head, "weight", None) is not None \
                and self.lm_head.weight.dtype == self.dtype:
            self.embed = self.lm_head.weight  # tied and dense in the same dtype: one copy

    def rotary(self, max_positions: int, device: torch.device) -> RotaryEmbedding:
        a = self.args
        return RotaryEmbedding(a.head_dim, max_positions, a.rope_theta, a.rope_scaling, device)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """Hidden states ``(T, D)`` after the final norm for the flat batch ``input_ids (T,)``."""
        x = self.embed[input_ids].float()  # (T, D) float32 residual stream, updated in place
        delta = None
        for i, layer in enumerate(self.layers):
            delta = layer(x, delta, ctx, i)
        return ctx.ops.add_rms_norm(x, delta, self.norm, self.args.rms_norm_eps, self.dtype)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits ``(S, V)`` for the selected hidden states ``(S, D)``."""
        return self.lm_head(hidden).float()
