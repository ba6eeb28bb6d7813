"""The prefix cache in the engine: what is reused, that outputs do not change, that nothing leaks."""

from __future__ import annotations

import random

from conftest import generate_tokens as tokens_of
from conftest import run_concurrently, wait_idle
from lmserve import Engine, SamplingParams

PAGE = 16


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_second_turn_of_a_chat_prefills_only_what_is_new(builtin_engine):
    tok = builtin_engine.tokenizer
    params = SamplingParams(temperature=0, max_tokens=30)
    history = [{"role": "user", "content": "Give me a word that rhymes with 'cat'."}]
    first = tok.apply_chat_template(history)
    answer = tokens_of(builtin_engine, first, params)
    history.append({"role": "assistant", "content": tok.decode(answer)})
    history.append({"role": "user", "content": "And one that rhymes with 'dog'?"})
    second = tok.apply_chat_template(history)

    # The finished first turn left the KV of every token it computed (all but the last sampled).
    computed = first + answer[:-1]
    expected_hit = min(common_prefix(second, computed), len(second) - 1) // PAGE * PAGE
    assert expected_hit >= len(first) // PAGE * PAGE > 0

    before = builtin_engine.stats()
    tokens_of(builtin_engine, second, SamplingParams(temperature=0, max_tokens=1))
    after = builtin_engine.stats()
    assert after.prefix_cache_hit_tokens - before.prefix_cache_hit_tokens == expected_hit
    assert after.prefix_cache_queried_tokens - before.prefix_cache_queried_tokens == len(second)
    assert after.prefill_tokens - before.prefill_tokens == len(second) - expected_hit


def shared_prefix_prompts(vocab: int, n: int, seed: int = 0) -> list[list[int]]:
    """n prompts over 4 shared prefixes (30..150 tokens), each with its own short suffix."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(vocab) for _ in range(rng.randint(30, 150))] for _ in range(4)]
    return [rng.choice(prefixes) + [rng.randrange(vocab) for _ in range(rng.randint(1, 20))]
            for _ in range(n)]


def test_outputs_are_identical_with_the_cache_on_and_off(tiny_model_dir):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    common = dict(max_num_sequence=8, prefill_chunk_size=256, verbose=False)
    on = Engine(tiny_model_dir, **common)
    off = Engine(tiny_model_dir, prefix_cache_mode="disable", **common)
    try:
        prompts = shared_prefix_prompts(on.tokenizer.vocab_size, 50)
        with_cache = run_concurrently(on, prompts, params)
        without = run_concurrently(off, prompts, params)
        assert with_cache == without
        assert on.stats().prefix_cache_hit_tokens > 50 * 30  # the cache was really used
        assert off.stats().prefix_cache_hit_tokens == 0
        wait_idle(on)
        assert on.kv_pages_in_use() == 0
    finally:
        on.shutdown()
        off.shutdown()


def test_builtin_model_outputs_are_identical_with_the_cache_on_and_off(builtin_engine):
    tok = builtin_engine.tokenizer
    system = "You are a careful assistant. " * 12
    prompts = [tok.apply_chat_template([{"role": "system", "content": system},
                                        {"role": "user", "content": q}])
               for q in ("Say hi.", "Count to five.", "Name a fruit.", "What is 2+2?")] * 2
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    hits = builtin_engine.stats().prefix_cache_hit_tokens
    # One request first, so the shared system prompt is cached before the batch arrives.
    with_cache = [tokens_of(builtin_engine, prompts[0], params)]
    with_cache += run_concurrently(builtin_engine, prompts[1:], params)
    assert builtin_engine.stats().prefix_cache_hit_tokens - hits >= 7 * 4 * PAGE
    off = Engine(max_num_sequence=8, max_total_sequence_length=8192, prefix_cache_mode="disable",
                 verbose=False)
    try:
        without = [tokens_of(off, prompts[0], params)] + run_concurrently(off, prompts[1:], params)
        assert without == with_cache
    finally:
        off.shutdown()


def test_an_eviction_storm_leaks_no_page(tiny_model_dir):
    # 24 pages of 16 tokens against 60 distinct 100-token prefixes: the cache must keep evicting.
    engine = Engine(tiny_model_dir, max_num_sequence=4, max_total_sequence_length=384,
                    prefix_cache_max_num_recycling_seqs=-1, verbose=False)
    try:
        rng = random.Random(1)
        vocab = engine.tokenizer.vocab_size
        prompts = [[rng.randrange(vocab) for _ in range(100)] for _ in range(60)]
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        run_concurrently(engine, prompts, params)
        run_concurrently(engine, prompts[:20], params)  # some hits on what survived
        wait_idle(engine)
        core = engine._core
        assert engine.kv_pages_in_use() == 0
        assert core.pool.num_used == core.prefix_cache.num_pages > 0
        core.prefix_cache.clear()
        assert core.pool.num_free == core.pool.num_pages
    finally:
        engine.shutdown()


def test_disabled_cache_and_zero_recycling_keep_nothing(tiny_model_dir):
    for kwargs in ({"prefix_cache_mode": "disable"}, {"prefix_cache_max_num_recycling_seqs": 0}):
        engine = Engine(tiny_model_dir, verbose=False, **kwargs)
        try:
            prompt = list(range(100, 180))
            params = SamplingParams(temperature=0, max_tokens=2)
            tokens_of(engine, prompt, params)
            tokens_of(engine, prompt, params)
            assert engine.stats().prefix_cache_hit_tokens == 0
            assert engine._core.pool.num_used == 0
        finally:
            engine.shutdown()
