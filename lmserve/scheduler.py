"""Continuous batching: which sequences run in the next step, how many tokens each, which pages.

Every step the running sequences come first, oldest admission first: a decoding sequence gets
its one token, a sequence part-way through its prompt gets the next chunk. Waiting sequences are
then admitted in arrival order while there is room (batch slots, prefill budget, pages). When a
running sequence needs a page and none is free, the most recently admitted running sequence is
preempted: its pages are freed and it waits at the head of the queue to be recomputed.

``prefill_mode="hybrid"``: decode tokens and prefill chunks share one step (split-fuse), the
step's tokens capped at ``prefill_chunk_size``. ``"chunked"``: a step is all prefill or all decode,
and the two alternate while both have work, so a stream of new prompts never stalls the decodes.

With a prefix cache, an admitted sequence first takes the cached pages of its longest cached
prefix and prefills only the rest; finished prefill chunks and finished sequences are offered to
the cache; and when pages run short, the cache gives up unused prefixes before anyone is preempted.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Optional

from lmserve.cache.pages import PagePool, pages_needed
from lmserve.cache.radix import RadixCache
from lmserve.request import Sequence, SeqStatus
from lmserve.step import SeqStep, StepInput


@dataclass
class ScheduledChunk:
    """``num_tokens`` tokens of ``seq``, starting at ``seq.num_computed``, in this step."""

    seq: Sequence
    num_tokens: int
    samples: bool  # the chunk reaches the sequence's last token, so a new token is sampled
    decode: bool  # the sequence was decoding (Sequence.is_decoding), not prefilling


@dataclass
class Batch:
    chunks: list[ScheduledChunk]

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    def step_input(self) -> StepInput:
        """The step as the runner sees it: plain data, one ``SeqStep`` per chunk."""
        return StepInput([
            SeqStep(start=c.seq.num_computed,
                    token_ids=c.seq.token_ids[c.seq.num_computed : c.seq.num_computed + c.num_tokens],
                    page_table=list(c.seq.pages), num_logits=1 if c.samples else 0)
            for c in self.chunks
        ])


def _tokens(chunks: list[ScheduledChunk]) -> int:
    return sum(c.num_tokens for c in chunks)


class Scheduler:
    def __init__(
        self,
        pool: PagePool,
        page_size: int,
        max_num_sequence: int,
        prefill_chunk_size: int,
        prefill_mode: str = "hybrid",
        prefix_cache: Optional[RadixCache] = None,
    ) -> None:
        self.pool = pool
        self.page_size = page_size
        self.max_num_sequence = max_num_sequence
        self.prefill_chunk_size = prefill_chunk_size
        self.prefill_mode = prefill_mode
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.prefix_cache = prefix_cache
        self.num_preemptions = 0
        self._last_step_prefilled = False  # chunked mode alternates prefill and decode steps
        self.prefix_queried_tokens = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hit_tokens = 0  # of which found, and not computed again

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> Optional[Batch]:
        """Pick the next step's work; None when there is nothing to run.

        A step that had to preempt admits nobody: the pages just freed are for the sequences
        already running, or a preempted prefill would come straight back and take them again.
        """
        preempted = self.num_preemptions
        decodes_wait = any(s.is_decoding for s in self.running)
        if (self.prefill_mode == "chunked" and self._has_prefill_work()
                and not (self._last_step_prefilled and decodes_wait)):
            chunks = self._schedule_running(decodes=False, prefills=True)
            if self.num_preemptions == preempted:
                chunks += self._admit_waiting(self.prefill_chunk_size - _tokens(chunks))
            self._last_step_prefilled = bool(chunks)
            if chunks:
                return Batch(chunks)
            # No page for any prefill: run the decodes rather than stall.
        self._last_step_prefilled = False
        chunks = self._schedule_running(decodes=True, prefills=self.prefill_mode == "hybrid")
        if self.prefill_mode == "hybrid" and self.num_preemptions == preempted:
            chunks += self._admit_waiting(self.prefill_chunk_size - _tokens(chunks))
        return Batch(chunks) if chunks else None

    def finish(self, seq: Sequence) -> None:
        """Take a finished or aborted sequence out of the queues, offer its KV to the prefix
        cache, and free its pages."""
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)
        if self.prefix_cache is not None:
            self.prefix_cache.recycle(seq.token_ids[: seq.num_computed], seq.pages)
        self._free_pages(seq)
        seq.status = SeqStatus.FINISHED

    def commit(self, batch: Batch) -> None:
        """Record that the batch ran: its tokens now have KV in the cache. Prefill chunks are
        offered to the prefix cache right away, so requests arriving meanwhile can share them."""
        for c in batch.chunks:
            c.seq.num_computed += c.num_tokens
            if self.prefix_cache is not None and not c.decode:
                self.prefix_cache.insert(c.seq.token_ids[: c.seq.num_computed], c.seq.pages)

    # -- internals -----------------------------------------------------------------------------

    def _has_prefill_work(self) -> bool:
        return any(not s.is_decoding for s in self.running) or (
            bool(self.waiting) and len(self.running) < self.max_num_sequence
        )

    def _schedule_running(self, decodes: bool, prefills: bool) -> list[ScheduledChunk]:
        """Chunks for running sequences: decodes first claim their token, prefills share the rest."""
        num_decodes = sum(1 for s in self.running if s.is_decoding) if decodes else 0
        budget = self.prefill_chunk_size - num_decodes if prefills else 0
        chunks: list[ScheduledChunk] = []
        i = 0
        while i < len(self.running):
            seq = self.running[i]
            is_decode = seq.is_decoding
            n = (1 if decodes else 0) if is_decode else min(seq.num_pending, budget)
            if n <= 0:
                i += 1
                continue
            if not self._reserve(seq, n):
                continue  # seq preempted itself (it was the newest); nothing left after it
            if not is_decode:
                budget -= n
            chunks.append(ScheduledChunk(seq, n, samples=n == seq.num_pending, decode=is_decode))
            i += 1
        return chunks

    def _reserve(self, seq: Sequence, n: int) -> bool:
        """Give ``seq`` pages for ``n`` more tokens, preempting the newest sequences if needed.

        Returns False when ``seq`` had to preempt itself (it was the newest one left).
        """
        need = pages_needed(seq.num_computed + n, self.page_size) - len(seq.pages)
        while self._make_room(need) < need:
            victim = self.running[-1]
            self._preempt(victim)
            if victim is seq:
                return False
        if need > 0:
            seq.pages += self.pool.alloc(need)
        return True

    def _admit_waiting(self, budget: int) -> list[ScheduledChunk]:
        chunks: list[ScheduledChunk] = []
        while self.waiting and budget > 0 and len(self.running) < self.max_num_sequence:
            seq = self.waiting[0]
            reused = self._reuse_prefix(seq)
            n = min(seq.num_pending, budget)
            need = pages_needed(seq.num_computed + n, self.page_size) - len(seq.pages)
            if self._make_room(need) < need:
                if reused:  # give the shared prefix back; it is matched again next time
                    self._free_pages(seq)
                    seq.num_computed = 0
                break  # first come, first served: nobody overtakes the head of the queue
            if reused:
                self.prefix_queried_tokens += len(seq.token_ids)
                self.prefix_hit_tokens += seq.num_computed
            self.waiting.popleft()
            seq.pages += self.pool.alloc(need)
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            budget -= n
            chunks.append(ScheduledChunk(seq, n, samples=n == seq.num_pending, decode=seq.is_decoding))
        return chunks

    def _reuse_prefix(self, seq: Sequence) -> bool:
        """Start a fresh sequence from the cached pages of its longest cached prefix; returns
        whether the cache was consulted.

        The last token is never matched: its forward pass gives the logits to sample from.
        """
        if self.prefix_cache is None or seq.num_computed or seq.pages:
            return False
        pages = self.prefix_cache.match(seq.token_ids[:-1])
        self.pool.share(pages)
        seq.pages = pages
        seq.num_computed = len(pages) * self.page_size
        return True

    def _make_room(self, need: int) -> int:
        """Evict unused cached prefixes until ``need`` pages are free, if the cache has them;
        returns the pages free now."""
        if self.prefix_cache is not None and need > self.pool.num_free:
            self.prefix_cache.evict(need - self.pool.num_free)
        return self.pool.num_free

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._free_pages(seq)
        seq.num_computed = 0
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def _free_pages(self, seq: Sequence) -> None:
        self.pool.release(seq.pages)
        seq.pages = []
