"""Attention backends; importing the package registers the built-in ones."""

import logging

import torch

from lmserve.attention import cpu_paged, torch_native  # noqa: F401  (register "cpu_paged", "torch_native")
from lmserve.attention.base import AttentionShape

logger = logging.getLogger("lmserve")


def resolve_attention(name: str, shape: AttentionShape, kv_dtype: torch.dtype) -> str:
    """``name``, or torch_native (logged) when the C++ kernel cannot serve this model here."""
    if name == "cpu_paged":
        reason = cpu_paged.why_unsupported(shape, kv_dtype)
        if reason:
            logger.warning("attention=cpu_paged is unavailable (%s); using torch_native", reason)
            return "torch_native"
    return name


def resolve_kv_dtype(kv_dtype: str, shape: AttentionShape) -> str:
    """``kv_dtype``, or bfloat16 when it is int8 and the C++ kernel (the only reader of int8 KV)
    cannot serve this model here. The plan and the engine both ask; the engine logs it."""
    if kv_dtype == "int8" and cpu_paged.why_unsupported(shape, torch.int8):
        return "bfloat16"
    return kv_dtype
