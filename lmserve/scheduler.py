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
from dataclasses import dataclass, field
from typing import Callable, Optional

from lmserve.cache.manager import KVCacheManager
from lmserve.request import SeqStatus, Sequence
from lmserve.speculative.adaptive import DraftChoice
from lmserve.speculative.tree import DraftTree, num_in_place
from lmserve.step import SeqStep, StepInput
from lmserve.util import cdiv


@dataclass(eq=False)
class ScheduledChunk:
    """``num_tokens`` tokens of ``seq``, starting at ``seq.num_computed``, in this step; a
    decoding sequence may add up to ``num_lookahead`` draft tokens after its newest token."""

    seq: Sequence
    num_tokens: int
    samples: bool  # the chunk reaches the sequence's last token, so a new token is sampled
    decode: bool  # the sequence was decoding (Sequence.is_decoding), not prefilling
    num_lookahead: int = 0  # draft slots reserved (pages allocated) for this step
    draft: DraftTree = field(default_factory=DraftTree)  # at most num_lookahead nodes, drafted
    draft_length: int = 0  # the draft length the speculator allowed (for the adaptive length)
    accepted: list[int] = field(default_factory=list)  # the draft nodes the target verified
    # Positions whose logit rows score the next prompt token (``prompt_logprobs``): those of the
    # chunk whose next prompt token has no logprob yet, ending where the sampled row begins.
    # Fixed when the chunk is scheduled (an abort while it is in flight resets the sequence).
    prompt_rows: range = field(init=False)

    def __post_init__(self) -> None:
        seq = self.seq
        self.prompt_rows = range(0)
        if not self.decode and seq.scores_prompt:
            end = min(seq.num_computed + self.num_tokens, seq.num_prompt_tokens - 1)
            self.prompt_rows = range(max(seq.num_computed, len(seq.request.prompt_logprobs)), max(end, 0))

    @property
    def num_accepted(self) -> int:
        return len(self.accepted)

    @property
    def num_logits(self) -> int:
        """Logit rows of the chunk: its prompt-scoring rows, then one per token sampled."""
        return len(self.prompt_rows) + (1 + len(self.draft) if self.samples else 0)

    def seq_step(self) -> SeqStep:
        """The chunk as plain data: its tokens then its drafts (with the tree's shape unless
        they are a chain), its logit rows (``num_logits``)."""
        start = self.seq.num_computed
        tokens = self.seq.token_ids[start : start + self.num_tokens]
        n = self.num_tokens
        tree = None if self.draft.is_chain else list(range(-1, n - 1)) + [
            n + p for p in self.draft.parents]
        return SeqStep(start=start, token_ids=tokens + self.draft.token_ids,
                       page_table=list(self.seq.pages),
                       num_logits=self.num_logits, tree_parents=tree,
                       state_slot=self.seq.state_slot,
                       history_slots=tuple(self.seq.history_slots[: len(self.draft)]))

    def accepted_moves(self) -> list[tuple[int, int]]:
        """Positions (from, to) that put the accepted path's KV at the positions of its depths
        (a draft node's KV is in the step's slot of its index)."""
        first = self.seq.num_computed + self.num_tokens  # the position of depth 1
        return [(first + node, first + depth) for depth, node in enumerate(self.accepted)
                if node != depth]


@dataclass
class Batch:
    chunks: list[ScheduledChunk]
    state_copies: list[tuple[int, int]] = field(default_factory=list)  # see StepInput
    # The adaptive draft length's choice for the step, which it measures the step by
    # (``Speculator``); None where it chose nothing.
    draft_choice: Optional[DraftChoice] = None
    # A multi-step run's new tokens (its one chunk's; ``engine.multi_step``), known when it ran:
    # nothing to sample.
    tokens: Optional[list[int]] = None

    def step_input(self) -> StepInput:
        """The step as the runner sees it: plain data, one ``SeqStep`` per chunk."""
        return StepInput([c.seq_step() for c in self.chunks], self.state_copies)


# Prompt tokens that sequences scoring their prompts (``prompt_logprobs``) run in one step, all
# together: each needs a logit row of the whole vocabulary (and its log-softmax), so the memory
# plan holds that many rows (``plan.workspace_bytes``).
SCORED_ROWS_PER_STEP = 256


def _fit(slots: list[int], room: int) -> list[int]:
    """Draft slots trimmed, longest first, to fit ``room`` tokens: a step never runs more tokens
    than ``prefill_chunk_size``, which sizes the activations' workspace."""
    slots = list(slots)
    while sum(slots) > max(room, 0):
        slots[slots.index(max(slots))] -= 1
    return slots


