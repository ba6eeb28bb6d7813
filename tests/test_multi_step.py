"""Multi-step decoding (engine/multi_step.py): a lone greedy sequence decodes several tokens a
step in one C++ call, with the same tokens as a token a step, ending where they end, and only
where nothing else changes its logits or waits for the engine."""

from __future__ import annotations

import itertools

import pytest

import lmserve.engine.multi_step as multi_step
from conftest import concurrently, generate_tokens, wait_idle
from lmserve import Engine, SamplingParams
from lmserve.models.builtin import builtin_model_path
from lmserve.scheduler import Batch
from lmserve.speculative.adaptive import DraftChoice
from lmserve.structured.params import StructuredOutputsParams

TEXTS = ["Name three rivers of Europe and the seas they flow into.", "Write a haiku about autumn."]


def _runs(engine: Engine) -> list[tuple[int, int]]:
    """Each multi-step run of ``engine`` from now on: (its tokens, the sequences running or
    waiting)."""
    ms, runs = engine._core.multi_step, []
    original = ms.run

    def run(batch):
        ran = original(batch)
        if ran:
            scheduler = engine._core.scheduler
            runs.append((len(batch.tokens), len(scheduler.running) + len(scheduler.waiting)))
        return ran

    ms.run = run
    return runs


def _prompt(engine: Engine, text: str) -> list[int]:
    return engine.tokenizer.apply_chat_template([{"role": "user", "content": text}])


@pytest.fixture(scope="module")
def engines():
    """The built-in model at a level with multi-step decoding and without, by level (built
    once for the module)."""
    pairs: dict[str, tuple[Engine, Engine]] = {}

    def pair(level: str) -> tuple[Engine, Engine]:
        if level not in pairs:
            pairs[level] = (Engine(opt=level, verbose=False),
                            Engine(opt=f"{level};multi_step=0", verbose=False))
        return pairs[level]

    yield pair
    for engine in (e for p in pairs.values() for e in p):
        engine.shutdown()


@pytest.fixture
def long_runs(monkeypatch):
    """Runs as long as ``MAX_RUN`` at every level (O0's tokens take longer than the budget)."""
    monkeypatch.setattr(multi_step, "RUN_SECONDS", 10.0)


@pytest.mark.parametrize("level", ["O2", "O3", "O1", "O0"])
def test_a_lone_greedy_stream_decodes_in_runs_with_the_tokens_of_one_a_step(engines, long_runs, level):
    on, off = engines(level)
    assert on._core.multi_step is not None and off._core.multi_step is None
    runs = _runs(on)
    for text in TEXTS:
        params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
        tokens = generate_tokens(on, _prompt(on, text), params)
        assert tokens == generate_tokens(off, _prompt(off, text), params)
        assert len(tokens) == 40
    # The first decode step times the stream, then runs of MAX_RUN take over.
    assert [n for n, _ in runs].count(multi_step.MAX_RUN) >= 6
    wait_idle(on)
    assert on.kv_pages_in_use() == 0


def _both(on: Engine, off: Engine, text: str, params: SamplingParams) -> tuple[list, list]:
    """Each engine's outputs (text and finish reason, tokens) for the same request."""
    def outputs(engine):
        outs = list(engine.generate(_prompt(engine, text), params))
        tokens = [t for o in outs for d in o.deltas for t in d.token_ids]
        text_ = "".join(d.text for o in outs for d in o.deltas)
        return text_, outs[-1].deltas[-1].finish_reason, tokens
    return outputs(on), outputs(off)


