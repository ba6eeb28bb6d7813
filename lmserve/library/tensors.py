"""Named tensors in a safetensors file, read back memory-mapped.

The file is plain safetensors (any tool reads it), written so that it maps well: the header is
padded so that the data starts at a multiple of 64 bytes, and tensors whose size is a multiple of
64 bytes (all the large ones: packed weight blocks, embeddings) come first, so each starts on a
cache line; the rest follow from the widest element down, so each is aligned to its element. Reading maps
the file privately (copy on write) and views each tensor in place: no copy is made, pages come
from the page cache as the engine touches them, and processes serving the same file share them.
"""

from __future__ import annotations

import json
import math
import mmap
import struct
from typing import Mapping

import torch

# safetensors' names of the dtypes lmserve stores.
DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
          torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
          torch.uint8: "U8", torch.bool: "BOOL"}
_BY_NAME = {name: dtype for dtype, name in DTYPES.items()}
_ALIGN = 64


def write_tensors(path: str, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str]) -> None:
    """Write ``tensors`` and string ``metadata`` (safetensors' ``__metadata__``) to ``path``."""
    for name, t in tensors.items():
        if t.dtype not in DTYPES:
            raise TypeError(f"tensor {name!r} has dtype {t.dtype}, which a model library does not store")

    def nbytes(t: torch.Tensor) -> int:
        return t.numel() * t.element_size()

    order = sorted(tensors, key=lambda n: (nbytes(tensors[n]) % _ALIGN != 0,
                                           -tensors[n].element_size(), n))
    header: dict[str, object] = {"__metadata__": dict(metadata)}
    offset = 0
    for name in order:
        t = tensors[name]
        header[name] = {"dtype": DTYPES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + nbytes(t)]}
        offset += nbytes(t)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % _ALIGN)  # safetensors allows trailing spaces
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for name in order:
            t = tensors[name].detach().contiguous()
            if t.numel():
                f.write(t.reshape(-1).view(torch.uint8).numpy().data)


def read_tensors(path: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors of ``path`` as views of a private memory map of it, and its metadata."""
    with open(path, "rb") as f:
        size = f.seek(0, 2)
        if size < 8:
            raise ValueError(f"{path} is not a safetensors file: {size} bytes")
        f.seek(0)
        (length,) = struct.unpack("<Q", f.read(8))
        if 8 + length > size:
            raise ValueError(f"{path}: its header says {length} bytes, the file has {size}")
        header = json.loads(f.read(length))
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) if size > 8 + length else None
    metadata = header.pop("__metadata__", {})
    start = 8 + length
    tensors = {}
    for name, entry in header.items():
        dtype = _BY_NAME[entry["dtype"]]
        begin, end = entry["data_offsets"]
        shape = entry["shape"]
        if not 0 <= begin <= end or end - begin != math.prod(shape) * dtype.itemsize:
            raise ValueError(f"{path}: tensor {name!r} has bytes {begin}..{end} for shape {shape} of {dtype}")
        if begin == end:
            tensors[name] = torch.empty(shape, dtype=dtype)
            continue
        if start + end > size:
            raise ValueError(f"{path}: tensor {name!r} ends at byte {start + end}, past the file's end ({size})")
        count = (end - begin) // dtype.itemsize
        tensors[name] = torch.frombuffer(mapped, dtype=dtype, count=count, offset=start + begin).view(shape)
    return tensors, metadata
