"""Compile lmserve's C++ CPU kernels on first use and load them with ctypes.

The kernels are plain C ABI functions over raw pointers, so they build in about a second with
the system ``g++`` (no torch headers) and are called through ctypes with the GIL released. The
shared object is cached under ``~/.cache/lmserve/kernels`` keyed by the source, the compiler
flags and the CPU's feature flags.

The one dispatch point: ``selected_isa()`` picks the instruction set every kernel is built for,
the best this CPU has (AVX-512, AVX2, Arm64 NEON; AMX on request), or the one ``LMSERVE_ISA``
names. Each kernel source says which it supports on its first line (``// lmserve-isa: avx512
avx2 neon``); a kernel without the selected one builds for the ISA that one extends (AMX extends
AVX-512) if it has that, else a missing version, compiler or build leaves the kernel unavailable
and its callers fall back to the torch path (``describe_kernels`` says which op runs where).

A process serving a model library (``lmserve.library``) loads the library's own builds instead
(``use_prebuilt_kernels``) and never runs the compiler.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

logger = logging.getLogger("lmserve")

_SOURCE_DIR = Path(__file__).parent
# The flags every kernel is built with, before its ISA's (benchmarks/kernel_ab.py builds other
# revisions alike).
COMMON_FLAGS = ["-O3", "-fopenmp", "-shared", "-fPIC", "-std=c++17"]
ISA_ENV = "LMSERVE_ISA"
# A model library's kernels directory: kernels not loaded yet come from there, never compiled.
_prebuilt: Optional[Path] = None


@dataclass(frozen=True)
class Isa:
    """An instruction set the kernels are built for."""

    name: str
    machine: str  # platform.machine() of the CPUs that run it
    needs: tuple[str, ...]  # CPU feature flags it requires (/proc/cpuinfo names)
    flags: tuple[str, ...]  # g++ flags that target it
    extends: Optional[str] = None  # the ISA a kernel without a version for this one builds for
    default: bool = True  # chosen without LMSERVE_ISA where the CPU runs it

    def compile_flags(self, cpu: set[str]) -> list[str]:
        """The flags for this CPU: the ISA's, plus the optional extensions it has."""
        extra = [flag for feature, flag in _OPTIONAL.get(self.name, ()) if feature in cpu]
        return [*self.flags, *extra]


# Best first. AMX is AVX-512 plus the tile instructions of Sapphire Rapids on, in the kernels
# that have a tile path (LM_AMX: the int8 matmul's TDPBSUD, the same bits; the bf16 matmul's
# TDPBF16PS, other last bits); only on request so far, as its int8 matmul is slower than
# AVX-512's on 4-bit weights and its bf16 one is not measured yet (docs/performance.md).
# AVX-512 builds for the CPU itself (its VNNI, BF16 and tuning) without tiles; AVX2 for the
# x86-64 v3 level (Haswell, Zen 1 on), with AVX-VNNI where present; NEON for ARMv8.2 with dot
# products.
_AVX512_NEEDS = ("avx512f", "avx512bw", "avx512vl", "avx512dq")
ISAS = [
    Isa("amx", "x86_64", (*_AVX512_NEEDS, "amx_tile", "amx_int8", "amx_bf16"),
        ("-march=native", "-mamx-tile", "-mamx-int8", "-mamx-bf16", "-DLM_AMX=1"), extends="avx512",
        default=False),
    Isa("avx512", "x86_64", _AVX512_NEEDS, ("-march=native",)),
    Isa("avx2", "x86_64", ("avx2", "fma", "f16c", "bmi1", "bmi2", "abm", "movbe"),
        ("-march=x86-64-v3", "-mtune=native")),
    Isa("neon", "aarch64", ("asimd", "asimddp"), ("-march=armv8.2-a+dotprod",)),
]
# Extensions a build uses when the CPU has them: (cpu flag, g++ flag).
_OPTIONAL = {"avx2": (("avx_vnni", "-mavxvnni"),), "neon": (("i8mm", "-march=armv8.2-a+dotprod+i8mm"),)}


