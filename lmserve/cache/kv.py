"""The KV tensors of the paged cache: one key and one value buffer per layer."""

from __future__ import annotations

import math
import mmap

import torch


def zeros_on_demand(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A zero tensor whose CPU memory is taken page by page as it is first written.

    Anonymous memory maps read as zeros and cost nothing until touched, so a server-sized cache
    (tens of GiB) is ready at once instead of after writing every byte, and the process's
    resident memory shows the KV actually used. Other devices get ``torch.zeros``.
    """
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    # The tensor keeps the map alive; the map is unmapped when the tensor is freed.
    return torch.frombuffer(mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE), dtype=dtype).view(shape)


# An int8 cache's values are stored 4 tokens to a word (see KVCache), so its pages hold a
# multiple of 4 tokens.
INT8_PAGE_MULTIPLE = 4

# dtype of the KV cache by its opt name (int8: codes with a scale per token and head)
KV_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
             "int8": torch.int8}


def head_sizes(head_dim: int, dtype: torch.dtype) -> tuple[int, int]:
    """Elements of one token's key and value for one KV head: ``head_dim``, and for int8 codes
    the key's float32 scale and int32 code sum, the value's scale after them."""
    if dtype == torch.int8:
        return head_dim + 8, head_dim + 4
    return head_dim, head_dim


def kv_bytes_per_head(head_dim: int, kv_dtype: str) -> int:
    """Bytes of one token's key and value for one KV head in a ``kv_dtype`` (opt name) cache."""
    dtype = KV_DTYPES[kv_dtype]
    return sum(head_sizes(head_dim, dtype)) * dtype.itemsize


class KVCache:
    """Per-layer key/value buffers addressed by slot (``page * page_size + offset``).

    Shapes: ``v[layer]`` is ``(num_pages * page_size, num_kv_heads, head_dim)``, so a token's
    values are written with one indexed copy and a sequence's are read by gathering the slots of
    its pages; ``k[layer]`` is the same, or with ``keys_transposed`` (the C++ attention kernel's
    layout) ``(num_pages, num_kv_heads, head_dim, page_size)``: each page's keys per head as
    ``head_dim`` rows of ``page_size``, so one dimension of consecutive keys is contiguous.

    An int8 cache (the C++ kernel's only) holds codes and their float32 scales (value = code *
    scale, one scale per token and head) in the same buffers, both per page and head, laid out for
    the kernel's integer dot products: ``k`` is ``(num_pages, num_kv_heads, head_dim + 8,
    page_size)`` bytes, rows of ``4 * page_size`` bytes: for each 4 dimensions the page's keys'
    codes for them, then the keys' scales, then the int32 sums of their codes; ``v`` is
    ``(num_pages, num_kv_heads, head_dim + 4, page_size)`` bytes: for each 4 keys a row of
    ``head_dim`` words (word d holds the 4 keys' codes of dimension d), then the values' scales.
    Its pages hold a multiple of 4 tokens.
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
        keys_transposed: bool = False,
    ) -> None:
        self.page_size = page_size
        if dtype == torch.int8 and not keys_transposed:
            raise ValueError("an int8 KV cache needs the C++ kernel's layout (keys transposed)")
        if dtype == torch.int8 and page_size % INT8_PAGE_MULTIPLE:
            raise ValueError(f"an int8 KV cache needs pages of a multiple of {INT8_PAGE_MULTIPLE} "
                             f"tokens, got kv_cache_page_size={page_size}")
        k_dim, v_dim = head_sizes(head_dim, dtype)
        by_slot = (num_pages * page_size, num_kv_heads, v_dim)
        k_shape = (num_pages, num_kv_heads, k_dim, page_size) if keys_transposed else by_slot
        v_shape = (num_pages, num_kv_heads, v_dim, page_size) if dtype == torch.int8 else by_slot
        self.k = [zeros_on_demand(k_shape, dtype, device) for _ in range(num_layers)]
        self.v = [zeros_on_demand(v_shape, dtype, device) for _ in range(num_layers)]
