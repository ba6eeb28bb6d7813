"""Drafting with a small model (``speculative_mode="small_draft"``, ``additional_models[0]``).

The draft model is a second worker whose KV tensors are indexed by the same page ids as the
target's (``Sequence.num_draft_computed`` counts the tokens with draft KV). A drafting sequence
catches up on the tokens the draft has not run, then drafts one pass per position for all
drafting sequences together (a lone greedy one: its passes in one C++ call); a chain ends at a
stop token or after a near tie (``TIE_MARGIN``, ``DRAW_MARGIN``). Under a window on every layer
(``keep_up``) the draft keeps step every step, so pages are never held for a lagging draft.
docs/speculative.md ("A draft model") tells the rest.
"""

from __future__ import annotations

import logging
from typing import Optional

from lmserve.config import DEFAULT_DRAFT_OPT, EngineConfig, OptFlags, parse_opt
from lmserve.greedy_chain import GreedyChain
from lmserve.library.library import ModelLibrary
from lmserve.models.args import ModelArgs
from lmserve.models.source import ModelSource, open_draft_model
from lmserve.request import Sequence
from lmserve.runner import ModelRunner
from lmserve.scheduler import Batch, ScheduledChunk
from lmserve.speculative.coupled import coupled_tokens, lead_with, plain_greedy
from lmserve.speculative.tree import DraftTree
from lmserve.step import SeqStep, StepInput

logger = logging.getLogger("lmserve")

# A draft whose logit leads the draft's second best by less than this (a near tie) ends the
# chain: the target agrees there about as often as not (the built-in model drafting itself at O3
# for O0: 42% and 62% of the 24 and 32 near ties in chat and grounded answers, 99% of the other
# drafts; benchmarks/draft_ties.py), so passes past it are mostly wasted. 0.1 did best in a
# replay of recorded drafts (chat, k=8: 2.57x plain decoding, 2.52x at 0.05, 2.50x at 0.2, 2.34x
# without) and beat 0.2 in the benchmark, where chains ending there ran at 1.11x the tokens/s of
# chains run to k=8 (chat; performance.md).
# (At draft_opt=O1 the logits are bfloat16, whose steps above 8 are 0.06-0.125: there the rule
# ends a chain at exact or one-step ties.)
TIE_MARGIN = 0.1
# For a request that samples, a draft drawn with the request's noise (``spec.coupled``) whose
# quantile lies within this share of the distribution from an edge of the drawn token's share
# ends the chain too: the target's slightly different distribution puts the quantile in a
# neighbour as often as not there (the built-in model at O3 for O0, temperature 0.7, chat:
# 33% of the 15% of draws within 0.01 were the target's samples, 95% of the others).
DRAW_MARGIN = 0.01