def supported_isas() -> list[Isa]:
    """The instruction sets this CPU runs, best first."""
    cpu, machine = cpu_flags(), platform.machine()
    return [isa for isa in ISAS if isa.machine == machine and all(f in cpu for f in isa.needs)]


@functools.cache
def tile_state_granted() -> bool:
    """Whether Linux gives this process AMX's tile state when asked (arch_prctl
    ARCH_REQ_XCOMP_PERM for XTILEDATA, as the kernels ask again): a kernel refused would
    fault at its first tile instruction. Asked only of a process that chose AMX: the grant
    cannot be undone and makes Linux refuse small alternate signal stacks."""
    sys_arch_prctl, arch_req_xcomp_perm, xfeature_xtiledata = 158, 0x1023, 18
    try:
        args = map(ctypes.c_long, (sys_arch_prctl, arch_req_xcomp_perm, xfeature_xtiledata))
        return ctypes.CDLL(None).syscall(*args) == 0
    except (OSError, AttributeError):
        return False


@functools.cache
def selected_isa() -> Optional[Isa]:
    """The instruction set every kernel is built for: ``LMSERVE_ISA`` if set (refused, naming
    the choices, when this CPU cannot run it), else the best this CPU has of those chosen by
    default; None if none."""
    supported = supported_isas()
    wanted = os.environ.get(ISA_ENV)
    if wanted:
        match = [isa for isa in supported if isa.name == wanted]
        if not match:
            known = [isa.name for isa in ISAS]
            raise ValueError(f"{ISA_ENV}={wanted!r}: " + (
                f"this CPU runs {', '.join(i.name for i in supported) or 'none of them'}"
                if wanted in known else f"unknown; the kernels are built for {', '.join(known)}"))
        if "amx_tile" in match[0].needs and not tile_state_granted():
            raise ValueError(f"{ISA_ENV}={wanted!r}: Linux refused this process AMX's tile state "
                             "(arch_prctl ARCH_REQ_XCOMP_PERM)")
        return match[0]
    return next((isa for isa in supported if isa.default), None)


@functools.cache
def kernel_isas(name: str) -> list[str]:
    """The instruction sets kernel ``name``'s source supports (its ``lmserve-isa:`` line)."""
    with open(_SOURCE_DIR / f"{name}.cpp") as f:
        for line in f:
            if line.startswith("// lmserve-isa:"):
                return line.split(":", 1)[1].split()
    return []


def kernel_isa(name: Optional[str] = None) -> Optional[Isa]:
    """The instruction set kernel ``name`` is built for: the selected one, or the one it extends
    when the kernel has no version of its own for it (None for any name: the selected one)."""
    isa = selected_isa()
    if isa is not None and isa.extends and name is not None and isa.name not in kernel_isas(name):
        return next(i for i in ISAS if i.name == isa.extends)
    return isa


def compile_flags(name: Optional[str] = None) -> list[str]:
    """Every flag kernel ``name`` (any kernel if None) is built with."""
    isa = kernel_isa(name)
    return COMMON_FLAGS + (isa.compile_flags(cpu_flags()) if isa else [])


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
    return hashlib.sha256(source + " ".join(compile_flags(name)).encode()).hexdigest()


def _cpuinfo(*keys: str) -> Optional[str]:
    """The value of the first ``/proc/cpuinfo`` line starting with one of ``keys``, or None."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(keys):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def cpu_flags() -> set[str]:
    """This CPU's feature flags as Linux names them (``/proc/cpuinfo``: ``flags`` on x86,
    ``Features`` on Arm)."""
    return set((_cpuinfo("flags", "Features") or "").split())


def cpu_name() -> str:
    """This CPU's model and core count, for benchmark reports ("AMD EPYC, 2 cores")."""
    return f"{_cpuinfo('model name') or platform.processor() or 'unknown CPU'}, {os.cpu_count()} cores"


# g++'s names of instruction sets that Linux spells otherwise (both without "-", "_" and ".").
_GCC_TO_LINUX = {"bmi": "bmi1", "sha": "shani", "pclmul": "pclmulqdq", "rdrnd": "rdrand",
                 "lzcnt": "abm", "prfchw": "3dnowprefetch", "sahf": "lahflm", "sse3": "pni"}


