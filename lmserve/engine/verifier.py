"""From a batch's logits to its new tokens: the prompts scored where asked, a row sampled per
drafted position and one after, drafts accepted by one rule for every drafter and tree
(``lmserve.speculative.speculator`` says why that is lossless), a drafter on the target's hidden
states handed the accepted rows, and an accepted tree path's KV moved into place."""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import torch

from lmserve.cache.manager import KVCacheManager
from lmserve.outputs import TokenLogprob
from lmserve.request import SeqStatus, Sequence
from lmserve.runner import Runner
from lmserve.sampler import SampleResult, sample, score_tokens, sequence_batch
from lmserve.scheduler import Batch, ScheduledChunk
from lmserve.speculative.speculator import FeatureDrafter, Speculator
from lmserve.structured.matcher import fill_bitmask


class NewTokens(NamedTuple):
    """A sequence's tokens from one step (one, or accepted drafts and one more), in order."""

    seq: Sequence
    token_ids: list[int]
    logprobs: Optional[list[TokenLogprob]]


class Verifier:
    """Turns a finished forward pass into each sequence's new tokens (``verify``)."""

    def __init__(self, runner: Runner, kv_manager: KVCacheManager, speculator: Optional[Speculator],
                 vocab_size: int, eos_token_ids: list[int], device: torch.device,
                 start: Callable[[Sequence], None]) -> None:
        """``start`` schedules a request's other choices once its first has scored the prompt."""
        self.runner = runner
        self.kv_manager = kv_manager
        self.speculator = speculator
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.device = device
        self.start = start

    def verify(self, batch: Batch, logits: Optional[torch.Tensor]) -> tuple[Batch, list[NewTokens]]:
        """The batch without the sequences aborted while it was in flight, and its new tokens
        (a multi-step run's are in already: no logits)."""
        if batch.tokens is not None:
            return batch, [NewTokens(batch.chunks[0].seq, batch.tokens, None)]
        assert logits is not None  # every batch but a multi-step run's has run the model
        if any(c.seq.status is SeqStatus.FINISHED for c in batch.chunks):
            batch, logits = _without_aborted(batch, logits)
        new_tokens = self._sample(batch, self._score_prompts(batch, logits))
        if self.runner.feature_layers is not None:
            self._observe(batch)
        self._move_accepted_kv(batch)
        return batch, new_tokens

    def _score_prompts(self, batch: Batch, logits: torch.Tensor) -> torch.Tensor:
        """Record the prompt logprobs of the chunks that score their prompt and return the
        other rows (those sampled from). Once a prompt is scored, its request's other choices
        start."""
        if not any(c.prompt_rows for c in batch.chunks):
            return logits
        sampled: list[int] = []
        row = 0
        for c in batch.chunks:
            positions, rows, req = c.prompt_rows, c.num_logits, c.seq.request
            n = len(positions)
            k = req.params.prompt_logprobs
            if n and k is not None:  # (a chunk has prompt rows only where its request asks)
                if positions.start != len(req.prompt_logprobs):
                    raise RuntimeError(f"request {req.request_id}: prompt logprobs from position "
                                       f"{positions.start}, {len(req.prompt_logprobs)} scored")
                targets = torch.tensor(req.prompt_token_ids[positions.start + 1 : positions.stop + 1])
                result = score_tokens(logits[row : row + n], targets, k)
                req.prompt_logprobs += [_logprob(result, r, k) for r in range(n)]
                if req.prompt_scored:
                    for seq in req.deferred:
                        req.seqs.append(seq)
                        self.start(seq)
                    req.deferred = []
            sampled += range(row + n, row + rows)
            row += rows
        return logits[sampled]

    def _sample(self, batch: Batch, logits: torch.Tensor) -> list[NewTokens]:
        """Each sampling chunk's new tokens: a row per drafted position and one after, sampled
        as if the drafts before it were accepted; the drafts accepted and the target's token
        after them. Without drafts: one sampled token."""
        chunks = [c for c in batch.chunks if c.samples]
        if not chunks:
            return []
        # Per chunk, per row: the drafts before the row's position (the path to its draft node).
        paths = [[[c.draft.token_ids[n] for n in c.draft.path(node)] for node in range(-1, len(c.draft))]
                 for c in chunks]
        rows = [(c.seq, before) for c, befores in zip(chunks, paths) for before in befores]
        masks = fill_bitmask([(c.seq.grammar, p) for c, p in zip(chunks, paths)], self.vocab_size)
        result = sample(logits, sequence_batch(rows, self.vocab_size, self.device, self.eos_token_ids, masks))
        sampled = result.token_ids.tolist()
        new, row = [], 0
        for c in chunks:
            c.accepted = c.draft.accept(sampled[row : row + len(c.draft) + 1])
            kept = [row] + [row + 1 + node for node in c.accepted]  # rows after each new token
            k = c.seq.request.params.logprobs
            logprobs = None if k is None else [_logprob(result, r, k) for r in kept]
            new.append(NewTokens(c.seq, [sampled[r] for r in kept], logprobs))
            row += len(c.draft) + 1
        return new

    def _observe(self, batch: Batch) -> None:
        """Hand a drafter on the target's hidden states (Medusa, EAGLE) the features of each
        chunk's verified tokens (its tokens run and the drafts accepted), from the step just run:
        no second pass."""
        drafter = self.speculator and self.speculator.drafter
        assert isinstance(drafter, FeatureDrafter) and self.runner.features is not None  # feature_layers set
        offset, features = 0, self.runner.features
        for c in batch.chunks:
            end = offset + c.num_tokens
            if c.accepted == list(range(len(c.accepted))):  # a chain's first drafts: in place
                rows = features[offset : end + len(c.accepted)]
            else:
                rows = features[list(range(offset, end)) + [end + node for node in c.accepted]]
            drafter.observe(c.seq, c.seq.num_computed, rows)
            offset = end + len(c.draft)

    def _move_accepted_kv(self, batch: Batch) -> None:
        """Put the KV of accepted draft-tree paths at the positions of their depths."""
        src, dst = [], []
        for c in batch.chunks:
            for a, b in c.accepted_moves():
                src.append(self.kv_manager.slot(c.seq, a))
                dst.append(self.kv_manager.slot(c.seq, b))
        self.runner.move_kv(src, dst)


def _without_aborted(batch: Batch, logits: torch.Tensor) -> tuple[Batch, torch.Tensor]:
    """The batch and its logit rows without the sequences aborted while it was in flight
    (their pages are already free)."""
    chunks: list[ScheduledChunk] = []
    rows: list[int] = []
    row = 0
    for c in batch.chunks:
        n = c.num_logits
        if c.seq.status is not SeqStatus.FINISHED:
            chunks.append(c)
            rows += range(row, row + n)
        row += n
    return Batch(chunks, batch.state_copies, batch.draft_choice), logits[rows]


def _logprob(result: SampleResult, row: int, k: int) -> TokenLogprob:
    """Row ``row``'s token with its logprob and ``k`` top alternatives (a row that asked for them)."""
    assert result.logprobs is not None and result.top_ids is not None and result.top_logprobs is not None
    top = list(zip(result.top_ids[row, :k].tolist(), result.top_logprobs[row, :k].tolist()))
    return TokenLogprob(int(result.token_ids[row]), float(result.logprobs[row]), top)