class Scheduler:
    def __init__(
        self,
        kv: KVCacheManager,
        max_num_sequence: int,
        prefill_chunk_size: int,
        prefill_mode: str = "hybrid",
        lookahead: Optional[Callable[[list[Sequence], bool], list[int]]] = None,
        pipeline_depth: int = 1,
    ) -> None:
        """``lookahead(seqs, with_prefill)``: the draft slots to reserve for each of this step's
        decoding sequences (the speculative drafter's wish), told whether prefill chunks may
        share the step; None without speculation. ``pipeline_depth``: batches in flight at
        once (pipeline stages), each of about ``1 / pipeline_depth`` of the sequences."""
        self.kv = kv
        self.pipeline_depth = pipeline_depth
        self.in_flight: set[Sequence] = set()  # scheduled, not updated yet (pipeline_depth > 1)
        self._cap = max_num_sequence  # most sequences in the batch being scheduled
        self._scoring_left = SCORED_ROWS_PER_STEP  # prompt rows the batch may still score
        self.lookahead = lookahead
        self.max_num_sequence = max_num_sequence
        self.prefill_chunk_size = prefill_chunk_size
        self.prefill_mode = prefill_mode
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self._last_step_prefilled = False  # chunked mode alternates prefill and decode steps
        self._wishes: dict[Sequence, int] = {}  # this step's draft slots wished, by sequence
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
        self._cap = self._batch_cap()
        self._scoring_left = SCORED_ROWS_PER_STEP
        decodes_wait = any(s.is_decoding for s in self._ready())
        if (self.prefill_mode == "chunked" and self._has_prefill_work()
                and not (self._last_step_prefilled and decodes_wait)):
            chunks = self._schedule_running(decodes=False, prefills=True)
            if self.num_preemptions == preempted:
                chunks += self._admit_waiting(self.prefill_chunk_size - self._tokens(chunks),
                                              self._cap - len(chunks))
            self._last_step_prefilled = bool(chunks)
            if chunks:
                return self._batch(chunks)
            # No page for any prefill: run the decodes rather than stall.
        self._last_step_prefilled = False
        chunks = self._schedule_running(decodes=True, prefills=self.prefill_mode == "hybrid")
        if self.prefill_mode == "hybrid" and self.num_preemptions == preempted:
            chunks += self._admit_waiting(self.prefill_chunk_size - self._tokens(chunks),
                                          self._cap - len(chunks))
        self._grant_draft_slots(chunks)
        return self._batch(chunks)

    def _batch(self, chunks: list[ScheduledChunk]) -> Optional[Batch]:
        """The step's batch, with the state copies decided since the last one; None if empty."""
        if not chunks:
            return None
        if self.pipeline_depth > 1:
            self.in_flight.update(c.seq for c in chunks)
        return Batch(chunks, self.kv.take_state_copies())

    def _ready(self) -> list[Sequence]:
        """The running sequences not in flight, oldest admission first."""
        return [s for s in self.running if s not in self.in_flight] if self.in_flight else self.running

    def _batch_cap(self) -> int:
        """Most sequences in the next batch: all, or with batches in flight their share, so
        that the pipeline's batches are about even."""
        if self.pipeline_depth == 1:
            return self.max_num_sequence
        admissible = min(len(self.waiting), self.max_num_sequence - len(self.running))
        return max(1, cdiv(len(self.running) + admissible, self.pipeline_depth))

    def finish(self, seq: Sequence, recycle: bool = True) -> None:
        """Take a finished or aborted sequence out of the queues, offer its KV (and recurrent
        state) to the prefix cache unless not ``recycle``, and free its pages."""
        self.in_flight.discard(seq)
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)
        self.kv.free(seq, recycle=recycle)
        seq.status = SeqStatus.FINISHED

    def update(self, batch: Batch) -> None:
        """Record what the step verified, after its new tokens were appended: the tokens run
        and the accepted drafts now have KV, the pages of rejected drafts are released; prefill
        chunks are offered to the prefix cache at once (so requests arriving meanwhile can share
        them); sequences that finished free their pages."""
        for c in batch.chunks:
            seq = c.seq
            self.in_flight.discard(seq)
            if seq.status is SeqStatus.FINISHED:
                continue  # aborted while its output was processed; its pages are free
            # A draft model's KV holds the chain it ran (drafters put it first, as nodes 0, 1,
            # ...) at their step slots: valid for the accepted nodes that did not move.
            seq.num_draft_computed = min(
                seq.num_draft_computed, seq.num_computed + c.num_tokens + num_in_place(c.accepted))
            # The accepted drafts have KV; a stop inside the accepted run may have cut the tokens.
            start = seq.num_computed
            seq.num_computed = min(start + c.num_tokens + c.num_accepted, len(seq.token_ids))
            self.kv.keep_state(seq, start, c.num_tokens + len(c.draft))
            if not c.decode:
                self.kv.cache(seq)
            self.kv.rollback(seq)  # pages reserved for rejected or unused draft slots
            self.kv.release_past_window(seq)
            if seq.finish_reason is not None:
                self.finish(seq)

    # -- internals -----------------------------------------------------------------------------

    def _has_prefill_work(self) -> bool:
        return any(not s.is_decoding for s in self._ready()) or (
            bool(self.waiting) and len(self.running) < self.max_num_sequence
        )

    def _schedule_running(self, decodes: bool, prefills: bool) -> list[ScheduledChunk]:
        """Chunks for running sequences: decodes first claim their token (and draft slots),
        prefills share the rest."""
        decoding = [s for s in self._ready() if s.is_decoding][:self._cap] if decodes else []
        slots = [0] * len(decoding)
        if self.lookahead and decoding:
            slots = self.lookahead(decoding, prefills and self._has_prefill_work())
        self._wishes = dict(zip(decoding, _fit(slots, self.prefill_chunk_size - len(decoding))))
        room = self.prefill_chunk_size - len(decoding) - sum(self._wishes.values())
        budget = room if prefills else 0
        chunks: list[ScheduledChunk] = []
        i = 0
        while i < len(self.running) and len(chunks) < self._cap:
            seq = self.running[i]
            is_decode = seq.is_decoding
            n = int(seq in self._wishes) if is_decode else self.kv.chunk_limit(
                seq, min(seq.num_pending, budget, self._prompt_cap(seq)))
            if seq in self.in_flight:
                n = 0
            if n <= 0:
                i += 1
                continue
            reserved = self._reserve(seq, n)
            if reserved is None:  # it waits for sequences in flight to come back
                i += 1
                continue
            if not reserved:
                continue  # seq preempted itself (it was the newest); nothing left after it
            if not is_decode:
                budget -= n
            chunks.append(self._chunk(seq, n, decode=is_decode))
            i += 1
        return chunks

    def _prompt_cap(self, seq: Sequence) -> int:
        """Most tokens of a chunk of ``seq``: while it scores its prompt (a logit row each, of
        the whole vocabulary), the tokens it scored already (recomputed after a preemption)
        and what is left of the step's ``SCORED_ROWS_PER_STEP``; else no limit."""
        if not seq.scores_prompt:
            return seq.num_pending
        return max(0, len(seq.request.prompt_logprobs) - seq.num_computed) + self._scoring_left

    def _chunk(self, seq: Sequence, n: int, decode: bool) -> ScheduledChunk:
        """A chunk of ``n`` tokens of ``seq``, its scored rows counted against the step's."""
        chunk = ScheduledChunk(seq, n, samples=n == seq.num_pending, decode=decode)
        self._scoring_left -= len(chunk.prompt_rows)
        return chunk

    def _tokens(self, chunks: list[ScheduledChunk]) -> int:
        """Tokens the chunks run, the draft slots wished for them included (granted later)."""
        return sum(c.num_tokens + self._wishes.get(c.seq, 0) for c in chunks)

    def _grant_draft_slots(self, chunks: list[ScheduledChunk]) -> None:
        """Give decoding chunks the draft slots wished for them, from the pages every chunk's
        own tokens left free: a draft that may be rejected never preempts a sequence, evicts a
        cached prefix or keeps a waiting one out."""
        for c in chunks:
            slots = self._wishes.get(c.seq, 0) if c.decode else 0
            while slots and not self.kv.allocate(c.seq, c.num_tokens, slots, evict=False):
                slots -= 1
            c.num_lookahead = slots
        self._wishes = {}

    def _reserve(self, seq: Sequence, n: int) -> Optional[bool]:
        """Give ``seq`` pages for ``n`` more tokens, preempting the newest sequences if needed.

        Returns False when ``seq`` had to preempt itself (it was the newest one left), None
        when it would have to but sequences in flight (never preempted: a batch in flight
        writes their pages) may give theirs back or be preempted once they are back.
        """
        while not self.kv.allocate(seq, n):
            victim = self._ready()[-1]
            if victim is seq and self.in_flight:
                return None
            self._preempt(victim)
            if victim is seq:
                return False
        return True

    def _admit_waiting(self, budget: int, room_for: int) -> list[ScheduledChunk]:
        """Admit waiting sequences, ``room_for`` at most, within ``budget`` tokens."""
        chunks: list[ScheduledChunk] = []
        while (self.waiting and budget > 0 and len(self.running) < self.max_num_sequence
               and len(chunks) < room_for):
            seq = self.waiting[0]
            if not self.kv.ready(seq):
                break  # a later choice waits for the first's state (first come, first served)
            reused = self.kv.match_prefix(seq)
            n = self.kv.chunk_limit(seq, min(seq.num_pending, budget, self._prompt_cap(seq)))
            if n <= 0 or not self.kv.allocate(seq, n):
                if reused:  # give the shared prefix back; it is matched again next time
                    self.kv.free(seq)
                break  # first come, first served: nobody overtakes the head of the queue
            if reused:
                self.prefix_queried_tokens += len(seq.token_ids)
                self.prefix_hit_tokens += seq.num_computed
            self.waiting.popleft()
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            budget -= n
            chunks.append(self._chunk(seq, n, decode=seq.is_decoding))
        return chunks

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.kv.free(seq)
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
