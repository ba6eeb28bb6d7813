"""Recurrent-state slots of running sequences, and their snapshots in the prefix cache.

The KV-cache manager delegates here for models with recurrent layers, so the scheduler still
sees one manager. A sequence takes ``1 + history`` slots when it first needs state (its state,
then one per draft position of a step, for rollback) and gives them back when it is freed. The
tensors live in the worker (``cache.state.StateCache``); what this side decides that moves data
(restore a snapshot, take one, roll back to a history slot) is queued as slot copies, which the
next step makes before it runs (``StepInput.state_copies``).

The ``n`` choices of one request fork: the first runs the prompt but its last token and leaves a
snapshot there; the others wait for it, copy that state and run only the last token (in a
hybrid, from the last whole page: its KV pages are shared up to there).
"""

from __future__ import annotations

from typing import Optional

from lmserve.cache.free_list import FreeList
from lmserve.cache.snapshots import StateSnapshots
from lmserve.request import SeqStatus, Sequence


class StateManager:
    def __init__(self, slots: FreeList, history: int,
                 snapshots: Optional[StateSnapshots] = None, snapshot_every: int = 0,
                 align: int = 1) -> None:
        """``snapshot_every``: prompt positions (multiples of it) where a snapshot is taken as
        prefill passes them (0: none); ``align``: snapshots sit only at multiples of this (a
        hybrid model's page size, so that its KV pages end where the state was taken)."""
        self.slots = slots
        self.history = history
        self.snapshots = snapshots
        self.snapshot_every = snapshot_every
        self.align = align
        self.copies: list[tuple[int, int]] = []  # (src, dst), for the next step

    def ensure(self, seq: Sequence) -> None:
        """Give ``seq`` its slots if it has none (taking cached snapshots' slots if need be)."""
        if seq.state_slot >= 0:
            return
        taken = self._take(1 + self.history)
        seq.state_slot, seq.history_slots = taken[0], taken[1:]

    def match(self, seq: Sequence, limit: int) -> int:
        """Start ``seq`` from the longest snapshot of at most ``limit`` of its tokens; returns
        how many tokens it covers (0: none)."""
        if self.snapshots is None:
            return 0
        n, slot = self.snapshots.match(seq.token_ids[:limit], self.align)
        if n:
            self.ensure(seq)
            self.copies.append((slot, seq.state_slot))
        return n

    def fork_point(self, seq: Sequence) -> int:
        """Where the choices of a request with ``n > 1`` part: the first choice's state is kept
        after its prompt but the last token (at whole pages, in a hybrid) and the others start
        from it. 0: no fork (one choice, or no snapshots)."""
        if self.snapshots is None or seq.request.params.n == 1:
            return 0
        return (seq.num_prompt_tokens - 1) // self.align * self.align

    def chunk_end(self, seq: Sequence, num_tokens: int) -> int:
        """``num_tokens`` of ``seq``'s pending prompt, cut where a snapshot is to be taken (a
        first choice's fork point; the next multiple of ``snapshot_every``, unless the chunk
        ends the prompt): a state can only be kept where a step ended."""
        start = seq.num_computed
        end = start + num_tokens
        if self.snapshots is None:
            return num_tokens
        fork = self.fork_point(seq)
        if seq.index == 0 and start < fork < end:
            end = fork
        if self.snapshot_every and end < len(seq.token_ids):
            end = min(end, (start // self.snapshot_every + 1) * self.snapshot_every)
        return end - start

    def ready(self, seq: Sequence) -> bool:
        """Whether ``seq`` may be admitted: a later choice of a forking request waits until the
        first has passed the fork point (or finished), so that it starts from its snapshot."""
        fork = self.fork_point(seq)
        if not fork or seq.index == 0:
            return True
        first = seq.request.seqs[0]
        return first.status is SeqStatus.FINISHED or first.num_computed >= fork

    def at_boundary(self, seq: Sequence) -> None:
        """After a prompt chunk: snapshot the state if the chunk ended at a snapshot position."""
        n = seq.num_computed
        wanted = (self.snapshot_every and n % self.snapshot_every == 0) or (
            seq.index == 0 and n == self.fork_point(seq))
        if not (n and wanted) or self.snapshots is None or n % self.align \
                or self.snapshots.holds(seq.token_ids[:n]):
            return
        slot = self._take(1)[0]
        self.copies.append((seq.state_slot, slot))
        self.slots.release(self.snapshots.insert(seq.token_ids[:n], slot))

    def keep(self, seq: Sequence, start: int, ran: int) -> None:
        """A step ran ``ran`` tokens of ``seq`` from position ``start`` and ``seq.num_computed``
        is what it kept: if drafts were rejected, restore the state after the last kept token."""
        kept = seq.num_computed - start
        if 0 < kept < ran:
            self.copies.append((seq.history_slots[kept - 1], seq.state_slot))

    def free(self, seq: Sequence, snapshot: bool) -> None:
        """Give back ``seq``'s slots; with ``snapshot``, its state stays in the prefix cache as
        the state after its computed tokens (where snapshots may sit there)."""
        if seq.state_slot < 0:
            return
        slots = [seq.state_slot, *seq.history_slots]
        n = seq.num_computed
        if snapshot and self.snapshots is not None and n and n % self.align == 0:
            self.slots.release(self.snapshots.insert(seq.token_ids[:n], slots[0]))
            slots = slots[1:]
        self.slots.release(slots)
        seq.state_slot, seq.history_slots = -1, []

    def take_copies(self) -> list[tuple[int, int]]:
        copies, self.copies = self.copies, []
        return copies

    def held_by_sequences(self) -> int:
        """Slots that running or waiting sequences hold (not the snapshots)."""
        return self.slots.num_used - (len(self.snapshots) if self.snapshots else 0)

    def _take(self, n: int) -> list[int]:
        while self.slots.num_free < n and self.snapshots is not None and len(self.snapshots):
            self.slots.release([self.snapshots.evict()])
        return self.slots.alloc(n)
