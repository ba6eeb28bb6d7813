"""A head's draft vocabulary: the tokens it drafts among, when fewer than the model's.

On a CPU a head's vocabulary projection is most of its cost: for a small model with a large
vocabulary (the built-in model: 49,152 tokens of 576 values) one projection reads as much as a
fifth of the model's weights, and Medusa runs one per head. Drafting among the few thousand
tokens the model actually writes costs a tenth of that and loses only drafts that are rarely
right. EAGLE-3 publishes this as ``d2t``; for EAGLE-1/2 and Medusa heads lmserve reads a
``draft_vocab.json`` beside the weights (``{"token_ids": [...]}``, which ``lmserve
train-heads`` writes: the tokens of the answers it trained on). Other engines ignore the file
and draft over the whole vocabulary. Drafts only propose: the output never changes. A head's logits are over
its draft vocabulary;
``to_token_ids`` maps the drafter's picks back.
"""

from __future__ import annotations

import json
import os
from typing import Optional

import torch

FILE = "draft_vocab.json"


def read_draft_vocab(path: str, vocab_size: int) -> Optional[torch.Tensor]:
    """The sorted token ids ``(V',)`` in the ``draft_vocab.json`` beside the heads at ``path``
    (a directory or a weights file), or None without one; refused unless they are distinct ids
    of the model's vocabulary."""
    directory = path if os.path.isdir(path) else os.path.dirname(path)
    file = os.path.join(directory, FILE)
    if not os.path.isfile(file):
        return None
    with open(file, encoding="utf-8") as f:
        ids = json.load(f).get("token_ids")
    if not isinstance(ids, list) or not ids or not all(isinstance(i, int) for i in ids):
        raise ValueError(f"{file}: 'token_ids' must be a non-empty list of token ids")
    if len(set(ids)) != len(ids) or min(ids) < 0 or max(ids) >= vocab_size:
        raise ValueError(f"{file}: 'token_ids' must be distinct ids below the model's vocabulary "
                         f"size {vocab_size}")
    return torch.tensor(sorted(ids))


def write_draft_vocab(directory: str, token_ids: torch.Tensor) -> None:
    with open(os.path.join(directory, FILE), "w", encoding="utf-8") as f:
        json.dump({"token_ids": token_ids.tolist()}, f)


def to_token_ids(indices: torch.Tensor, token_ids: Optional[torch.Tensor]) -> torch.Tensor:
    """Indices into a draft vocabulary's logits as the model's token ids (as they are without
    one)."""
    return indices if token_ids is None else token_ids[indices]
