"""EngineCore: the single loop body that owns the model, the KV cache and the scheduler."""

from __future__ import annotations

import dataclasses
import logging
import numbers
import random
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from lmserve.cache.free_list import FreeList
from lmserve.cache.manager import KVCacheManager
from lmserve.cache.pages import PagePool
from lmserve.cache.radix import RadixCache
from lmserve.cache.snapshots import StateSnapshots
from lmserve.cache.state_manager import StateManager
from lmserve.config import EngineConfig, parse_opt
from lmserve.engine.multi_step import MultiStepDecode
from lmserve.engine.output import OutputProcessor
from lmserve.engine.verifier import NewTokens, Verifier
from lmserve.errors import CONTEXT_LENGTH_EXCEEDED, InvalidRequestError
from lmserve.models.source import open_model
from lmserve.outputs import EngineStats, RequestOutput, SequenceDelta, TokenLogprob
from lmserve.parallel.driver import ParallelRunner
from lmserve.parallel.group import ParallelGroup, world_size
from lmserve.parallel.rank import build_rank
from lmserve.plan import make_plan, resolve_window
from lmserve.request import Request, SeqStatus, Sequence
from lmserve.sampling_params import OutOfVocabularyError, SamplingParams
from lmserve.scheduler import Batch, Scheduler
from lmserve.speculative.draft_model import draft_opt, read_draft_model
from lmserve.speculative.eagle import build_eagle_runner
from lmserve.speculative.eagle_heads import read_eagle_head
from lmserve.speculative.speculator import SpecCounters, make_speculator
from lmserve.structured.compiler import GrammarCompiler
from lmserve.structured.matcher import SequenceGrammar
from lmserve.worker import build_worker

logger = logging.getLogger("lmserve")

# KV pages free this long give their memory back to the system (see PagePool.idle_pages). Long
# enough that a page freed by one request is usually taken again by the next while it is warm.
KV_IDLE_RELEASE_S = 5.0


@dataclass
class _Counters:
    prefill_tokens: int = 0
    decode_tokens: int = 0
    steps: int = 0


