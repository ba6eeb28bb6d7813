"""Training data for draft heads: the model's own answers and its hidden states along them.

``generate`` asks the engine to answer each prompt (its chat template, greedy, and if asked
further answers sampled at ``SAMPLED_TEMPERATURE``: more conversations from the same prompts;
every request queued at once so the engine batches them as it would a server's load);
``features`` runs each
conversation through the model once more, teacher-forced, keeping the hidden states the heads
read (``ModelRunner.feature_layers``) at the level the heads will serve at.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from lmserve.engine.core import EngineCore
from lmserve.sampling_params import SamplingParams
from lmserve.step import SeqStep, StepInput
from lmserve.util import cdiv

# Answers beyond a prompt's greedy one are sampled this warm: the model's own likely choices,
# in contexts its greedy answer does not reach.
SAMPLED_TEMPERATURE = 0.8


@dataclass
class Sample:
    """One conversation: its ``tokens`` (prompt then answer), where the answer starts, and the
    model's features at every position ``(len(tokens), F)`` once ``features`` ran."""

    tokens: list[int]
    answer_start: int
    features: Optional[torch.Tensor] = None


def chat_prompt_ids(core: EngineCore, prompt: str) -> list[int]:
    """``prompt`` as a user turn in the model's chat template (the plain text without one)."""
    if core.tokenizer.chat_template:
        return core.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
    return core.tokenizer.encode(prompt, add_special_tokens=True)


def generate(core: EngineCore, prompts: list[str], max_tokens: int,
             progress: Callable[[int], None] = lambda n: None, answers: int = 1) -> list[Sample]:
    """The model's answers to ``prompts`` (at most ``max_tokens`` each), batched by the engine:
    per prompt its greedy answer, then ``answers - 1`` sampled ones (seeded: the same on every
    run); ``progress`` is called with the tokens each step produced."""
    samples = {}
    for i, prompt in enumerate(prompts):
        ids = chat_prompt_ids(core, prompt)
        for j in range(answers):
            params = SamplingParams(temperature=SAMPLED_TEMPERATURE if j else 0.0,
                                    seed=i * answers + j if j else None, max_tokens=max_tokens)
            core.add_request(f"{i}.{j}", ids, params)
            samples[f"{i}.{j}"] = Sample(list(ids), len(ids))
    while core.has_work():
        for out in core.step():
            if out.error is not None:
                raise out.error
            for delta in out.deltas:
                samples[out.request_id].tokens += delta.token_ids
                progress(len(delta.token_ids))
    return list(samples.values())


def features(core: EngineCore, samples: list[Sample], feature_layers: tuple[int, ...],
             progress: Callable[[int], None] = lambda n: None) -> None:
    """Fill each sample's ``features``: the model's final hidden states (``feature_layers=()``)
    or the inputs of those layers side by side, one prefill of each conversation through the
    engine's runner on pages borrowed from its pool (the engine must be idle)."""
    runner, pool, page_size = core.runner, core.pool, core.plan.page_size
    runner.feature_layers = feature_layers
    chunk = core.plan.prefill_chunk_size
    try:
        for sample in samples:
            pages = pool.alloc(cdiv(len(sample.tokens), page_size))
            try:
                rows = []
                for start in range(0, len(sample.tokens), chunk):
                    ids = sample.tokens[start : start + chunk]
                    with torch.inference_mode():
                        runner.execute(StepInput([SeqStep(start, ids, pages, num_logits=0)]))
                    rows.append(runner.features.clone())
                    progress(len(ids))
            finally:
                pool.release(pages)
            sample.features = torch.cat(rows).float()  # outside inference mode: trainable on
    finally:
        runner.feature_layers = None
