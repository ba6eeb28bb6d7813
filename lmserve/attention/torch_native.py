"""Paged attention with plain torch ops (scaled_dot_product_attention); runs on any device.

Decode sequences (one query token each) are attended together in one call over their gathered,
padded KV; each prefill chunk is attended on its own, causally, over its cached prefix plus itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from lmserve.attention.base import AttentionBackend, AttentionInput, register_backend


@dataclass
class PrefillPart:
    start: int  # first token of this chunk in the flat batch
    length: int  # query tokens in the chunk
    slots: torch.Tensor  # (L,) cache slots of the whole context, prefix and chunk
    mask: torch.Tensor | None  # (n, L) bool, None when the chunk is the whole context (plain causal)


@dataclass
class NativeMeta:
    slot_mapping: torch.Tensor  # (T,) where each new token's KV is written
    decode_tokens: torch.Tensor | None  # (Bd,) flat indices of decode queries
    decode_slots: torch.Tensor | None  # (Bd, Lmax) cache slots, padded
    decode_mask: torch.Tensor | None  # (Bd, 1, 1, Lmax) True where a key is real
    prefills: list[PrefillPart]


def _context_slots(pages: list[int], length: int, page_size: int) -> torch.Tensor:
    """Cache slots of the first ``length`` tokens of a sequence stored in ``pages``."""
    pos = torch.arange(length)
    return torch.tensor(pages, dtype=torch.long)[pos // page_size] * page_size + pos % page_size


@register_backend("torch_native")
class TorchNativeBackend(AttentionBackend):
    def prepare(self, inp: AttentionInput, page_size: int, device: torch.device) -> NativeMeta:
        slot_chunks: list[torch.Tensor] = []
        decode_tokens: list[int] = []
        decode_slots: list[torch.Tensor] = []
        prefills: list[PrefillPart] = []
        start = 0
        for qlen, ctx, pages in zip(inp.query_lens, inp.context_lens, inp.page_tables):
            slots = _context_slots(pages, ctx, page_size)
            slot_chunks.append(slots[ctx - qlen:])
            if qlen == 1:
                decode_tokens.append(start)
                decode_slots.append(slots)
            else:
                mask = None
                if ctx != qlen:  # a chunk after a cached prefix: causal with an offset
                    rows = torch.arange(ctx - qlen, ctx).unsqueeze(1)
                    mask = (torch.arange(ctx).unsqueeze(0) <= rows).to(device)
                prefills.append(PrefillPart(start, qlen, slots.to(device), mask))
            start += qlen

        meta = NativeMeta(torch.cat(slot_chunks).to(device), None, None, None, prefills)
        if decode_tokens:
            lens = torch.tensor([len(s) for s in decode_slots])
            padded = torch.nn.utils.rnn.pad_sequence(decode_slots, batch_first=True)  # (Bd, Lmax)
            mask = torch.arange(padded.shape[1]).unsqueeze(0) < lens.unsqueeze(1)
            meta.decode_tokens = torch.tensor(decode_tokens, device=device)
            meta.decode_slots = padded.to(device)
            meta.decode_mask = mask[:, None, None, :].to(device)
        return meta

    def forward(self, meta, q, k, v, k_cache, v_cache, scale):
        k_cache.index_copy_(0, meta.slot_mapping, k)
        v_cache.index_copy_(0, meta.slot_mapping, v)
        out = torch.empty_like(q)  # (T, H, hd)

        if meta.decode_tokens is not None:
            qd = q.index_select(0, meta.decode_tokens).unsqueeze(2)  # (Bd, H, 1, hd)
            kd = k_cache[meta.decode_slots].transpose(1, 2)  # (Bd, KVH, Lmax, hd)
            vd = v_cache[meta.decode_slots].transpose(1, 2)
            od = F.scaled_dot_product_attention(
                qd, kd, vd, attn_mask=meta.decode_mask, scale=scale, enable_gqa=True
            )  # (Bd, H, 1, hd)
            out.index_copy_(0, meta.decode_tokens, od.squeeze(2))

        for p in meta.prefills:
            qp = q[p.start : p.start + p.length].transpose(0, 1).unsqueeze(0)  # (1, H, n, hd)
            kp = k_cache[p.slots].transpose(0, 1).unsqueeze(0)  # (1, KVH, L, hd)
            vp = v_cache[p.slots].transpose(0, 1).unsqueeze(0)
            op = F.scaled_dot_product_attention(
                qp, kp, vp, attn_mask=p.mask, is_causal=p.mask is None, scale=scale, enable_gqa=True
            )  # (1, H, n, hd)
            out[p.start : p.start + p.length] = op.squeeze(0).transpose(0, 1)
        return out
