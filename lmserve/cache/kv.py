"""The KV tensors of the paged cache: one key and one value buffer per layer."""

from __future__ import annotations

import torch


class KVCache:
    """Per-layer key/value buffers addressed by slot (``page * page_size + offset``).

    Shapes: ``k[layer]`` and ``v[layer]`` are ``(num_pages * page_size, num_kv_heads, head_dim)``,
    so a token's KV is written with one indexed copy and a sequence's KV is read by gathering the
    slots of its pages.
    """

    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        self.page_size = page_size
        self.num_slots = num_pages * page_size
        shape = (self.num_slots, num_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
