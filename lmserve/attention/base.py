"""The attention backend interface: per-step metadata built once, then one call per layer."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable, Generic, Optional, TypeVar

import torch

from lmserve.attention.window import AttentionWindow


@dataclass
class AttentionInput:
    """Where each sequence of a flat batch sits, as plain lists (one entry per sequence).

    The flat batch holds the tokens of every scheduled sequence back to back. Sequence ``i``
    contributes ``query_lens[i]`` new tokens at positions ``context_lens[i] - query_lens[i]``
    .. ``context_lens[i] - 1``; its keys and values for all ``context_lens[i]`` positions live in
    the KV cache slots of ``page_tables[i]``.

    A draft tree (speculative decoding) changes what a sequence's new tokens attend, not where
    their keys go: with ``tree_masks[i]`` given, its new token ``j`` attends the keys before the
    step and those of the step's tokens set in bit ``j'`` of ``tree_masks[i][j]`` (its ancestors
    in the tree and itself, bit 0 the first new token); its position (rotary) is the context
    before the step plus the bits set, minus one. None: causal, as a chain.

    A sliding ``window`` (attention/window.py) restricts what the model's windowed layers
    attend; when every layer is windowed (``dense_layers`` False) a page table's entries for
    pages no query can see any more are ``RELEASED`` (the manager gave them back).
    ``sink_cos``/``sink_sin``: ``(T, hd)`` rotary angles of ``window.sink_position`` of each
    token's position, None when they equal its own (no query has moved past its sinks yet).
    """

    query_lens: list[int]
    context_lens: list[int]
    page_tables: list[list[int]]
    tree_masks: Optional[list[Optional[list[int]]]] = None
    window: Optional[AttentionWindow] = None
    dense_layers: bool = True
    sink_cos: Optional[torch.Tensor] = None
    sink_sin: Optional[torch.Tensor] = None

    def first_keys(self, i: int) -> int:
        """The oldest key past the sinks that sequence ``i``'s first new token sees (0 without a
        window): its keys before it (the sinks excepted) are needed by no query of the step."""
        if self.window is None:
            return 0
        return self.window.lowest_key(self.context_lens[i] - self.query_lens[i])


# A page table entry whose page a sliding window has given back (see KVCacheManager).
RELEASED = -1


@dataclass(frozen=True)
class AttentionShape:
    """The attention heads of one model layer."""

    num_heads: int
    num_kv_heads: int
    head_dim: int

    @property
    def scale(self) -> float:
        return self.head_dim**-0.5


# The per-step metadata a backend's ``prepare`` builds and its ``forward`` reads.
MetaT = TypeVar("MetaT")


class AttentionBackend(ABC, Generic[MetaT]):
    """Rotary embedding, KV-cache store and paged attention over a flat batch.

    Chosen once when the engine starts; ``prepare`` runs once per step, ``forward`` once per layer.
    """

    # The key cache layout the backend reads and writes (see ``KVCache``): by slot, or each
    # page's keys transposed per head.
    keys_transposed: bool = False

    def __init__(self, shape: AttentionShape) -> None:
        self.shape = shape

    @abstractmethod
    def prepare(self, inp: AttentionInput, page_size: int, device: torch.device) -> MetaT:
        """Build the step's metadata (index tensors, masks) once, shared by all layers."""

    @abstractmethod
    def forward(
        self,
        meta: MetaT,
        qkv: torch.Tensor,  # (T, (H + 2 * KVH) * hd): the fused q/k/v projection
        cos: torch.Tensor,  # (T, hd) float32 rotary angles of each token's position
        sin: torch.Tensor,  # (T, hd)
        k_cache: torch.Tensor,  # (slots, KVH, hd), or (pages, KVH, hd, page_size) if keys_transposed
        v_cache: torch.Tensor,  # (slots, KVH, hd); int8: (pages, KVH, hd + 4, page_size) bytes
        windowed: bool = False,  # this layer attends within the step's window
    ) -> torch.Tensor:  # (T, H * hd) in qkv's dtype
        """Rotate q and k, write this step's keys/values into the cache, attend each query
        causally over its sequence's cached keys (a draft tree's tokens: over their ancestors;
        a windowed layer's: over the keys its window shows)."""


_BACKENDS: dict[str, type[AttentionBackend]] = {}


_B = TypeVar("_B", bound=type[AttentionBackend])


def register_backend(name: str) -> Callable[[_B], _B]:
    """Class decorator adding an attention backend to the registry under ``name``."""

    def deco(cls: _B) -> _B:
        _BACKENDS[name] = cls
        return cls

    return deco


def create_backend(name: str, shape: AttentionShape) -> AttentionBackend:
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; known: {sorted(_BACKENDS)}")
    return _BACKENDS[name](shape)
