"""Invariant 1: greedy output of the full-precision path equals Hugging Face transformers.

Both sides load the same GGUF (the built-in SmolLM2-135M-Instruct, Q4_1) and dequantize it to
float32, so the weights are identical and only the arithmetic differs.
"""

import pytest
import torch

from lmserve import Engine, SamplingParams
from prompts import CHAT_PROMPTS, long_prompt

NEW_TOKENS = 64
# Float32 on both sides; summation order differs (fused projections, paged attention), which
# moves log-probabilities by a few 1e-5. 1e-3 leaves margin without hiding a real bug, which
# shifts them by 1e-1 or more.
LOGPROB_TOL = 1e-3


def hf_greedy(model, prompt_ids: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy continuation (eos ignored) and its log-probs at each new position."""
    ids = torch.tensor([prompt_ids])
    out = model(ids, use_cache=True)
    cache, logits = out.cache, out.logits[0, -1]
    tokens, logprobs = [], []
    for _ in range(n):
        logprobs.append(torch.log_softmax(logits.float(), -1))
        tokens.append(int(logits.argmax()))
        out = model(torch.tensor([[tokens[-1]]]), cache=cache, use_cache=True)
        cache, logits = out.cache, out.logits[0, -1]
    return tokens, torch.stack(logprobs)


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


def hf_greedy_uncached(model, prompt_ids: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    """``hf_greedy`` by a whole forward pass per token, without transformers' cache: the model's
    definition, where a model's cached decode path disagrees with it (Bamba's, in transformers
    5.24, by 1e-3 in log-prob after a few tokens)."""
    tokens, logprobs = [], []
    for _ in range(n):
        logits = model(torch.tensor([prompt_ids + tokens])).logits[0, -1]
        logprobs.append(torch.log_softmax(logits.float(), -1))
        tokens.append(int(logits.argmax()))
    return tokens, torch.stack(logprobs)


def assert_matches_transformers(engine: Engine, hf_model, prompt: list[int], new_tokens: int,
                                reference=hf_greedy) -> None:
    """``engine``'s greedy tokens equal transformers', and every reported top-5 log-prob agrees
    with transformers' at that position (teacher-forced on the shared tokens). ``reference``:
    ``hf_greedy`` or ``hf_greedy_uncached``."""
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True, logprobs=5)
    deltas = [d for o in engine.generate(prompt, params) for d in o.deltas]
    tokens = [t for d in deltas for t in d.token_ids]
    ref_tokens, ref_logprobs = reference(hf_model, prompt, new_tokens)
    assert tokens == ref_tokens, f"prompt of {len(prompt)} tokens diverged"
    lps = [lp for d in deltas for lp in d.logprobs]
    for pos, lp in enumerate(lps):
        assert abs(lp.logprob - ref_logprobs[pos, lp.token_id].item()) < LOGPROB_TOL
        for tid, val in lp.top:
            assert abs(val - ref_logprobs[pos, tid].item()) < LOGPROB_TOL
        assert [t for t, _ in lp.top] == ref_logprobs[pos].topk(5).indices.tolist()


@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated")
@torch.inference_mode()
def test_greedy_tokens_and_logprobs_match_transformers(reference_engine, hf_builtin, prompts):
    for prompt in prompts:
        assert_matches_transformers(reference_engine, hf_builtin, prompt, NEW_TOKENS)


@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated")
@torch.inference_mode()
def test_compiled_torch_path_matches_transformers(hf_builtin, prompts):
    """opt compile=1: the layers' torch ops as compiled graphs keep the reference's tokens and
    log-probs (the chat prompts, fewer tokens: the long prompt adds nothing compiled)."""
    engine = Engine(opt="O0;compile=1", max_num_sequence=8, verbose=False)
    try:
        assert engine._core.runner.compiled is not None
        for prompt in prompts[:-1]:
            assert_matches_transformers(engine, hf_builtin, prompt, 24)
    finally:
        engine.shutdown()
