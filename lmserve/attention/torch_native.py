"""Paged attention with plain torch ops (scaled_dot_product_attention); runs on any device.

The attention math runs in float32 whatever the cache dtype: on CPU, torch's bfloat16 attention
kernel is several times slower than its float32 one, and float32 is the more accurate.

Decode sequences (one query token each) are attended together in one call over their gathered,
padded KV; each prefill chunk is attended on its own, causally, over its cached prefix plus itself.
A windowed layer attends each sequence on its own over the pages its window shows, with its
sinks scored from their position (attention/window.py) by an explicit softmax.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from lmserve.attention.base import AttentionBackend, AttentionInput, register_backend
from lmserve.layers.rotary import apply_rotary
from lmserve.util import cdiv


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
class WindowPart:
    """One sequence's tokens under a window: the pages of the keys they see, and which they see."""

    start: int  # first token in the flat batch
    length: int
    pages: torch.Tensor  # (P,) the sink pages and those of the step's windows
    mask: torch.Tensor  # (n, P * page_size) True where a query attends a key
    sinks: torch.Tensor  # (P * page_size,) True for the sink keys


@dataclass
class NativeMeta:
    page_size: int
    slot_mapping: torch.Tensor  # (T,) where each new token's KV is written
    decode_tokens: torch.Tensor | None  # (Bd,) flat indices of decode queries
    decode_pages: torch.Tensor | None  # (Bd, Pmax) page tables, padded
    decode_mask: torch.Tensor | None  # (Bd, 1, 1, Pmax * page_size) True where a key is real
    prefills: list[PrefillPart]
    windowed: list[WindowPart] | None = None  # the same for windowed layers
    sink_cos: torch.Tensor | None = None  # (T, hd) each query's sink position's angles (None: its own)
    sink_sin: torch.Tensor | None = None


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
class TorchNativeBackend(AttentionBackend[NativeMeta]):
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
            if not inp.dense_layers:
                pass  # no layer reads the dense parts (and pages past the window may be gone)
            elif qlen == 1:
                decode_tokens.append(start)
                decode_seqs.append(i)
            elif ctx == qlen and tree is None:
                prefills.append(PrefillPart(start, qlen, None, ctx, None))
            else:  # a chunk after a cached prefix: causal with an offset (or a tree's mask)
                used = torch.tensor(pages[: cdiv(ctx, page_size)], device=device)
                keys = torch.arange(len(used) * page_size).unsqueeze(0)
                if tree is None:
                    mask = keys <= torch.arange(ctx - qlen, ctx).unsqueeze(1)
                else:
                    mask = (keys < ctx - qlen) | _tree_mask(tree, ctx - qlen, keys.shape[1])
                prefills.append(PrefillPart(start, qlen, used, ctx, mask.to(device)))
            start += qlen

        meta = NativeMeta(page_size, torch.cat(slot_chunks).to(device), None, None, None, prefills)
        if inp.window is not None:
            meta.windowed = _window_parts(inp, trees, page_size, device)
            meta.sink_cos, meta.sink_sin = inp.sink_cos, inp.sink_sin
        if decode_tokens:
            lens = torch.tensor([inp.context_lens[i] for i in decode_seqs])
            n_pages = cdiv(int(lens.max()), page_size)
            table = torch.zeros(len(decode_seqs), n_pages, dtype=torch.long)
            for row, i in enumerate(decode_seqs):
                row_pages = inp.page_tables[i][: cdiv(inp.context_lens[i], page_size)]
                table[row, : len(row_pages)] = torch.tensor(row_pages)
            mask = torch.arange(n_pages * page_size).unsqueeze(0) < lens.unsqueeze(1)
            meta.decode_tokens = torch.tensor(decode_tokens, device=device)
            meta.decode_pages = table.to(device)
            meta.decode_mask = mask[:, None, None, :].to(device)
        return meta

    def forward(self, meta, qkv, cos, sin, k_cache, v_cache, windowed=False):
        T, (H, KVH, hd) = qkv.shape[0], (self.shape.num_heads, self.shape.num_kv_heads, self.shape.head_dim)
        q_raw, k, v = qkv.split([H * hd, KVH * hd, KVH * hd], dim=-1)
        q = apply_rotary(q_raw.view(T, H, hd), cos, sin)  # (T, H, hd)
        k = apply_rotary(k.view(T, KVH, hd), cos, sin)  # (T, KVH, hd)
        v = v.view(T, KVH, hd)
        scale, page_size = self.shape.scale, meta.page_size
        k_cache.index_copy_(0, meta.slot_mapping, k.to(k_cache.dtype))
        v_cache.index_copy_(0, meta.slot_mapping, v.to(v_cache.dtype))
        out = torch.empty_like(q)  # (T, H, hd)
        if windowed:
            q_sink = None if meta.sink_cos is None else \
                apply_rotary(q_raw.view(T, H, hd), meta.sink_cos, meta.sink_sin)
            for part in meta.windowed:
                out[part.start : part.start + part.length] = _attend_window(
                    part, q, q_sink, k_cache, v_cache, page_size, scale).to(out.dtype)
            return out.view(T, H * hd)

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