def native_isa() -> list[str]:
    """The instruction sets of this CPU that the kernels' flags let g++ use, as Linux names
    them: what a kernel built here may execute, so what a CPU running it must have."""
    isa = selected_isa()
    if isa is not None and isa.machine == "aarch64":  # g++ lists no -m options there
        return sorted(set(isa.needs) | {f for f, _ in _OPTIONAL["neon"] if f in cpu_flags()})
    target = [f for f in compile_flags() if f.startswith(("-march", "-mtune", "-mavx", "-mamx"))]
    listing = subprocess.run(["g++", *target, "-Q", "--help=target"], capture_output=True,
                             text=True, check=True).stdout
    enabled = {re.sub(r"[-_.]", "", m) for m in re.findall(r"^\s+-m([\w.-]+)\s+\[enabled\]", listing, re.M)}
    enabled = {_GCC_TO_LINUX.get(name, name) for name in enabled}
    return sorted(f for f in cpu_flags() if re.sub(r"[-_.]", "", f) in enabled)


def why_unavailable(name: str) -> Optional[str]:
    """Why kernel ``name`` cannot be built here for the selected instruction set, or None if it
    can (or comes from a model library, checked against this CPU when it was opened)."""
    if _prebuilt is not None:
        return None
    isa = selected_isa()
    if isa is None:
        return (f"the CPU has none of the instruction sets the kernels are built for "
                f"({', '.join(i.name for i in ISAS)})")
    target = kernel_isa(name)
    assert target is not None  # the selected ISA, or the one it extends
    if target.name not in kernel_isas(name):
        return f"it has no {target.name} version yet"
    if shutil.which("g++") is None:
        return "no g++ compiler on PATH"
    return None


# The ops each kernel computes, for ``describe_kernels``.
KERNEL_OPS = {"int8_gemm": "int8-activation matmuls", "block_gemm": "block and bf16 matmuls",
              "dense_gemm": "float32 matmuls", "paged_attention": "attention", "fused_ops": "norm and SiLU",
              "ssm_decode": "recurrent decode", "shm_all_reduce": "tensor-parallel all-reduce"}
# What the kernels with a tile path (``lmserve-isa: amx``) multiply on AMX tiles.
AMX_TILE_OPS = "int8-activation matmuls of 16 rows or more, block and bf16 matmuls"


def describe_kernels() -> str:
    """Where each op runs on this machine, for the start-up log and ``lmserve plan``: the
    selected instruction set, the C++ ops and the torch ones with why (what the machine can
    run: knobs that choose torch, ``attention=torch_native`` or float16 weights, run those ops
    in torch whatever this says)."""
    if _prebuilt is not None:
        return f"C++ from the model library ({_prebuilt})"
    isa = selected_isa()
    runs = ", ".join(i.name for i in supported_isas()) or "none of " + ", ".join(i.name for i in ISAS)
    head = f"{isa.name if isa else 'none'} (this CPU runs {runs}; {ISA_ENV} chooses)"
    if isa is not None and "amx_tile" in isa.needs:
        head += f"; AMX tiles: {AMX_TILE_OPS}"
    reasons = {op: why_unavailable(name) for name, op in KERNEL_OPS.items()}
    native = [op for op, reason in reasons.items() if reason is None]
    torch_ops = [f"{op} ({reason})" for op, reason in reasons.items() if reason is not None]
    return "; ".join([head] + ([f"C++: {', '.join(native)}"] if native else [])
                     + ([f"torch: {', '.join(torch_ops)}"] if torch_ops else []))


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
    """The shared object of kernel ``name`` for this CPU and the selected instruction set,
    compiled unless cached; None (logged) where it cannot be built."""
    reason = why_unavailable(name)
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
        cmd = ["g++", *compile_flags(name), str(_SOURCE_DIR / f"{name}.cpp"), "-o", tmp]
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            os.unlink(tmp)
            logger.warning("building C++ kernel %s failed; using the torch path:\n%s", name,
                           result.stderr[-2000:])
            return None
        os.replace(tmp, target)
    return target
