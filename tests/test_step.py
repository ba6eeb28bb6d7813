"""The step as plain data: what the scheduler hands the runner, and the runner reading only that."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from lmserve.cache.manager import KVCacheManager
from lmserve.cache.pages import PagePool
from lmserve.config import EngineConfig
from lmserve.engine.core import EngineCore
from lmserve.request import Request, Sequence
from lmserve.sampling_params import SamplingParams
from lmserve.scheduler import Scheduler
from lmserve.step import SeqStep, StepInput
from lmserve.util import cdiv


def _seq(name: str, tokens: list[int]) -> Sequence:
    return Sequence(Request(name, list(tokens), SamplingParams(max_tokens=8)), 0, list(tokens), None)


def test_the_scheduler_describes_each_sequence_of_a_step():
    s = Scheduler(KVCacheManager(PagePool(16), page_size=4), max_num_sequence=4,
                  prefill_chunk_size=8)
    a, b = _seq("a", list(range(10, 16))), _seq("b", list(range(20, 25)))
    s.add(a)
    s.add(b)
    batch = s.schedule()  # a whole (6 tokens), then the first 2 of b's 5
    assert batch.step_input() == StepInput([
        SeqStep(start=0, token_ids=[10, 11, 12, 13, 14, 15], page_table=[0, 1], num_logits=1),
        SeqStep(start=0, token_ids=[20, 21], page_table=[2], num_logits=0),
    ])
    a.token_ids.append(99)  # a sampled its first token
    s.update(batch)
    step = s.schedule().step_input()
    assert step == StepInput([
        SeqStep(start=6, token_ids=[99], page_table=[0, 1], num_logits=1),
        SeqStep(start=2, token_ids=[22, 23, 24], page_table=[2, 3], num_logits=1),
    ])
    assert (step.num_tokens, step.num_logits, step.seqs[1].context_len) == (4, 2, 5)


def test_a_step_cannot_ask_for_more_logits_than_tokens():
    with pytest.raises(ValueError, match="num_logits must be in 0..2, got 3"):
        SeqStep(start=0, token_ids=[1, 2], page_table=[0], num_logits=3)


def test_the_runner_gives_the_last_k_tokens_logits_from_plain_data_alone(tiny_model_dir):
    """Hand-built steps, no Sequence anywhere: a prompt in two chunks (the second attending the
    first's cached KV) beside another prompt in one, several logit rows each, against
    transformers' logits at the same positions (O0: float32, the torch reference path)."""
    core = EngineCore(EngineConfig(model=tiny_model_dir, opt="O0", verbose=False))
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    a, b = [5, 17, 300, 42, 7, 9, 1000, 12, 8, 40], [3, 4, 5, 6, 8]
    page = core.plan.page_size
    pages_a = core.pool.alloc(cdiv(len(a), page))
    pages_b = core.pool.alloc(cdiv(len(b), page))

    first = core.runner.execute(StepInput([SeqStep(0, a[:4], pages_a, 0), SeqStep(0, b, pages_b, 3)]))
    second = core.runner.execute(StepInput([SeqStep(4, a[4:], pages_a, 4)]))
    with torch.no_grad():
        ref_a = hf(torch.tensor([a])).logits[0]
        ref_b = hf(torch.tensor([b])).logits[0]
    torch.testing.assert_close(first, ref_b[-3:], atol=2e-4, rtol=1e-4)
    torch.testing.assert_close(second, ref_a[-4:], atol=2e-4, rtol=1e-4)
    assert core.runner.execute(StepInput([SeqStep(len(a), [1], pages_a, 0)])).numel() == 0
