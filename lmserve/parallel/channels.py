"""Point-to-point channels between pipeline stages: a stage's residual stream to the next stage,
and the last stage's final hidden rows back to rank 0, which samples (``parallel.stages``).

- ``ShmChannel``, on one host: a ring of ``SLOTS`` slots in a shared segment, one writer and
  one reader; a tensor larger than a slot streams through it in pieces. The writer only waits
  when every slot is full, so a stage hands its output on and goes on with the next batch.
- ``GlooChannel``, across hosts: torch.distributed's ``isend``/``recv`` on a group of their
  own; a send is waited for only before the next one, for the same reason.

A message is the tensor's dtype and shape, then its bytes.

Segment: a cache line with the pieces written, one with the pieces taken, then the slots.
"""

from __future__ import annotations

import ctypes
import struct
import time
from typing import Callable, Optional, Union

import torch
import torch.distributed as dist

from lmserve.parallel.all_reduce import map_segment, shm_library
from lmserve.parallel.commands import RankLost

SLOTS = 4
SLOT_BYTES = 1 << 20
_LINE = 64
_HEADER = 64  # dtype, number of dims, up to 6 sizes: int64 each
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.int64)
_WAIT_SLICE_NS = 50_000_000  # between two looks at whether the peer is known to be lost
_SLEEP_S = 100e-6  # receive_sleeping's naps


def channel_segment_bytes() -> int:
    return 2 * _LINE + SLOTS * SLOT_BYTES


def _header(t: torch.Tensor) -> torch.Tensor:
    if t.dim() > 6:
        raise ValueError(f"a channel carries tensors of at most 6 dims, got {tuple(t.shape)}")
    words = [_DTYPES.index(t.dtype), t.dim(), *t.shape]
    return torch.tensor(words + [0] * (_HEADER // 8 - len(words)), dtype=torch.int64)


def _empty(header: torch.Tensor) -> torch.Tensor:
    words = header.tolist()
    return torch.empty(words[2:2 + words[1]], dtype=_DTYPES[words[0]])


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """``t``'s storage as a flat uint8 tensor (no copy)."""
    return t.contiguous().view(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)


class ShmChannel:
    """One writer rank to one reader rank through the segment file ``path`` (see the module
    docstring). A wait gives up after ``timeout_s`` (``RankLost`` naming ``peer``), or as soon
    as ``lost()`` says why the group is gone."""

    def __init__(self, path: str, peer: int, timeout_s: float,
                 lost: Callable[[], Optional[str]] = lambda: None) -> None:
        lib = shm_library()
        assert lib is not None  # built only where shm_available() (parallel/group.py)
        lib.lm_shm_wait_above.restype = ctypes.c_int64
        lib.lm_shm_wait_above.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64]
        lib.lm_shm_publish.argtypes = [ctypes.c_void_p, ctypes.c_int64]
        self.lib, self.peer, self.timeout_s, self.lost = lib, peer, timeout_s, lost
        self.map, self.base = map_segment(path, channel_segment_bytes())
        self.bytes = torch.frombuffer(self.map, dtype=torch.uint8)
        self.pieces = 0  # written (the writer) or taken (the reader)
        self.seconds = 0.0  # spent moving bytes, not waiting for the peer (benchmarks/parallel.py)

    def send(self, t: torch.Tensor) -> None:
        started = time.perf_counter()
        data, header = _bytes(t), _header(t).view(torch.uint8)
        done = 0
        while True:
            # Slot of piece n (1-based) is free once the reader took piece n - SLOTS.
            self._wait(self.base + _LINE, self.pieces - SLOTS)
            slot = 2 * _LINE + (self.pieces % SLOTS) * SLOT_BYTES
            if done == 0:
                self.bytes[slot:slot + _HEADER].copy_(header)
                slot, room = slot + _HEADER, SLOT_BYTES - _HEADER
            else:
                room = SLOT_BYTES
            n = min(room, len(data) - done)
            self.bytes[slot:slot + n].copy_(data[done:done + n])
            done += n
            self.pieces += 1
            self.lib.lm_shm_publish(self.base, self.pieces)
            if done == len(data):
                break
        self.seconds += time.perf_counter() - started

    def receive(self) -> torch.Tensor:
        started = time.perf_counter()
        out: Optional[torch.Tensor] = None
        done = 0
        while True:
            self._wait(self.base, self.pieces)
            slot = 2 * _LINE + (self.pieces % SLOTS) * SLOT_BYTES
            if out is None:
                out = _empty(self.bytes[slot:slot + _HEADER].clone().view(torch.int64))
                data = _bytes(out)
                slot, room = slot + _HEADER, SLOT_BYTES - _HEADER
            else:
                room = SLOT_BYTES
            n = min(room, len(data) - done)
            data[done:done + n].copy_(self.bytes[slot:slot + n])
            done += n
            self.pieces += 1
            self.lib.lm_shm_publish(self.base + _LINE, self.pieces)
            if done == len(data):
                break
        self.seconds += time.perf_counter() - started
        return out

    def receive_sleeping(self) -> torch.Tensor:
        """``receive``, waiting in short sleeps rather than spinning: for a thread that shares
        its core with a thread that computes (rank 0's taker of the last stage's outputs)."""
        deadline = time.monotonic() + self.timeout_s
        while struct.unpack_from("<q", self.map, 0)[0] <= self.pieces:
            if self.lost() is not None or time.monotonic() > deadline:
                raise RankLost(self.peer)
            time.sleep(_SLEEP_S)
        return self.receive()

    def _wait(self, counter: int, value: int) -> None:
        """Until the counter at ``counter`` exceeds ``value`` (the time is not counted)."""
        started = time.perf_counter()
        deadline = time.monotonic() + self.timeout_s
        while self.lib.lm_shm_wait_above(counter, value, _WAIT_SLICE_NS) <= value:
            if self.lost() is not None or time.monotonic() > deadline:
                raise RankLost(self.peer)
        self.seconds -= time.perf_counter() - started


class GlooChannel:
    """One rank to another (``peer``: the other end) over torch.distributed's ``group``."""

    def __init__(self, group, peer: int) -> None:
        self.group, self.peer = group, peer
        self.sending: list = []  # the last send's works and tensors, until it is done
        self.seconds = 0.0  # spent in send and receive, waits for the peer included

    def send(self, t: torch.Tensor) -> None:
        started = time.perf_counter()
        self._finish_send()
        t = t.contiguous()
        header = _header(t)
        works = [dist.isend(header, self.peer, group=self.group)]
        if t.numel():
            works.append(dist.isend(t, self.peer, group=self.group))
        self.sending = [works, header, t]
        self.seconds += time.perf_counter() - started

    def receive(self) -> torch.Tensor:
        started = time.perf_counter()
        header = torch.empty(_HEADER // 8, dtype=torch.int64)
        try:
            dist.recv(header, self.peer, group=self.group)
            out = _empty(header)
            if out.numel():
                dist.recv(out, self.peer, group=self.group)
        except RuntimeError as err:
            raise RankLost(self.peer) from err
        self.seconds += time.perf_counter() - started
        return out

    def receive_sleeping(self) -> torch.Tensor:
        return self.receive()  # (gloo's recv sleeps in its wait)

    def _finish_send(self) -> None:
        if self.sending:
            try:
                for work in self.sending[0]:
                    work.wait()
            except RuntimeError as err:
                raise RankLost(self.peer) from err
            self.sending = []


Channel = Union[ShmChannel, GlooChannel]
