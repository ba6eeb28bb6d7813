"""Medusa drafting (``speculative_mode="medusa"``): heads on the target's last hidden state.

Medusa (FasterDecoding/Medusa) adds ``k`` heads to a model: head ``i`` maps the final hidden
state ``h`` of the token just sampled to the token ``i + 2`` positions later (the model's own head
gives the next one), through ``L`` residual blocks ``x + silu(W x + b)`` and a vocabulary
projection. So all depths are drafted at once from the hidden state of the last verified token,
which the target's verify pass computes anyway: no draft model, no second pass. The drafts are
the heads' best tokens (deterministic, q = 1, so verification needs no draft probabilities, see
``speculator``); with a tree, the heads' top candidates as Medusa's ``medusa_choices`` (paths of
ranks) or, without them, the best chain with the next best tokens as leaves. A node's children
are drafted only while its path is likely enough by the heads (``MIN_PATH_LOG_PROB``, the sum of
its tokens' log-probabilities, each from its own head, over the draft vocabulary if there is
one), as EAGLE's.

Heads load from the layouts people publish: FasterDecoding's directory (``config.json`` with
``medusa_num_heads`` and ``medusa_num_layers``; ``medusa_lm_head.safetensors`` with
``{i}.{j}.linear.weight/bias`` and ``{i}.{L}.weight``), and vLLM's names (``blocks.{i}.layers.{j}``,
``lm_heads.{i}``), with an optional draft vocabulary (``draft_vocab.py``). A ``.pt``/``.bin``
file is read only with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file

from lmserve.config import MAX_TREE_TOKENS, OptFlags
from lmserve.models.args import ModelArgs
from lmserve.request import Sequence
from lmserve.scheduler import Batch, ScheduledChunk
from lmserve.speculative.draft_level import head_formats, head_linear
from lmserve.speculative.draft_vocab import read_draft_vocab, to_token_ids
from lmserve.speculative.tree import MIN_PATH_LOG_PROB, DraftTree

_FILES = ("medusa_lm_head.safetensors", "model.safetensors", "medusa_lm_head.pt", "medusa_lm_head.bin",
          "pytorch_model.bin")
_FASTER = re.compile(r"(\d+)\.(\d+)\.(linear\.weight|linear\.bias|weight)")
_VLLM = re.compile(r"(?:blocks\.(\d+)\.layers\.(\d+)\.(weight|bias)|lm_heads\.(\d+)\.weight)")


@dataclass
class MedusaHeads:
    """``blocks[i]``: head i's residual blocks as (weight (D, D), bias (D,)); ``heads[i]``: its
    vocabulary projection (V, D), or its draft vocabulary's rows (V', D). Float32, as in the
    file (``MedusaDrafter`` holds them at the drafter's level)."""

    blocks: list[list[tuple[torch.Tensor, torch.Tensor]]]
    heads: list[torch.Tensor]
    choices: Optional[list[tuple[int, ...]]] = None  # medusa_choices: paths of top-k ranks
    # A draft vocabulary (draft_vocab.py): the token ids of the projections' rows; None: all.
    vocab: Optional[torch.Tensor] = None

    def __len__(self) -> int:
        return len(self.heads)


def _heads_file(path: str) -> str:
    file = path if os.path.isfile(path) else next(
        (os.path.join(path, n) for n in _FILES if os.path.isfile(os.path.join(path, n))), None)
    if file is None:
        raise FileNotFoundError(f"{path} holds no Medusa heads (looked for {', '.join(_FILES)})")
    return file


def medusa_heads_size(path: str) -> int:
    """The number of weights in the heads' file at ``path``, from a safetensors header without
    reading the tensors (for the plan); errors name the heads."""
    try:
        file = _heads_file(path)
        if not file.endswith(".safetensors"):
            tensors = torch.load(file, map_location="cpu", weights_only=True)
            return sum(t.numel() for t in tensors.values())
        with safe_open(file, framework="pt") as f:
            return sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())
    except FileNotFoundError as err:
        raise FileNotFoundError(f"additional_models[0] (the Medusa heads): {err}") from None
    except Exception as err:  # a damaged file: safetensors' and pickle's own errors
        raise ValueError(f"additional_models[0] (the Medusa heads): cannot read {path}: {err}") from None


