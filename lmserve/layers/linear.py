"""Linear layers in the weight formats ``opt`` selects: dense (float32/bfloat16/float16) or
blocks of 4-bit/8-bit codes multiplied by lmserve's C++ kernels (kernels/block_gemm.cpp with
bf16 dot products, kernels/int8_gemm.cpp with int8 activations and VNNI integer dot products).

Every kernel computes each output row the same way whatever the number of rows in the call, so
a token's result does not depend on its batch company: the block kernels, and for dense float32
weights kernels/dense_gemm.cpp (``dense_linear``; oneDNN where it cannot be built).
"""

from __future__ import annotations

import ctypes
import functools
import logging
from typing import NamedTuple, Optional, Sequence, Union

import torch
import torch.nn.functional as F

from lmserve.kernels.build import load_kernel_library, why_unavailable
from lmserve.layers.blocks import BLOCK, BlockWeight
from lmserve.layers.call_list import THREADS, Arg, address

logger = logging.getLogger("lmserve")

Weight = Union[torch.Tensor, BlockWeight]


def dense_weight(w: Weight) -> torch.Tensor:
    """``w``, a weight no reader keeps as blocks: a vector (a norm's, a bias: only GGUF matrices
    stay blocks), or any weight of a model only Hugging Face files hold (Mamba)."""
    assert isinstance(w, torch.Tensor), "a weight in blocks where a dense one is read"
    return w

# Weight formats that are plain float dtypes (the weights are loaded dequantized); also the map
# from a dtype's name in ``opt`` to the torch dtype.
FLOAT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
BLOCK_FORMATS = {"int4": 4, "int8": 8, "bfloat16": 16}
# Integer activations: int8 digits per value, quantized per row and block of 32 inside the
# matmul (int16 = two int8 digits). Between layers they travel as float32.
INT_ACT_DIGITS = {"int8": 1, "int16": 2}
ACT_TENSOR_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16,
                     **{name: torch.float32 for name in INT_ACT_DIGITS}}


class MlpActs(NamedTuple):
    """The activations entering the MLP's gate/up and down projections (``opt``'s
    gate_up_act_dtype and mlp_act_dtype as this machine runs them), of one tensor type."""

    gate_up: str
    down: str

    @property
    def dtype(self) -> torch.dtype:  # the MLP's tensors
        return ACT_TENSOR_DTYPES[self.gate_up]


_P, _I = ctypes.c_void_p, ctypes.c_int


@functools.cache
def _library() -> Optional[ctypes.CDLL]:
    return load_kernel_library("block_gemm", {"lm_block_gemm": [_P, _I, _P, _P, _P] + [_I] * 6})


@functools.cache
def _dense_library() -> Optional[ctypes.CDLL]:
    return load_kernel_library("dense_gemm", {"lm_dense_gemm": [_P, _P, _P] + [_I] * 4})


@functools.cache
def _int8_library() -> Optional[ctypes.CDLL]:
    return load_kernel_library("int8_gemm", {"lm_int8_gemm": [_P, _I, _P, _P, _P] + [_I] * 8})


def _why_not_built(library, name: str) -> Optional[str]:
    """Why the kernel ``library()`` loads cannot be used here, or None."""
    reason = why_unavailable(name)
    if reason is None and library() is None:
        return f"the C++ {name} kernel could not be built or loaded (see the log)"
    return reason


@functools.cache
def block_kernel_unavailable() -> Optional[str]:
    """Why block weights cannot be used on this machine, or None."""
    return _why_not_built(_library, "block_gemm")


@functools.cache
def dense_kernel_unavailable() -> Optional[str]:
    """Why float32 matmuls run in oneDNN rather than lmserve's kernel here, or None."""
    return _why_not_built(_dense_library, "dense_gemm")


@functools.cache
def int8_kernel_unavailable() -> Optional[str]:
    """Why int8/int16 activations cannot be used on this machine, or None (they need the int8
    kernel, and the block kernel for the layers it does not take)."""
    return block_kernel_unavailable() or _why_not_built(_int8_library, "int8_gemm")


def aligned(t: torch.Tensor) -> torch.Tensor:
    """``t``, or a copy of it starting on a 64-byte boundary. BLAS picks its path by where a
    weight starts: on Zen 4, torch's one-row ``F.linear`` gave other bits for a weight 56 bytes
    off a boundary (a view into a file's buffer) than for the same weight aligned (as a model
    library maps it), so the two ways of loading a model would not compute alike."""
    return t if t.data_ptr() % 64 == 0 else t.clone()


