"""The speculative-decoding policy the engine calls: how many drafts, which, and what was accepted.

Lossless whatever the drafts: the target samples every drafted position as if the drafts before
it were accepted, with that position's own noise (``sampler.position_generator``), and drafts
are accepted while they equal its samples, down a chain or a tree. Every token emitted is the
target's own sample, so greedy and seeded output equal speculation off; docs/speculative.md
("The output does not change") tells why that is rejection sampling.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional, Protocol, runtime_checkable

import torch

from lmserve.config import MAX_ADAPTIVE_K, EngineConfig
from lmserve.models.args import ModelArgs
from lmserve.plan import EnginePlan
from lmserve.request import Sequence
from lmserve.runner import ModelRunner
from lmserve.scheduler import Batch, ScheduledChunk
from lmserve.speculative.adaptive import AdaptiveDraftLength, DraftChoice
from lmserve.speculative.draft_model import DraftModelDrafter, draft_opt
from lmserve.speculative.eagle import EagleDrafter
from lmserve.speculative.medusa import MedusaDrafter, read_medusa_heads
from lmserve.speculative.ngram import NgramDrafter


@dataclass
class SpecCounters:
    """vLLM's spec_decode counters: verify steps with drafts, drafts, accepted drafts, and
    accepted drafts per draft position (index 0: first drafts accepted)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)


class Drafter(Protocol):
    """What the speculator needs of a drafter (``NgramDrafter``, ``DraftModelDrafter``,
    ``EagleDrafter``, ``MedusaDrafter``)."""

    # Where the adaptive length starts for one to three streams: deep for a drafter whose drafts
    # are right most of the time or that drafts little where it is unsure, shallow for one
    # whose drafts cost a pass each and are often wrong (the climb from a wrong start costs:
    # from 4 down to 0 takes about 175 steps).
    adaptive_start: int

    def offer(self, seq: Sequence, cap: int) -> int:
        """How deep the drafter can draft for ``seq`` this step, at most ``cap``."""

    def num_nodes(self, seq: Sequence, depth: int) -> int:
        """The draft tokens (tree nodes) it drafts for ``seq`` at most ``depth`` deep."""

    def behind(self, seq: Sequence) -> int:
        """The tokens of ``seq`` it would run before drafting (a drafter with state that sat
        out catches up); the adaptive length weighs a try's catch-up by them."""

    def propose(self, batch: Batch, depths: dict[ScheduledChunk, int]) -> None:
        """Fill the ``draft`` of the chunks in ``depths``: at most that deep and
        ``num_lookahead`` nodes, and at most what was offered. A drafter with its own KV (a
        draft model) writes it only for the chain it ran, put first as nodes 0, 1, ... (see
        ``Scheduler.update``)."""


@runtime_checkable
class FeatureDrafter(Drafter, Protocol):
    """A drafter on the target's hidden states (``EagleDrafter``, ``MedusaDrafter``)."""

    feature_layers: tuple[int, ...]  # which (see ``ModelRunner.feature_layers``)

    def observe(self, seq: Sequence, start: int, features: torch.Tensor) -> None:
        """The features ``(n, F)`` of ``seq``'s verified tokens from position ``start`` on."""


