"""Attention backends; importing the package registers the built-in ones."""

import logging
from typing import Optional

import torch

from lmserve.attention import cpu_paged, torch_native  # noqa: F401  (register "cpu_paged", "torch_native")
from lmserve.attention.base import AttentionShape
from lmserve.cache.kv import INT8_PAGE_MULTIPLE

logger = logging.getLogger("lmserve")


def resolve_attention(name: str, shape: AttentionShape, kv_dtype: torch.dtype,
                      log: bool = True) -> str:
    """``name``, or torch_native (logged, with ``log``) when the C++ kernel cannot serve this
    model here."""
    if name == "cpu_paged":
        reason = cpu_paged.why_unsupported(shape, kv_dtype)
        if reason:
            if log:
                logger.warning("attention=cpu_paged is unavailable (%s); using torch_native", reason)
            return "torch_native"
    return name


def why_no_int8_kv(shape: AttentionShape, page_size: int) -> Optional[str]:
    """Why this model cannot have an int8 KV cache here, or None: only the C++ kernel reads one,
    and its values go 4 tokens to a word, so pages must hold a multiple of 4."""
    if page_size % INT8_PAGE_MULTIPLE:
        return f"kv_cache_page_size={page_size} is not a multiple of {INT8_PAGE_MULTIPLE}"
    return cpu_paged.why_unsupported(shape, torch.int8)


def resolve_kv_dtype(kv_dtype: str, shape: AttentionShape, page_size: int) -> str:
    """``kv_dtype``, or bfloat16 when it is int8 and this model cannot have one here
    (``why_no_int8_kv``). The plan and the engine both ask; the engine logs it."""
    if kv_dtype == "int8" and why_no_int8_kv(shape, page_size):
        return "bfloat16"
    return kv_dtype
