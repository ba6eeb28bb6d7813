"""The KV tensors of the paged cache: one key and one value buffer per layer."""

from __future__ import annotations

import math
import mmap
from collections.abc import Callable

import torch

from lmserve.util import cdiv


class OnDemandBuffer:
    """A zero tensor whose CPU memory is taken page by page as it is first written, and can be
    given back.

    Anonymous memory maps read as zeros and cost nothing until touched, so a server-sized cache
    (tens of GiB) is ready at once instead of after writing every byte. ``discard`` hands a byte
    range's memory back to the system (it reads as zeros again), so that the process's resident
    memory follows the KV in use, not the most it ever held. Other devices get ``torch.zeros``.
    """

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> None:
        nbytes = math.prod(shape) * dtype.itemsize
        self._map: mmap.mmap | None = None
        if torch.device(device).type != "cpu" or nbytes == 0:
            self.tensor = torch.zeros(shape, dtype=dtype, device=device)
            return
        # The tensor keeps the map alive; the map is unmapped when both are gone.
        self._map = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE)
        self.tensor = torch.frombuffer(self._map, dtype=dtype).view(shape)

    def discard(self, start: int, end: int) -> None:
        """Give back the memory of the system pages wholly inside bytes ``[start, end)``; they
        read as zeros afterwards. Pages only partly inside keep their memory (and contents)."""
        if self._map is None:
            return
        first = cdiv(start, mmap.PAGESIZE) * mmap.PAGESIZE
        last = end // mmap.PAGESIZE * mmap.PAGESIZE if end < len(self._map) else len(self._map)
        if last > first:
            self._map.madvise(mmap.MADV_DONTNEED, first, last - first)


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
        self.num_pages = num_pages
        self.head_dim = head_dim
        self.dtype = dtype
        self._buffers = [OnDemandBuffer(shape, dtype, device)
                         for _ in range(num_layers) for shape in (k_shape, v_shape)]
        self.k = [b.tensor for b in self._buffers[0::2]]
        self.v = [b.tensor for b in self._buffers[1::2]]

    def discard(self, pages: list[int], is_free: Callable[[int], bool]) -> None:
        """Give the memory of free ``pages`` back to the system (their KV reads as zeros then).

        Every buffer is laid out page by page, so a run of consecutive pages is one byte range
        per buffer. A system page it shares with neighbouring KV pages goes too when those are
        free as well (``is_free``): else pages going idle one at a time would each keep the
        system pages at their edges (a fifth of an int8 cache's) for good.
        """
        runs: list[list[int]] = []
        for p in sorted(pages):
            if runs and runs[-1][1] == p:
                runs[-1][1] = p + 1
            else:
                runs.append([p, p + 1])
        for buffer in self._buffers:
            page_bytes = buffer.tensor.nbytes // self.num_pages
            if page_bytes == 0:
                continue
            for first, end in runs:
                start, stop = first * page_bytes, end * page_bytes
                lo = start // mmap.PAGESIZE * mmap.PAGESIZE
                hi = min(cdiv(stop, mmap.PAGESIZE) * mmap.PAGESIZE, buffer.tensor.nbytes)
                if all(is_free(p) for p in range(lo // page_bytes, first)):
                    start = lo
                if all(is_free(p) for p in range(end, min(cdiv(hi, page_bytes), self.num_pages))):
                    stop = hi
                buffer.discard(start, stop)

    def move(self, src: list[int], dst: list[int]) -> None:
        """Copy the keys and values of slots ``src[i]`` to slots ``dst[i]`` in every layer (a
        verified draft tree's path into the positions it now has); all are read before any is
        written."""
        if not src:
            return
        ps = self.page_size
        s, d = torch.tensor(src), torch.tensor(dst)
        sp, so, dp, do = s // ps, s % ps, d // ps, d % ps
        for k, v in zip(self.k, self.v):
            for t, views in ((k, self._key_views), (v, self._value_views)):
                for view, by in views(t):
                    if by == "slot":
                        view[d] = view[s]
                    elif by == "offset":  # (pages, KVH, ..., page_size, ...): a token's offset
                        view[dp, :, ..., do, :] = view[sp, :, ..., so, :]
                    else:  # "word": int8 values, 4 tokens' codes to a word (see the class doc)
                        view[dp, :, do // 4, :, do % 4] = view[sp, :, so // 4, :, so % 4]

    def _key_views(self, k: torch.Tensor) -> list[tuple[torch.Tensor, str]]:
        """Views of a key buffer in which one index picks a token (see ``move``)."""
        if k.dim() == 3:
            return [(k, "slot")]
        if self.dtype == torch.int8:  # rows of 4 bytes per token
            return [(k.view(*k.shape[:2], -1, self.page_size, 4), "offset")]
        return [(k.unsqueeze(-1), "offset")]

    def _value_views(self, v: torch.Tensor) -> list[tuple[torch.Tensor, str]]:
        if v.dim() == 3:
            return [(v, "slot")]
        pages, heads, ps, d = v.shape[0], v.shape[1], self.page_size, self.head_dim
        flat = v.view(pages, heads, -1)
        codes = flat[:, :, : d * ps].view(pages, heads, ps // 4, d, 4)
        scales = flat[:, :, d * ps :].view(pages, heads, ps, 4)
        return [(codes, "word"), (scales, "offset")]