class EngineCore:
    """Loads the model and runs steps: schedule, execute, sample, append, update. Not thread-safe:
    exactly one thread (the engine loop) calls ``add_request``, ``abort_request`` and ``step``."""

    def __init__(self, config: EngineConfig) -> None:
        # A model library brings its own opt and parallel split (``open_model``).
        config, self.source = open_model(config)
        self.config = config
        self.args = self.source.args
        draft = read_draft_model(config, self.args)
        eagle = read_eagle_head(config, self.args)
        draft_args = draft.args if draft is not None else eagle.args if eagle is not None else None
        draft_level = draft_opt(config, draft)  # (read only with a draft model or an EAGLE head)
        self.plan = make_plan(config, self.args, draft_args=draft_args, draft_opt=draft_level,
                              stage_layers_given=self.source.stage_layers)
        opt = parse_opt(config.opt)
        self.device = torch.device("cpu")

        self.group = None  # the other ranks of a parallel engine, started here
        if world_size(config) > 1:  # (make_plan has refused a split the model cannot take)
            self.group = ParallelGroup.start(config)
        try:
            self.runner = self._build_runner(opt)
            # A draft model is a second worker over the same page ids (its own KV tensors). Under a
            # window on every layer it attends within the same window (pages past it are given
            # back; its drafts only need to be good guesses), else within its own, if any.
            self.draft_runner = None
            if draft is not None:
                kv_dtype = self.plan.draft_kv_dtype
                assert kv_dtype is not None  # (planned for every draft model)
                draft_plan = dataclasses.replace(self.plan, kv_dtype=kv_dtype)
                if not self.plan.bounded:
                    window, layers = resolve_window(None, None, draft.args)
                    draft_plan = dataclasses.replace(draft_plan, window=window, window_layers=layers)
                self.draft_runner = build_worker(draft.load_model(draft_level), draft_plan, draft_level,
                                                 self.device)
            elif eagle is not None:  # an EAGLE head: its layer's KV over the same page ids
                self.draft_runner = build_eagle_runner(eagle, self.runner.model, self.plan, draft_level,
                                                       self.device)
            self.tokenizer = self.source.tokenizer()
            plan = self.plan
            self.pool = PagePool(plan.num_pages)
            self.prefix_cache = self._make_prefix_cache(config, plan)
            self.kv_manager = KVCacheManager(self.pool, plan.page_size, self.prefix_cache,
                                             with_draft=self.draft_runner is not None,
                                             window=plan.window if plan.bounded else None,
                                             states=self._make_state_manager(plan),
                                             paged=plan.num_pages > 0,
                                             lazy_draft=draft is not None and not plan.bounded)
            self.speculator = make_speculator(config, plan, self.args, self.draft_runner,
                                              frozenset(self.tokenizer.eos_token_ids))
            if self.speculator is not None:
                self.runner.feature_layers = self.speculator.feature_layers
            # A lone greedy sequence's multi-step runs: without speculation, or where the drafter
            # drafts nothing (not beside drafters on the target's features: no chain builds).
            self.multi_step = None
            if opt.multi_step:
                self.multi_step = MultiStepDecode.build(self.runner, plan.max_single_sequence_length,
                                                        frozenset(self.tokenizer.eos_token_ids))
            if self.speculator is not None and self.multi_step is not None:
                self.speculator.plain_run = self._multi_step_lookahead
            lookahead = (self.speculator.lookahead if self.speculator is not None
                         else self._multi_step_lookahead if self.multi_step is not None else None)
            self.scheduler = Scheduler(self.kv_manager, plan.max_num_sequence, plan.prefill_chunk_size,
                                       config.prefill_mode, lookahead,
                                       config.pipeline_parallel_stages or 1)
            self.verifier = Verifier(self.runner, self.kv_manager, self.speculator, self.args.vocab_size,
                                     self.tokenizer.eos_token_ids, self.device, self.scheduler.add)
            self.outputs = OutputProcessor(self.tokenizer, plan.max_single_sequence_length)
            self.grammars = GrammarCompiler(self.tokenizer, self.args.vocab_size)
            self.requests: dict[str, Request] = {}
            # Batches started and not finished: (batch, its logits when ready, start time).
            self.in_flight: deque[tuple[Batch, Callable[[], Optional[torch.Tensor]], float]] = deque()
            self.counters = _Counters()
            self._said_queueing = False
            if self.group is not None:  # every rank is built, and this one is ready for steps
                self.group.barrier()
        except BaseException:
            self.close(kill=True)
            raise
        if config.verbose:
            logger.info("model %s (%s, %d layers)\n%s", self.source.describe(), self.args.architecture,
                        self.args.num_layers, plan.describe())

    # -- requests ------------------------------------------------------------------------------

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Refuse a request that can never run, before it is queued (safe from any thread).

        Raises ``InvalidRequestError`` (a ``ValueError``), so that a server can tell the
        caller's fault from a failure of the engine.
        """
        if not isinstance(prompt_token_ids, (list, tuple)) or not all(
                isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in prompt_token_ids):
            raise InvalidRequestError("the prompt must be a list of token ids (ints); encode text "
                                      "with the engine's tokenizer, or use chat/completions", "prompt")
        if not prompt_token_ids:
            raise InvalidRequestError("the prompt is empty: at least one token is needed", "prompt")
        limit = self.plan.max_single_sequence_length
        if len(prompt_token_ids) >= limit:
            raise InvalidRequestError(
                f"the prompt has {len(prompt_token_ids)} tokens, but this engine allows at most "
                f"{limit} tokens per sequence (prompt and output together), so at most "
                f"{limit - 1} prompt tokens", "prompt", CONTEXT_LENGTH_EXCEEDED
            )
        vocab = self.args.vocab_size
        bad = next((t for t in prompt_token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequestError(f"prompt token id {bad} is outside the vocabulary (size {vocab})",
                                      "prompt")
        try:
            params.check_vocab(vocab)
        except OutOfVocabularyError as err:
            raise InvalidRequestError(str(err), err.field) from None
        if params.structured_outputs is not None:
            # Compiled here, in the caller's thread; add_request then finds it in the cache.
            self.grammars.compile(params.structured_outputs)

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        req = Request(request_id, list(prompt_token_ids), params)
        # Compiled by validate() in the caller's thread: this finds it in xgrammar's cache.
        wanted = params.structured_outputs
        compiled = None if wanted is None else self.grammars.compile(wanted)
        for i in range(params.n):
            req.seqs.append(Sequence(req, i, list(prompt_token_ids), _seed(params, i),
                                     grammar=None if wanted is None else SequenceGrammar(compiled, wanted.origin)))
        if not req.prompt_scored:  # the first choice scores the prompt, then the others start
            req.seqs, req.deferred = req.seqs[:1], req.seqs[1:]
        self.requests[request_id] = req
        for seq in req.seqs:
            self.scheduler.add(seq)

    def abort_request(self, request_id: str, mid_step: bool = False) -> Optional[RequestOutput]:
        """Stop a request wherever it is and free its pages; its last output says "abort".
        ``mid_step``: from inside a step, after its forward pass and before ``update``, when a
        sequence's recurrent state is already past its computed tokens: nothing is cached."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        deltas = []
        for seq in req.seqs:
            if seq.status is not SeqStatus.FINISHED:
                self.scheduler.finish(seq, recycle=not mid_step)
                seq.finish_reason = "abort"
                deltas.append(SequenceDelta(seq.index, "", [], None, "abort"))
        deltas += [SequenceDelta(seq.index, "", [], None, "abort") for seq in req.deferred]
        req.deferred = []
        return RequestOutput(request_id, req.prompt_token_ids, deltas, finished=True)

    def has_work(self) -> bool:
        return self.scheduler.has_work() or bool(self.in_flight)

    def pages_held_by_requests(self) -> int:
        """KV pages some request holds (pages only the prefix cache holds do not count)."""
        return self.kv_manager.pages_held_by_sequences()

    def state_slots_held_by_requests(self) -> int:
        """Recurrent-state slots some request holds (snapshots in the prefix cache do not count)."""
        return self.kv_manager.states.held_by_sequences() if self.kv_manager.states else 0

    def stats(self) -> EngineStats:
        """A snapshot of queue sizes, KV use and counters (readable from any thread)."""
        sched, c = self.scheduler, self.counters
        spec = self.speculator.counters if self.speculator else SpecCounters()
        return EngineStats(
            num_running=len(sched.running),
            num_waiting=len(sched.waiting),
            kv_pages_used=self.pages_held_by_requests(),
            kv_pages_total=self.pool.num_pages,
            num_preemptions=sched.num_preemptions,
            prefill_tokens=c.prefill_tokens,
            decode_tokens=c.decode_tokens,
            steps=c.steps,
            prefix_cache_pages=self.prefix_cache.num_pages if self.prefix_cache else 0,
            prefix_cache_queried_tokens=sched.prefix_queried_tokens,
            prefix_cache_hit_tokens=sched.prefix_hit_tokens,
            spec_num_drafts=spec.num_drafts,
            spec_num_draft_tokens=spec.num_draft_tokens,
            spec_num_accepted_tokens=spec.num_accepted_tokens,
            spec_accepted_per_pos=list(spec.accepted_per_pos),
        )

    def release_idle_memory(self) -> int:
        """Give the memory of pages free for ``KV_IDLE_RELEASE_S`` back to the system; returns
        how many pages it was. Called every second, busy or idle: a parallel engine also keeps
        its other ranks waiting for the next step (they time out otherwise) and raises
        ``ParallelFailure`` here when a rank's process has exited."""
        if self.group is not None:
            self.group.check()
            self.runner.keep_alive()
        pages = self.pool.idle_pages(KV_IDLE_RELEASE_S)
        if pages:
            for runner in filter(None, (self.runner, self.draft_runner)):
                runner.discard_kv(pages, lambda p: self.pool.refcount(p) == 0)
        return len(pages)

    # -- the step ------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule, start, verify, append, update: one forward pass over the next batch;
        returns each touched request's news. Sequences advance (and offer tokens to the prefix
        cache) only in ``update``, after their new tokens are known.

        With pipeline stages, up to one batch per stage is in flight: a step starts batches
        (of sequences not in flight) until the pipeline is full, then finishes the oldest."""
        while len(self.in_flight) < self.scheduler.pipeline_depth:
            started = time.perf_counter()  # (scheduling is where drafts are looked up and get pages)
            batch = self.scheduler.schedule()
            if batch is None:
                break
            self.in_flight.append(self._start(batch, started))
        self._say_if_queueing()
        if not self.in_flight:
            return []
        batch, logits, started = self.in_flight.popleft()
        batch, new_tokens = self.verifier.verify(batch, logits())
        outputs = self._append(new_tokens)
        self.scheduler.update(batch)
        self._record(batch, time.perf_counter() - started)
        return outputs

    def _start(self, batch: Batch, started: float
               ) -> tuple[Batch, Callable[[], Optional[torch.Tensor]], float]:
        """Draft for the batch (scheduled from ``started`` on) and start its forward pass (see
        ``ParallelRunner.submit``)."""
        now = time.monotonic()
        for chunk in batch.chunks:
            if chunk.seq.request.first_scheduled_time is None:
                chunk.seq.request.first_scheduled_time = now
        if self.speculator is not None:
            self.speculator.propose(batch)
        if self.multi_step is not None and self.multi_step.run(batch):
            return batch, lambda: None, started  # its tokens are in: nothing to sample
        return batch, self.runner.submit(batch.step_input()), started

    def _record(self, batch: Batch, seconds: float) -> None:
        """Count the batch's tokens; the drafter's length and multi-step runs learn its time
        (which counts its scheduling: drafts cost their lookup and pages there)."""
        if self.speculator is not None:
            self.speculator.record(batch, seconds)
        if self.multi_step is not None:
            self.multi_step.record(batch, seconds)
        for c in batch.chunks:
            if c.decode:
                self.counters.decode_tokens += c.num_tokens + c.num_accepted
            else:
                self.counters.prefill_tokens += c.num_tokens
        self.counters.steps += 1

    def close(self, kill: bool = False) -> None:
        """Stop the other ranks of a parallel engine (``kill``: at once, after a failure);
        nothing to do for one process."""
        if self.group is not None:
            if getattr(self, "runner", None) is not None:  # (None yet if the build failed)
                self.runner.close()
            self.group.close(kill)
            self.group = None

    # -- internals -----------------------------------------------------------------------------

    def _multi_step_lookahead(self, seqs: list[Sequence], with_prefill: bool) -> list[int]:
        """A run's slots for a sequence decoding alone, with nothing else running or waiting
        (``MultiStepDecode``): the scheduler's ``lookahead`` without speculation, the
        speculator's where it drafts nothing (``Speculator.plain_run``)."""
        assert self.multi_step is not None  # (set as the lookahead only with multi-step runs)
        alone = len(self.scheduler.running) == 1 and not self.scheduler.waiting
        return self.multi_step.lookahead(seqs, alone and not with_prefill)

    def _say_if_queueing(self) -> None:
        """Say once, with the numbers, that requests wait for a batch slot: a user of the
        default mode (batch 4) who sends more at once should not be left guessing."""
        sched = self.scheduler
        if self._said_queueing or not sched.waiting or len(sched.running) < self.plan.max_num_sequence:
            return
        self._said_queueing = True
        hint = ("for many concurrent users use mode \"server\" (lmserve serve --mode server), "
                "which sizes the batch to the memory" if self.plan.mode != "server"
                else "--max-num-sequence sets a larger batch")
        logger.warning("requests are queueing for a batch slot (%d waiting): max_num_sequence=%d "
                       "(mode %s) runs at most %d at once; %s", len(self.scheduler.waiting),
                       self.plan.max_num_sequence, self.plan.mode, self.plan.max_num_sequence, hint)

    def _build_runner(self, opt):
        """The target model's runner: a worker, or rank 0's part of a parallel one (every
        rank builds its part on this plan)."""
        if self.group is None:
            return build_worker(self.source.load_model(opt), self.plan, opt, self.device)
        self.group.send(self.plan)
        runner = ParallelRunner(build_rank(self.source, opt, self.plan, self.group), self.group)
        logger.info("parallel engine: %s", self.group.describe())
        return runner

    def _make_prefix_cache(self, config: EngineConfig, plan) -> Optional[RadixCache]:
        """The radix prefix cache, unless disabled (mode "disable", or 0 recycled sequences)."""
        limit = config.prefix_cache_max_num_recycling_seqs
        if config.prefix_cache_mode == "disable" or limit == 0 or plan.num_pages == 0:
            return None
        if limit is None:
            limit = plan.max_num_sequence
        return RadixCache(self.pool, plan.page_size, max_recycled=None if limit == -1 else limit)

    def _make_state_manager(self, plan) -> Optional[StateManager]:
        """Recurrent-state slots and snapshots (a model with recurrent layers), or None.
        Snapshots are taken where prompt chunks end at multiples of the prefill chunk (a
        hybrid's: of whole pages too, so its cached KV pages end there)."""
        if plan.state is None:
            return None
        align = plan.page_size if plan.num_pages else 1
        every = plan.prefill_chunk_size // align * align
        snapshots = StateSnapshots(plan.state.snapshots) if plan.state.snapshots else None
        return StateManager(FreeList(plan.state.num_slots, "state slots"), plan.state.history, snapshots,
                            every, align)

    def _append(self, new_tokens: list[NewTokens]) -> list[RequestOutput]:
        by_request: dict[str, RequestOutput] = {}
        for seq, token_ids, logprobs in new_tokens:
            req = seq.request
            out = by_request.get(req.request_id)
            if out is None:
                out = by_request[req.request_id] = RequestOutput(
                    req.request_id, req.prompt_token_ids, [], False,
                    first_scheduled_time=req.first_scheduled_time,
                    prompt_logprobs=_take_prompt_logprobs(req))
            if out.error is not None:
                continue  # an earlier choice of this request already failed it
            try:
                delta = self.outputs.append(seq, token_ids, logprobs)
            except Exception as exc:  # fail this request only; the others go on
                logger.exception("request %s failed while processing its output", req.request_id)
                self.abort_request(req.request_id, mid_step=True)
                out.error, out.finished = exc, True
                continue
            out.deltas.append(delta)
        for out in by_request.values():
            if out.error is None:
                out.finished = self.requests[out.request_id].finished
                if out.finished:
                    del self.requests[out.request_id]
        return list(by_request.values())



def _seed(params: SamplingParams, index: int) -> Optional[int]:
    """The noise seed of choice ``index`` (None for greedy): the request's seed, or a fresh one."""
    if params.is_greedy:
        return None
    return params.seed + index if params.seed is not None else random.getrandbits(63)


def _take_prompt_logprobs(req: Request) -> Optional[list[Optional[TokenLogprob]]]:
    """The request's prompt logprobs (None first: the first token has no context) the first
    time they are complete; None before, after, and when not asked for."""
    if req.params.prompt_logprobs is None or req.prompt_logprobs_reported or not req.prompt_scored:
        return None
    req.prompt_logprobs_reported = True
    return [None, *req.prompt_logprobs]