class DraftModelDrafter:
    """Drafts from a draft model's runner, with ``width`` tokens at each depth: the draft (its
    best token, or the one a sampling request's noise draws) continues the chain, the next best
    are leaves beside it; at most ``max_pass_tokens`` tokens a pass."""

    # A draft model is right most of the time (the built-in at O3: 94-98% of the drafts, its
    # chain ending after a near tie), and between 4, 6 and 8 drafts the goodputs differ by a few
    # percent, so the adaptive length stays near its start, as prompt lookup's does.
    adaptive_start = 8

    def __init__(self, runner: ModelRunner, max_pass_tokens: int, width: int = 1,
                 keep_up: bool = False, eos_token_ids: frozenset[int] = frozenset()) -> None:
        self.runner = runner
        self.max_pass_tokens = max_pass_tokens
        self.width = width
        self.keep_up = keep_up
        self.eos_token_ids = eos_token_ids
        self.drafting = True  # whether the latest decode step drafted (see the module's doc)
        # One greedy sequence's chain runs in one C++ call where the draft's passes are all
        # kernels (greedy_chain.py); else, and for sampling requests, tree widths and
        # batches, pass by pass from here.
        self.chain = GreedyChain.build(runner) if width == 1 else None

    def offer(self, seq: Sequence, cap: int) -> int:
        return cap

    def num_nodes(self, seq: Sequence, depth: int) -> int:
        return depth * self.width

    def behind(self, seq: Sequence) -> int:
        return max(0, len(seq.token_ids) - 1 - seq.num_draft_computed)

    def propose(self, batch: Batch, depths: dict[ScheduledChunk, int]) -> None:
        # Catch up: prefill chunks' tokens while drafting goes on (the latest decode step
        # drafted), and every token of a drafting sequence up to its newest, whose logits give
        # the first drafts (under a window on every layer, always).
        if all(c.decode for c in batch.chunks) and batch.chunks:
            self.drafting = any(depths.values())
        ends = {}
        for c in batch.chunks:
            if not c.decode and (self.drafting or self.keep_up):
                ends[c] = c.seq.num_computed + c.num_tokens
            elif c.decode and (depths.get(c) or self.keep_up):
                ends[c] = len(c.seq.token_ids)
        first = self._catch_up(ends, {c for c, depth in depths.items() if depth})
        levels = {c: [first[c][0]] for c, depth in depths.items() if depth}  # candidates by depth
        tied = {c for c in levels if first[c][1]}
        for depth in range(1, max(depths.values(), default=0)):
            deeper = [c for c in levels if depths[c] > depth and c not in tied
                      and not self._ends(c.seq, levels[c][-1][0])]
            if not deeper:
                break
            if self.chain is not None and len(deeper) == 1 and plain_greedy(deeper[0].seq.request.params):
                self._chain_on(deeper[0].seq, depths[deeper[0]] - depth, levels[deeper[0]])
                break
            steps = [SeqStep(start=c.seq.num_draft_computed, token_ids=[levels[c][-1][0]],
                             page_table=list(c.seq.pages), num_logits=1) for c in deeper]
            rows = [(c.seq, [candidates[0] for candidates in levels[c]]) for c in deeper]
            for c, (candidates, near_tie) in zip(deeper, self._run(steps, rows)):
                c.seq.num_draft_computed += 1
                levels[c].append(candidates)
                if near_tie:
                    tied.add(c)
        for c, by_depth in levels.items():
            c.draft = DraftTree.from_candidates(by_depth, c.num_lookahead)

    def _chain_on(self, seq: Sequence, passes: int, candidates: list[list[int]]) -> None:
        """At most ``passes`` more drafts after the last of ``candidates`` (by depth), appended,
        in one C++ call (``self.chain``)."""
        assert self.chain is not None  # (called where there is one)
        drafts = self.chain.run(candidates[-1][0], seq.num_draft_computed, list(seq.pages), passes,
                                self._stop_ids(seq), TIE_MARGIN)
        seq.num_draft_computed += len(drafts)
        candidates += [[token] for token in drafts]

    def _ends(self, seq: Sequence, token: int) -> bool:
        """Whether a drafted ``token`` leaves nothing after it to draft: it ends ``seq`` when
        accepted (the output processor's rules, before stop strings), and before ``min_tokens``
        the sampler bans it, so it is rejected."""
        return token in self._stop_ids(seq)

    def _stop_ids(self, seq: Sequence) -> list[int]:
        """The token ids that end ``seq``'s chain (``_ends``)."""
        return seq.request.params.stop_ids(self.eos_token_ids)

    def _catch_up(self, ends: dict[ScheduledChunk, int],
                  drafting: set[ScheduledChunk]) -> dict[ScheduledChunk, tuple[list[int], bool]]:
        """Run each chunk's tokens from its draft count to its end, in passes of at most
        ``max_pass_tokens``; returns each ``drafting`` chunk's first drafts (``_run``'s)."""
        first: dict[ScheduledChunk, tuple[list[int], bool]] = {}
        while pending := [c for c, end in ends.items() if c.seq.num_draft_computed < end]:
            steps, chunks, budget = [], [], self.max_pass_tokens
            for c in pending:
                seq, n = c.seq, min(ends[c] - c.seq.num_draft_computed, budget)
                if n <= 0:
                    break
                start = seq.num_draft_computed
                wants = c in drafting and start + n == ends[c]
                steps.append(SeqStep(start=start, token_ids=seq.token_ids[start : start + n],
                                     page_table=list(seq.pages), num_logits=1 if wants else 0))
                chunks.append(c)
                budget -= n
            candidates = iter(self._run(steps, [(c.seq, []) for c, step in zip(chunks, steps)
                                                if step.num_logits]))
            for c, step in zip(chunks, steps):
                c.seq.num_draft_computed += len(step.token_ids)
                if step.num_logits:
                    first[c] = next(candidates)
        return first

    def _run(self, steps: list[SeqStep], rows: list[tuple[Sequence, list[int]]]
             ) -> list[tuple[list[int], bool]]:
        """One draft pass; per logit row (``(seq, drafts before it)``, as ``coupled_tokens``'s)
        ``width`` tokens, the draft first: the best ones, or where the request samples, the
        token its noise draws first (``spec.coupled``); and whether the draft is near a tie
        (``TIE_MARGIN``, ``DRAW_MARGIN``)."""
        logits = self.runner.execute(StepInput(steps))
        if not logits.shape[0]:
            return []
        best = logits.topk(max(self.width, 2), dim=-1)  # (40 us more than an argmax a pass)
        tied = ((best.values[:, 0] - best.values[:, 1]) < TIE_MARGIN).tolist()
        tokens = best.indices[:, : self.width].tolist()
        for i in (best.values[:, 0] == best.values[:, 1]).nonzero().flatten().tolist():
            # An exact tie: the first of the best tokens, as argmax (the target's greedy choice,
            # and GreedyChain's) takes it; topk's order among equals is unspecified.
            tokens[i] = lead_with(int(logits[i].argmax()), tokens[i])
        drawing = [i for i, (seq, _) in enumerate(rows) if not plain_greedy(seq.request.params)]
        if drawing:
            drawn, margins = coupled_tokens(logits[drawing], [rows[i] for i in drawing],
                                            self.eos_token_ids)
            for i, token, margin in zip(drawing, drawn, margins):
                tokens[i] = lead_with(token, tokens[i])
                tied[i] = margin < DRAW_MARGIN
        return list(zip(tokens, tied))


