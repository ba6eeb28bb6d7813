"""libgomp's spinning, set as torch's libgomp loads (``import lmserve`` does it, see ``__init__``).

The C++ kernels split each call's work with OpenMP, in libgomp (torch's own where its wheel
ships ``libgomp.so.1``: one runtime for both), and a decode step makes a few hundred such calls:
their threads must still be spinning when the next call starts. libgomp spins for
``GOMP_SPINCOUNT`` iterations (300,000 by default) while it manages no more threads than the
CPUs in its affinity mask, and for only 100 beyond that, then sleeps in the kernel. Every OS
thread that runs multithreaded OpenMP work keeps a team of its own until it exits, so one
multithreaded torch operation in another thread (a Python API user's own tensors, a test's
reference model) can tip the count: an empty parallel region then took 11-30 microseconds
instead of 0.6, and one-stream decoding ran at 0.34-0.36x (benchmarks/thread_sync.py, 2-core Zen
4). ``OMP_WAIT_POLICY=active`` raises those 100 spins to 1,000, enough between the calls of a
step (0.6 microseconds a region, 0.95-1.00x); ``GOMP_SPINCOUNT`` keeps 300,000 spins otherwise
(active alone would spin for minutes whenever the engine idles).

libgomp reads its settings once, when it loads. So they are put in the environment only while
this module loads torch's libgomp, before torch does, and taken out again: this process keeps
them, child processes do not inherit them (an lmserve child sets them for itself). That needs
torch's libgomp to be the ``libgomp.so.1`` the kernels load too (torch's x86-64 wheels); a
renamed copy (``libgomp-<hash>.so``, as auditwheel leaves it) is a second runtime the kernels do
not share, and is left alone.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import sys
from pathlib import Path
from typing import Optional

SETTINGS = {"OMP_WAIT_POLICY": "active", "GOMP_SPINCOUNT": "300000"}
KERNELS_LIBGOMP = "libgomp.so.1"  # what g++ -fopenmp links the kernels against

# None once the settings took; else why they did not (engine/thread_check.py's warning says it).
status: Optional[str] = "not configured yet"


def torch_libgomp() -> Optional[Path]:
    """The libgomp torch's package ships, without importing torch: ``torch/lib`` (x86-64
    wheels) or ``torch.libs`` beside it (auditwheel's, as aarch64 wheels have it)."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return None
    package = Path(next(iter(spec.submodule_search_locations)))
    for libs in (package / "lib", package.parent / "torch.libs"):
        found = sorted(libs.glob("libgomp*.so*"))
        if found:
            return found[0]
    return None


def libgomp_copies() -> set[str]:
    """The paths of the libgomp files mapped into this process."""
    try:
        maps = Path("/proc/self/maps").read_bytes().decode(errors="replace")
    except OSError:
        return set()
    return {line.split()[-1] for line in maps.splitlines() if "libgomp" in line.rsplit("/", 1)[-1]}


def configure_libgomp() -> Optional[str]:
    """Load torch's libgomp with ``SETTINGS`` in the environment, then take them out again;
    None if that was done, else why not (kept in ``status``). Never raises: an import of
    lmserve must not fail for an optimisation."""
    global status
    try:
        status = _configure()
    except Exception as err:  # noqa: BLE001
        status = f"setting it up failed: {err!r}"
    return status


def _configure() -> Optional[str]:
    if any(name.startswith(tuple(SETTINGS)) for name in os.environ):  # (also OMP_WAIT_POLICY_ALL)
        return "OMP_WAIT_POLICY or GOMP_SPINCOUNT is set in the environment, and left as it is"
    if "torch" in sys.modules or libgomp_copies():
        return "torch (or another user of libgomp) was loaded before lmserve"
    lib = torch_libgomp()
    if lib is None:
        return "torch's package has no libgomp of its own (its OpenMP keeps its settings)"
    if lib.name != KERNELS_LIBGOMP:
        return f"torch's libgomp is {lib.name}, a runtime of its own beside the kernels' {KERNELS_LIBGOMP}"
    os.environ.update(SETTINGS)  # (none of them is set: checked above)
    try:
        ctypes.CDLL(str(lib))  # torch and the kernels find it loaded (the same soname) and use it
    except OSError as err:
        return f"loading {lib} failed: {err}"
    finally:
        for name in SETTINGS:
            del os.environ[name]
    return None
