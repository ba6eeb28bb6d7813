"""Medusa and EAGLE heads as plain PyTorch modules: what ``lmserve train-heads`` trains, with
parameter names in the published layouts (so ``state_dict()`` is the file people load), and the
plain reference the engine's drafters are tested against.

Both run on the target's features of one sequence at a time, with autograd; the engine's own
drafters (``medusa.py``, ``eagle.py``) run the same math batched over paged KV.
"""

from __future__ import annotations

from typing import cast

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

    def forward(self, x: torch.Tensor, rotary: RotaryEmbedding,
                earlier: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Self-attention of one sequence ``x (T, in_dim)`` from position 0, as pass ``s =
        len(earlier)`` of an unrolled draft (``EagleNet.draft_passes``): row ``r`` attends the
        first pass's rows up to ``r - s``, then row ``r - s + j`` of pass ``j`` for ``j = 1 ..
        s`` (itself last). ``earlier`` holds the keys and values of the passes before; this
        pass's are appended. Pass 0 is plain causal attention."""
        a, t = self.args, x.shape[0]
        q = self.q_proj(x).view(t, a.num_heads, a.head_dim).transpose(0, 1)  # (H, T, hd)
        k = self.k_proj(x).view(t, a.num_kv_heads, a.head_dim).transpose(0, 1)
        v = self.v_proj(x).view(t, a.num_kv_heads, a.head_dim).transpose(0, 1)
        cos, sin = rotary.cos[:t], rotary.sin[:t]
        q, k = (z * cos + _rotate_half(z) * sin for z in (q, k))
        group = a.num_heads // a.num_kv_heads
        earlier.append((k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)))
        s = len(earlier) - 1
        if s == 0:
            out = F.scaled_dot_product_attention(q, *earlier[0], is_causal=True)  # (H, T, hd)
        else:
            scale = a.head_dim ** -0.5
            rows = torch.arange(t)
            first = (q @ earlier[0][0].transpose(1, 2)) * scale  # (H, T, T)
            first = first.masked_fill(rows[None, :] > rows[:, None] - s, float("-inf"))
            # Pass j's row r - s + j for row r: its keys and values moved down s - j rows.
            chain = [(_down(kj, s - j), _down(vj, s - j)) for j, (kj, vj) in enumerate(earlier) if j]
            scores = torch.cat([first] + [(q * kj).sum(-1, keepdim=True) * scale
                                          for kj, _ in chain], dim=-1)
            weights = torch.softmax(scores, dim=-1)  # (H, T, T + s)
            out = weights[..., :t] @ earlier[0][1]
            for j, (_, vj) in enumerate(chain):
                out = out + weights[..., t + j : t + j + 1] * vj
        return self.o_proj(out.transpose(0, 1).reshape(t, -1))


def _down(x: torch.Tensor, n: int) -> torch.Tensor:
    """``x (H, T, hd)`` moved ``n`` rows down (zeros on top)."""
    return F.pad(x, (0, 0, n, 0))[:, : x.shape[1]]


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
        # (ModuleList indexing is typed as any Module)
        layer = self.midlayer if self.version == 3 else cast(_Layer, self.layers[0])
        if self.version == 3:
            x = self.fc(features)
            h = torch.cat([layer.input_layernorm(embeddings), layer.hidden_norm(x)], dim=-1)
            return self._rest(layer, x, h, rotary, [])
        return self.draft_passes(embeddings, features, rotary, 1)[0]

    def draft_passes(self, embeddings: torch.Tensor, features: torch.Tensor,
                     rotary: RotaryEmbedding, steps: int) -> list[torch.Tensor]:
        """The hidden states ``(T, D)`` of ``steps`` draft passes of an EAGLE-1 head over one
        sequence, as the engine drafts them (EAGLE-3's "training-time test"). Pass 0 is
        ``forward``. Row ``r`` of pass ``s`` is the ``s + 1``-th draft of a chain begun after
        position ``r - s``: it reads token ``r + 1`` and the head's own prediction of the
        feature at ``r`` (row ``r - 1`` of pass ``s - 1``), and attends the target's features
        up to ``r - s`` and the chain's earlier drafts. Rows ``r < s`` have no such chain."""
        if self.version != 1:
            raise ValueError("draft passes are for EAGLE-1 heads (what train-heads trains)")
        layer = cast(_Layer, self.layers[0])  # (ModuleList indexing is typed as any Module)
        earlier: list[tuple[torch.Tensor, torch.Tensor]] = []
        passes: list[torch.Tensor] = []
        for _ in range(steps):
            if passes:  # the previous pass's prediction of each row's feature
                features = F.pad(passes[-1], (0, 0, 1, 0))[: len(embeddings)]
            x = self.fc(torch.cat([embeddings, features], dim=-1))
            passes.append(self._rest(layer, x, x, rotary, earlier))
        return passes

    @staticmethod
    def _rest(layer: _Layer, x: torch.Tensor, h: torch.Tensor, rotary: RotaryEmbedding,
              earlier: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """The layer after its input: attention over ``h`` added to ``x``, then the MLP."""
        x = x + layer.self_attn(h, rotary, earlier)
        return x + layer.mlp(layer.post_attention_layernorm(x))
