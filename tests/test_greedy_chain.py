"""A draft model's chain of greedy drafts in one C++ call (greedy_chain.py) against the same
drafts pass by pass through the runner: the same tokens, the same stopping, the same KV bits."""

from __future__ import annotations

import ctypes
import math

import pytest
import torch

from conftest import generate_tokens, wait_idle
from lmserve import Engine, SamplingParams
from lmserve.greedy_chain import GreedyChain, _library
from lmserve.layers.call_list import float_word
from lmserve.models.builtin import builtin_model_path
from lmserve.request import Request, Sequence
from lmserve.scheduler import Batch, ScheduledChunk
from lmserve.speculative.draft_model import DraftModelDrafter
from lmserve.step import SeqStep, StepInput

PASSES = 12


@pytest.fixture(scope="module", params=["O3", "O2", "O1", "O0"])
def draft(request):
    """An engine drafting with the built-in model at a level (idle: the test drives its draft
    runner directly), its chain, and a prompt."""
    engine = Engine(opt=f"O3;draft_opt={request.param}", verbose=False, max_num_sequence=1,
                    speculative_mode="small_draft", additional_models=[builtin_model_path()],
                    spec_draft_length=4)
    chain = GreedyChain.build(engine._core.draft_runner)
    prompt = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Name three rivers of Europe and the seas they flow into."}])
    yield engine._core.draft_runner, chain, prompt
    engine.shutdown()


def _pages(runner, prompt: list[int]) -> list[int]:
    size = runner.kv.page_size
    return list(range(1, 1 + math.ceil((len(prompt) + PASSES) / size)))


def _pass_by_pass(runner, prompt: list[int], pages: list[int]) -> tuple[list[int], list[float]]:
    """The prompt into the draft's cache, then PASSES one-token steps from Python, each
    feeding the previous step's best token: the drafts and each one's lead over the second."""
    runner.execute(StepInput([SeqStep(start=0, token_ids=prompt[:-1], page_table=pages, num_logits=0)]))
    token, drafts, leads = prompt[-1], [], []
    for i in range(PASSES):
        logits = runner.execute(StepInput([SeqStep(start=len(prompt) - 1 + i, token_ids=[token],
                                                   page_table=pages, num_logits=1)]))
        best = logits.topk(2, dim=-1)
        token = logits.argmax(dim=-1).item()  # (the first of exact ties, as the chain's pick)
        drafts.append(token)
        leads.append((best.values[0, 0] - best.values[0, 1]).item())
    return drafts, leads


def test_the_chain_drafts_what_passes_from_python_draft_and_writes_the_same_kv(draft):
    runner, chain, prompt = draft
    assert chain is not None  # every level's draft pass is all kernels here
    pages = _pages(runner, prompt)
    drafts, leads = _pass_by_pass(runner, prompt, pages)
    by_page = [t.view(runner.kv.num_pages, -1) for t in (*runner.kv.k, *runner.kv.v)]  # (see KVCache)
    kv = [t[pages].clone() for t in by_page]
    for t in by_page:
        t[pages] = 0  # what the chain writes, only the chain wrote
    runner.execute(StepInput([SeqStep(start=0, token_ids=prompt[:-1], page_table=pages, num_logits=0)]))
    assert chain.run(prompt[-1], len(prompt) - 1, pages, PASSES, [], -math.inf) == drafts
    assert all(torch.equal(t[pages], before) for t, before in zip(by_page, kv))
    assert len(set(drafts)) > 3  # (a real continuation, not one token over and over)


def test_the_chain_stops_after_a_near_tie_or_a_stop_token(draft):
    runner, chain, prompt = draft
    pages = _pages(runner, prompt)
    drafts, leads = _pass_by_pass(runner, prompt, pages)
    # A margin just above the smallest lead: the chain ends at its first draft with that lead.
    first_low = leads.index(min(leads))
    margin = math.nextafter(leads[first_low], math.inf)
    assert chain.run(prompt[-1], len(prompt) - 1, pages, PASSES, [], margin) == drafts[: first_low + 1]
    stop = drafts[3]
    end = drafts.index(stop) + 1
    assert chain.run(prompt[-1], len(prompt) - 1, pages, PASSES, [99999, stop], -math.inf) == drafts[:end]
    assert chain.run(prompt[-1], len(prompt) - 1, pages, 2, [], -math.inf) == drafts[:2]


def test_one_greedy_stream_drafts_through_the_chain_with_the_output_of_plain_decoding(builtin_engine):
    engine = Engine(verbose=False, max_num_sequence=1, speculative_mode="small_draft",
                    additional_models=[builtin_model_path()], spec_draft_length=6)
    chain = engine._core.speculator.drafter.chain
    runs, run = [], chain.run
    chain.run = lambda *args: runs.append(run(*args)) or runs[-1]
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    prompts = [engine.tokenizer.apply_chat_template([{"role": "user", "content": ask}])
               for ask in ("What is the capital of France?", "Write a haiku about the sea.",
                           "Explain photosynthesis in two sentences.")]
    try:
        assert [generate_tokens(engine, p, params) for p in prompts] == \
            [generate_tokens(builtin_engine, p, params) for p in prompts]
        assert max(map(len, runs)) == 5  # after the first draft (the catch-up pass's), k - 1
        assert engine.stats().spec_num_accepted_tokens > 0
        wait_idle(engine)
        assert engine.kv_pages_in_use() == 0
    finally:
        engine.shutdown()


