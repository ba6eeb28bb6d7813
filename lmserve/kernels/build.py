"""Compile lmserve's C++ CPU kernels on first use and load them with ctypes.

The kernels are plain C ABI functions over raw pointers, so they build in about a second with
the system ``g++`` (no torch headers) and are called through ctypes with the GIL released. The
shared object is cached under ``~/.cache/lmserve/kernels`` keyed by the source, the compiler
flags and the CPU's feature flags (it is built with ``-march=native``). Any failure (no compiler,
no AVX-512) leaves the kernels unavailable, and callers fall back to the torch path.

A process serving a model library (``lmserve.library``) loads the library's own builds instead
(``use_prebuilt_kernels``) and never runs the compiler.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import re
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
# A model library's kernels directory: kernels not loaded yet come from there, never compiled.
_prebuilt: Optional[Path] = None


def cache_dir() -> Path:
    root = os.environ.get("LMSERVE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "lmserve")
    return Path(root) / "kernels"


def kernel_names() -> list[str]:
    """Every kernel of this package (its ``.cpp`` files' names)."""
    return sorted(p.stem for p in _SOURCE_DIR.glob("*.cpp"))


def source_digest(name: str) -> str:
    """A digest of what kernel ``name`` is built from: its source, the headers, the flags."""
    source = (_SOURCE_DIR / f"{name}.cpp").read_bytes() + b"".join(
        h.read_bytes() for h in sorted(_SOURCE_DIR.glob("*.h")))
    return hashlib.sha256(source + " ".join(COMPILE_FLAGS).encode()).hexdigest()


def cpu_flags() -> set[str]:
    """This CPU's feature flags as Linux names them (``/proc/cpuinfo``)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


# g++'s names of instruction sets that Linux spells otherwise (both without "-", "_" and ".").
_GCC_TO_LINUX = {"bmi": "bmi1", "sha": "shani", "pclmul": "pclmulqdq", "rdrnd": "rdrand",
                 "lzcnt": "abm", "prfchw": "3dnowprefetch", "sahf": "lahflm", "sse3": "pni"}


def native_isa() -> list[str]:
    """The instruction sets of this CPU that ``-march=native`` lets g++ use, as Linux names
    them: what a kernel built here may execute, so what a CPU running it must have."""
    listing = subprocess.run(["g++", "-march=native", "-Q", "--help=target"], capture_output=True,
                             text=True, check=True).stdout
    enabled = {re.sub(r"[-_.]", "", m) for m in re.findall(r"^\s+-m([\w.-]+)\s+\[enabled\]", listing, re.M)}
    enabled = {_GCC_TO_LINUX.get(name, name) for name in enabled}
    return sorted(f for f in cpu_flags() if re.sub(r"[-_.]", "", f) in enabled)


def why_unavailable() -> Optional[str]:
    """Why the kernels cannot be built here, or None if they can (or come from a model
    library, which was checked against this CPU when it was opened)."""
    if _prebuilt is not None:
        return None
    missing = [f for f in _REQUIRED_CPU_FLAGS if f not in cpu_flags()]
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


def use_prebuilt_kernels(directory: Optional[Path]) -> None:
    """Load the kernels this process has not loaded yet from ``directory`` (``<name>.so``, a
    model library's builds), never compiling; None: build them here again."""
    global _prebuilt
    _prebuilt = directory


@functools.cache
def _load(name: str) -> Optional[ctypes.CDLL]:
    if _prebuilt is not None:
        path = _prebuilt / f"{name}.so"
        if not path.is_file():
            logger.info("C++ kernel %s is not in the model library (%s); using the torch path",
                        name, _prebuilt)
            return None
        return ctypes.CDLL(str(path))
    target = build_kernel(name)
    return None if target is None else ctypes.CDLL(str(target))


def build_kernel(name: str) -> Optional[Path]:
    """The shared object of kernel ``name`` for this CPU, compiled unless cached; None (logged)
    where it cannot be built."""
    reason = why_unavailable()
    if reason:
        logger.info("C++ kernel %s unavailable: %s; using the torch path", name, reason)
        return None
    key = hashlib.sha256(source_digest(name).encode()
                         + " ".join(sorted(cpu_flags())).encode()).hexdigest()[:16]
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
    return target
