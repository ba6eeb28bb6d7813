"""Medusa and EAGLE heads as plain PyTorch modules: what ``lmserve train-heads`` trains, with
parameter names in the published layouts (so ``state_dict()`` is the file people load), and the
plain reference the engine's drafters are tested against.

Both run on the target's features of one sequence at a time, with autograd; the engine's own
drafters (``medusa.py``, ``eagle.py``) run the same math batched over paged KV.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lmserve.layers.rotary import RotaryEmbedding
from lmserve.models.args import ModelArgs


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


class MedusaNet(nn.Module):
    """``num_heads`` Medusa heads in FasterDecoding's layout: head i is ``{i}.{j}.linear`` residual
    SiLU blocks, then ``{i}.{L}`` the vocabulary projection (initialised from the model's head,
    blocks from zero: at first each head predicts what the model's head does)."""

    def __init__(self, lm_head: torch.Tensor, num_heads: int, num_layers: int = 1) -> None:
        super().__init__()
        v, d = lm_head.shape
        for i in range(num_heads):
            blocks = []
            for _ in range(num_layers):
                block = nn.Module()
                block.linear = nn.Linear(d, d)
                nn.init.zeros_(block.linear.weight)
                nn.init.zeros_(block.linear.bias)
                blocks.append(block)
            proj = nn.Linear(d, v, bias=False)
            proj.weight = nn.Parameter(lm_head.detach().float().clone(), requires_grad=False)
            self.add_module(str(i), nn.Sequential(*blocks, proj))
        self.num_heads, self.num_layers = num_heads, num_layers

    def hidden(self, i: int, h: torch.Tensor) -> torch.Tensor:
        """Head ``i``'s hidden state (before its projection) for the final hidden states ``h``."""
        x = h.float()
        for block in list(getattr(self, str(i)))[: self.num_layers]:
            x = x + F.silu(block.linear(x))
        return x

    def projection(self, i: int) -> torch.Tensor:
        return getattr(self, str(i))[self.num_layers].weight


class _Attention(nn.Module):
    def __init__(self, args: ModelArgs, in_dim: int) -> None:
        super().__init__()
        q, kv = args.num_heads * args.head_dim, args.num_kv_heads * args.head_dim
        self.q_proj = nn.Linear(in_dim, q, bias=False)
        self.k_proj = nn.Linear(in_dim, kv, bias=False)
        self.v_proj = nn.Linear(in_dim, kv, bias=False)
        self.o_proj = nn.Linear(q, args.hidden_size, bias=False)
        self.args = args

    def forward(self, x: torch.Tensor, rotary: RotaryEmbedding) -> torch.Tensor:
        """Causal self-attention of one sequence ``x (T, in_dim)`` from position 0."""
        a, t = self.args, x.shape[0]
        q = self.q_proj(x).view(t, a.num_heads, a.head_dim).transpose(0, 1)
        k = self.k_proj(x).view(t, a.num_kv_heads, a.head_dim).transpose(0, 1)
        v = self.v_proj(x).view(t, a.num_kv_heads, a.head_dim).transpose(0, 1)
        cos, sin = rotary.cos[:t], rotary.sin[:t]
        q, k = (z * cos + _rotate_half(z) * sin for z in (q, k))
        group = a.num_heads // a.num_kv_heads
        k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (H, T, hd)
        return self.o_proj(out.transpose(0, 1).reshape(t, -1))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


class _Mlp(nn.Module):
    def __init__(self, d: int, f: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(d, f, bias=False)
        self.up_proj = nn.Linear(d, f, bias=False)
        self.down_proj = nn.Linear(f, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _Layer(nn.Module):
    def __init__(self, args: ModelArgs, version: int) -> None:
        super().__init__()
        d = args.hidden_size
        self.self_attn = _Attention(args, 2 * d if version == 3 else d)
        self.mlp = _Mlp(d, args.intermediate_size)
        self.post_attention_layernorm = RMSNorm(d, args.rms_norm_eps)
        if version == 3:
            self.input_layernorm = RMSNorm(d, args.rms_norm_eps)
            self.hidden_norm = RMSNorm(d, args.rms_norm_eps)


class EagleNet(nn.Module):
    """An EAGLE-1/2 (``version`` 1) or EAGLE-3 (3) head in SafeAILab's names (``fc``,
    ``layers.0.*`` or ``midlayer.*``, and for EAGLE-3 ``norm``, ``lm_head``)."""

    def __init__(self, args: ModelArgs, version: int = 1, fc_bias: bool = True,
                 draft_vocab_size: int = 0) -> None:
        super().__init__()
        d = args.hidden_size
        self.args, self.version = args, version
        self.fc = nn.Linear((3 if version == 3 else 2) * d, d, bias=fc_bias and version == 1)
        if version == 3:
            self.midlayer = _Layer(args, 3)
            self.norm = RMSNorm(d, args.rms_norm_eps)
            self.lm_head = nn.Linear(d, draft_vocab_size or args.vocab_size, bias=False)
        else:
            self.layers = nn.ModuleList([_Layer(args, 1)])

    def forward(self, embeddings: torch.Tensor, features: torch.Tensor,
                rotary: RotaryEmbedding) -> torch.Tensor:
        """The head's hidden states ``(T, D)`` for one sequence from position 0: row ``p`` from
        the embedding of token ``p + 1`` and the target's feature at ``p`` (teacher forced)."""
        layer = self.midlayer if self.version == 3 else self.layers[0]
        if self.version == 3:
            x = self.fc(features)
            h = torch.cat([layer.input_layernorm(embeddings), layer.hidden_norm(x)], dim=-1)
        else:
            x = h = self.fc(torch.cat([embeddings, features], dim=-1))
        x = x + layer.self_attn(h, rotary)
        return x + layer.mlp(layer.post_attention_layernorm(x))
