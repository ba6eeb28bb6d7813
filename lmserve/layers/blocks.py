"""Weights in blocks of 32 along the input dimension, as GGUF's Q4_0, Q4_1 and Q8_0 store them
(and Q5_0, as 8-bit codes, and Q4_K, whose sub-blocks of 32 are Q4_1 blocks once their
constants are multiplied out).

A ``BlockWeight`` keeps the file's own codes (4-bit or 8-bit) with one float32 scale and zero per
block, ``w = code * scale + zero``. GGUF's fp16 block constants convert to float32 exactly, so
the weights the kernel multiplies with are the file's weights, not a re-rounding of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
import torch

BLOCK = 32


@dataclass
class BlockWeight:
    # (N, K/32, 16) uint8 (4-bit: low nibble = weight i, high = i+16), (N, K/32, 32) int8 as
    # uint8, or (N, K/32, 64) bytes of bf16 weights (16-bit: the weights themselves, scale 1)
    codes: torch.Tensor
    scale: torch.Tensor  # (N, K/32) float32
    zero: Optional[torch.Tensor]  # (N, K/32) float32, or None for no offset
    bits: int  # 4, 8 or 16

    @property
    def shape(self) -> tuple[int, int]:
        return self.codes.shape[0], self.codes.shape[1] * BLOCK

    def dequantize(self) -> torch.Tensor:
        """The weights as a float32 ``(N, K)`` tensor."""
        if self.bits == 16:
            return self.codes.view(torch.bfloat16).float().reshape(self.shape)
        if self.bits == 4:
            lo, hi = self.codes & 0x0F, self.codes >> 4
            q = torch.cat([lo, hi], dim=-1).float()  # (N, G, 32)
        else:
            q = self.codes.view(torch.int8).float()
        w = q * self.scale.unsqueeze(-1)
        if self.zero is not None:
            w = w + self.zero.unsqueeze(-1)
        return w.reshape(self.shape)

    def map_rows(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> BlockWeight:
        """Apply a row reordering ``fn`` (acting on dim 0) to codes, scales and zeros alike."""
        zero = None if self.zero is None else fn(self.zero)
        return BlockWeight(fn(self.codes), fn(self.scale), zero, self.bits)

    @staticmethod
    def cat(parts: list[BlockWeight]) -> BlockWeight:
        """Stack weights with the same block format along the output dimension."""
        if any(p.zero is None for p in parts) and not all(p.zero is None for p in parts):
            parts = [p if p.zero is not None else p.with_zero() for p in parts]
        zeros = [p.zero for p in parts if p.zero is not None]  # every part's, or none (above)
        zero = None if parts[0].zero is None else torch.cat(zeros)
        return BlockWeight(torch.cat([p.codes for p in parts]), torch.cat([p.scale for p in parts]),
                           zero, parts[0].bits)

    def with_zero(self) -> BlockWeight:
        return BlockWeight(self.codes, self.scale, torch.zeros_like(self.scale), self.bits)

    @staticmethod
    def quantize(w: torch.Tensor, bits: int) -> BlockWeight:
        """Round a dense ``(N, K)`` weight to blocks: 4-bit with min/max per block (like Q4_1),
        8-bit symmetric (like Q8_0), or 16-bit: bfloat16."""
        n, k = w.shape
        if bits == 16:
            codes = w.to(torch.bfloat16).contiguous().view(torch.uint8).reshape(n, k // BLOCK, 2 * BLOCK)
            return BlockWeight(codes, torch.ones(n, k // BLOCK), None, 16)
        blocks = w.float().reshape(n, k // BLOCK, BLOCK)
        if bits == 8:
            scale = blocks.abs().amax(-1) / 127
            safe = torch.where(scale == 0, torch.ones_like(scale), scale)
            q = torch.round(blocks / safe.unsqueeze(-1)).clamp(-127, 127).to(torch.int8)
            return BlockWeight(q.view(torch.uint8).contiguous(), scale.contiguous(), None, 8)
        lo, hi = blocks.amin(-1), blocks.amax(-1)
        scale = (hi - lo) / 15
        safe = torch.where(scale == 0, torch.ones_like(scale), scale)
        q = torch.round((blocks - lo.unsqueeze(-1)) / safe.unsqueeze(-1)).clamp(0, 15).to(torch.uint8)
        codes = q[..., :16] | (q[..., 16:] << 4)
        return BlockWeight(codes.contiguous(), scale.contiguous(), lo.contiguous(), 4)


# GGUF block layouts: bytes of header (fp16 constants) and whether a min follows the scale.
_GGUF_LAYOUTS = {"Q4_0": (2, False, 4), "Q4_1": (4, True, 4), "Q8_0": (2, False, 8)}


def gguf_block_types() -> set[str]:
    """Names of the GGUF types kept as blocks."""
    return {*_GGUF_LAYOUTS, "Q5_0", "Q4_K"}


def from_gguf_blocks(raw: np.ndarray, type_name: str, rows: int, cols: int) -> BlockWeight:
    """A BlockWeight from a GGUF tensor's raw bytes ``(rows, bytes per row)``."""
    if type_name == "Q4_K":
        return _from_q4_k(raw, rows, cols)
    if type_name == "Q5_0":
        return _from_q5_0(raw, rows, cols)
    header, has_min, bits = _GGUF_LAYOUTS[type_name]
    code_bytes = BLOCK * bits // 8
    blocks = torch.from_numpy(np.array(raw))  # copy: the memmap is read-only
    blocks = blocks.reshape(rows, cols // BLOCK, header + code_bytes)
    consts = blocks[..., :header].contiguous().view(torch.float16).float()  # (N, G, 1 or 2)
    scale = consts[..., 0].contiguous()
    codes = blocks[..., header:].contiguous()
    if has_min:  # Q4_1: w = d * q + m
        return BlockWeight(codes, scale, consts[..., 1].contiguous(), 4)
    if bits == 4:  # Q4_0: w = d * (q - 8)
        return BlockWeight(codes, scale, -8 * scale, 4)
    return BlockWeight(codes, scale, None, 8)  # Q8_0: w = d * q


def _from_q5_0(raw: np.ndarray, rows: int, cols: int) -> BlockWeight:
    """Q5_0 (what llama.cpp's k-quant mixes write for matrices whose width is no multiple of 256)
    as 8-bit blocks: fp16 ``d``, then the 32 fifth bits, then 16 bytes of low nibbles (byte i:
    weights i and i+16); ``w = d * (q - 16)``, Q8_0's form with codes -16..15."""
    blocks = torch.from_numpy(np.array(raw)).reshape(rows, cols // BLOCK, 22)
    d = blocks[..., 0:2].contiguous().view(torch.float16).float()[..., 0]
    fifth = (blocks[..., 2:6].unsqueeze(-1) >> torch.arange(8, dtype=torch.uint8)) & 1  # bit i of the 32
    nibbles = torch.cat([blocks[..., 6:] & 15, blocks[..., 6:] >> 4], dim=-1)
    q = (nibbles | (fifth.reshape(rows, -1, BLOCK) << 4)).to(torch.int8) - 16
    return BlockWeight(q.view(torch.uint8).contiguous(), d.contiguous(), None, 8)


_Q4_K_SUPER = 256  # weights of a Q4_K super-block: 8 blocks of 32
_Q4_K_BYTES = 144  # fp16 d and dmin, 12 bytes of 6-bit scales and mins, 128 of 4-bit codes


def _from_q4_k(raw: np.ndarray, rows: int, cols: int) -> BlockWeight:
    """Q4_K (llama.cpp's k-quant, most of a Q4_K_M file) as blocks of 32. A super-block of 256
    holds fp16 ``d`` and ``dmin`` and, per block of 32, a 6-bit scale ``sc`` and min ``m``:
    ``w = d * sc * q - dmin * m``, a Q4_1 block with scale ``d * sc`` and zero ``-dmin * m``, both
    exact in float32 (an fp16 times a 6-bit integer)."""
    supers = torch.from_numpy(np.array(raw)).reshape(rows, cols // _Q4_K_SUPER, _Q4_K_BYTES)
    d = supers[..., 0:2].contiguous().view(torch.float16).float()  # (N, S, 1)
    dmin = supers[..., 2:4].contiguous().view(torch.float16).float()
    # Bytes 0-3: scales 0-3 (low 6 bits) and the top 2 bits of scales 4-7; 4-7: the same for the
    # mins; 8-11: the low 4 bits of scales 4-7 (low nibble) and of mins 4-7 (high nibble).
    packed = supers[..., 4:16].to(torch.int32)
    sc_lo, m_lo, rest = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    sc = torch.cat([sc_lo & 63, (rest & 15) | ((sc_lo >> 2) & 48)], dim=-1)  # (N, S, 8)
    m = torch.cat([m_lo & 63, (rest >> 4) | ((m_lo >> 2) & 48)], dim=-1)
    # Codes: 4 runs of 32 bytes, run j holding block 2j in its low nibbles and 2j+1 in its high.
    runs = supers[..., 16:].reshape(rows, -1, 4, 1, 32)
    q = torch.cat([runs & 15, runs >> 4], dim=3).reshape(rows, -1, BLOCK)  # (N, G, 32) in order
    codes = q[..., :16] | (q[..., 16:] << 4)
    scale, zero = (d * sc).reshape(rows, -1), -(dmin * m).reshape(rows, -1)
    return BlockWeight(codes.contiguous(), scale.contiguous(), zero.contiguous(), 4)