def _window_parts(inp: AttentionInput, trees: list, page_size: int,
                  device: torch.device) -> list[WindowPart]:
    """Each sequence's ``WindowPart`` (see ``AttentionWindow`` for what a query sees)."""
    window = inp.window
    assert window is not None  # prepare asks only for a windowed step's
    sink_pages = cdiv(window.sinks, page_size)
    parts: list[WindowPart] = []
    start = 0
    for i, (qlen, ctx, table, tree) in enumerate(
            zip(inp.query_lens, inp.context_lens, inp.page_tables, trees)):
        end = cdiv(ctx, page_size)
        first = max(sink_pages, inp.first_keys(i) // page_size)
        index = list(range(min(sink_pages, end))) + list(range(first, end))
        keys = (torch.tensor(index).unsqueeze(1) * page_size + torch.arange(page_size)).flatten()
        step_start = ctx - qlen
        if tree is None:
            positions = torch.arange(step_start, ctx).unsqueeze(1)  # (n, 1)
            causal = keys <= positions
        else:  # the keys before the tree, then its tokens' ancestors and themselves
            positions = torch.tensor([step_start + m.bit_count() - 1 for m in tree]).unsqueeze(1)
            in_step = keys >= step_start
            bits = _tree_mask(tree, 0, len(tree))[:, (keys - step_start).clamp(0, len(tree) - 1)]
            causal = ~in_step | (bits & in_step & (keys < ctx))
        sees = (keys < window.sinks) | (keys > positions - window.size)
        parts.append(WindowPart(start, qlen, torch.tensor([table[j] for j in index], device=device),
                                (causal & sees).to(device), (keys < window.sinks).to(device)))
        start += qlen
    return parts


def _attend_window(part: WindowPart, q: torch.Tensor, q_sink: torch.Tensor | None,
                   k_cache: torch.Tensor, v_cache: torch.Tensor, page_size: int,
                   scale: float) -> torch.Tensor:
    """(n, H, hd) float32 attention of one ``WindowPart``'s queries."""
    chunk = slice(part.start, part.start + part.length)
    kp = _gather_pages(k_cache, part.pages, page_size).float()  # (L, KVH, hd)
    vp = _gather_pages(v_cache, part.pages, page_size).float()
    groups = q.shape[1] // kp.shape[1]
    kp, vp = kp.repeat_interleave(groups, dim=1), vp.repeat_interleave(groups, dim=1)  # (L, H, hd)
    scores = torch.einsum("nhd,lhd->hnl", q[chunk].float(), kp) * scale  # (H, n, L)
    if q_sink is not None:  # the sinks scored from the queries' sink positions
        sink_scores = torch.einsum("nhd,lhd->hnl", q_sink[chunk].float(), kp) * scale
        scores = torch.where(part.sinks, sink_scores, scores)
    weights = scores.masked_fill(~part.mask, float("-inf")).softmax(dim=-1)
    return torch.einsum("hnl,lhd->nhd", weights, vp)
