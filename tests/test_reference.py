"""Invariant 1: greedy output of the full-precision path equals Hugging Face transformers.

Both sides load the same GGUF (the built-in SmolLM2-135M-Instruct, Q4_1) and dequantize it to
float32, so the weights are identical and only the arithmetic differs.
"""

import pytest
import torch

from conftest import concurrently
from lmserve import Engine, SamplingParams
from prompts import CHAT_PROMPTS, long_prompt

NEW_TOKENS = 64
# Float32 on both sides; summation order differs (fused projections, paged attention), which
# moves log-probabilities by a few 1e-5. 1e-3 leaves margin without hiding a real bug, which
# shifts them by 1e-1 or more.
LOGPROB_TOL = 1e-3


@pytest.fixture(scope="module")
def reference_engine():
    """The built-in model on the full-precision path."""
    engine = Engine(opt="O0", max_num_sequence=8, verbose=False)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def prompts(reference_engine) -> list[list[int]]:
    tok = reference_engine.tokenizer
    chats = [tok.apply_chat_template([{"role": "user", "content": p}]) for p in CHAT_PROMPTS]
    return chats + [tok.apply_chat_template([{"role": "user", "content": long_prompt()}])]


def test_prompts_are_varied_and_one_is_long(prompts):
    assert len(prompts) >= 8
    assert max(len(p) for p in prompts) > 1000


def hf_greedy_uncached(model, prompt_ids: list[int], n: int) -> list[int]:
    """transformers' greedy continuation (eos ignored), by a whole forward pass per token: the
    model's definition, where a model's cached decode path disagrees with it (Bamba's, in
    transformers 5.24, by 1e-3 in log-prob after a few tokens)."""
    tokens: list[int] = []
    for _ in range(n):
        tokens.append(int(model(torch.tensor([prompt_ids + tokens])).logits[0, -1].argmax()))
    return tokens


def hf_logprobs(model, prompt_ids: list[int], tokens: list[int]) -> torch.Tensor:
    """transformers' log-probs ``(len(tokens), V)`` of the token after the prompt and after each
    prefix of ``tokens``: one forward pass, teacher-forced on ``tokens``."""
    ids = torch.tensor([prompt_ids + tokens[:-1]])
    return torch.log_softmax(model(ids, logits_to_keep=len(tokens)).logits[0].float(), -1)


def assert_matches_transformers(engine: Engine, hf_model, prompts: list[list[int]],
                                new_tokens: int) -> None:
    """``engine``'s greedy tokens for each prompt (all sent at once: in batch company) are
    transformers', and every reported top-5 log-prob agrees with transformers' at that position.
    Checked teacher-forced: transformers' best token after each prefix of the engine's tokens is
    the engine's next one, which makes them, by induction, transformers' greedy continuation."""
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True, logprobs=5)
    outputs = concurrently(lambda p: [d for o in engine.generate(p, params) for d in o.deltas],
                           prompts)
    for prompt, deltas in zip(prompts, outputs):
        tokens = [t for d in deltas for t in d.token_ids]
        ref_logprobs = hf_logprobs(hf_model, prompt, tokens)
        assert tokens == ref_logprobs.argmax(-1).tolist(), f"prompt of {len(prompt)} tokens diverged"
        lps = [lp for d in deltas for lp in d.logprobs]
        assert len(lps) == len(tokens) == new_tokens
        for pos, lp in enumerate(lps):
            assert abs(lp.logprob - ref_logprobs[pos, lp.token_id].item()) < LOGPROB_TOL
            for tid, val in lp.top:
                assert abs(val - ref_logprobs[pos, tid].item()) < LOGPROB_TOL
            assert [t for t, _ in lp.top] == ref_logprobs[pos].topk(5).indices.tolist()


@torch.inference_mode()
def test_greedy_tokens_and_logprobs_match_transformers(reference_engine, hf_builtin, prompts):
    assert_matches_transformers(reference_engine, hf_builtin, prompts, NEW_TOKENS)


@torch.inference_mode()
def test_compiled_torch_path_matches_transformers(hf_builtin, prompts):
    """opt compile=1: the layers' torch ops as compiled graphs keep the reference's tokens and
    log-probs, for a prompt alone and for the chat prompts together (steps of one token and of
    several run different graphs; fewer tokens: the long prompt adds nothing compiled)."""
    engine = Engine(opt="O0;compile=1", max_num_sequence=8, verbose=False)
    try:
        assert engine._core.runner.compiled is not None
        assert_matches_transformers(engine, hf_builtin, prompts[:1], 24)
        assert_matches_transformers(engine, hf_builtin, prompts[:-1], 24)
    finally:
        engine.shutdown()


@torch.inference_mode()
def test_prompt_logprobs_match_transformers(reference_engine, hf_builtin, prompts):
    """``prompt_logprobs``: every prompt token's logprob and the top 5 at its position are
    transformers' from one forward pass over the prompt; the long prompt takes several prefill
    chunks, and the prompts run in each other's company."""
    params = SamplingParams(temperature=0, max_tokens=0, prompt_logprobs=5)
    chosen = prompts[:2] + prompts[-1:]
    outputs = concurrently(lambda p: list(reference_engine.generate(p, params)), chosen)
    for prompt, outs in zip(chosen, outputs):
        scored = outs[0].prompt_logprobs
        assert len(scored) == len(prompt) and scored[0] is None
        ref = torch.log_softmax(hf_builtin(torch.tensor([prompt])).logits[0].float(), -1)
        for pos, lp in enumerate(scored[1:]):
            assert lp.token_id == prompt[pos + 1]
            assert abs(lp.logprob - ref[pos, lp.token_id].item()) < LOGPROB_TOL
            fifth = ref[pos].topk(5).values[-1].item()
            for tid, val in lp.top:
                assert abs(val - ref[pos, tid].item()) < LOGPROB_TOL and val > fifth - LOGPROB_TOL
