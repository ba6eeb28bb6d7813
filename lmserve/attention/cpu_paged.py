"""Paged attention with lmserve's C++ kernel (AVX-512): one call per layer does the rotary
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
from lmserve.kernels.build import load_kernel_library, why_unavailable
from lmserve.layers.call_list import THREADS, Arg, Slot, address, float_word

_P, _I = ctypes.c_void_p, ctypes.c_int


def _library() -> Optional[ctypes.CDLL]:
    lib = load_kernel_library(
        "paged_attention", {"lm_paged_attention": [_P] * 13 + [_I] * 5 + [ctypes.c_float, _I, _I],
                            "lm_paged_attention_int8_kv": []})
    if lib is not None:  # (load_kernel_library's functions return nothing; this one answers)
        lib.lm_paged_attention_int8_kv.restype = ctypes.c_int
    return lib


def why_unsupported(shape: AttentionShape, kv_dtype: torch.dtype) -> Optional[str]:
    """Why the kernel cannot serve this model and cache, or None if it can."""
    if shape.head_dim % 16 or shape.head_dim > 256:
        return f"head_dim {shape.head_dim} is not a multiple of 16 up to 256"
    if shape.num_heads // shape.num_kv_heads > 16:
        return "more than 16 query heads per KV head"
    if kv_dtype not in (torch.float32, torch.bfloat16, torch.int8):
        return f"KV cache dtype {kv_dtype} (the kernel reads float32, bfloat16 or int8)"
    reason = why_unavailable()
    if reason is None and _library() is None:
        reason = "the kernel failed to build (see the log)"
    if reason is None and kv_dtype == torch.int8 and not _library().lm_paged_attention_int8_kv():
        reason = "the CPU lacks AVX512-VNNI, which an int8 KV cache's scores need"
    return reason


def _dtype_flags(io_dtype: torch.dtype, cache_dtype: torch.dtype) -> int:
    """The kernel's dtype argument: bit 0 qkv, bit 1 the caches, bit 2 the output is bf16 (the
    output has qkv's dtype); bit 4 the caches are int8."""
    io = int(io_dtype == torch.bfloat16)
    return io | int(cache_dtype == torch.bfloat16) << 1 | io << 2 | int(cache_dtype == torch.int8) << 4


# A step's attention inputs shared by every layer's call (see packed_call).
_META_SLOTS = tuple(Slot(f"attention.{name}") for name in (
    "cos", "sin", "slots", "pages", "page_offset", "context", "tree_start", "tree_bits"))
_PAGE_SIZE = Slot("attention.page_size")


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


@register_backend("cpu_paged")
class CpuPagedBackend(AttentionBackend):
    # A key block's scores are then sums of whole vectors (q[d] times 16 keys' dimension d), with
    # no reduction across vector lanes, and a page's keys for one head are one contiguous run.
    keys_transposed = True

    def __init__(self, shape: AttentionShape) -> None:
        super().__init__(shape)
        self.lib = _library()
        if self.lib is None:
            raise RuntimeError("the C++ paged attention kernel is not available on this machine")

    def prepare(self, inp: AttentionInput, page_size: int, device: torch.device) -> PagedMeta:
        slots: list[int] = []
        pages: list[int] = []
        offsets: list[int] = []
        context: list[int] = []
        tree_start: list[int] = []
        tree_bits: list[int] = []
        trees = inp.tree_masks or [None] * len(inp.query_lens)
        for qlen, ctx, table, masks in zip(inp.query_lens, inp.context_lens, inp.page_tables, trees):
            used = table[: -(-ctx // page_size)]
            offsets += [len(pages)] * qlen
            start = ctx - qlen
            for pos in range(start, ctx):
                slots.append(used[pos // page_size] * page_size + pos % page_size)
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
        return meta

    def packed_call(self, qkv: Arg, dtype: torch.dtype, q_buf: Arg, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, out: Arg, tokens: Arg) -> list[Arg]:
        """``forward`` as a call for a ``CallList``: ``qkv`` (tokens, ...) of ``dtype`` (float32 or
        bfloat16), ``out`` of the same dtype, ``q_buf`` float32 (tokens, H, hd) scratch; the
        step's metadata and rotary angles are the slots ``call_values`` fills."""
        flags = _dtype_flags(dtype, k_cache.dtype)
        return [address(self.lib.lm_paged_attention_packed), qkv, *_META_SLOTS[:3], q_buf,
                k_cache.data_ptr(), v_cache.data_ptr(), *_META_SLOTS[3:], out, tokens,
                self.shape.num_heads, self.shape.num_kv_heads, self.shape.head_dim, _PAGE_SIZE,
                float_word(self.shape.scale), flags, THREADS]

    @staticmethod
    def call_values(meta: PagedMeta, cos: torch.Tensor, sin: torch.Tensor) -> dict[str, int]:
        """The step's values of the slots in ``packed_call`` (cos and sin contiguous)."""
        tensors = (cos, sin, meta.slots, meta.pages, meta.page_offset, meta.context,
                   meta.tree_start, meta.tree_bits)
        values = {slot.name: 0 if t is None else t.data_ptr() for slot, t in zip(_META_SLOTS, tensors)}
        return values | {_PAGE_SIZE.name: meta.page_size}

    def forward(self, meta: PagedMeta, qkv, cos, sin, k_cache, v_cache):
        T, (H, KVH, hd) = qkv.shape[0], (self.shape.num_heads, self.shape.num_kv_heads, self.shape.head_dim)
        dtype = qkv.dtype
        qkv = (qkv if dtype in (torch.float32, torch.bfloat16) else qkv.float()).contiguous()
        cos, sin = cos.contiguous(), sin.contiguous()
        q_buf = torch.empty(T, H, hd, dtype=torch.float32)
        out = torch.empty(T, H * hd, dtype=qkv.dtype)
        flags = _dtype_flags(qkv.dtype, k_cache.dtype)
        self.lib.lm_paged_attention(
            qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), meta.slots.data_ptr(), q_buf.data_ptr(),
            k_cache.data_ptr(), v_cache.data_ptr(), meta.pages.data_ptr(),
            meta.page_offset.data_ptr(), meta.context.data_ptr(),
            0 if meta.tree_start is None else meta.tree_start.data_ptr(),
            0 if meta.tree_bits is None else meta.tree_bits.data_ptr(), out.data_ptr(),
            T, H, KVH, hd, meta.page_size, self.shape.scale, flags, torch.get_num_threads())
        return out.to(dtype)
