"""The Python API on real engines: OpenAI-shaped chat/completions (sync and async), other models."""

from __future__ import annotations

import asyncio
import gc
import threading
import weakref

import pytest
import torch

from lmserve import AsyncEngine, Engine, SamplingParams
from lmserve.engine.async_engine import _Mailbox
from lmserve.layers.blocks import BlockWeight
from lmserve.layers.linear import BlockLinear, int8_kernel_unavailable
from lmserve.models.loader import load_weights
from tiny_models import make_gguf_llama, make_hf_llama

MESSAGES = [{"role": "user", "content": "Name three colours."}]


def test_chat_completion_stream_and_non_stream_agree(builtin_engine):
    reply = builtin_engine.chat.completions.create(messages=MESSAGES, max_tokens=20, temperature=0)
    choice = reply.choices[0]
    assert reply.object == "chat.completion" and choice.message.role == "assistant"
    assert choice.message.content and choice.finish_reason in ("stop", "length")
    chunks = list(builtin_engine.chat.completions.create(
        messages=MESSAGES, max_tokens=20, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].usage == reply.usage
    assert reply.usage.completion_tokens <= 20
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens


def test_completion_with_n_and_logprobs(builtin_engine):
    reply = builtin_engine.completions.create(prompt="The capital of France is", max_tokens=5,
                                              n=2, temperature=0.8, seed=11, logprobs=3)
    assert [c.index for c in reply.choices] == [0, 1]
    assert reply.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in reply.choices)
    for c in reply.choices:
        assert len(c.logprobs.top_logprobs[0]) == 3
    again = builtin_engine.completions.create(prompt="The capital of France is", max_tokens=5,
                                              n=2, temperature=0.8, seed=11, logprobs=3)
    assert [c.text for c in again.choices] == [c.text for c in reply.choices]


def test_bad_request_is_refused_naming_the_field(builtin_engine):
    with pytest.raises(ValueError, match="temperature"):
        builtin_engine.chat.completions.create(messages=MESSAGES, temperature=-1)
    with pytest.raises(ValueError, match="messages"):
        builtin_engine.chat.completions.create(messages=[])
    for prompt, says in [("Hello", "list of token ids"), ([1, 2.5], "list of token ids"),
                         ([1, 10**9], "outside the vocabulary"), ([], "empty")]:
        with pytest.raises(ValueError, match=says):
            next(builtin_engine.generate(prompt, SamplingParams(max_tokens=2)))


def test_async_engine_serves_concurrent_requests(tiny_model_dir):
    engine = AsyncEngine(tiny_model_dir, max_num_sequence=4, verbose=False)

    async def one(i):
        reply = await engine.chat.completions.create(
            messages=[{"role": "user", "content": f"hello {i}"}], max_tokens=6, temperature=0,
            ignore_eos=True)
        return reply.usage.completion_tokens

    async def streamed():
        stream = await engine.completions.create(prompt="abc", max_tokens=5, stream=True,
                                                 temperature=0, ignore_eos=True)
        return "".join([c.choices[0].text async for c in stream if c.choices])

    async def main():
        counts = await asyncio.gather(*(one(i) for i in range(10)))
        text = await streamed()
        return counts, text

    try:
        counts, text = asyncio.run(main())
        assert counts == [6] * 10
        assert isinstance(text, str)
        assert engine.kv_pages_in_use() == 0
    finally:
        engine.shutdown()


def test_engine_outputs_reach_their_queues_in_order_one_wake_up_a_burst():
    """The engine thread's outputs for many streams of one event loop: each queue gets its own in
    order, a burst posted before the loop runs costs one wake-up (a self-pipe write), a later
    post wakes it again, and a closed loop is not an error."""
    loop = asyncio.new_event_loop()
    wake_ups = []
    real = loop.call_soon_threadsafe
    loop.call_soon_threadsafe = lambda *args: (wake_ups.append(args), real(*args))[1]
    box = _Mailbox(loop)
    queues = [asyncio.Queue() for _ in range(3)]

    def from_another_thread(items):
        thread = threading.Thread(target=lambda: [box.post(queues[i % 3], i) for i in items])
        thread.start()
        thread.join()

    def drained():
        loop.run_until_complete(asyncio.sleep(0))  # runs the scheduled hand-over
        return [[q.get_nowait() for _ in range(q.qsize())] for q in queues]

    try:
        from_another_thread(range(30))
        assert len(wake_ups) == 1
        assert drained() == [list(range(k, 30, 3)) for k in range(3)]
        from_another_thread([30])
        assert len(wake_ups) == 2 and drained() == [[30], [], []]
    finally:
        loop.close()

    class Output:  # something the mailbox must not keep once nobody listens
        pass

    kept = weakref.ref(out := Output())
    thread = threading.Thread(target=box.post, args=(queues[0], out))
    thread.start()
    thread.join()
    del out
    gc.collect()
    assert kept() is None