def test_runs_end_where_one_token_a_step_ends(engines, long_runs):
    """A stop token or end of sequence inside a run, a stop string, and max_tokens that are
    not a multiple of the run: the same text, tokens and finish reason."""
    on, off = engines("O2")
    runs = _runs(on)
    plain = generate_tokens(off, _prompt(off, TEXTS[0]), SamplingParams(temperature=0, max_tokens=60))
    text = off.tokenizer.decode(plain)
    cases = [
        SamplingParams(temperature=0, max_tokens=60),  # ends at the model's end of sequence or 60
        SamplingParams(temperature=0, max_tokens=60, stop_token_ids=[plain[13]]),
        SamplingParams(temperature=0, max_tokens=60, stop=[text[len(text) // 2 : len(text) // 2 + 4]]),
        SamplingParams(temperature=0, max_tokens=13, ignore_eos=True),
        # before min_tokens a stop token is banned: the argmax moves to the next best
        SamplingParams(temperature=0, max_tokens=60, min_tokens=12, stop_token_ids=[plain[5]]),
    ]
    for params in cases:
        a, b = _both(on, off, TEXTS[0], params)
        assert a == b, params
    assert runs and all(alone == 1 for _, alone in runs)
    wait_idle(on)
    assert on.kv_pages_in_use() == 0


def test_what_changes_the_logits_or_company_decodes_a_token_a_step(engines, long_runs):
    """Sampling, logprobs, penalties, a logit bias and a grammar take a token a step, with their
    outputs unchanged; of
    two streams, one runs only while nothing else is running or waiting."""
    on, off = engines("O2")
    runs = _runs(on)
    for params in (SamplingParams(temperature=0.8, seed=3, max_tokens=24),
                   SamplingParams(temperature=0, logprobs=2, max_tokens=24),
                   SamplingParams(temperature=0, logprobs=0, max_tokens=24),
                   SamplingParams(temperature=0, repetition_penalty=1.3, max_tokens=24),
                   SamplingParams(temperature=0, frequency_penalty=0.5, max_tokens=24),
                   SamplingParams(temperature=0, logit_bias={(_prompt(on, TEXTS[1])[-1]): 5.0}, max_tokens=24),
                   SamplingParams(temperature=0, max_tokens=24, structured_outputs=StructuredOutputsParams(
                       regex="[a-z ]{10,40}"))):
        a, b = _both(on, off, TEXTS[1], params)
        assert a == b, params
    assert runs == []
    # Chunked prefill runs decode-only steps between a prompt's chunks: no run may delay them.
    chunked = Engine(verbose=False, prefill_mode="chunked", prefill_chunk_size=16)
    try:
        runs = _runs(chunked)
        # The second arrives while the first decodes and outlasts it: it ends alone.
        requests = [(_prompt(on, t), SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
                    for t, n in zip(TEXTS, (30, 60))]
        together = concurrently(lambda r: generate_tokens(chunked, *r), requests, delays=[0, 0.1])
        assert together == [generate_tokens(off, *r) for r in requests]
        assert runs and all(alone == 1 for _, alone in runs)
    finally:
        chunked.shutdown()


def test_leaving_a_stream_between_runs_frees_every_page(engines, long_runs):
    on, _ = engines("O2")
    runs = _runs(on)
    for after in (1, 2, 3):
        stream = on.generate(_prompt(on, TEXTS[0]), SamplingParams(temperature=0, max_tokens=200))
        for seen, _ in enumerate(stream, 1):
            if seen == after:
                break
        stream.close()  # leaving the stream aborts the request
    wait_idle(on)
    assert runs and on.kv_pages_in_use() == 0


def test_a_run_stops_at_the_longest_sequence(long_runs):
    on = Engine(verbose=False, max_single_sequence_length=64)
    off = Engine(verbose=False, max_single_sequence_length=64, opt="O2;multi_step=0")
    try:
        runs = _runs(on)
        prompt = _prompt(on, TEXTS[1])
        params = SamplingParams(temperature=0, ignore_eos=True)
        tokens = generate_tokens(on, prompt, params)
        assert tokens == generate_tokens(off, prompt, params)
        assert len(prompt) + len(tokens) == 64 and runs
        wait_idle(on)
        assert on.kv_pages_in_use() == 0
    finally:
        on.shutdown()
        off.shutdown()


@pytest.mark.parametrize("mode", ["ngram", "small_draft"])
def test_where_the_adaptive_length_decodes_plainly_a_lone_stream_runs(engines, long_runs, mode):
    """With speculation, the steps where the adaptive draft length decodes plainly are runs;
    drafting resumes between them (a draft model catching up on the runs' tokens), and the
    output is plain decoding's."""
    _, off = engines("O2")
    extra = {"additional_models": [builtin_model_path()]} if mode == "small_draft" else {}
    engine = Engine(verbose=False, speculative_mode=mode, spec_draft_length=0, **extra)
    try:
        speculator = engine._core.speculator
        assert speculator.plain_run is not None
        lengths = itertools.cycle([0, 0, 4])  # plain, plain, drafts: the choices, not measured
        speculator.adaptive.choose = lambda num_seqs, behind=0: DraftChoice(num_seqs, next(lengths))
        speculator.adaptive.observe = lambda *args, **kwargs: None
        runs = _runs(engine)
        params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
        for text in TEXTS:
            assert generate_tokens(engine, _prompt(engine, text), params) == \
                generate_tokens(off, _prompt(off, text), params)
        # (prompt lookup drafts only where the text repeats itself)
        assert len(runs) >= 6 and speculator.counters.num_drafts >= (4 if mode == "small_draft" else 1)
        wait_idle(engine)
        assert engine.kv_pages_in_use() == 0
    finally:
        engine.shutdown()


def test_the_adaptive_length_times_a_run_as_plain_decoding_a_token():
    """A run of 4 tokens in 40 ms is 4 steps of plain decoding (length 0, nothing drafted) at
    10 ms; the 4 steps count towards the next try of a length that drafts as 4 plain ones."""
    engine = Engine(verbose=False, speculative_mode="ngram", spec_draft_length=0)
    try:
        speculator, seen = engine._core.speculator, []
        speculator.adaptive.observe = lambda *args, **kwargs: seen.append((args, kwargs))
        batch = Batch([], draft_choice=DraftChoice(1, 0), tokens=[5, 6, 7, 8])
        speculator.record(batch, 0.04)
        assert seen == [((DraftChoice(1, 0), 0.01, [(0, 0)], False), {"steps": 4})]
        assert speculator.counters.num_drafts == 0
    finally:
        engine.shutdown()


def test_where_prompt_lookup_finds_no_match_a_lone_stream_runs(engines, long_runs):
    """A fixed draft length: steps with a match draft, steps without one are runs; the output
    is plain decoding's."""
    _, off = engines("O2")
    engine = Engine(verbose=False, speculative_mode="ngram", spec_draft_length=4)
    try:
        runs = _runs(engine)
        params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
        text = "Copy this list twice, numbered: apples, pears, plums, cherries, figs, dates."
        assert generate_tokens(engine, _prompt(engine, text), params) == \
            generate_tokens(off, _prompt(off, text), params)
        assert runs and engine._core.speculator.counters.num_drafts > 0
    finally:
        engine.shutdown()
