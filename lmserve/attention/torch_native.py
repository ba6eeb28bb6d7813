"""Paged attention with plain torch ops (scaled_dot_product_attention); runs on any device.

The attention math runs in float32 whatever the cache dtype: on CPU, torch's bfloat16 attention
kernel is several times slower than its float32 one, and float32 is the more accurate.

Decode sequences (one query token each) are attended together in one call over their gathered,
padded KV; each prefill chunk is attended on its own, causally, over its cached prefix plus itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from lmserve.attention.base import AttentionBackend, AttentionInput, register_backend
from lmserve.layers.rotary import apply_rotary


@dataclass
class PrefillPart:
    start: int  # first token of this chunk in the flat batch
    length: int  # query tokens in the chunk
    # Pages holding the cached prefix and the chunk, and a (n, L) causal mask with an offset;
    # both None when the chunk is the whole context: it then attends to its own fresh k and v.
    pages: torch.Tensor | None
    context: int
    mask: torch.Tensor | None


@dataclass
class NativeMeta:
    page_size: int
    slot_mapping: torch.Tensor  # (T,) where each new token's KV is written
    decode_tokens: torch.Tensor | None  # (Bd,) flat indices of decode queries
    decode_pages: torch.Tensor | None  # (Bd, Pmax) page tables, padded
    decode_mask: torch.Tensor | None  # (Bd, 1, 1, Pmax * page_size) True where a key is real
    prefills: list[PrefillPart]


def _new_slots(pages: list[int], start: int, end: int, page_size: int) -> torch.Tensor:
    """Cache slots of positions ``start .. end-1`` of a sequence stored in ``pages``."""
    pos = torch.arange(start, end)
    return torch.tensor(pages, dtype=torch.long)[pos // page_size] * page_size + pos % page_size


def _gather_pages(cache: torch.Tensor, pages: torch.Tensor, page_size: int) -> torch.Tensor:
    """KV of whole pages: ``(..., P)`` page ids -> ``(..., P * page_size, KVH, hd)``.

    Copying whole pages (page_size rows at a time) is several times faster than gathering
    token by token.
    """
    paged = cache.view(-1, page_size * cache.shape[1] * cache.shape[2])  # (num_pages, page*KVH*hd)
    out = paged.index_select(0, pages.flatten())  # (n, page*KVH*hd)
    return out.view(*pages.shape[:-1], pages.shape[-1] * page_size, *cache.shape[1:])


def _tree_mask(masks: list[int], start: int, num_keys: int) -> torch.Tensor:
    """(len(masks), num_keys) True where a draft tree's token attends a step token's key (at
    ``start`` + its index in the step)."""
    bits = torch.tensor([[m >> j & 1 for j in range(len(masks))] for m in masks], dtype=torch.bool)
    out = torch.zeros(len(masks), num_keys, dtype=torch.bool)
    out[:, start : start + len(masks)] = bits
    return out


@register_backend("torch_native")
class TorchNativeBackend(AttentionBackend):
    def prepare(self, inp: AttentionInput, page_size: int, device: torch.device) -> NativeMeta:
        slot_chunks: list[torch.Tensor] = []
        decode_tokens: list[int] = []
        decode_seqs: list[int] = []
        prefills: list[PrefillPart] = []
        start = 0
        trees = inp.tree_masks or [None] * len(inp.query_lens)
        for i, (qlen, ctx, pages, tree) in enumerate(
                zip(inp.query_lens, inp.context_lens, inp.page_tables, trees)):
            slot_chunks.append(_new_slots(pages, ctx - qlen, ctx, page_size))
            if qlen == 1:
                decode_tokens.append(start)
                decode_seqs.append(i)
            elif ctx == qlen and tree is None:
                prefills.append(PrefillPart(start, qlen, None, ctx, None))
            else:  # a chunk after a cached prefix: causal with an offset (or a tree's mask)
                used = torch.tensor(pages[: -(-ctx // page_size)], device=device)
                keys = torch.arange(len(used) * page_size).unsqueeze(0)
                if tree is None:
                    mask = keys <= torch.arange(ctx - qlen, ctx).unsqueeze(1)
                else:
                    mask = (keys < ctx - qlen) | _tree_mask(tree, ctx - qlen, keys.shape[1])
                prefills.append(PrefillPart(start, qlen, used, ctx, mask.to(device)))
            start += qlen

        meta = NativeMeta(page_size, torch.cat(slot_chunks).to(device), None, None, None, prefills)
        if decode_tokens:
            lens = torch.tensor([inp.context_lens[i] for i in decode_seqs])
            n_pages = -(-int(lens.max()) // page_size)
            table = torch.zeros(len(decode_seqs), n_pages, dtype=torch.long)
            for row, i in enumerate(decode_seqs):
                used = inp.page_tables[i][: -(-inp.context_lens[i] // page_size)]
                table[row, : len(used)] = torch.tensor(used)
            mask = torch.arange(n_pages * page_size).unsqueeze(0) < lens.unsqueeze(1)
            meta.decode_tokens = torch.tensor(decode_tokens, device=device)
            meta.decode_pages = table.to(device)
            meta.decode_mask = mask[:, None, None, :].to(device)
        return meta

    def forward(self, meta, qkv, cos, sin, k_cache, v_cache):
        T, (H, KVH, hd) = qkv.shape[0], (self.shape.num_heads, self.shape.num_kv_heads, self.shape.head_dim)
        q, k, v = qkv.split([H * hd, KVH * hd, KVH * hd], dim=-1)
        q = apply_rotary(q.view(T, H, hd), cos, sin)  # (T, H, hd)
        k = apply_rotary(k.view(T, KVH, hd), cos, sin)  # (T, KVH, hd)
        v = v.view(T, KVH, hd)
        scale, page_size = self.shape.scale, meta.page_size
        k_cache.index_copy_(0, meta.slot_mapping, k.to(k_cache.dtype))
        v_cache.index_copy_(0, meta.slot_mapping, v.to(v_cache.dtype))
        out = torch.empty_like(q)  # (T, H, hd)

        if meta.decode_tokens is not None:
            qd = q.index_select(0, meta.decode_tokens).unsqueeze(2).float()  # (Bd, H, 1, hd)
            kd = _gather_pages(k_cache, meta.decode_pages, page_size).transpose(1, 2)  # (Bd, KVH, L, hd)
            vd = _gather_pages(v_cache, meta.decode_pages, page_size).transpose(1, 2)
            kd, vd = kd.float(), vd.float()
            od = F.scaled_dot_product_attention(
                qd, kd, vd, attn_mask=meta.decode_mask, scale=scale, enable_gqa=True
            )  # (Bd, H, 1, hd)
            out.index_copy_(0, meta.decode_tokens, od.squeeze(2).to(out.dtype))

        for p in meta.prefills:
            chunk = slice(p.start, p.start + p.length)
            qp = q[chunk].transpose(0, 1).unsqueeze(0).float()  # (1, H, n, hd)
            if p.pages is None:
                # Rounded as the cache stores them, so a prompt sees the same keys whether it is
                # prefilled whole, in chunks, or after a cached prefix.
                kp, vp = k[chunk].to(k_cache.dtype), v[chunk].to(v_cache.dtype)  # (n, KVH, hd)
            else:
                kp = _gather_pages(k_cache, p.pages, page_size)  # (L, KVH, hd)
                vp = _gather_pages(v_cache, p.pages, page_size)
            kp = kp.transpose(0, 1).unsqueeze(0).float()  # (1, KVH, L, hd)
            vp = vp.transpose(0, 1).unsqueeze(0).float()
            op = F.scaled_dot_product_attention(
                qp, kp, vp, attn_mask=p.mask, is_causal=p.mask is None, scale=scale, enable_gqa=True
            )  # (1, H, n, hd)
            out[chunk] = op.squeeze(0).transpose(0, 1).to(out.dtype)
        return out.view(T, H * hd)