@functools.cache
def _onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def _on_dense_kernel(weight: torch.Tensor) -> bool:
    """Whether kernels/dense_gemm.cpp multiplies (float32) activations by this ``weight``."""
    return (weight.dtype == torch.float32 and weight.device.type == "cpu" and weight.is_contiguous()
            and dense_kernel_unavailable() is None)


def dense_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` with ``x`` cast to the weight's dtype; float32 on a CPU
    through lmserve's kernel (kernels/dense_gemm.cpp), else oneDNN.

    The kernel computes every row alike whatever the number of rows (oneDNN gives a row alone
    other last bits than the same row among others, and MKL's sgemm, torch's ``F.linear``,
    differs past the last multiple of 8 rows). On AMD Zen 4 it took 1.1-2.4x less time than
    oneDNN for 1-64 rows of a layer's matrices and 1-16 rows of the 49152-row head, and about
    as long for 64 of the head's (``benchmarks/dense_gemm.py``), before 1-4 rows moved to the
    8-row tile (8-18% less time again over a whole model's weights; docs/performance.md).
    """
    x = x.to(weight.dtype)
    if x.dim() == 2 and _on_dense_kernel(weight):
        if x.shape[1] != weight.shape[1]:  # the kernel would read past the end of x
            raise ValueError(f"input of shape {tuple(x.shape)} for a linear layer taking "
                             f"(M, {weight.shape[1]})")
        x = x.contiguous()
        out = torch.empty(x.shape[0], weight.shape[0], dtype=torch.float32)
        lib = _dense_library()
        assert lib is not None  # _on_dense_kernel: it loaded
        lib.lm_dense_gemm(x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.shape[0],
                                       weight.shape[0], weight.shape[1], torch.get_num_threads())
        return out if bias is None else out + bias
    if weight.dtype != torch.float32 or weight.device.type != "cpu" or x.dim() != 2 or not _onednn_available():
        return F.linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


class DenseLinear:
    """``y = x @ W^T + b`` with W held dense in ``dtype``."""

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor], dtype: torch.dtype):
        self.weight = aligned(weight.to(dtype))
        self.bias = None if bias is None else bias.to(dtype)

    @property
    def n(self) -> int:
        return self.weight.shape[0]

    @property
    def k(self) -> int:
        return self.weight.shape[1]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return dense_linear(x, self.weight, self.bias)

    def packable(self, dtype: torch.dtype) -> bool:
        """Whether ``packed_call`` can run this layer on activations of ``dtype``: float32
        weights and activations on lmserve's kernel, no bias."""
        return dtype == torch.float32 and self.bias is None and _on_dense_kernel(self.weight)

    def packed_call(self, x: Arg, dtype: torch.dtype, out: Arg, rows: Arg) -> list[Arg]:
        """This matmul as a call for a ``CallList`` (see ``BlockLinear.packed_call``); only where
        ``packable(dtype)``."""
        if not self.packable(dtype):
            raise ValueError(f"a {self.weight.dtype} dense layer{' with a bias' if self.bias is not None else ''} "
                             f"on {dtype} activations has no C++ call")
        lib = _dense_library()
        assert lib is not None  # packable: it loaded
        return [address(lib.lm_dense_gemm_packed), x, self.weight.data_ptr(), out, rows, self.n, self.k,
                THREADS]


class BlockLinear:
    """``y = x @ W^T + b`` with W in 32-wide blocks of 4-, 8- or 16-bit (bf16) codes.

    bfloat16 ``x`` gives a bfloat16 result, float32 ``x`` a float32 one. With ``act`` int8 or
    int16 (and 4- or 8-bit weights) ``x`` is quantized per row and block of 32 to one int8 digit
    (as llama.cpp does) or two, and multiplied with integer dot products; otherwise bfloat16
    ``x`` is multiplied as is and float32 ``x`` as two bfloat16 halves (about 16 significant
    bits, twice the work).
    """

    def __init__(self, weight: BlockWeight, bias: Optional[torch.Tensor], act: str = "float32"):
        self.digits = INT_ACT_DIGITS.get(act, 0) if weight.bits in (4, 8) else 0
        if self.lib is None:
            raise RuntimeError("the C++ block kernel is not available on this machine")
        self.bits = weight.bits
        self.n, self.k = weight.shape
        self.codes, self.consts = pack_rows_int8(weight) if self.digits else pack_rows(weight)
        self.bias = None if bias is None else bias.float()

    @property
    def lib(self) -> Optional[ctypes.CDLL]:
        """The kernel library this layer calls (a property: a model library stores data only)."""
        return _int8_library() if self.digits else _library()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2 or x.shape[1] != self.k:  # the kernel would read past the end of x
            raise ValueError(f"input of shape {tuple(x.shape)} for a linear layer taking (M, {self.k})")
        if x.dtype != torch.float32:
            x = x.to(torch.bfloat16)
        x = x.contiguous()
        m = x.shape[0]  # (M, K)
        out = torch.empty(m, self.n, dtype=x.dtype)
        lib = self.lib
        assert lib is not None  # __init__ refused a layer without it
        kernel = lib.lm_int8_gemm if self.digits else lib.lm_block_gemm
        kernel(*self._args(x.data_ptr(), x.dtype, out.data_ptr(), m, torch.get_num_threads()))
        return out if self.bias is None else out + self.bias.to(out.dtype)

    def packable(self, dtype: torch.dtype) -> bool:
        """Whether ``packed_call`` can run this layer on activations of ``dtype`` (float32 or
        bfloat16; it adds no bias)."""
        return self.bias is None and dtype in (torch.float32, torch.bfloat16)

    def packed_call(self, x: Arg, dtype: torch.dtype, out: Arg, rows: Arg) -> list[Arg]:
        """This matmul as a call for a ``CallList``: ``x`` (rows, K) of ``dtype`` (float32 or
        bfloat16) into ``out`` (rows, N) of the same dtype, as ``__call__`` computes it (no bias:
        the caller checks)."""
        lib = self.lib
        assert lib is not None  # __init__ refused a layer without it
        kernel = lib.lm_int8_gemm_packed if self.digits else lib.lm_block_gemm_packed
        return [address(kernel), *self._args(x, dtype, out, rows, THREADS)]

    def _args(self, x: Arg, dtype: torch.dtype, out: Arg, rows: Arg, threads: Arg) -> list[Arg]:
        """The kernel's arguments in order, for ``x`` of ``dtype`` into ``out`` of the same."""
        f32 = int(dtype == torch.float32)
        args = [x, f32, self.codes.data_ptr(), self.consts.data_ptr(), out, 1 - f32, rows, self.n,
                self.k, self.bits]
        if self.digits:
            args += [self.digits, int(self.consts.dtype == torch.float16)]
        return args + [threads]


Linear = Union[DenseLinear, BlockLinear]

PACK = 4  # weight rows the kernel interleaves in memory (kPack in block_gemm.cpp)


def _grouped_consts(scale: torch.Tensor, zero: torch.Tensor, rows: int) -> torch.Tensor:
    """Block constants for rows interleaved in groups of ``rows`` (N padded to a multiple):
    ``(N/rows, G, 2, rows)``, each group's scales, then its zeros, block by block."""
    n, g = scale.shape
    pad = -n % rows
    consts = F.pad(torch.stack([scale, zero]), (0, 0, 0, pad)).view(2, (n + pad) // rows, rows, g)
    return consts.permute(1, 3, 0, 2).contiguous()


def _grouped_codes(codes: torch.Tensor, rows: int, *block: int) -> torch.Tensor:
    """Codes ``(N, G, bytes)`` viewed as ``(N/rows, rows, G, *block)`` (N padded with zero rows
    to a multiple of ``rows``, a block's bytes shaped ``block``); callers order the axes."""
    n, g = codes.shape[:2]
    pad = -n % rows
    return F.pad(codes, (0, 0, 0, 0, 0, pad)).view((n + pad) // rows, rows, g, *block)


def pack_rows(w: BlockWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """The bf16 kernel's layout: rows in groups of 4 interleaved block by block (N padded to a
    multiple of 4), so a strip of 4 rows is one contiguous stream. Returns codes
    ``(N/4, G, 4, bytes)`` and consts ``(N/4, G, 2, 4)`` (the 4 scales, then the 4 zeros)."""
    zero = w.zero if w.zero is not None else torch.zeros_like(w.scale)
    codes = _grouped_codes(w.codes, PACK, -1).transpose(1, 2).contiguous()
    return codes, _grouped_consts(w.scale, zero, PACK)


INT8_GROUP = 16  # weight rows the int8 kernel computes per vector (int8_gemm.cpp)


def pack_rows_int8(w: BlockWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """The int8 kernel's layout, rows in groups of 16 (N padded to a multiple of 16): codes
    ``(N/16, G, V, 16, 4)`` unsigned bytes (V = 4 vectors of nibble pairs for 4-bit, whose
    low nibble holds block element 4v+i and high one 16+4v+i; V = 8 for 8-bit, element 4v+i),
    and consts ``(N/16, G, 2, 16)`` (16 scales, then 16 zeros), float16 when that holds them
    exactly (GGUF's are float16: less to stream in decode), else float32. 8-bit codes are signed
    in the file; they are stored plus 128 with the zero lowered by 128 scales (exact when the
    zero is 0, as for Q8_0)."""
    zero = w.zero if w.zero is not None else torch.zeros_like(w.scale)
    codes = w.codes
    if w.bits == 8:
        codes = (codes.view(torch.int8).to(torch.int16) + 128).to(torch.uint8)
        zero = zero - 128 * w.scale
    codes = _grouped_codes(codes, INT8_GROUP, -1, 4).permute(0, 2, 3, 1, 4).contiguous()
    consts = _grouped_consts(w.scale, zero, INT8_GROUP)
    if torch.equal(consts.half().float(), consts):
        consts = consts.half()
    return codes, consts


def _dense(parts: Sequence[Weight]) -> torch.Tensor:
    """The parts dequantized and stacked (a single dense part is returned as is, not copied)."""
    dense = [p.dequantize() if isinstance(p, BlockWeight) else p for p in parts]
    return dense[0] if len(dense) == 1 else torch.cat(dense)


def make_linear(parts: Sequence[Weight], bias: Optional[torch.Tensor], fmt: str,
                act: str = "float32") -> Linear:
    """One linear layer from the weights ``parts`` stacked along the output dimension (fused
    q/k/v or gate/up), its input activations ``act`` (float32, bfloat16, or int8/int16:
    quantized in the int8 kernel, for 4-/8-bit blocks), held as ``fmt`` says:

    - ``float32``/``float16``: dense torch tensors, dequantized from blocks if need be;
    - ``bfloat16``: bf16 weights in the block kernel (its rows are batch-invariant; oneDNN's
      bf16 matmul is not for every shape);
    - ``native``: the file's 4-bit/8-bit blocks as they are; other weights bfloat16;
    - ``int4``/``int8``: blocks, re-rounding weights the file does not have in that many bits.

    Without the kernel (``resolve_weight_format`` maps block formats to bfloat16 then), or when
    the input size is not a multiple of 32, the weights are dense torch tensors.
    """
    if fmt in ("float32", "float16") or parts[0].shape[1] % BLOCK or block_kernel_unavailable():
        return DenseLinear(_dense(parts), bias, FLOAT_DTYPES.get(fmt, torch.bfloat16))
    if fmt == "native":
        blocks = [p for p in parts if isinstance(p, BlockWeight)]
        if len(blocks) == len(parts) and len({p.bits for p in blocks}) == 1:
            return BlockLinear(BlockWeight.cat(blocks), bias, act)
        fmt = "bfloat16"
    bits = BLOCK_FORMATS[fmt]
    blocks = [p if isinstance(p, BlockWeight) and p.bits == bits else BlockWeight.quantize(_dense([p]), bits)
              for p in parts]
    return BlockLinear(BlockWeight.cat(blocks), bias, act)


def resolve_weight_format(fmt: str) -> str:
    """``fmt``, or bfloat16 (logged) when it needs the block kernel and that is unavailable here."""
    if fmt in ("float32", "bfloat16", "float16"):
        return fmt
    reason = block_kernel_unavailable()
    if reason is None:
        return fmt
    logger.warning("weight format %s needs the C++ block kernel, which is unavailable (%s); "
                   "using bfloat16 weights", fmt, reason)
    return "bfloat16"


def resolve_act_dtype(act: str) -> str:
    """``act``, or the float dtype with at least as many bits (logged) when it is int8/int16 and
    the int8 kernel is unavailable here."""
    reason = int8_kernel_unavailable() if act in INT_ACT_DIGITS else None
    if reason is None:
        return act
    fallback = "bfloat16" if act == "int8" else "float32"
    logger.warning("%s activations need the C++ int8 kernel, which is unavailable (%s); using %s",
                   act, reason, fallback)
    return fallback


def resolve_mlp_acts(gate_up: str, down: str) -> MlpActs:
    """The MLP's activations (``OptFlags.mlp_act_dtypes``) as this machine runs them; where
    the int8 kernel is missing, int8 and int16 fall back to different dtypes, and gate/up then
    takes down's."""
    resolved = resolve_act_dtype(down)
    up = resolved if gate_up == down else resolve_act_dtype(gate_up)  # (each fallback logged once)
    return MlpActs(up if ACT_TENSOR_DTYPES[up] == ACT_TENSOR_DTYPES[resolved] else resolved, resolved)
