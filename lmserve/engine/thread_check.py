"""Whether the engine thread's C++ kernels start and join their threads at full speed.

Each kernel call is an OpenMP parallel region (in libgomp), and a decode step makes a few
hundred: they are fast only while the team's threads spin between them. ``lmserve/openmp.py``
sets libgomp up for that when lmserve is imported before torch; a process that imported torch
first and ran multithreaded torch work in another thread has threads that sleep between
regions (11-30 microseconds a region instead of 0.6) and decoded at about a third of the speed
(benchmarks/thread_sync.py, 2-core Zen 4). The engine thread measures now and then and, after
two slow measurements in a row, says once why and what to do.
"""

from __future__ import annotations

import ctypes
import logging
import statistics
from typing import Optional

import torch

from lmserve import openmp
from lmserve.kernels.build import load_kernel_library

logger = logging.getLogger("lmserve")

CHECK_INTERVAL_S = 30.0
# A region's start and join: about 0.6 microseconds for two spinning threads here, 10 or more
# when they sleep; more threads take longer to gather, so the bound grows with them.
SLOW_REGION_S, SLOW_PER_THREAD_S = 5e-6, 0.5e-6
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


def slow_region_s(threads: int) -> float:
    """The time above which a region of ``threads`` threads counts as slow."""
    return SLOW_REGION_S + SLOW_PER_THREAD_S * threads


class ThreadSyncCheck:
    """Run on the engine thread: ``maybe_check`` measures at most every ``CHECK_INTERVAL_S``
    and warns once, after two slow measurements in a row. Built with the engine (the probe
    compiles then, not in a request's step); a probe that fails turns the check off."""

    def __init__(self) -> None:
        self.last: Optional[float] = None  # monotonic time of the last check
        self.slow = 0  # slow measurements in a row
        try:
            self.done = _library() is None  # warned, or nothing to measure with
        except Exception:  # noqa: BLE001  (a broken cached build: no check, the engine serves on)
            logger.debug("the kernel threads' probe did not load", exc_info=True)
            self.done = True
        copies = openmp.libgomp_copies()
        self.runtimes = f"; this process runs {len(copies)} libgomp copies" if len(copies) > 1 else ""

    def maybe_check(self, now: float) -> Optional[float]:
        """The measured seconds per region if it was time to check, else None."""
        if self.done or (self.last is not None and now - self.last < CHECK_INTERVAL_S):
            return None
        self.last = now
        threads = torch.get_num_threads()  # what the step's kernel calls use
        if threads < 2:
            return None
        try:
            seconds = parallel_region_seconds(threads)
        except Exception:  # noqa: BLE001  (a diagnostic: never the engine's failure)
            logger.debug("the kernel threads' check failed; not checking again", exc_info=True)
            self.done = True
            return None
        assert seconds is not None  # the probe built: else done was set in __init__
        self.slow = self.slow + 1 if seconds > slow_region_s(threads) else 0
        if self.slow == 2:
            self.done = True
            self._warn(seconds)
        return seconds

    def _warn(self, seconds: float) -> None:
        if openmp.status is None:
            cause = ("lmserve set libgomp's spinning, so other programs or threads are likely "
                     "keeping these CPUs busy")
        else:
            cause = (f"lmserve did not set libgomp's spinning ({openmp.status}), and another "
                     "thread of this process has likely run multithreaded torch work: libgomp "
                     "then manages more threads than CPUs and barely spins. Import lmserve before "
                     "torch, or set " + " ".join(f"{k}={v}" for k, v in openmp.SETTINGS.items())
                     + " in the environment")
        logger.warning("the C++ kernels' threads are slow to start: an empty parallel region takes "
                       "%.1f us (under 1 when they spin), and a step makes hundreds. %s%s.",
                       seconds * 1e6, cause, self.runtimes)
