"""Paged attention with lmserve's C++ kernel: one call per layer does the rotary
embedding, the KV-cache store and causal attention of every token over its own pages.

Unlike the torch path it copies no KV: each query reads exactly the keys it attends, so the cost
grows with the tokens attended rather than with the longest sequence in the batch, and each row is
computed identically whatever its batch company (see kernels/paged_attention.cpp).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Optional

import torch

from lmserve.attention.base import AttentionBackend, AttentionInput, AttentionShape, register_backend
from lmserve.attention.window import AttentionWindow
from lmserve.kernels.build import load_kernel_library, why_unavailable
from lmserve.layers.call_list import THREADS, Arg, Slot, address, float_word
from lmserve.util import cdiv

_P, _I = ctypes.c_void_p, ctypes.c_int


def _library() -> Optional[ctypes.CDLL]:
    return load_kernel_library(
        "paged_attention", {"lm_paged_attention": [_P] * 13 + [_I] * 5 + [ctypes.c_float, _I, _I]
                                                   + [_P] * 4 + [_I, _I]})


def why_unsupported(shape: AttentionShape, kv_dtype: torch.dtype) -> Optional[str]:
    """Why the kernel cannot serve this model and cache, or None if it can."""
    if shape.head_dim % 16 or shape.head_dim > 256:
        return f"head_dim {shape.head_dim} is not a multiple of 16 up to 256"
    if shape.num_heads // shape.num_kv_heads > 16:
        return "more than 16 query heads per KV head"
    if kv_dtype not in (torch.float32, torch.bfloat16, torch.int8):
        return f"KV cache dtype {kv_dtype} (the kernel reads float32, bfloat16 or int8)"
    reason = why_unavailable("paged_attention")
    if reason is None and _library() is None:
        reason = "the kernel failed to build (see the log)"
    return reason


def _dtype_flags(io_dtype: torch.dtype, cache_dtype: torch.dtype) -> int:
    """The kernel's dtype argument: bit 0 qkv, bit 1 the caches, bit 2 the output is bf16 (the
    output has qkv's dtype); bit 4 the caches are int8."""
    io = int(io_dtype == torch.bfloat16)
    return io | int(cache_dtype == torch.bfloat16) << 1 | io << 2 | int(cache_dtype == torch.int8) << 4


# A step's attention inputs shared by every layer's call (see packed_call).
_META_SLOTS = tuple(Slot(f"attention.{name}") for name in (
    "cos", "sin", "slots", "pages", "page_offset", "context", "tree_start", "tree_bits",
    "sink_cos", "sink_sin", "page_skip"))
_PAGE_SIZE = Slot("attention.page_size")
_WINDOW = (Slot("attention.window"), Slot("attention.sinks"))


@dataclass
class PagedMeta:
    slots: torch.Tensor  # (T,) int64 cache slot of each new token
    pages: torch.Tensor  # (sum of page-table lengths,) int32, every sequence's table back to back
    page_offset: torch.Tensor  # (T,) int64 where each token's sequence table starts in `pages`
    context: torch.Tensor  # (T,) int32 keys each token attends (its position + 1)
    page_size: int
    # Draft trees (None when the step has none): (T,) int32 the cache position of each tree
    # token's first step token (-1 for other tokens), and (T,) int64 its attended step tokens'
    # bits (``AttentionInput.tree_masks``, as two's complement).
    tree_start: Optional[torch.Tensor] = None
    tree_bits: Optional[torch.Tensor] = None
    # Sliding windows (None without): each token's window and sinks, the angles of its sink
    # position (None: its own), and (T,) int32 how far its page table is shifted past its sink
    # pages (the pages between them and its window are left out: see paged_attention.cpp).
    window: Optional[AttentionWindow] = None
    sink_cos: Optional[torch.Tensor] = None
    sink_sin: Optional[torch.Tensor] = None
    page_skip: Optional[torch.Tensor] = None


def _address(t: Optional[torch.Tensor]) -> int:
    return 0 if t is None else t.data_ptr()