def read_medusa_heads(path: str, target: ModelArgs) -> MedusaHeads:
    """Medusa heads from ``path`` (a directory or a weights file), checked against the target:
    a tensor with a name or shape that does not fit is refused, naming it."""
    directory = path if os.path.isdir(path) else os.path.dirname(path)
    config: dict[str, Any] = {}
    if os.path.isfile(os.path.join(directory, "config.json")):
        with open(os.path.join(directory, "config.json"), encoding="utf-8") as f:
            config = json.load(f)
    file = _heads_file(path)
    if file.endswith(".safetensors"):
        tensors = load_file(file)
    else:  # never a full unpickle: tensors only
        tensors = torch.load(file, map_location="cpu", weights_only=True)
    if config.get("truncated_vocab_size") or config.get("original_lm_head"):
        raise ValueError(f"{directory}/config.json asks for vLLM's truncated_vocab_size or "
                         f"original_lm_head, which lmserve does not support: heads must project "
                         f"to the whole vocabulary")
    blocks: dict[int, dict[int, dict[str, torch.Tensor]]] = {}
    heads: dict[int, torch.Tensor] = {}
    after: dict[int, tuple[int, str]] = {}  # FasterDecoding: head i's projection's block index
    for name, tensor in tensors.items():
        faster, vllm = _FASTER.fullmatch(name), _VLLM.fullmatch(name)
        if faster:
            i, j, kind = int(faster[1]), int(faster[2]), faster[3]
            if kind == "weight":  # {i}.{L}.weight: the vocabulary projection after L blocks
                heads[i] = tensor
                after[i] = (j, name)
            else:
                blocks.setdefault(i, {}).setdefault(j, {})[kind.split(".")[1]] = tensor
        elif vllm and vllm[4] is not None:
            heads[int(vllm[4])] = tensor
        elif vllm:
            blocks.setdefault(int(vllm[1]), {}).setdefault(int(vllm[2]), {})[vllm[3]] = tensor
        else:
            raise ValueError(f"{file} has tensor '{name}', which is not a Medusa head tensor "
                             f"({{i}}.{{j}}.linear.weight/bias, {{i}}.{{L}}.weight, "
                             f"blocks.{{i}}.layers.{{j}}.weight/bias or lm_heads.{{i}}.weight)")
    k = config.get("medusa_num_heads", config.get("num_heads", len(heads)))
    num_layers = config.get("medusa_num_layers", config.get("num_hidden_layers"))
    if sorted(heads) != list(range(k)) or any(i not in heads for i in blocks):
        raise ValueError(f"{file}: Medusa heads {sorted(heads)} (blocks for {sorted(blocks)}) found, "
                         f"expected 0..{k - 1} (medusa_num_heads={k})")
    d, v = target.hidden_size, target.vocab_size
    vocab = read_draft_vocab(path, v)
    out = MedusaHeads([], [], _choices(config), vocab)
    for i in range(k):
        if tuple(heads[i].shape) != (v, d):
            raise ValueError(f"{file}: head {i}'s vocabulary projection is {tuple(heads[i].shape)}, "
                             f"the model needs ({v}, {d}) (vocabulary, hidden size)")
        layers = blocks.get(i, {})
        expected = num_layers if num_layers is not None else len(layers)
        if sorted(layers) != list(range(expected)) or after.get(i, (expected,))[0] != expected:
            where = f"; its projection is '{after[i][1]}'" if i in after else ""
            raise ValueError(f"{file}: head {i} has residual blocks {sorted(layers)}{where}, "
                             f"expected blocks 0..{expected - 1} and the projection after them")
        pairs = []
        for j in range(expected):
            if "weight" not in layers[j] or set(layers[j]) - {"weight", "bias"}:
                raise ValueError(f"{file}: head {i} block {j} needs a weight (and may have a "
                                 f"bias), found {sorted(layers[j])}")
            w = layers[j]["weight"]
            b = layers[j].get("bias", torch.zeros(d))  # vLLM's blocks may have no bias
            if tuple(w.shape) != (d, d) or tuple(b.shape) != (d,):
                raise ValueError(f"{file}: head {i} block {j} is {tuple(w.shape)} + {tuple(b.shape)}, "
                                 f"the model's hidden size needs ({d}, {d}) + ({d},)")
            pairs.append((w.float(), b.float()))
        out.blocks.append(pairs)
        out.heads.append((heads[i] if vocab is None else heads[i][vocab]).float())
    return out


