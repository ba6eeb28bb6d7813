"""Hybrid (split-fuse) against chunked prefill, with the engine stepped by hand."""

from __future__ import annotations

import pytest

from lmserve.config import EngineConfig
from lmserve.engine.core import EngineCore
from lmserve.sampling_params import SamplingParams


def run_by_hand(model_dir: str, prefill_mode: str) -> tuple[dict[str, int], dict[str, list[int]]]:
    """A: 10-token prompt, 5 new tokens, from step 1. B: 40-token prompt, 3 new tokens, added
    after step 1. Chunk of 16 tokens. Returns the step each request finished at, and its tokens."""
    core = EngineCore(EngineConfig(model=model_dir, prefill_chunk_size=16, max_num_sequence=4,
                                   prefill_mode=prefill_mode, prefix_cache_mode="disable",
                                   verbose=False))
    params = {"A": SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
              "B": SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)}
    prompts = {"A": list(range(100, 110)), "B": list(range(200, 240))}
    core.add_request("A", prompts["A"], params["A"])
    finished: dict[str, int] = {}
    tokens: dict[str, list[int]] = {"A": [], "B": []}
    for step in range(1, 20):
        for out in core.step():
            tokens[out.request_id] += [t for d in out.deltas for t in d.token_ids]
            if out.finished:
                finished[out.request_id] = step
        if step == 1:
            core.add_request("B", prompts["B"], params["B"])
        if len(finished) == 2:
            break
    return finished, tokens


@pytest.mark.parametrize("mode, expected", [
    # hybrid: A decodes in every step while B's prompt is prefilled 15, 15, 10 tokens at a time.
    ("hybrid", {"A": 5, "B": 6}),
    # chunked: prefill and decode steps alternate: B's prompt is prefilled in steps 3, 5, 7
    # (16, 16, 8 tokens; step 2 is A's decode), A decodes in steps 2, 4, 6, 8; B's last token
    # comes in step 9.
    ("chunked", {"A": 8, "B": 9}),
])
def test_exact_finishing_steps(tiny_model_dir, mode, expected):
    finished, _ = run_by_hand(tiny_model_dir, mode)
    assert finished == expected


def test_greedy_outputs_do_not_depend_on_the_prefill_mode(tiny_model_dir):
    _, hybrid = run_by_hand(tiny_model_dir, "hybrid")
    _, chunked = run_by_hand(tiny_model_dir, "chunked")
    assert hybrid == chunked and len(hybrid["A"]) == 5 and len(hybrid["B"]) == 3
