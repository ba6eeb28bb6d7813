"""Llama-family decoder (Llama, Mistral, Qwen2) over a flat batch of tokens from many sequences.

There is no batch dimension: ``T`` tokens of all scheduled sequences sit back to back, and the
attention backend knows which tokens belong to which sequence and where their KV pages are.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from lmserve.attention.base import AttentionBackend
from lmserve.cache.kv import KVCache
from lmserve.layers.blocks import BlockWeight
from lmserve.layers.linear import DENSE_FORMATS, Weight, make_linear
from lmserve.layers.rotary import RotaryEmbedding
from lmserve.models.args import ModelArgs


@dataclass
class ForwardContext:
    """What every layer of one step shares: attention metadata, rotary angles, the KV cache."""

    backend: AttentionBackend
    attn_meta: object
    cos: torch.Tensor  # (T, hd)
    sin: torch.Tensor  # (T, hd)
    kv: KVCache


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype) -> torch.Tensor:
    """RMSNorm of the float32 residual stream, returned in the matmuls' dtype."""
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * x).to(out_dtype)


class LlamaLayer:
    """One decoder block with fused q/k/v and gate/up projections.

    The residual stream stays float32; matmul inputs are in ``dtype`` (float32 on the reference
    path, bfloat16 on the fast ones), so rounding does not pile up over the layers.
    """

    def __init__(self, args: ModelArgs, w: dict[str, Weight], prefix: str, fmt: str, dtype: torch.dtype):
        def get(name: str) -> Weight:
            return w[prefix + name]

        attn = "self_attn."
        qkv_bias = None
        if args.attention_bias:
            qkv_bias = torch.cat([get(attn + f"{p}_proj.bias") for p in "qkv"])
        self.qkv = make_linear([get(attn + f"{p}_proj.weight") for p in "qkv"], qkv_bias, fmt)
        # Llama configs with attention_bias=True also have an o_proj bias
        self.o = make_linear([get(attn + "o_proj.weight")], w.get(prefix + attn + "o_proj.bias"), fmt)
        self.gate_up = make_linear([get("mlp.gate_proj.weight"), get("mlp.up_proj.weight")], None, fmt)
        self.down = make_linear([get("mlp.down_proj.weight")], None, fmt)
        self.norm1 = get("input_layernorm.weight").float()
        self.norm2 = get("post_attention_layernorm.weight").float()
        self.dtype = dtype
        self.eps = args.rms_norm_eps

    def __call__(self, x: torch.Tensor, ctx: ForwardContext, layer: int) -> torch.Tensor:
        qkv = self.qkv(rms_norm(x, self.norm1, self.eps, self.dtype))
        attn = ctx.backend.forward(
            ctx.attn_meta, qkv, ctx.cos, ctx.sin, ctx.kv.k[layer], ctx.kv.v[layer]
        )  # (T, H * hd)
        x = x + self.o(attn).float()

        h = rms_norm(x, self.norm2, self.eps, self.dtype)
        gate, up = self.gate_up(h).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up).float()


class LlamaModel:
    """The whole decoder: embedding, layers, final norm and the language-model head."""

    def __init__(self, args: ModelArgs, weights: dict[str, Weight], weight_format: str):
        """``weight_format``: how matmul weights are held, see ``make_linear``."""
        self.args = args
        self.dtype = DENSE_FORMATS.get(weight_format, torch.bfloat16)  # matmul input dtype
        embed = weights["model.embed_tokens.weight"]
        self.embed = (embed.dequantize() if isinstance(embed, BlockWeight) else embed).to(self.dtype)  # (V, D)
        self.layers = [
            LlamaLayer(args, weights, f"model.layers.{i}.", weight_format, self.dtype)
            for i in range(args.num_layers)
        ]
        self.norm = weights["model.norm.weight"].float()
        head = weights.get("lm_head.weight")
        if head is None or args.tie_word_embeddings:
            head = embed
        self.lm_head = make_linear([head], None, weight_format)

    def rotary(self, max_positions: int, device: torch.device) -> RotaryEmbedding:
        a = self.args
        return RotaryEmbedding(a.head_dim, max_positions, a.rope_theta, a.rope_scaling, device)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """Hidden states ``(T, D)`` after the final norm for the flat batch ``input_ids (T,)``."""
        x = self.embed[input_ids].float()  # (T, D)
        for i, layer in enumerate(self.layers):
            x = layer(x, ctx, i)
        return rms_norm(x, self.norm, self.args.rms_norm_eps, self.dtype)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits ``(S, V)`` for the selected hidden states ``(S, D)``."""
        return self.lm_head(hidden).float()