def _choices(config: dict) -> Optional[list[tuple[int, ...]]]:
    """``medusa_choices`` as tree paths, parents first, each path's prefixes included (one tree
    node per path); refused when the tree would not fit one verify step."""
    choices = config.get("medusa_choices")
    if choices is None:
        return None
    paths = {tuple(c[:n]) for c in choices for n in range(1, len(c) + 1)}
    if len(paths) >= MAX_TREE_TOKENS:
        raise ValueError(f"medusa_choices makes a tree of {len(paths)} tokens; a step verifies at "
                         f"most {MAX_TREE_TOKENS - 1} drafts per sequence")
    return sorted(paths, key=lambda c: (len(c), c))


class MedusaDrafter:
    """Drafts from Medusa heads on the hidden state of each sequence's newest token, which the
    engine hands over after sampling (``observe``); ``width`` candidates per depth for a tree."""

    feature_layers = ()  # the target's final hidden states
    adaptive_start = 1  # heads trained here are right 10-17% of the time

    def __init__(self, heads: MedusaHeads, level: OptFlags, width: int = 1) -> None:
        """``level``: the drafter's (``draft_level``), which the heads' matrices run at (the
        float32 ``heads`` are not kept)."""
        self.choices, self.vocab = heads.choices, heads.vocab
        self.width = width
        formats = head_formats(level)
        self.blocks = [[head_linear([w], b, formats) for w, b in blocks] for blocks in heads.blocks]
        self.projections = [head_linear([h], None, formats) for h in heads.heads]

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor, depth: Optional[int] = None) -> torch.Tensor:
        """``(depth, B, V)``: the first ``depth`` heads' float32 logits (all by default) for the
        hidden states ``(B, D)``, over the draft vocabulary (``V'``) if there is one."""
        out = []
        for blocks, projection in list(zip(self.blocks, self.projections))[:depth]:
            x = hidden.float()
            for block in blocks:
                x = x + F.silu(block(x).float())
            out.append(projection(x).float())
        return torch.stack(out)

    @staticmethod
    def observe(seq: Sequence, start: int, hidden: torch.Tensor) -> None:
        """The final hidden states ``(n, D)`` of the tokens of ``seq`` from position ``start``
        that a step verified: the last is the one its newest token was sampled from (kept as the
        sequence's draft state, so it goes with the sequence)."""
        seq.draft_state = hidden[-1].clone()  # not a view keeping the step's rows alive

    def offer(self, seq: Sequence, cap: int) -> int:
        return min(cap, len(self.projections)) if seq.draft_state is not None else 0

    def num_nodes(self, seq: Sequence, depth: int) -> int:
        if self.choices is not None:
            return sum(len(c) <= depth for c in self.choices)
        return depth * self.width

    @staticmethod
    def behind(seq: Sequence) -> int:
        return 0  # (no state to catch up)

    def propose(self, batch: Batch, depths: dict[ScheduledChunk, int]) -> None:
        drafting = [c for c, depth in depths.items() if depth]
        if not drafting:
            return
        deepest = max(depths[c] for c in drafting)
        logits = self.logits(torch.stack([c.seq.draft_state for c in drafting]), deepest)
        ranks = max((max(c) + 1 for c in self.choices), default=1) if self.choices else self.width
        best = logits.log_softmax(dim=-1).topk(ranks, dim=-1)
        top = to_token_ids(best.indices, self.vocab)  # (k, B, ranks)
        for b, c in enumerate(drafting):
            levels = top[: depths[c], b].tolist()  # per depth, its candidates best first
            log_probs = best.values[: depths[c], b].tolist()
            if self.choices is not None:
                tree = DraftTree()
                for path in (p for p in self.choices if len(p) <= depths[c]):
                    parent = sum(log_probs[d][rank] for d, rank in enumerate(path[:-1]))
                    if parent >= MIN_PATH_LOG_PROB:
                        node = -1
                        for depth, rank in enumerate(path):
                            node = tree.add(node, levels[depth][rank])
            else:  # the chain goes on past a node while its path is likely enough
                chain_log_prob, depth = 0.0, 0
                while depth < len(levels) and chain_log_prob >= MIN_PATH_LOG_PROB:
                    chain_log_prob += log_probs[depth][0]
                    depth += 1
                tree = DraftTree.from_candidates(levels[:depth], c.num_lookahead)
            c.draft = tree.truncated(c.num_lookahead, depths[c])
