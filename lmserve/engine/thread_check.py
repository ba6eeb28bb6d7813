"""Whether the engine thread's C++ kernels start and join their threads at full speed.

Each kernel call is an OpenMP parallel region in torch's libgomp, and a decode step makes a few
hundred: they are fast only while the team's threads spin between them. ``lmserve/openmp.py``
sets libgomp up for that when lmserve is imported before torch; a process that imported torch
first and ran multithreaded torch work in another thread has threads that sleep between
regions, about 11 microseconds a region instead of 0.6, and decodes 40-45% slower (2-core
Zen 4). The engine thread measures now and then and says once what to do.
"""

from __future__ import annotations

import ctypes
import logging
import os
import statistics
from typing import Optional

import torch

from lmserve.kernels.build import load_kernel_library
from lmserve.openmp import SETTINGS

logger = logging.getLogger("lmserve")

CHECK_INTERVAL_S = 30.0
SLOW_REGION_S = 5e-6  # about 1 microsecond when the threads spin, 10 or more when they sleep
REGIONS = 50  # back-to-back regions per timing; the median of TIMINGS timings is taken
TIMINGS = 5


def _library():
    return load_kernel_library("parallel_probe", {
        "lm_time_parallel_regions": [ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_double)]})


def parallel_region_seconds(threads: int) -> Optional[float]:
    """Median seconds an empty parallel region of ``threads`` threads takes on this thread, or
    None where the probe does not build."""
    lib = _library()
    if lib is None:
        return None
    took = ctypes.c_double()
    times = []
    for _ in range(TIMINGS):
        lib.lm_time_parallel_regions(threads, REGIONS, ctypes.byref(took))
        times.append(took.value)
    return statistics.median(times)


class ThreadSyncCheck:
    """Run on the engine thread: ``maybe_check`` measures at most every ``CHECK_INTERVAL_S``
    and warns once if regions are slow."""

    def __init__(self) -> None:
        self.last: Optional[float] = None  # monotonic time of the last check
        self.warned = False

    def maybe_check(self, now: float) -> Optional[float]:
        """The measured seconds per region if it was time to check, else None."""
        if self.warned or (self.last is not None and now - self.last < CHECK_INTERVAL_S):
            return None
        self.last = now
        threads = torch.get_num_threads()  # what the step's kernel calls use
        if threads < 2:
            return None
        seconds = parallel_region_seconds(threads)
        if seconds is not None and seconds > SLOW_REGION_S:
            self.warned = True
            logger.warning(
                "the C++ kernels' threads are slow to start: an empty parallel region takes "
                "%.1f us (about 1 when they spin), and a step makes hundreds (decoding was 40-45%% "
                "slower on 2 cores). The usual cause: torch was imported before lmserve, so "
                "libgomp kept its default spinning, and another thread of this process ran "
                "multithreaded torch work, so libgomp manages more threads than the %d CPUs and "
                "barely spins. Import lmserve before torch, or set %s in the environment; or "
                "other programs keep these CPUs busy.", seconds * 1e6, len(os.sched_getaffinity(0)),
                " ".join(f"{k}={v}" for k, v in SETTINGS.items()))
        return seconds
