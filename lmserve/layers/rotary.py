"""Rotary position embeddings (Hugging Face "rotate half" layout), with Llama-3 style scaling."""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
import torch.nn.functional as F


def rope_inv_freq(head_dim: int, theta: float, scaling: Optional[dict[str, Any]]) -> torch.Tensor:
    """Inverse frequencies ``(head_dim/2,)``, adjusted by the model's rope scaling if any."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "default":
        return inv_freq.float()
    assert scaling is not None  # without scaling the kind is "default"
    if kind == "linear":
        return (inv_freq / scaling["factor"]).float()
    if kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_ctx = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths are slowed by `factor`, short ones kept, the band between blended.
        smooth = (old_ctx / wavelen - low) / (high - low)
        blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        out = torch.where(wavelen > old_ctx / low, inv_freq / factor, blended)
        out = torch.where(wavelen < old_ctx / high, inv_freq, out)
        return out.float()
    raise NotImplementedError(f"rope scaling type {kind!r} is not supported")


class RotaryEmbedding:
    """A cos/sin table for every position up to ``max_positions``, looked up once per step.

    Positions past the table (a sequence streaming past the context under a sliding window) are
    computed when asked, with the angle in float64: in float32 an angle of a million radians is
    off by a tenth, while only the difference of query and key angles should matter.
    """

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling=None, device="cpu",
                 rotary_dim: Optional[int] = None):
        """``rotary_dim``: rotate only that many leading dims of each head (partial rotary, with
        the q/k weights' rows in ``partial_rotary_order``): the other pairs get frequency 0,
        which leaves them as they are."""
        inv_freq = rope_inv_freq(rotary_dim or head_dim, theta, scaling)
        self.inv_freq = F.pad(inv_freq, (0, head_dim // 2 - len(inv_freq)))
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, self.inv_freq)  # (P, hd/2)
        emb = torch.cat([freqs, freqs], dim=-1)  # (P, hd)
        self.cos = emb.cos().to(device)
        self.sin = emb.sin().to(device)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for each token, shaped ``(T, hd)``."""
        if positions.numel() == 0 or int(positions.max()) < len(self.cos):
            return self.cos[positions], self.sin[positions]
        freqs = torch.outer(positions.double(), self.inv_freq.double())  # (T, hd/2)
        emb = torch.cat([freqs, freqs], dim=-1)
        cos, sin = emb.cos().to(self.cos), emb.sin().to(self.sin)
        if int(positions.min()) < len(self.cos):  # a step straddling the table's end
            inside = (positions < len(self.cos)).unsqueeze(1)
            table = positions.clamp(max=len(self.cos) - 1)
            cos = torch.where(inside, self.cos[table], cos)
            sin = torch.where(inside, self.sin[table], sin)
        return cos, sin


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``(T, heads, hd)`` by the per-token angles ``(T, hd)`` (in float32, result in
    x's dtype)."""
    xf = x.float()
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # broadcast over heads
    half = x.shape[-1] // 2
    rotated = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
    return (xf * cos + rotated * sin).to(x.dtype)


def partial_rotary_order(head_dim: int, rotary_dim: int) -> list[int]:
    """A head's dims reordered so that rotating the whole head in the rotate-half layout rotates
    the first ``rotary_dim`` as transformers' partial rotary does (dim i with i + rotary_dim/2)
    and pairs the rest with each other (at frequency 0, unchanged). q and k rows take this order
    alike, so their dot products are those of the original order."""
    r, rest = rotary_dim // 2, (head_dim - rotary_dim) // 2
    first = list(range(r)) + [rotary_dim + j for j in range(rest)]
    second = [r + j for j in range(r)] + [rotary_dim + rest + j for j in range(rest)]
    return first + second
