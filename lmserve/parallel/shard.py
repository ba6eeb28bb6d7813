"""Tensor-parallel shards of a decoder's weights (Megatron-LM's split, as vLLM and SGLang do it).

Rank ``r`` of ``n`` holds, in every layer:

- q/k/v: the rows of its heads, ``num_heads / n`` query heads and ``num_kv_heads / n`` KV heads
  (a query head stays with its KV head); gate/up: ``intermediate_size / n`` rows. Their outputs
  are the rank's own part, so attention and SiLU run on them with no communication.
- o and down: the matching columns. Each rank's output is a partial sum of the whole output,
  which an all-reduce adds up (``parallel.all_reduce``): two per layer.
- Norms and the embedding whole: every rank keeps the whole residual stream, so a token's row is
  looked up locally rather than gathered. The language-model head only on rank 0, which samples:
  the logits never cross processes, at the cost of rank 0 computing them alone.

Blocks of 4-/8-bit codes (GGUF's Q4_0, Q4_1, Q8_0, Q5_0, Q4_K) are split as they are: rows are whole rows
of blocks, columns are whole blocks, so nothing is dequantized and every ``opt`` level runs
sharded. A column split must then fall on a block boundary (32 inputs).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from lmserve.layers.blocks import BLOCK, BlockWeight
from lmserve.layers.linear import Weight
from lmserve.models.args import ModelArgs

_ROW_SPLIT = re.compile(r"\.(self_attn\.[qkv]_proj|mlp\.(gate|up)_proj)\.(weight|bias)$")
_COLUMN_SPLIT = re.compile(r"\.(self_attn\.o_proj|mlp\.down_proj)\.weight$")
_RANK0_ONLY = re.compile(r"\.self_attn\.o_proj\.bias$")  # added once, before the all-reduce


@dataclass(frozen=True)
class TensorShard:
    """Rank ``rank`` of ``size`` tensor-parallel ranks."""

    rank: int
    size: int


def check_shardable(args: ModelArgs, size: int, blocks: bool) -> None:
    """Refuse, with the numbers, a model that ``size`` ranks cannot split evenly (``blocks``:
    the weights stay 4-/8-bit blocks, whose column splits must fall on 32-input boundaries)."""
    if args.ssm_layers:
        raise ValueError(f"tensor_parallel_shards={size}: models with recurrent layers "
                         f"({args.architecture}) are not split across ranks; use 1")
    reason = _why_not(args, size, blocks)
    if reason is not None:
        fits = [n for n in range(1, args.num_kv_heads + 1) if _why_not(args, n, blocks) is None]
        raise ValueError(f"tensor_parallel_shards={size} {reason}; values that fit: {fits}")


def _why_not(args: ModelArgs, size: int, blocks: bool) -> Optional[str]:
    for name, count in (("num_heads", args.num_heads), ("num_kv_heads", args.num_kv_heads),
                        ("intermediate_size", args.intermediate_size)):
        if count % size:
            return f"must divide the model's {name} ({count})"
    if blocks:
        for name, width in (("o_proj", args.num_heads // size * args.head_dim),
                            ("down_proj", args.intermediate_size // size)):
            if width % BLOCK:
                return (f"would split {name}'s quantized blocks: each rank's {width} inputs are "
                        f"not a multiple of {BLOCK}")
    return None


def shard_args(args: ModelArgs, size: int) -> ModelArgs:
    """The hyper-parameters of one rank's part: its heads and MLP width."""
    return dataclasses.replace(args, num_heads=args.num_heads // size,
                               num_kv_heads=args.num_kv_heads // size,
                               intermediate_size=args.intermediate_size // size)


def shard_weights(weights: dict[str, Weight], args: ModelArgs, shard: TensorShard) -> dict[str, Weight]:
    """Rank ``shard.rank``'s weights (see the module docstring); ``weights`` keyed by Hugging Face
    Llama names, as ``load_weights`` returns them."""
    out: dict[str, Weight] = {}
    for name, w in weights.items():
        if _RANK0_ONLY.search(name):
            if shard.rank == 0:
                out[name] = w
        elif _ROW_SPLIT.search(name):
            out[name] = _part(w, 0, shard, _rows)
        elif _COLUMN_SPLIT.search(name):
            out[name] = _part(w, 1, shard, _columns)
        else:
            out[name] = w
    return out


def _part(w: Weight, axis: int, shard: TensorShard,
          take: Callable[[torch.Tensor, slice], torch.Tensor]) -> Weight:
    """Shard ``shard.rank`` of ``w`` along its output (0) or input (1) axis: a dense tensor's
    elements, or a block weight's rows or whole blocks (its codes, scales and zeros alike)."""
    length = w.shape[axis] // (BLOCK if isinstance(w, BlockWeight) and axis == 1 else 1)
    step = length // shard.size
    part = slice(shard.rank * step, (shard.rank + 1) * step)
    if isinstance(w, BlockWeight):
        zero = None if w.zero is None else take(w.zero, part)
        return BlockWeight(take(w.codes, part), take(w.scale, part), zero, w.bits)
    return take(w, part)


def _rows(t: torch.Tensor, part: slice) -> torch.Tensor:
    return t[part].contiguous()


def _columns(t: torch.Tensor, part: slice) -> torch.Tensor:
    return t[:, part].contiguous()
