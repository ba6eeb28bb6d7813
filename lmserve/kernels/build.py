"""Compile lmserve's C++ CPU kernels on first use and load them with ctypes.

The kernels are plain C ABI functions over raw pointers, so they build in about a second with
the system ``g++`` (no torch headers) and are called through ctypes with the GIL released. The
shared object is cached under ``~/.cache/lmserve/kernels`` keyed by the source, the compiler
flags and the CPU's feature flags (it is built with ``-march=native``). Any failure (no compiler,
no AVX-512) leaves the kernels unavailable, and callers fall back to the torch path.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Optional

logger = logging.getLogger("lmserve")

_SOURCE_DIR = Path(__file__).parent
# The flags every kernel is built with (benchmarks/kernel_ab.py builds other revisions alike).
COMPILE_FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17"]
_REQUIRED_CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512dq")


def cache_dir() -> Path:
    root = os.environ.get("LMSERVE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "lmserve")
    return Path(root) / "kernels"


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def why_unavailable() -> Optional[str]:
    """Why the kernels cannot be built here, or None if they can."""
    missing = [f for f in _REQUIRED_CPU_FLAGS if f not in _cpu_flags()]
    if missing:
        return f"the CPU lacks {', '.join(missing)}"
    if shutil.which("g++") is None:
        return "no g++ compiler on PATH"
    return None


def load_kernel_library(name: str, signatures: dict[str, list]) -> Optional[ctypes.CDLL]:
    """Build (once) and load ``<name>.cpp`` from this package, its C functions typed with
    ``signatures`` (function name -> ctypes argument types; they return nothing); None if that
    is not possible."""
    lib = _load(name)
    if lib is not None:
        for function, argtypes in signatures.items():
            getattr(lib, function).argtypes = argtypes
            getattr(lib, function).restype = None
    return lib


@functools.cache
def _load(name: str) -> Optional[ctypes.CDLL]:
    reason = why_unavailable()
    if reason:
        logger.info("C++ kernel %s unavailable: %s; using the torch path", name, reason)
        return None
    source = (_SOURCE_DIR / f"{name}.cpp").read_bytes() + b"".join(
        h.read_bytes() for h in sorted(_SOURCE_DIR.glob("*.h")))
    key = hashlib.sha256(source + " ".join(COMPILE_FLAGS).encode()
                         + " ".join(sorted(_cpu_flags())).encode()).hexdigest()[:16]
    target = cache_dir() / f"{name}-{key}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        # Build beside the target and rename, so concurrent processes never load half a file.
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
        cmd = ["g++", *COMPILE_FLAGS, str(_SOURCE_DIR / f"{name}.cpp"), "-o", tmp]
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            os.unlink(tmp)
            logger.warning("building C++ kernel %s failed; using the torch path:\n%s", name,
                           result.stderr[-2000:])
            return None
        os.replace(tmp, target)
    return ctypes.CDLL(str(target))
