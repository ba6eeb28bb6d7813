"""How rank 0's commands (each step's plain data, KV moves, stop) reach the other ranks, as bytes.

- ``ShmCommands``, on one host: rank 0 writes the bytes into a shared segment and publishes a
  sequence number; each rank waits for it (spinning, then yielding its core, then sleeping a
  millisecond at a time once idle) and publishes what it has taken, which rank 0 waits for
  before it writes the next. About a microsecond, against about a millisecond for gloo's two
  sends a step (measured by benchmarks/parallel.py): gloo's sends and receives each go through
  its I/O thread, with a thread wake-up on both sides.
- ``GlooCommands``, across hosts: a size, then the bytes, sent to each rank in turn (so that a
  timeout names the rank); gloo's sends wait for the receiver, so an idle rank 0 sends a
  keep-alive each second (``keep_alive``).

Segment: a cache line with rank 0's sequence number, the command's length and rank 0's pid,
a cache line per rank with the last sequence number it took, then ``COMMAND_BYTES`` of command.
A command that does not fit goes over gloo, flagged by a negative length.
"""

from __future__ import annotations

import ctypes
import os
import struct
import time
from typing import Callable, Optional, Union

import torch
import torch.distributed as dist

from lmserve.parallel.all_reduce import map_segment, shm_library

COMMAND_BYTES = 4 << 20
_LINE = 64
_SPIN_NS = 50_000_000  # waiting for a command: spin and yield this long, then sleep
_IDLE_SLEEP_S = 0.001


class RankLost(Exception):
    """``rank`` did not take the previous command in time."""

    def __init__(self, rank: int) -> None:
        super().__init__(f"rank {rank}")
        self.rank = rank


def command_segment_bytes(world: int) -> int:
    return _LINE * (1 + world) + COMMAND_BYTES


class GlooCommands:
    """Commands over gloo point-to-point sends on ``group`` (any hosts)."""

    needs_keep_alive = True

    def __init__(self, group, world: int) -> None:
        self.group = group
        self.world = world

    def send(self, data: bytes) -> None:
        payload = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        size = torch.tensor([len(data)], dtype=torch.int64)
        for rank in range(1, self.world):
            try:
                dist.send(size, dst=rank, group=self.group)
                dist.send(payload, dst=rank, group=self.group)
            except RuntimeError as err:
                raise RankLost(rank) from err

    def receive(self) -> bytes:
        size = torch.empty(1, dtype=torch.int64)
        dist.recv(size, src=0, group=self.group)
        data = torch.empty(int(size), dtype=torch.uint8)
        dist.recv(data, src=0, group=self.group)
        return data.numpy().tobytes()


class ShmCommands:
    """Commands through the segment file ``path`` (created by rank 0, see the module docstring);
    ``gloo`` carries those larger than the segment."""

    needs_keep_alive = False

    def __init__(self, path: str, rank: int, world: int, timeout_s: float, gloo: GlooCommands,
                 lost: Callable[[], Optional[str]] = lambda: None) -> None:
        lib = shm_library()
        assert lib is not None  # built only where shm_available() (parallel/group.py)
        lib.lm_shm_wait_above.restype = ctypes.c_int64
        lib.lm_shm_wait_above.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64]
        lib.lm_shm_publish.argtypes = [ctypes.c_void_p, ctypes.c_int64]
        self.lib, self.gloo = lib, gloo
        self.rank, self.world, self.timeout_s = rank, world, timeout_s
        self.lost = lost  # why the group is known to be gone (rank 0's watchdog), or None
        self.map, self.base = map_segment(path, command_segment_bytes(world))
        self.payload = _LINE * (1 + world)
        self.seq = 0  # the last command sent (rank 0) or taken (the others)
        if rank == 0:
            struct.pack_into("<q", self.map, 16, os.getpid())

    def _taken(self, rank: int) -> int:
        return self.base + _LINE * (1 + rank)

    def send(self, data: bytes) -> None:
        for rank in range(1, self.world):  # everyone has taken the previous command
            deadline = time.monotonic() + self.timeout_s
            while self.lib.lm_shm_wait_above(self._taken(rank), self.seq - 1, _SPIN_NS) < self.seq:
                if self.lost() is not None or time.monotonic() > deadline:
                    raise RankLost(rank)
        fits = len(data) <= COMMAND_BYTES
        if fits:
            self.map[self.payload:self.payload + len(data)] = data
        struct.pack_into("<q", self.map, 8, len(data) if fits else -1)
        self.seq += 1
        self.lib.lm_shm_publish(self.base, self.seq)
        if not fits:
            self.gloo.send(data)

    def receive(self) -> bytes:
        while self.lib.lm_shm_wait_above(self.base, self.seq, _SPIN_NS) <= self.seq:
            self._check_rank0()
            time.sleep(_IDLE_SLEEP_S)
        self.seq += 1
        length = struct.unpack_from("<q", self.map, 8)[0]
        data = bytes(self.map[self.payload:self.payload + length]) if length >= 0 else None
        self.lib.lm_shm_publish(self._taken(self.rank), self.seq)
        return data if data is not None else self.gloo.receive()

    def _check_rank0(self) -> None:
        """Rank 0 may be gone while this rank is idle (a rank it started dies with it anyway)."""
        pid = struct.unpack_from("<q", self.map, 16)[0]
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            raise ConnectionError(f"rank 0 (pid {pid}) is gone") from None
        except PermissionError:
            pass


Commands = Union[GlooCommands, ShmCommands]
