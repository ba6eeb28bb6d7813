"""Turns a scheduled batch into flat tensors, runs the model, and returns the logits to sample."""

from __future__ import annotations

from typing import Optional

import torch

from lmserve.attention.base import AttentionBackend, AttentionInput
from lmserve.cache.kv import KVCache
from lmserve.layers.compiled import CompiledLayerOps
from lmserve.models.llama import ForwardContext
from lmserve.scheduler import Batch


class ModelRunner:
    """Owns the model, the KV tensors and the attention backend; one ``execute`` per step."""

    def __init__(self, model, kv: KVCache, backend: AttentionBackend, ops, max_positions: int,
                 device: torch.device, compiled: Optional[CompiledLayerOps] = None) -> None:
        """``ops``: the element-wise layer ops (``layers.fused.TorchOps`` or ``FusedOps``);
        ``compiled``: the layers' torch ops as compiled graphs (opt compile=1), or None."""
        self.model = model
        self.compiled = compiled
        self.kv = kv
        self.backend = backend
        self.ops = ops
        self.device = device
        self.rotary = model.rotary(max_positions, device)
        self.layer_calls = model.layer_calls(backend, ops, kv)

    def execute(self, batch: Batch) -> torch.Tensor:
        """Logits ``(S, V)`` for the chunks of ``batch`` that sample, in batch order."""
        input_ids: list[int] = []
        positions: list[int] = []
        last_token: list[int] = []  # flat index of each sampling chunk's last token
        for c in batch.chunks:
            start = c.seq.num_computed
            input_ids += c.seq.token_ids[start : start + c.num_tokens]
            positions += range(start, start + c.num_tokens)
            if c.samples:
                last_token.append(len(input_ids) - 1)

        attn_in = AttentionInput(
            query_lens=[c.num_tokens for c in batch.chunks],
            context_lens=[c.seq.num_computed + c.num_tokens for c in batch.chunks],
            page_tables=[c.seq.pages for c in batch.chunks],
        )
        pos = torch.tensor(positions, device=self.device)
        cos, sin = self.rotary.lookup(pos)
        ctx = ForwardContext(
            backend=self.backend,
            attn_meta=self.backend.prepare(attn_in, self.kv.page_size, self.device),
            ops=self.ops,
            cos=cos,
            sin=sin,
            kv=self.kv,
            layer_calls=self.layer_calls,
            compiled=self.compiled,
        )
        hidden = self.model.forward(torch.tensor(input_ids, device=self.device), ctx)  # (T, D)
        if not last_token:
            return hidden.new_empty((0, 0))
        return self.model.logits(hidden[torch.tensor(last_token, device=self.device)])  # (S, V)
