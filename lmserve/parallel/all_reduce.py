"""The all-reduce of tensor parallelism: after o and down, every rank's partial output is
summed, in place, and every rank gets the same bits.

- ``ShmAllReduce``: ranks on one host meet in a shared-memory segment
  (kernels/shm_all_reduce.cpp); it is also a call of the C++ layer call list, so the fast decode
  path keeps running a whole step in one call.
- ``GlooAllReduce``: torch.distributed over gloo, for ranks on several hosts (or where the C++
  kernels do not build); the layers then run on the torch path.

Both sum bf16 parts in float32 and round once, so two ranks give the same bits either way.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import struct
import time
from typing import Optional, Union

import torch
import torch.distributed as dist

from lmserve.kernels.build import load_kernel_library
from lmserve.layers.call_list import Arg, address

SLOT_BYTES = 4 << 20  # per rank and buffer; larger tensors are reduced in several rounds
_LINE = 64  # the segment's header: an error word, then a cache line per rank (its round counter
# and its time in all-reduces)


def segment_bytes(world: int) -> int:
    return _LINE * (1 + world) + 2 * world * SLOT_BYTES


def create_segment(path: str, size: int) -> None:
    """Create a zeroed segment file of ``size`` bytes (on /dev/shm) for the ranks of one host."""
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, size)
    finally:
        os.close(fd)


def map_segment(path: str, size: int) -> tuple[mmap.mmap, int]:
    """The segment file ``path`` mapped, and the address of its first byte."""
    fd = os.open(path, os.O_RDWR)
    try:
        mapped = mmap.mmap(fd, size)
    finally:
        os.close(fd)
    return mapped, ctypes.addressof(ctypes.c_char.from_buffer(mapped))


def shm_library() -> Optional[ctypes.CDLL]:
    P, I, L = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64  # noqa: E741
    return load_kernel_library("shm_all_reduce",
                               {"lm_shm_all_reduce": [P, I, I, L, P, I, L, L, L]})


def shm_available() -> bool:
    return shm_library() is not None


class ShmAllReduce:
    """Sum over the ranks of one host through the segment file ``path`` (``create_segment``):
    ``world`` ranks, this one the ``rank``-th; the group's ranks are ``first`` onwards."""

    def __init__(self, path: str, rank: int, world: int, timeout_s: float, first: int = 0) -> None:
        lib = shm_library()
        if lib is None:
            raise RuntimeError("the C++ shared-memory all-reduce is not available on this machine")
        self.lib = lib
        self.rank, self.world, self.timeout_ms = rank, world, int(timeout_s * 1000)
        self.first = first
        self.map, self.address = map_segment(path, segment_bytes(world))

    def __call__(self, t: torch.Tensor) -> None:
        """Sum the contiguous float32 or bf16 tensor ``t`` (rows, width) over the ranks, in place."""
        rows, width = t.shape
        self.lib.lm_shm_all_reduce(*self._args(t.data_ptr(), t.dtype, rows, width))

    def packed_call(self, data: Arg, dtype: torch.dtype, rows: Arg, width: int) -> list[Arg]:
        """``__call__`` as a call of a ``CallList``."""
        return [address(self.lib.lm_shm_all_reduce_packed), *self._args(data, dtype, rows, width)]

    def _args(self, data: Arg, dtype: torch.dtype, rows: Arg, width: int) -> list[Arg]:
        return [self.address, self.rank, self.world, SLOT_BYTES, data, int(dtype == torch.bfloat16),
                rows, width, self.timeout_ms]

    def failed_rank(self) -> Optional[int]:
        """The rank a collective gave up waiting for (or that the watchdog saw die), or None."""
        word = struct.unpack_from("<i", self.map, 0)[0]
        return self.first + word - 1 if word else None

    def seconds(self) -> float:
        """Time this rank has spent in all-reduces, waiting for the others included."""
        return struct.unpack_from("<q", self.map, _LINE * (1 + self.rank) + 8)[0] / 1e9

    def fail(self, rank: int) -> None:
        """Make every rank's waits end: ``rank``, one of the group's, is gone (called by the
        watchdog)."""
        if not struct.unpack_from("<i", self.map, 0)[0]:
            struct.pack_into("<i", self.map, 0, rank - self.first + 1)


class GlooAllReduce:
    """Sum over the ranks of ``group`` with torch.distributed (any hosts)."""

    packed_call = None  # no C++ form: the layers run on the torch path

    def __init__(self, group) -> None:
        self.group = group
        self._seconds = 0.0

    def __call__(self, t: torch.Tensor) -> None:
        started = time.perf_counter()
        total = t.float()
        dist.all_reduce(total, group=self.group)
        t.copy_(total)
        self._seconds += time.perf_counter() - started

    def seconds(self) -> float:
        """Time this rank has spent in all-reduces, waiting for the others included."""
        return self._seconds

    @staticmethod
    def failed_rank() -> Optional[int]:
        return None  # gloo raises instead


AllReduce = Union[ShmAllReduce, GlooAllReduce]
