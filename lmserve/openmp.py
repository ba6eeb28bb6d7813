"""libgomp's spinning, set before torch loads it (``import lmserve`` does, see ``__init__``).

The C++ kernels split each call's work with OpenMP, in the libgomp that torch ships and loads,
and a decode step makes a few hundred such calls: their threads must still be spinning when the
next call starts. libgomp spins for ``GOMP_SPINCOUNT`` iterations (300,000 by default) while it
manages no more threads than the machine has CPUs, and for only 100 beyond that, then sleeps in
the kernel. Every OS thread that runs multithreaded OpenMP work keeps a team of its own for its
life, so one multithreaded torch operation in any other thread (a Python API user's own tensors,
a test's reference model) tips the count for good: an empty parallel region then took 11
microseconds instead of 0.6 and a draft model's decode passes 40-45% longer (2-core Zen 4).
``OMP_WAIT_POLICY=active`` raises those 100 spins to 1,000, enough between the calls of a step
(0.6 microseconds a region again, full speed); ``GOMP_SPINCOUNT`` keeps the default's 300,000
spins otherwise (active alone would spin for minutes whenever the engine idles), and
``KMP_BLOCKTIME`` keeps LLVM's and Intel's OpenMP, should the process load one too, at their
default 200 ms (active alone makes those spin for good).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

SETTINGS = {"OMP_WAIT_POLICY": "active", "GOMP_SPINCOUNT": "300000", "KMP_BLOCKTIME": "200"}


def configure_libgomp() -> bool:
    """Put ``SETTINGS`` in the environment where they still act and are torch's libgomp's to
    read: torch not imported yet, its package ships libgomp, and neither is set already (a
    user's choice wins). Returns whether they were set."""
    if "torch" in sys.modules or any(name in os.environ for name in SETTINGS):
        return False
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return False
    libs = Path(next(iter(spec.submodule_search_locations))) / "lib"
    if not any(libs.glob("libgomp*.so*")):  # another OpenMP: its own settings, not these
        return False
    os.environ.update(SETTINGS)
    return True
