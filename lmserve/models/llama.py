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
from lmserve.layers.rotary import RotaryEmbedding, apply_rotary
from lmserve.models.args import ModelArgs


@dataclass
class ForwardContext:
    """What every layer of one step shares: attention metadata, rotary angles, the KV cache."""

    backend: AttentionBackend
    attn_meta: object
    cos: torch.Tensor  # (T, 1, hd)
    sin: torch.Tensor  # (T, 1, hd)
    kv: KVCache


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype) -> torch.Tensor:
    """RMSNorm of the float32 residual stream, returned in the matmuls' dtype."""
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * x).to(out_dtype)


class LlamaLayer:
    """One decoder block with fused q/k/v and gate/up projections.

    The residual stream stays float32; matmul inputs and weights are in ``dtype`` (float32 on the
    reference path, bfloat16 on the fast one), so rounding does not pile up over the layers.
    """

    def __init__(self, args: ModelArgs, w: dict[str, torch.Tensor], prefix: str, dtype: torch.dtype):
        def get(name: str) -> torch.Tensor:
            return w[prefix + name]

        attn = "self_attn."
        self.qkv = torch.cat([get(attn + f"{p}_proj.weight") for p in "qkv"]).to(dtype)
        self.qkv_bias = None
        if args.attention_bias:
            self.qkv_bias = torch.cat([get(attn + f"{p}_proj.bias") for p in "qkv"]).to(dtype)
        self.o = get(attn + "o_proj.weight").to(dtype)
        o_bias = w.get(prefix + attn + "o_proj.bias")  # Llama configs with attention_bias=True
        self.o_bias = None if o_bias is None else o_bias.to(dtype)
        self.gate_up = torch.cat([get("mlp.gate_proj.weight"), get("mlp.up_proj.weight")]).to(dtype)
        self.down = get("mlp.down_proj.weight").to(dtype)
        self.norm1 = get("input_layernorm.weight").float()
        self.norm2 = get("post_attention_layernorm.weight").float()

        self.dtype = dtype
        self.eps = args.rms_norm_eps
        self.h, self.kvh, self.hd = args.num_heads, args.num_kv_heads, args.head_dim
        self.scale = self.hd**-0.5

    def __call__(self, x: torch.Tensor, ctx: ForwardContext, layer: int) -> torch.Tensor:
        T = x.shape[0]
        qkv = F.linear(rms_norm(x, self.norm1, self.eps, self.dtype), self.qkv, self.qkv_bias)
        q, k, v = qkv.split([self.h * self.hd, self.kvh * self.hd, self.kvh * self.hd], dim=-1)
        q = apply_rotary(q.view(T, self.h, self.hd), ctx.cos, ctx.sin)  # (T, H, hd)
        k = apply_rotary(k.view(T, self.kvh, self.hd), ctx.cos, ctx.sin)  # (T, KVH, hd)
        v = v.view(T, self.kvh, self.hd)
        attn = ctx.backend.forward(
            ctx.attn_meta, q, k, v, ctx.kv.k[layer], ctx.kv.v[layer], self.scale
        )  # (T, H, hd)
        x = x + F.linear(attn.reshape(T, -1), self.o, self.o_bias).float()

        h = rms_norm(x, self.norm2, self.eps, self.dtype)
        gate, up = F.linear(h, self.gate_up).chunk(2, dim=-1)
        return x + F.linear(F.silu(gate) * up, self.down).float()


class LlamaModel:
    """The whole decoder: embedding, layers, final norm and the language-model head."""

    def __init__(self, args: ModelArgs, weights: dict[str, torch.Tensor], dtype: torch.dtype):
        self.args = args
        self.dtype = dtype
        self.embed = weights["model.embed_tokens.weight"].to(dtype)  # (V, D)
        self.layers = [
            LlamaLayer(args, weights, f"model.layers.{i}.", dtype) for i in range(args.num_layers)
        ]
        self.norm = weights["model.norm.weight"].float()
        head = weights.get("lm_head.weight")
        self.lm_head = self.embed if head is None or args.tie_word_embeddings else head.to(dtype)

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
        return F.linear(hidden, self.lm_head).float()
