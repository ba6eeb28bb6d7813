"""Pipeline parallelism end to end: stages (and stages of tensor-parallel ranks) as real
processes, against one process on the same weights, over gloo and shared memory; batches in
flight together; preemption, prefix cache and aborts; a stage that dies. The parts on their
own: tests/test_pipeline_parts.py."""

from __future__ import annotations

import dataclasses
import os
import signal
import time

import pytest

from lmserve.config import EngineConfig
from lmserve.engine.core import EngineCore
from lmserve.parallel.group import ParallelFailure
from lmserve.sampling_params import SamplingParams
from test_parallel import PROMPTS, assert_same_greedy, both, gone, preemption_prefix_and_aborts, rank_pids, run
from tiny_models import make_gguf_llama, make_hf_llama


@pytest.fixture(scope="module")
def tiny_q41(tmp_path_factory) -> str:
    return make_gguf_llama(str(tmp_path_factory.mktemp("pp_q41") / "m.gguf"), "Q4_1",
                           num_layers=4, seed=3)


def test_two_stages_of_two_ranks_over_gloo_match_one_process_at_O0_with_draft_trees(
        tmp_path, monkeypatch):
    """TP=2 x PP=2, every channel and all-reduce over gloo (as across hosts); float32 partial
    sums added in another order: logprobs within 1e-4. The engine verifies n-gram draft trees
    and accepts some."""
    model = make_hf_llama(str(tmp_path / "model"), num_layers=3, seed=3)
    monkeypatch.setenv("LMSERVE_TRANSPORT", "gloo")
    config = EngineConfig(model=model, opt="O0", verbose=False)
    expected = run(EngineCore(config), PROMPTS, max_tokens=40)  # long enough to repeat itself
    staged = EngineCore(dataclasses.replace(config, tensor_parallel_shards=2,
                                            pipeline_parallel_stages=2, speculative_mode="ngram",
                                            spec_draft_length=3, spec_tree_width=2))
    try:
        assert "through gloo" in staged.group.describe()
        assert_same_greedy(expected, run(staged, PROMPTS, max_tokens=40), 1e-4, length=40)
        assert staged.stats().spec_num_accepted_tokens > 0
    finally:
        staged.close()


def test_two_stages_give_one_process_bits_at_O0(tmp_path):
    """PP=2 alone, in shared memory: each stage runs the same float32 ops on the same rows as
    one process, so tokens and logprobs are equal."""
    model = make_hf_llama(str(tmp_path / "model"), num_layers=2, seed=4)
    config = EngineConfig(model=model, opt="O0", pipeline_parallel_stages=2, verbose=False)
    expected, got = both(config, lambda c: run(c, PROMPTS))
    assert_same_greedy(expected, got, tolerance=1e-6)


def test_two_stages_of_two_ranks_match_one_process_at_the_default_level(tiny_q41):
    """TP=2 x PP=2 in shared memory, with a sliding window and sinks on every stage and a draft
    model on rank 0; the tensor-parallel all-reduce rounds bf16 partial sums, so logprobs within
    0.05."""
    config = EngineConfig(model=tiny_q41, tensor_parallel_shards=2, pipeline_parallel_stages=2,
                          sliding_window_size=8, attention_sink_size=2,
                          speculative_mode="small_draft", additional_models=[tiny_q41],
                          spec_draft_length=3, verbose=False)

    def generate(core):
        out = run(core, PROMPTS, max_tokens=30)  # past the window
        assert core.stats().spec_num_accepted_tokens > 0
        return out

    expected, got = both(config, generate)
    assert_same_greedy(expected, got, tolerance=0.05, length=30)


@pytest.fixture(scope="module")
def q41_engines(tiny_q41):
    """One process and three stages at the default level, with a small KV cache (preemption)."""
    config = EngineConfig(model=tiny_q41, max_num_sequence=4, max_total_sequence_length=96,
                          prefill_chunk_size=32, verbose=False)
    staged = EngineCore(dataclasses.replace(config, pipeline_parallel_stages=3))
    yield EngineCore(config), staged
    staged.close(kill=True)


def test_batches_in_flight_give_one_process_bits(q41_engines):
    """Three requests, three stages: the first step starts a batch for each request, finishes
    the first and leaves two in flight. Each stage runs the same ops on the same rows as one
    process: equal logprobs."""
    one, staged = q41_engines
    for i, p in enumerate(PROMPTS):
        staged.add_request(f"first-{i}", p, SamplingParams(max_tokens=2, temperature=0))
    staged.step()
    assert [[c.seq.request.request_id for c in batch.chunks]
            for batch, _, _ in staged.in_flight] == [["first-1"], ["first-2"]]
    while staged.has_work():
        staged.step()
    assert_same_greedy(run(one, PROMPTS), run(staged, PROMPTS), tolerance=1e-6)


def test_stages_preempt_share_prefixes_and_abort_as_one_process(q41_engines):
    expected, got = (preemption_prefix_and_aborts(core) for core in q41_engines)
    assert got == expected and got[3]


def test_a_stage_that_dies_fails_the_engine_at_once(q41_engines):
    staged = q41_engines[1]
    ranks = rank_pids(os.getpid())
    last = next(pid for pid in ranks if b'"rank": 2,' in open(f"/proc/{pid}/cmdline", "rb").read())
    os.kill(last, signal.SIGKILL)
    killed = time.monotonic()
    with pytest.raises(ParallelFailure, match=f"rank 2 \\(pid {last}\\) exited with code -9"):
        run(staged, PROMPTS, max_tokens=50)
    assert time.monotonic() - killed < 3
    staged.close(kill=True)
    assert all(gone(rank) for rank in ranks)


def test_heads_on_every_token_are_refused_with_stages():
    with pytest.raises(ValueError, match=r"speculative_mode='medusa' drafts from the hidden states "
                                         r"of every token a step runs"):
        EngineCore(EngineConfig(pipeline_parallel_stages=2, speculative_mode="medusa",
                                additional_models=["heads"], verbose=False))
