"""Rank 0's runner of a parallel engine: every call the engine makes on its runner is first sent to
the other ranks as plain data, then run on rank 0's own part; the other ranks run the same."""

from __future__ import annotations

from typing import Callable, Optional

import torch

from lmserve.parallel.group import ParallelGroup
from lmserve.runner import ModelRunner
from lmserve.step import StepInput


class ParallelRunner:
    """A ``ModelRunner`` to the engine (``execute``, ``move_kv``, ``discard_kv``); rank 0's own
    part answers everything else (its model has the embedding and head that drafters share)."""

    def __init__(self, local: ModelRunner, group: ParallelGroup) -> None:
        self.local = local
        self.group = group

    def __getattr__(self, name: str):
        return getattr(self.local, name)  # model, kv, features, last_hidden, ...

    def __setattr__(self, name: str, value) -> None:
        if name in ("local", "group"):
            object.__setattr__(self, name, value)
        else:
            setattr(self.local, name, value)  # feature_layers: rank 0 has the whole hidden state

    def execute(self, step: StepInput, features: Optional[torch.Tensor] = None) -> torch.Tensor:
        self.group.send(("step", step))
        try:
            logits = self.local.execute(step, features)
        except RuntimeError as err:  # gloo's all-reduce gave up
            raise self.group.failure(err) from err
        self.group.check()
        return logits

    def move_kv(self, src_slots: list[int], dst_slots: list[int]) -> None:
        if src_slots:
            self.group.send(("move_kv", src_slots, dst_slots))
            self.local.move_kv(src_slots, dst_slots)

    def discard_kv(self, pages: list[int], is_free: Callable[[int], bool]) -> None:
        free = bytes(is_free(p) for p in range(self.local.kv.num_pages))
        self.group.send(("discard_kv", pages, free))
        self.local.discard_kv(pages, lambda p: free[p])

    def keep_alive(self) -> None:
        """Called every second by the engine (see ``ParallelGroup.keep_alive``)."""
        self.group.keep_alive()