@register_backend("cpu_paged")
class CpuPagedBackend(AttentionBackend[PagedMeta]):
    # A key block's scores are then sums of whole vectors (q[d] times 16 keys' dimension d), with
    # no reduction across vector lanes, and a page's keys for one head are one contiguous run.
    keys_transposed = True

    def __init__(self, shape: AttentionShape) -> None:
        super().__init__(shape)
        lib = _library()
        if lib is None:
            raise RuntimeError("the C++ paged attention kernel is not available on this machine")
        self.lib = lib

    def prepare(self, inp: AttentionInput, page_size: int, device: torch.device) -> PagedMeta:
        slots: list[int] = []
        pages: list[int] = []
        offsets: list[int] = []
        context: list[int] = []
        tree_start: list[int] = []
        tree_bits: list[int] = []
        skips: list[int] = []
        trees = inp.tree_masks or [None] * len(inp.query_lens)
        sink_pages = cdiv(inp.window.sinks, page_size) if inp.window else 0
        for i, (qlen, ctx, table, masks) in enumerate(
                zip(inp.query_lens, inp.context_lens, inp.page_tables, trees)):
            end = cdiv(ctx, page_size)
            # Every layer windowed: only the sink pages and those of the step's windows.
            skip = 0 if inp.dense_layers else max(0, inp.first_keys(i) // page_size - sink_pages)
            used = table[:sink_pages] + table[sink_pages + skip : end] if skip else table[:end]
            offsets += [len(pages)] * qlen
            skips += [skip] * qlen
            start = ctx - qlen
            for pos in range(start, ctx):
                index = pos // page_size
                slots.append(used[index - skip if index >= sink_pages else index] * page_size
                             + pos % page_size)
            if masks is None:
                context += range(start + 1, ctx + 1)
                tree_start += [-1] * qlen
                tree_bits += [0] * qlen
            else:  # the keys of the chain of its ancestors (see paged_attention.cpp)
                context += [start + m.bit_count() for m in masks]
                tree_start += [start] * qlen
                tree_bits += [m - (1 << 64) if m >> 63 else m for m in masks]
            pages += used
        meta = PagedMeta(
            slots=torch.tensor(slots, dtype=torch.int64),
            pages=torch.tensor(pages, dtype=torch.int32),
            page_offset=torch.tensor(offsets, dtype=torch.int64),
            context=torch.tensor(context, dtype=torch.int32),
            page_size=page_size,
        )
        if inp.tree_masks is not None:
            meta.tree_start = torch.tensor(tree_start, dtype=torch.int32)
            meta.tree_bits = torch.tensor(tree_bits, dtype=torch.int64)
        if inp.window is not None:
            meta.window = inp.window
            if inp.sink_cos is not None:
                assert inp.sink_sin is not None  # the sink angles come in pairs
                meta.sink_cos, meta.sink_sin = inp.sink_cos.contiguous(), inp.sink_sin.contiguous()
            if any(skips):
                meta.page_skip = torch.tensor(skips, dtype=torch.int32)
        return meta

    def packed_call(self, qkv: Arg, dtype: torch.dtype, q_buf: Arg, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, out: Arg, tokens: Arg, windowed: bool = False,
                    q_sink: Arg = 0) -> list[Arg]:
        """``forward`` as a call for a ``CallList``: ``qkv`` (tokens, ...) of ``dtype`` (float32 or
        bfloat16), ``out`` of the same dtype, ``q_buf`` (and for a ``windowed`` layer of a model
        with sinks ``q_sink``) float32 (tokens, H, hd) scratch; the step's metadata and rotary
        angles are the slots ``call_values`` fills."""
        flags = _dtype_flags(dtype, k_cache.dtype)
        return [address(self.lib.lm_paged_attention_packed), qkv, *_META_SLOTS[:3], q_buf,
                k_cache.data_ptr(), v_cache.data_ptr(), *_META_SLOTS[3:8], out, tokens,
                self.shape.num_heads, self.shape.num_kv_heads, self.shape.head_dim, _PAGE_SIZE,
                float_word(self.shape.scale), flags, THREADS, *_META_SLOTS[8:10], q_sink,
                _META_SLOTS[10], *(_WINDOW if windowed else (0, 0))]

    @staticmethod
    def call_values(meta: PagedMeta, cos: torch.Tensor, sin: torch.Tensor) -> dict[str, int]:
        """The step's values of the slots in ``packed_call`` (cos and sin contiguous)."""
        tensors = (cos, sin, meta.slots, meta.pages, meta.page_offset, meta.context,
                   meta.tree_start, meta.tree_bits, meta.sink_cos, meta.sink_sin, meta.page_skip)
        values = {slot.name: _address(t) for slot, t in zip(_META_SLOTS, tensors)}
        size, sinks = (meta.window.size, meta.window.sinks) if meta.window else (0, 0)
        return values | {_PAGE_SIZE.name: meta.page_size, _WINDOW[0].name: size, _WINDOW[1].name: sinks}

    @staticmethod
    def token_strides(meta: PagedMeta, cos: torch.Tensor, sin: torch.Tensor) -> dict[str, int]:
        """Bytes from one token's row to the next of each per-token input of ``call_values``: a
        step prepared for T tokens runs as T one-token passes by moving these slots on by their
        stride after each pass (``greedy_chain.py``)."""
        tensors = (cos, sin, meta.slots, None, meta.page_offset, meta.context, meta.tree_start,
                   meta.tree_bits, meta.sink_cos, meta.sink_sin, meta.page_skip)
        return {slot.name: t.stride(0) * t.element_size()
                for slot, t in zip(_META_SLOTS, tensors) if t is not None}

    def forward(self, meta: PagedMeta, qkv, cos, sin, k_cache, v_cache, windowed=False):
        T, (H, KVH, hd) = qkv.shape[0], (self.shape.num_heads, self.shape.num_kv_heads, self.shape.head_dim)
        dtype = qkv.dtype
        qkv = (qkv if dtype in (torch.float32, torch.bfloat16) else qkv.float()).contiguous()
        cos, sin = cos.contiguous(), sin.contiguous()
        q_buf = torch.empty(T, H, hd, dtype=torch.float32)
        out = torch.empty(T, H * hd, dtype=qkv.dtype)
        flags = _dtype_flags(qkv.dtype, k_cache.dtype)
        window = meta.window if windowed else None
        q_sink = torch.empty_like(q_buf) if window and meta.sink_cos is not None else None
        self.lib.lm_paged_attention(
            qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), meta.slots.data_ptr(), q_buf.data_ptr(),
            k_cache.data_ptr(), v_cache.data_ptr(), meta.pages.data_ptr(),
            meta.page_offset.data_ptr(), meta.context.data_ptr(),
            _address(meta.tree_start), _address(meta.tree_bits), out.data_ptr(),
            T, H, KVH, hd, meta.page_size, self.shape.scale, flags, torch.get_num_threads(),
            *(_address(t) for t in (meta.sink_cos, meta.sink_sin, q_sink, meta.page_skip)),
            window.size if window else 0, window.sinks if window else 0)
        return out.to(dtype)