class Speculator:
    """Speculative decoding with a drafter (a chain or trees of drafts) and a draft length
    (depth): fixed ``k``, or adaptive (k=0, chosen per step by ``AdaptiveDraftLength`` up to
    ``MAX_ADAPTIVE_K``)."""

    def __init__(self, drafter: Drafter, k: int, max_sequence_length: int,
                 pipeline_stages: int = 1) -> None:
        self.drafter = drafter
        self.adaptive = AdaptiveDraftLength(drafter.adaptive_start, pipeline_stages) if k == 0 \
            else None
        self.max_k = k or MAX_ADAPTIVE_K
        self.max_sequence_length = max_sequence_length
        self.counters = SpecCounters(accepted_per_pos=[0] * self.max_k)
        # A drafter on the target's hidden states (Medusa, EAGLE) names the ones it needs (see
        # ``ModelRunner.feature_layers``); the engine hands it those of each step's verified
        # tokens (``observe``).
        self.feature_layers: Optional[tuple[int, ...]] = getattr(drafter, "feature_layers", None)
        # The next step's, from ``lookahead`` to ``propose``: the drafter's offer, the slots
        # asked and the draft length per sequence, and the adaptive length's choice.
        self._depths: dict[Sequence, int] = {}
        self._asked: dict[Sequence, int] = {}
        self._allowed: dict[Sequence, int] = {}
        self._choice: Optional[DraftChoice] = None
        # Where a lone sequence drafts nothing (the adaptive length decodes plainly, or prompt
        # lookup found no match), its multi-step run: the run's slots
        # (``MultiStepDecode.lookahead``, set by the engine), or None.
        self.plain_run: Optional[Callable[[list[Sequence], bool], list[int]]] = None

    def lookahead(self, seqs: list[Sequence], with_prefill: bool = False) -> list[int]:
        """Draft slots (tree nodes) for this step's decoding sequences: the drafter's nodes as
        deep as it offers, at most ``k`` (or the adaptive length), less near a sequence's length
        limits (a draft past ``max_tokens`` would be thrown away, and one past the longest
        sequence has no position). The adaptive length drafts nothing in a step that prefill
        chunks may share (``with_prefill``): such a step is compute-bound, where drafts cost a
        full token."""
        self._depths, self._asked, self._allowed, self._choice = {}, {}, {}, None
        k = self.max_k
        if self.adaptive is not None:
            if with_prefill:
                self.adaptive.skip()
                return [0] * len(seqs)
            # Chosen before the drafter is asked: a plain decode step (the usual choice of a
            # full batch) then pays for no lookups or draft passes.
            self._choice = self.adaptive.choose(len(seqs),
                                                sum(map(self.drafter.behind, seqs)))
            k = self._choice.length
            if k == 0:
                return self.plain_run(seqs, with_prefill) if self.plain_run else [0] * len(seqs)
        self._allowed = {s: min(k, self._cap(s)) for s in seqs}
        depths = [self.drafter.offer(s, allowed) if (allowed := self._allowed[s]) else 0
                  for s in seqs]
        if self.plain_run is not None and depths == [0]:
            return self.plain_run(seqs, with_prefill)  # (a lone sequence with nothing to draft)
        self._depths = dict(zip(seqs, depths))
        # A tree's nodes take slots past the sequence's end: keep them within the longest.
        slots = [min(self.drafter.num_nodes(s, d) if d else 0,
                     self.max_sequence_length - len(s.token_ids) - 1)
                 for s, d in zip(seqs, depths)]
        self._asked = dict(zip(seqs, slots))
        return slots

    def propose(self, batch: Batch) -> None:
        """Fill the drafts of every chunk with reserved slots (a chunk may have been granted
        fewer slots than asked: when pages were short, or to fit the step's tokens), and mark
        the batch with what the adaptive length measures it by."""
        depths = {c: min(self._depths[c.seq], c.num_lookahead)
                  for c in batch.chunks if c.num_lookahead and c.seq in self._depths}
        self.drafter.propose(batch, depths)
        batch.draft_choice = self._choice
        for c in batch.chunks:
            # The length allowed, whatever the drafter offered (a short match earns less); but
            # where the scheduler cut the slots, the positions past them were never drafted.
            c.draft_length = self._allowed.get(c.seq, 0)
            if c.num_lookahead < self._asked.get(c.seq, 0):
                c.draft_length = min(c.draft_length, max(map(c.draft.depth, range(len(c.draft))),
                                                         default=0))
        self._depths, self._asked, self._allowed, self._choice = {}, {}, {}, None

    def record(self, batch: Batch, seconds: float) -> None:
        """Count a step (its chunks' ``num_accepted`` set) that took ``seconds`` in all. A
        multi-step run counts as plain decoding at its time a token."""
        if batch.tokens is not None:
            if batch.draft_choice is not None:
                assert self.adaptive is not None  # (a draft choice is the adaptive length's)
                n = len(batch.tokens)
                self.adaptive.observe(batch.draft_choice, seconds / n, [(0, 0)], False, steps=n)
            return
        decode_only, outcomes, drafted = True, [], False
        for chunk in batch.chunks:
            if not chunk.decode:
                decode_only = False
                continue
            drafts, accepted = len(chunk.draft), chunk.num_accepted
            outcomes.append((chunk.draft_length, accepted))
            drafted = drafted or drafts > 0
            if drafts:
                c = self.counters
                c.num_drafts += 1
                c.num_draft_tokens += drafts
                c.num_accepted_tokens += accepted
                for pos in range(accepted):
                    c.accepted_per_pos[pos] += 1
        if batch.draft_choice is not None and decode_only:
            assert self.adaptive is not None  # (a draft choice is the adaptive length's)
            self.adaptive.observe(batch.draft_choice, seconds, outcomes, drafted)

    def _cap(self, seq: Sequence) -> int:
        left = self.max_sequence_length - len(seq.token_ids)
        max_tokens = seq.request.params.max_tokens
        if max_tokens is not None:
            left = min(left, max_tokens - seq.num_output_tokens)
        return max(0, min(self.max_k, left - 1))


def make_speculator(config: EngineConfig, plan: EnginePlan, target: ModelArgs,
                    draft_runner: Optional[ModelRunner] = None,
                    eos_token_ids: frozenset[int] = frozenset()) -> Optional[Speculator]:
    """The config's speculative decoding, or None when it is off. ``draft_runner``: the draft
    model's worker, for ``small_draft``, or the EAGLE head's; ``target``: the model (Medusa heads
    must fit it); ``eos_token_ids``: the tokenizer's, where a draft model's chain ends (and which
    ``min_tokens`` bans from a sampling request's draws as from its tokens)."""
    if config.speculative_mode == "disable":
        return None
    width = config.spec_tree_width
    if config.speculative_mode == "ngram":
        drafter: Drafter = NgramDrafter(width)
    elif config.speculative_mode == "medusa":
        path = config.additional_models[0]
        assert isinstance(path, str)  # (EngineConfig takes a (path, model_lib) pair for small_draft only)
        try:
            heads = read_medusa_heads(path, target)
        except (OSError, ValueError) as err:
            raise type(err)(f"additional_models[0] (the Medusa heads): {err}") from None
        if heads.choices is not None and target.ssm_layers:
            raise ValueError("additional_models[0] (the Medusa heads) has medusa_choices, a tree, "
                             "which a model with recurrent layers cannot verify: its state follows "
                             "one chain of tokens")
        drafter = MedusaDrafter(heads, draft_opt(config), width)
    elif config.speculative_mode == "eagle":
        if draft_runner is None:
            raise ValueError("speculative_mode='eagle' needs the EAGLE head's runner (draft_runner)")
        drafter = EagleDrafter(draft_runner, draft_runner.model.aux_layers, plan.prefill_chunk_size, width)
    else:
        if draft_runner is None:
            raise ValueError("speculative_mode='small_draft' needs the draft model's runner (draft_runner)")
        drafter = DraftModelDrafter(draft_runner, plan.prefill_chunk_size, width, plan.bounded,
                                    eos_token_ids)
    return Speculator(drafter, config.spec_draft_length, plan.max_single_sequence_length,
                      config.pipeline_parallel_stages or 1)
