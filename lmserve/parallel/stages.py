"""Pipeline stages: which contiguous layers each stage holds, and what else it keeps.

Stage 0 embeds the tokens and, on rank 0, also holds the language-model head, which turns the
last stage's final hidden states into logits (rank 0 samples; the hidden rows it receives are
``vocab_size / hidden_size`` times smaller than their logits). The last stage applies the final
norm. Between stages the whole residual stream crosses (``parallel.channels``).

The default split balances the matmul work of a decode step: the head counts as
``vocab_size * hidden_size / layer parameters`` layers on stage 0 (for the built-in model
eight of its thirty layers; times the tensor-parallel ranks, which split the layers but not the
head), so stage 0 gets fewer layers. ``LMSERVE_PP_LAYER_PARTITION``
("10,20") sets the split by hand, as vLLM's ``VLLM_PP_LAYER_PARTITION`` does.
"""

from __future__ import annotations

import os
import re
from typing import Mapping, Optional

from lmserve.layers.linear import Weight
from lmserve.models.args import ModelArgs

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def layer_params(args: ModelArgs) -> int:
    """Matmul parameters of one decoder layer."""
    d, hd = args.hidden_size, args.head_dim
    return d * (args.num_heads + 2 * args.num_kv_heads) * hd + args.num_heads * hd * d \
        + 3 * d * args.intermediate_size


def check_stageable(args: ModelArgs, stages: int) -> None:
    """Refuse, with the numbers, a model that ``stages`` stages cannot split."""
    if args.ssm_layers:
        raise ValueError(f"pipeline_parallel_stages={stages}: models with recurrent layers "
                         f"({args.architecture}) are not split across stages; use 1")
    if stages > args.num_layers:
        raise ValueError(f"pipeline_parallel_stages={stages} exceeds the model's "
                         f"{args.num_layers} layers: each stage needs at least one")


def stage_layers(args: ModelArgs, stages: int, tensor: int = 1,
                 env: Mapping[str, str] = os.environ) -> tuple[range, ...]:
    """Each stage's layers, in order (see the module docstring); ``tensor``: the ranks each
    layer is split across (the head is not: it weighs ``tensor`` times more against them)."""
    check_stageable(args, stages)
    n = args.num_layers
    given = env.get("LMSERVE_PP_LAYER_PARTITION")
    if given:
        counts = [int(c) for c in given.split(",")]
        if len(counts) != stages or sum(counts) != n or min(counts) < 1:
            raise ValueError(f"LMSERVE_PP_LAYER_PARTITION={given!r} must give each of the {stages} "
                             f"stages at least one layer, {n} layers in all")
    else:
        counts = _balanced(n, stages, tensor * args.vocab_size * args.hidden_size / layer_params(args))
    starts = [sum(counts[:i]) for i in range(stages + 1)]
    return tuple(range(starts[i], starts[i + 1]) for i in range(stages))


def _balanced(layers: int, stages: int, head: float) -> list[int]:
    """Layer counts whose largest stage cost (layers, plus ``head`` on stage 0) is least; the
    other stages as even as can be, the later ones taking the remainder."""
    best: Optional[tuple[float, list[int]]] = None
    for first in range(1, layers - stages + 2):
        rest, others = layers - first, stages - 1
        counts = [first] + [rest // others + (i >= others - rest % others) for i in range(others)] \
            if others else [first]
        if sum(counts) != layers or min(counts) < 1:
            continue
        cost = max([counts[0] + head, *counts[1:]])
        if best is None or cost < best[0]:
            best = (cost, counts)
    assert best is not None
    return best[1]


def stage_weights(weights: dict[str, Weight], layers: range, first: bool, head: bool
                  ) -> dict[str, Weight]:
    """The weights a stage holds: its layers', the embedding table on the first stage (and with
    the head, which may be tied to it), the final norm on every stage (it is tiny)."""
    out = {}
    for name, w in weights.items():
        m = _LAYER.match(name)
        if m is not None:
            keep = int(m.group(1)) in layers
        elif name == "model.embed_tokens.weight":
            keep = first or head
        elif name == "lm_head.weight":
            keep = head
        else:
            keep = True
        if keep:
            out[name] = w
    return out
