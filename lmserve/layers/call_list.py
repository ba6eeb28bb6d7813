"""A fixed list of C++ kernel calls run by one call from Python (kernels/call_list.cpp).

Calling a kernel from Python costs a few microseconds whatever it computes (ctypes argument
conversion, output allocation, checks). A decode step of a small model makes hundreds of such
calls, each computing little, so that fixed cost is a large share of a token. A ``CallList`` is
built once from the calls' descriptions (a packed entry point's address, then its arguments as
64-bit words); the arguments that change from step to step are ``Slot`` placeholders, filled
with one vectorized op per run.
"""

from __future__ import annotations

import ctypes
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING, Union

import torch

from lmserve.kernels.build import load_kernel_library

if TYPE_CHECKING:
    from _ctypes import CFuncPtr  # ctypes._CFuncPtr, which typeshed does not re-export


@dataclass(frozen=True)
class Slot:
    """An argument given at each run: a buffer's address, a token count, the thread count."""

    name: str


THREADS = Slot("threads")  # torch's thread count at the time of the run

Arg = Union[int, Slot]


def address(function: CFuncPtr) -> int:
    """The address of a kernel's C function, the first word of a call."""
    value = ctypes.cast(function, ctypes.c_void_p).value
    assert value is not None  # a loaded function is never at NULL
    return value


def float_word(x: float) -> int:
    """A float32 argument as the 64-bit word the packed entry points read (bits in the low half)."""
    return struct.unpack("<I", struct.pack("<f", x))[0]


def _library():
    P, I = ctypes.c_void_p, ctypes.c_int  # noqa: E741
    lib = load_kernel_library("call_list", {"lm_run_calls": [P, I, I],
                                            "lm_run_call_passes": [P, I, I, I, P, P, I, P]})
    if lib is not None:
        lib.lm_run_call_passes.restype = I
    return lib


def call_lists_available() -> bool:
    """Whether the call-list runner builds on this machine."""
    return _library() is not None


class CallList:
    """Calls ``[function address, arg, ...]`` run in order by ``run``, which fills the slots."""

    def __init__(self, calls: list[list[Arg]]) -> None:
        self.lib = _library()
        if self.lib is None:
            raise RuntimeError("the C++ call-list runner is not available on this machine")
        self.names = sorted({a.name for call in calls for a in call if isinstance(a, Slot)})
        index = {name: i + 1 for i, name in enumerate(self.names)}  # 0: a fixed argument
        stride = max(len(call) for call in calls)
        self.fixed = torch.zeros(len(calls), stride, dtype=torch.int64)
        self.slots = torch.zeros(len(calls), stride, dtype=torch.int64)
        for i, call in enumerate(calls):
            for j, arg in enumerate(call):
                if isinstance(arg, Slot):
                    self.slots[i, j] = index[arg.name]
                else:
                    self.fixed[i, j] = arg
        self._words: dict[str, torch.Tensor] = {}  # (``_words_of``'s, once a name)

    def run(self, values: dict[str, int]) -> None:
        """Run every call with each slot set to ``values[name]``. The caller keeps the buffers
        whose addresses it passes alive until this returns."""
        calls = self.filled(values)
        self.lib.lm_run_calls(calls.data_ptr(), calls.shape[0], calls.shape[1])

    def run_passes(self, values: dict[str, int], passes: int, strides: dict[str, int],
                   stop: torch.Tensor) -> int:
        """``run`` up to ``passes`` times, each slot named in ``strides`` moved on by its stride
        (bytes) before every pass but the first; it stops after a pass that sets ``stop`` (one
        int32) nonzero. Returns the passes run."""
        calls = self.filled(values)
        moving = {name: self._words_of(name) for name in strides if name in self.names}
        words = torch.cat(list(moving.values()))
        steps = torch.cat([torch.full_like(w, strides[name]) for name, w in moving.items()])
        return self.lib.lm_run_call_passes(calls.data_ptr(), calls.shape[0], calls.shape[1], passes,
                                           words.data_ptr(), steps.data_ptr(), len(words), stop.data_ptr())

    def _words_of(self, name: str) -> torch.Tensor:
        """The flat indices into ``filled``'s calls of the words that take slot ``name``."""
        if name not in self._words:
            self._words[name] = (self.slots.flatten() == self.names.index(name) + 1).nonzero().flatten()
        return self._words[name]

    def filled(self, values: dict[str, int]) -> torch.Tensor:
        """The calls ``(n, stride)`` with each slot set to ``values[name]``."""
        given = torch.tensor([0] + [values[name] for name in self.names], dtype=torch.int64)
        return torch.where(self.slots > 0, given[self.slots], self.fixed)