def read_draft_model(config: EngineConfig, target: ModelArgs) -> Optional[ModelSource]:
    """small_draft's model (its files, or its compiled library), checked against the target;
    None for other modes. Errors name ``additional_models[0]``."""
    if config.speculative_mode != "small_draft":
        return None
    given = config.additional_models[0]
    try:
        draft = open_draft_model(given)
    except (OSError, ValueError) as err:
        raise type(err)(f"additional_models[0] (the draft model): {err}") from None
    if draft.args.vocab_size != target.vocab_size:
        raise ValueError(
            f"additional_models[0] ({given!r}) has a vocabulary of {draft.args.vocab_size} tokens "
            f"and the model {target.vocab_size}: a draft model must share the target's vocabulary")
    return draft


def draft_opt(config: EngineConfig, draft: Optional[ModelSource] = None) -> OptFlags:
    """The drafter's level (a draft model's, or heads' when ``draft`` is None): a compiled
    draft model's library's, else the ``draft_opt`` knob (default O3)."""
    knob = parse_opt(config.opt).draft_opt
    if isinstance(draft, ModelLibrary):
        if knob is not None:
            logger.warning("draft_opt=%s is ignored: the draft's model library %s was compiled "
                           "with opt=%r", knob, draft.root, draft.info.opt)
        return parse_opt(draft.info.opt)
    return parse_opt(knob or DEFAULT_DRAFT_OPT)