def _propose(runner, chain_on: bool, prompts: list[list[int]], depths: list[int]):
    """A drafter's drafts for decoding sequences of ``prompts`` (the draft has run none of
    them: it catches up first), each to its depth; with its chain or pass by pass."""
    drafter = DraftModelDrafter(runner, max_pass_tokens=512)
    assert drafter.chain is not None
    runs = []
    if chain_on:
        run = drafter.chain.run
        drafter.chain.run = lambda *args: runs.append(run(*args)) or runs[-1]
    else:
        drafter.chain = None
    chunks, first_page = [], 1
    for name, prompt, depth in zip("abc", prompts, depths):
        seq = Sequence(Request(name, prompt, SamplingParams(temperature=0, ignore_eos=True)), 0,
                       list(prompt), None)
        seq.num_computed = len(prompt) - 1
        seq.pages = list(range(first_page, first_page + len(_pages(runner, prompt))))
        first_page += len(seq.pages)
        chunks.append(ScheduledChunk(seq, 1, samples=True, decode=True, num_lookahead=depth))
    drafter.propose(Batch(chunks), dict(zip(chunks, depths)))
    return [(c.draft.token_ids, c.seq.num_draft_computed) for c in chunks], runs


def test_a_chain_takes_over_when_one_sequence_drafts_on_alone(draft):
    """Three greedy sequences drafted together to depths 1, 2 and 8: once only the third goes
    deeper, the chain drafts its rest: the same drafts and draft KV counts as pass by pass."""
    runner, _, prompt = draft
    prompts = [prompt, prompt[:-3] + prompt[-1:], prompt[2:]]
    with_chain, runs = _propose(runner, True, prompts, [1, 2, 8])
    assert runs  # (drafts after the second depth: one sequence alone)
    assert with_chain == _propose(runner, False, prompts, [1, 2, 8])[0]


def _pick(row: torch.Tensor, margin: float = -math.inf, stops: tuple[int, ...] = ()) -> tuple[int, float, bool]:
    """The chain's greedy pick of one row of logits: (token, lead over the second, stop)."""
    token, lead, stop = torch.zeros(1, dtype=torch.int64), torch.zeros(1), torch.zeros(1, dtype=torch.int32)
    ids = torch.tensor(list(stops) or [0], dtype=torch.int64)
    words = torch.tensor([row.data_ptr(), int(row.dtype == torch.bfloat16), len(row), float_word(margin),
                          ids.data_ptr(), len(stops), token.data_ptr(), lead.data_ptr(), stop.data_ptr()],
                         dtype=torch.int64)
    _library().lm_greedy_pick_packed(ctypes.c_void_p(words.data_ptr()))
    return int(token), float(lead), bool(stop)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_pick_is_torchs_argmax_ties_and_nans_included(dtype):
    """The pick a lone sequence's tokens come from (multi-step decoding) is the sampler's
    argmax on every row: the first of exact ties, a NaN as torch counts it (the first), rows
    whose length is no multiple of the kernel's 16 lanes; and its lead is best minus second."""
    rng = torch.Generator().manual_seed(0)
    for n in (1, 15, 16, 17, 49152, 49157):
        row = torch.randn(n, generator=rng).to(dtype)
        rows = [row, row.clone().fill_(-math.inf), row.clone().fill_(3.0)]
        if n > 5:
            tie = row.clone()
            tie[n - 2] = tie[n // 3] = tie.max() + 1  # an exact tie, the later one in another lane
            nan = row.clone()
            nan[n - 1] = nan[n // 2] = math.nan
            rows += [tie, nan]
        for r in rows:
            token, lead, stop = _pick(r)
            assert token == int(r.argmax()), (n, r)
            top = r.float().topk(min(2, n)).values
            if not r.isnan().any() and n > 1:
                expected = float(top[0] - top[1])  # (NaN for a row of -inf)
                assert lead == expected if not math.isnan(expected) else math.isnan(lead)
            # No margin, no stop ids: only a NaN lead stops (a NaN, or no finite logit at all).
            assert stop == bool(r.isnan().any() or (r == -math.inf).all())
    row = torch.tensor([0.0, 2.0, 1.5, -1.0], dtype=dtype)
    assert _pick(row, margin=0.4) == (1, 0.5, False) and _pick(row, margin=0.6) == (1, 0.5, True)
    assert _pick(row, stops=(7, 1)) == (1, 0.5, True)
