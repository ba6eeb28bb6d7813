"""``prompt_logprobs``: each prompt token's logprob given the tokens before it, as transformers
computes them over the whole prompt at once, however the engine splits, caches, preempts or
aborts the prompt; and ``max_tokens=0``, which scores a prompt and generates nothing."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from conftest import concurrently, wait_idle
from lmserve import Engine, SamplingParams
from lmserve.scheduler import SCORED_ROWS_PER_STEP
from lmserve.util import cdiv
from tiny_models import make_hf_recurrent

TOL = 1e-4  # float32 both sides; only the summation order differs


def run(engine: Engine, prompt: list[int], params: SamplingParams, request_id=None):
    """(prompt logprobs, tokens per choice, finish reasons per choice) of one request, checking
    that the prompt logprobs come once, with the first output."""
    outputs = list(engine.generate(prompt, params, request_id))
    scored = [i for i, o in enumerate(outputs) if o.prompt_logprobs is not None]
    assert scored == ([0] if params.prompt_logprobs is not None else [])
    tokens: dict[int, list[int]] = {}
    finish: dict[int, str] = {}
    for o in outputs:
        for d in o.deltas:
            tokens.setdefault(d.index, []).extend(d.token_ids)
            if d.finish_reason:
                finish[d.index] = d.finish_reason
    return outputs[0].prompt_logprobs, tokens, finish


def check_against(reference: torch.Tensor, prompt: list[int], scored, k: int) -> None:
    """``scored`` (one entry per prompt token) agrees with ``reference``, the log-softmax of a
    whole forward pass over ``prompt`` (``(len(prompt), V)``), at every position."""
    assert len(scored) == len(prompt) and scored[0] is None
    for pos, lp in enumerate(scored[1:]):
        assert lp.token_id == prompt[pos + 1]
        assert abs(lp.logprob - reference[pos, lp.token_id].item()) < TOL, f"position {pos + 1}"
        assert len(lp.top) == k
        kth_best = reference[pos].topk(max(k, 1)).values[-1].item()
        for token_id, value in lp.top:
            assert abs(value - reference[pos, token_id].item()) < TOL
            assert value > kth_best - TOL  # the k most likely, up to ties
        assert [v for _, v in lp.top] == sorted((v for _, v in lp.top), reverse=True)


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@torch.inference_mode()
def reference_logprobs(hf_model, prompt: list[int]) -> torch.Tensor:
    return torch.log_softmax(hf_model(torch.tensor([prompt])).logits[0].float(), -1)


PROMPTS = [list(range(1000 + 7 * i, 1000 + 7 * i + length)) for i, length in enumerate([150, 90, 61, 33])]


@torch.inference_mode()
def test_chunked_cached_preempted_and_in_company_prompts_score_as_one_pass(tiny_model_dir, tiny):
    """Prompts of up to 150 tokens in chunks of 32, four at once (n=2: the first choice scores,
    the second starts after it) in a KV cache too small for all: preemptions. Then the same
    prompts again, now in the prefix cache: scored whole all the same."""
    engine = Engine(tiny_model_dir, opt="O0", max_num_sequence=8, prefill_chunk_size=32,
                    kv_cache_page_size=8, max_total_sequence_length=320, verbose=False)
    try:
        params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, prompt_logprobs=3, n=2)
        results = concurrently(lambda p: run(engine, p, params), PROMPTS)
        assert engine._core.scheduler.num_preemptions > 0
        for prompt, (scored, tokens, _) in zip(PROMPTS, results):
            check_against(reference_logprobs(tiny, prompt), prompt, scored, 3)
            assert tokens[0] == tokens[1] and len(tokens[0]) == 24
        again = run(engine, PROMPTS[0], params)
        assert engine.stats().prefix_cache_hit_tokens > 0  # the second choice used the cache
        assert [lp.logprob for lp in again[0][1:]] == pytest.approx(
            [lp.logprob for lp in results[0][0][1:]], abs=TOL)
        wait_idle(engine)
        assert engine.kv_pages_in_use() == 0
    finally:
        engine.shutdown()


def test_max_tokens_zero_scores_and_generates_nothing(tiny_model_dir, tiny):
    engine = Engine(tiny_model_dir, opt="O0", max_num_sequence=4, verbose=False)
    try:
        prompt = PROMPTS[2]
        scored, tokens, finish = run(engine, prompt, SamplingParams(max_tokens=0, prompt_logprobs=0, n=3))
        check_against(reference_logprobs(tiny, prompt), prompt, scored, 0)
        assert tokens == {0: [], 1: [], 2: []} and finish == {0: "length", 1: "length", 2: "length"}
        scored, tokens, finish = run(engine, prompt, SamplingParams(max_tokens=0))
        assert scored is None and tokens == {0: []} and finish == {0: "length"}
        scored, tokens, _ = run(engine, [5], SamplingParams(max_tokens=2, prompt_logprobs=1))
        assert scored == [None] and len(tokens[0]) == 2  # one token: nothing to score
        # A long prompt is scored SCORED_ROWS_PER_STEP tokens a step (each a vocabulary's row).
        long, steps = list(range(3000, 3600)), engine.stats().steps
        scored, _, _ = run(engine, long, SamplingParams(max_tokens=0, prompt_logprobs=1))
        assert engine.stats().steps - steps == cdiv(len(long), SCORED_ROWS_PER_STEP)
        check_against(reference_logprobs(tiny, long), long, scored, 1)
        wait_idle(engine)
        assert engine.kv_pages_in_use() == 0
    finally:
        engine.shutdown()


def test_abort_while_the_prompt_is_scored_frees_everything(tiny_model_dir):
    """Aborted while its first choice scores a long prompt and the other two wait for it: every
    choice ends with "abort", nothing is held."""
    engine = Engine(tiny_model_dir, opt="O0", max_num_sequence=4, prefill_chunk_size=16,
                    kv_cache_page_size=8, verbose=False)
    try:
        prompt = list(range(2000, 3500))
        got: list = []
        params = SamplingParams(max_tokens=5, prompt_logprobs=2, n=3)
        worker = threading.Thread(target=lambda: got.extend(engine.generate(prompt, params, "r")))
        worker.start()
        deadline = time.monotonic() + 30
        while engine.stats().num_running == 0 and time.monotonic() < deadline:
            time.sleep(0.005)
        engine._loop.abort("r")
        worker.join(30)
        assert [d.finish_reason for o in got for d in o.deltas] == ["abort"] * 3
        assert all(o.prompt_logprobs is None for o in got)
        wait_idle(engine)
        assert engine.kv_pages_in_use() == 0 and not engine._core.requests
    finally:
        engine.shutdown()


@torch.inference_mode()
def test_recurrent_model_scores_its_prompt(tmp_path):
    """Mamba2 (recurrent state, snapshots at chunk ends): the same agreement."""
    from transformers import AutoModelForCausalLM

    model_dir = make_hf_recurrent(str(tmp_path / "mamba2"), "mamba2")
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    engine = Engine(model_dir, opt="O0", max_num_sequence=2, prefill_chunk_size=32, verbose=False)
    try:
        prompt = PROMPTS[1]
        scored, tokens, _ = run(engine, prompt, SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=2, n=2))
        check_against(reference_logprobs(hf, prompt), prompt, scored, 2)
        assert tokens[0] == tokens[1]
        wait_idle(engine)
        assert engine.kv_pages_in_use() == 0 and engine.state_slots_in_use() == 0
    finally:
        engine.shutdown()
