"""Rank 0's runner of a parallel engine: every call the engine makes on its runner is first sent to
the other ranks as plain data, then run on rank 0's own part; the other ranks run the same.
With pipeline stages, rank 0's part is stage 0 and the head: the logits of a step come from the
last stage's final hidden rows, some steps later (``submit``)."""

from __future__ import annotations

import queue
import threading
from typing import Any, Callable, Optional, Union

import torch

from lmserve.parallel.channels import Channel
from lmserve.parallel.commands import RankLost
from lmserve.parallel.group import ParallelGroup
from lmserve.parallel.rank import run_stage
from lmserve.runner import ModelRunner
from lmserve.step import StepInput


class ParallelRunner:
    """The engine's ``Runner`` (``lmserve.runner``) over every rank; rank 0's own part has the
    model's embedding and head (what drafters share) and the whole hidden state (features)."""

    def __init__(self, local: ModelRunner, group: ParallelGroup) -> None:
        self.local = local
        self.group = group
        self.results = None
        if group.stages > 1:
            self.results = _Results(group.links[((group.stages - 1) * group.tensor, 0)])

    @property
    def model(self) -> Any:
        return self.local.model

    @property
    def feature_layers(self) -> Optional[tuple[int, ...]]:
        return self.local.feature_layers

    @feature_layers.setter
    def feature_layers(self, layers: Optional[tuple[int, ...]]) -> None:
        self.local.feature_layers = layers

    @property
    def features(self) -> Optional[torch.Tensor]:
        return self.local.features

    def execute(self, step: StepInput, features: Optional[torch.Tensor] = None) -> torch.Tensor:
        return self.submit(step, features)()

    def submit(self, step: StepInput, features: Optional[torch.Tensor] = None
               ) -> Callable[[], torch.Tensor]:
        """Start ``step`` on every rank; the returned call gives its logits. With pipeline
        stages it returns as soon as rank 0 has run stage 0 and passed it on, so the engine can
        start the next batch while the later stages run this one; the calls are answered in
        the order of the steps."""
        self.group.send(("step", step))
        try:
            if self.results is None:
                logits = self.local.execute(step, features)
                self.group.check()
                return lambda: logits
            self.results.expect()
            run_stage(self.local, self.group, step)
        except (RuntimeError, RankLost) as err:  # gloo gave up, or a stage did not answer
            raise self._failure(err) from err
        return self._last_stage_logits

    def _last_stage_logits(self) -> torch.Tensor:
        """The oldest step's logits from the last stage's final hidden rows."""
        assert self.results is not None  # (asked for only with pipeline stages)
        rows = self.results.take()
        if isinstance(rows, BaseException):
            raise self._failure(rows) from rows
        self.local.last_hidden = rows  # (an EAGLE-style drafter's next input)
        return self.local.model.logits(rows) if len(rows) else rows.new_empty((0, 0))

    def _failure(self, err: BaseException) -> Exception:
        if isinstance(err, RankLost):
            return self.group.failure(err.__cause__, err.rank)
        return self.group.failure(err)

    def move_kv(self, src_slots: list[int], dst_slots: list[int]) -> None:
        if src_slots:
            self.group.send(("move_kv", src_slots, dst_slots))
            self.local.move_kv(src_slots, dst_slots)

    def discard_kv(self, pages: list[int], is_free: Callable[[int], bool]) -> None:
        free = bytes(is_free(p) for p in range(self.local.kv.num_pages))
        self.group.send(("discard_kv", pages, free))
        self.local.discard_kv(pages, lambda p: bool(free[p]))

    def keep_alive(self) -> None:
        """Called every second by the engine (see ``ParallelGroup.keep_alive``)."""
        self.group.keep_alive()

    def close(self) -> None:
        if self.results is not None:
            self.results.close()


class _Results:
    """The last stage's outputs, taken by a thread of rank 0 as soon as they come: the last
    stage never waits for rank 0 to take one (rank 0 may be waiting for it to take the next
    step), and waits only for outputs that are due, so an idle engine does not time out."""

    def __init__(self, channel: Channel) -> None:
        self.channel = channel
        self.due: queue.SimpleQueue = queue.SimpleQueue()  # a None per step started, then a stop
        self.ready: queue.SimpleQueue = queue.SimpleQueue()  # outputs, or the error that ended it
        threading.Thread(target=self._run, name="lmserve-last-stage", daemon=True).start()

    def expect(self) -> None:
        self.due.put(True)

    def take(self) -> Union[torch.Tensor, BaseException]:
        return self.ready.get()

    def close(self) -> None:
        self.due.put(False)

    def _run(self) -> None:
        while self.due.get():
            try:
                self.ready.put(self.channel.receive_sleeping())
            except (RankLost, RuntimeError) as err:
                self.ready.put(err)
                return