def test_event_loops_that_used_an_async_engine_are_not_kept(tiny_model_dir):
    engine = AsyncEngine(tiny_model_dir, verbose=False)
    loops = []

    async def one():
        loops.append(weakref.ref(asyncio.get_running_loop()))
        async for _ in engine.generate([1, 2, 3], SamplingParams(max_tokens=2, ignore_eos=True)):
            pass

    try:
        for _ in range(3):
            asyncio.run(one())
        engine.stats()  # the engine thread's last command (a request's) is replaced
        gc.collect()
        assert [ref() for ref in loops] == [None, None, None]
    finally:
        engine.shutdown()


def _hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n,
                         do_sample=False, pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("form", ["hf_dir", "gguf_f32", "gguf_q8_0"])
def test_other_llama_models_load_and_match_transformers(tmp_path, form):
    """A random Llama as a Hugging Face directory and as GGUF files: greedy equals transformers.

    For GGUF, transformers dequantizes the same file, so both sides hold identical weights.
    """
    from transformers import AutoModelForCausalLM

    kwargs = dict(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, seed=5)
    if form == "hf_dir":
        path = make_hf_llama(str(tmp_path / "m"), **kwargs)
        ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    else:
        qtype = {"gguf_f32": "F32", "gguf_q8_0": "Q8_0"}[form]
        path = make_gguf_llama(str(tmp_path / "m.gguf"), qtype=qtype, **kwargs)
        ref = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="m.gguf",
                                                   dtype=torch.float32)
    engine = Engine(path, opt="O0", verbose=False)
    try:
        prompts = [[5, 17, 300, 4000], list(range(100, 160))]
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        for p in prompts:
            got = [t for o in engine.generate(p, params) for d in o.deltas for t in d.token_ids]
            assert got == _hf_greedy(ref.eval(), p, 12)
    finally:
        engine.shutdown()


@pytest.mark.skipif(int8_kernel_unavailable() is not None, reason="needs the C++ int8 kernel")
@pytest.mark.parametrize("qtype, bits", [("Q4_K", 4), ("Q5_0", 8)])
def test_k_quant_files_keep_their_blocks_and_the_default_level_multiplies_them(tmp_path, qtype, bits):
    """Q4_K matrices (most of a Q4_K_M file) and Q5_0 ones (what such files hold where a width is
    no multiple of 256) stay the file's blocks, exactly its weights, and O2 multiplies them in
    the int8 kernel as it does Q4_1 and Q8_0 (not as bf16 copies): it scores a prompt as O0 does
    on the same file, to within its activations' rounding."""
    path = make_gguf_llama(str(tmp_path / "m.gguf"), qtype=qtype, num_layers=2, hidden_size=256,
                           intermediate_size=512, num_heads=4, num_kv_heads=2, seed=5)
    dense, blocks = load_weights(path), load_weights(path, keep_blocks=True)
    matrices = [name for name, w in dense.items() if w.dim() == 2]
    assert len(matrices) == 2 * 7 + 2
    for name in matrices:
        assert isinstance(blocks[name], BlockWeight) and torch.equal(blocks[name].dequantize(), dense[name])
    params = SamplingParams(max_tokens=0, prompt_logprobs=0)
    prompt = list(range(100, 160))
    scores = {}
    for opt in ("O0", "O2"):
        engine = Engine(path, opt=opt, verbose=False)
        try:
            if opt == "O2":
                layers = engine._core.runner.model.layers
                assert all(isinstance(m, BlockLinear) and m.bits == bits and m.digits >= 1
                           for layer in layers for m in (layer.qkv, layer.o, layer.gate_up, layer.down))
            [out] = engine.generate(prompt, params)
            scores[opt] = torch.tensor([lp.logprob for lp in out.prompt_logprobs[1:]])
        finally:
            engine.shutdown()
    assert (scores["O2"] - scores["O0"]).abs().max() < 0.05
