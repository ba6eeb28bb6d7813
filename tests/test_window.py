"""Sliding-window attention with attention sinks, per backend, against a dense reference written
here with StreamingLLM's own position rule (positions within the cache: the sinks first, then the
window's keys, each query at its index there), which the backends reach another way (keys stay
rotated at their own positions; a query scores the sinks from a moved position)."""

import pytest
import torch

from conftest import generate_tokens, run_concurrently, wait_idle
from lmserve import Engine, SamplingParams
from lmserve.attention import cpu_paged
from lmserve.attention.base import RELEASED, AttentionInput, AttentionShape, create_backend
from lmserve.attention.window import AttentionWindow
from lmserve.cache.kv import KVCache
from lmserve.config import EngineConfig
from lmserve.engine.core import EngineCore
from lmserve.layers.rotary import RotaryEmbedding, apply_rotary
from lmserve.util import cdiv
from prompts import CHAT_PROMPTS, long_prompt
from test_reference import assert_matches_transformers
from tiny_models import make_hf_llama

H, KVH = 4, 2


def kernel(shape, dtype=torch.float32):
    reason = cpu_paged.why_unsupported(shape, dtype)
    return pytest.param("cpu_paged", marks=pytest.mark.skipif(reason is not None, reason=str(reason)))


def streaming_reference(qkv: torch.Tensor, window: AttentionWindow, rotary: RotaryEmbedding,
                        hd: int) -> torch.Tensor:
    """(L, H, hd): token p attends the sinks and the last ``window.size`` keys, everything
    rotated at its index in that cache (sinks 0..s-1, then the window's keys in order)."""
    L = qkv.shape[0]
    q, k, v = qkv.split([H * hd, KVH * hd, KVH * hd], -1)
    q, k, v = q.view(L, H, hd), k.view(L, KVH, hd), v.view(L, KVH, hd)
    out = torch.empty(L, H, hd)
    for p in range(L):
        keys = sorted(set(range(min(window.sinks, p + 1))) | set(range(window.lowest_key(p), p + 1)))
        at = torch.arange(len(keys))  # positions within the cache
        cos, sin = rotary.lookup(at)
        kr = apply_rotary(k[keys], cos, sin).repeat_interleave(H // KVH, 1)  # (n, H, hd)
        qr = apply_rotary(q[p : p + 1], cos[-1:], sin[-1:])  # the query is the cache's last
        scores = torch.einsum("hd,nhd->hn", qr[0], kr) * hd**-0.5
        out[p] = torch.einsum("hn,nhd->hd", scores.softmax(-1), v[keys].repeat_interleave(H // KVH, 1))
    return out


def run_window_steps(backend, window, chunks, qkv, page, rotary, hd, release=True, dtype=torch.float32):
    """Feed ``qkv`` (L, ...) through ``backend`` in steps of ``chunks`` tokens with the window on
    every layer, releasing (when ``release``) the pages no later query sees, as the manager does;
    returns the attention output of every token (L, H, hd)."""
    L = qkv.shape[0]
    n_pages = cdiv(L, page)
    kv = KVCache(1, n_pages + 1, page, KVH, hd, dtype, keys_transposed=backend.keys_transposed)
    table = list(range(n_pages, 0, -1))  # scattered, descending
    sink_pages = cdiv(window.sinks, page)
    outs, done = [], 0
    for n in chunks:
        positions = torch.arange(done, done + n)
        cos, sin = rotary.lookup(positions)
        inp = AttentionInput([n], [done + n], [list(table)], window=window, dense_layers=not release)
        sink_pos = torch.tensor([window.sink_position(int(p)) for p in positions])
        if not torch.equal(sink_pos, positions):
            inp.sink_cos, inp.sink_sin = rotary.lookup(sink_pos)
        meta = backend.prepare(inp, page, torch.device("cpu"))
        outs.append(backend.forward(meta, qkv[done : done + n], cos, sin, kv.k[0], kv.v[0],
                                    windowed=True).view(n, H, hd))
        done += n
        if release:  # what no later query sees, its KV poisoned: a read would show as NaN
            for i in range(sink_pages, window.first_needed(done) // page):
                if table[i] != RELEASED:
                    poison_page(kv, table[i], backend.keys_transposed)
                    table[i] = RELEASED
    return torch.cat(outs)


def poison_page(kv: KVCache, page_id: int, keys_transposed: bool) -> None:
    """NaN in every key and value of a page (an int8 cache's bytes all 0xff: its scales NaN)."""
    slots = slice(page_id * kv.page_size, (page_id + 1) * kv.page_size)
    bad = -1 if kv.dtype == torch.int8 else float("nan")
    (kv.k[0][page_id] if keys_transposed else kv.k[0][slots]).fill_(bad)
    (kv.v[0][page_id] if kv.dtype == torch.int8 else kv.v[0][slots]).fill_(bad)


@pytest.mark.parametrize("name", ["torch_native", kernel(AttentionShape(H, KVH, 16))])
@pytest.mark.parametrize("page", [4, 8, 16])
@pytest.mark.parametrize("size,sinks", [(7, 0), (7, 3), (13, 5), (20, 1), (37, 4)])
def test_window_and_sinks_match_the_streaming_reference(name, page, size, sinks):
    torch.manual_seed(size * 10 + sinks)
    hd = 16
    window = AttentionWindow(size, sinks)
    rotary = RotaryEmbedding(hd, 4096, 10000.0)
    L = 70
    qkv = torch.randn(L, (H + 2 * KVH) * hd)
    expected = streaming_reference(qkv, window, rotary, hd)
    backend = create_backend(name, AttentionShape(H, KVH, hd))
    # Prefill chunks shorter and longer than the window, then decodes.
    got = run_window_steps(backend, window, CHUNKS, qkv, page, rotary, hd)
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-4)


# Prefill chunks shorter and longer than the window, then decodes: 70 tokens.
CHUNKS = [5, 23, 1, 17, 1, 1, 3] + [1] * 19


@pytest.mark.parametrize("cache,tol", [(torch.bfloat16, 2e-2), (torch.int8, 5e-2)])
@pytest.mark.parametrize("page", [4, 16])
@pytest.mark.parametrize("hd", [16, 64])
def test_kernel_rows_under_a_window_do_not_depend_on_chunking(cache, tol, page, hd):
    """The C++ kernel's rows are bit-identical whether a token is decoded or computed inside a
    prefill chunk, on bf16 and int8 caches, and stay near the float32 reference."""
    shape = AttentionShape(H, KVH, hd)
    if cpu_paged.why_unsupported(shape, cache) is not None:
        pytest.skip(cpu_paged.why_unsupported(shape, cache))
    torch.manual_seed(hd + page)
    window = AttentionWindow(13, 3)
    rotary = RotaryEmbedding(hd, 4096, 10000.0)
    qkv = torch.randn(70, (H + 2 * KVH) * hd)
    backend = create_backend("cpu_paged", shape)
    whole = run_window_steps(backend, window, [70], qkv, page, rotary, hd, dtype=cache)
    stepped = run_window_steps(backend, window, CHUNKS, qkv, page, rotary, hd, dtype=cache)
    assert torch.equal(whole, stepped)
    torch.testing.assert_close(stepped, streaming_reference(qkv, window, rotary, hd), atol=tol, rtol=0)


@pytest.mark.parametrize("name", ["torch_native", kernel(AttentionShape(H, KVH, 16))])
@pytest.mark.parametrize("page", [4, 8])
def test_a_draft_tree_under_a_window_attends_as_its_chains_would(name, page):
    """Each node of a draft tree after a windowed prefix (sinks moved) gets the attention of its
    chain (the prefix, then its ancestors and itself), with stale KV left in the slots past the
    step's tokens."""
    hd, window = 16, AttentionWindow(11, 2)
    torch.manual_seed(page)
    rotary = RotaryEmbedding(hd, 256, 10000.0)
    backend = create_backend(name, AttentionShape(H, KVH, hd))
    prefix = torch.randn(30, (H + 2 * KVH) * hd)
    nodes = torch.randn(6, (H + 2 * KVH) * hd)
    parents = [-1, 0, 1, 0, 3, 1]  # the root (newest token), then drafts at depths 1-3
    masks = []
    for i, p in enumerate(parents):
        masks.append((masks[p] if p >= 0 else 0) | 1 << i)
    kv = KVCache(1, 16, page, KVH, hd, keys_transposed=backend.keys_transposed)
    kv.v[0].fill_(100.0)  # stale values everywhere not written
    table = list(range(15, -1, -1))
    run_window_steps_on(backend, window, prefix, table, kv, rotary, page)
    positions = torch.tensor([30 + m.bit_count() - 1 for m in masks])
    cos, sin = rotary.lookup(positions)
    inp = AttentionInput([6], [36], [table], tree_masks=[masks], window=window, dense_layers=False)
    inp.sink_cos, inp.sink_sin = rotary.lookup(positions.clamp(max=window.last_sink_position))
    got = backend.forward(backend.prepare(inp, page, torch.device("cpu")), nodes, cos, sin,
                          kv.k[0], kv.v[0], windowed=True).view(6, H, hd)
    for i, m in enumerate(masks):
        chain = torch.cat([prefix, nodes[[j for j in range(6) if m >> j & 1]]])
        expected = streaming_reference(chain, window, rotary, hd)[-1]
        torch.testing.assert_close(got[i], expected, atol=2e-5, rtol=1e-4)


def run_window_steps_on(backend, window, qkv, table, kv, rotary, page) -> None:
    """Prefill ``qkv`` into ``kv`` in one windowed step (pages from ``table``)."""
    n = qkv.shape[0]
    positions = torch.arange(n)
    cos, sin = rotary.lookup(positions)
    inp = AttentionInput([n], [n], [table], window=window, dense_layers=False)
    inp.sink_cos, inp.sink_sin = rotary.lookup(positions.clamp(max=window.last_sink_position))
    backend.forward(backend.prepare(inp, page, torch.device("cpu")), qkv, cos, sin, kv.k[0], kv.v[0],
                    windowed=True)


def test_rotary_angles_past_the_table_are_computed_in_float64():
    rotary = RotaryEmbedding(16, 64, 10000.0)
    positions = torch.tensor([3, 63, 64, 1_000_003])
    cos, sin = rotary.lookup(positions)
    assert torch.equal(cos[:2], rotary.cos[[3, 63]])
    angles = torch.outer(positions[2:].double(), rotary.inv_freq.double())
    torch.testing.assert_close(cos[2:, :8], angles.cos().float(), atol=1e-6, rtol=0)
    torch.testing.assert_close(sin[2:, 8:], angles.sin().float(), atol=1e-6, rtol=0)
    beyond_cos, beyond_sin = rotary.lookup(positions[2:])  # a step wholly past the table
    assert torch.equal(beyond_cos, cos[2:]) and torch.equal(beyond_sin, sin[2:])


# -- the engine ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_mistral(hf_builtin):
    """The built-in model's weights in transformers' Mistral with a 64-token sliding window
    (transformers 5.x: a query sees keys ``kv_idx > q_idx - 64``, as AttentionWindow)."""
    from transformers import MistralConfig, MistralForCausalLM
    from transformers.masking_utils import sliding_window_overlay

    # The semantics matched (transformers 5.x; the suite runs 5.24): the last 64 keys, itself included.
    assert sliding_window_overlay(64)(0, 0, 100, 37) and not sliding_window_overlay(64)(0, 0, 100, 36)
    config = MistralConfig.from_dict(hf_builtin.config.to_dict() | {"sliding_window": 64})
    model = MistralForCausalLM(config)
    model.load_state_dict(hf_builtin.state_dict())
    return model.eval()


@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated")
@torch.inference_mode()
def test_builtin_model_with_a_window_matches_transformers_mistral(hf_mistral, hf_builtin):
    with Engine(opt="O0", sliding_window_size=64, max_num_sequence=2, verbose=False) as engine:
        assert engine.plan.bounded
        tok = engine.tokenizer
        prompt = tok.apply_chat_template([{"role": "user", "content": long_prompt()[:1000]}])
        assert 200 < len(prompt) < 400
        # The window matters here: the dense model's next-token log-probs differ.
        ids = torch.tensor([prompt])
        dense = torch.log_softmax(hf_builtin(ids).logits[0, -1], -1)
        assert (torch.log_softmax(hf_mistral(ids).logits[0, -1], -1) - dense).abs().max() > 0.1
        assert_matches_transformers(engine, hf_mistral, [prompt], 120)
        assert engine.kv_pages_in_use() == 0


GREEDY = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)


@pytest.fixture(scope="module")
def sink_engine():
    """The built-in model at the default level with a 64-token window and 4 sinks."""
    engine = Engine(sliding_window_size=64, attention_sink_size=4, max_num_sequence=4,
                    prefill_chunk_size=256, verbose=False)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def long_chats(sink_engine):
    """Chat prompts longer than the window."""
    tok = sink_engine.tokenizer
    text = long_prompt()
    return [tok.apply_chat_template([{"role": "user", "content": text[i * 300 : i * 300 + 600] + q}])
            for i, q in enumerate(CHAT_PROMPTS[:4])]


def test_sinks_keep_greedy_output_independent_of_batching_chunking_and_prefix_reuse(sink_engine,
                                                                                   long_chats):
    alone = [generate_tokens(sink_engine, p, GREEDY) for p in long_chats]
    assert run_concurrently(sink_engine, long_chats, GREEDY) == alone
    core = sink_engine._core
    hits = core.scheduler.prefix_hit_tokens
    assert generate_tokens(sink_engine, long_chats[0], GREEDY) == alone[0]
    assert core.scheduler.prefix_hit_tokens > hits  # the first chunk's pages were cached whole
    wait_idle(sink_engine)
    assert sink_engine.kv_pages_in_use() == 0
    # Chunked prefill, chunks of 16 (shorter than the window), and preemption: 16 pages for four
    # sequences whose windows and chunks need 7 each.
    with Engine(sliding_window_size=64, attention_sink_size=4, max_num_sequence=4,
                prefill_chunk_size=16, max_total_sequence_length=256, prefill_mode="chunked",
                verbose=False) as small:
        assert small.plan.max_pages_per_sequence == 1 + 5 + 1
        assert run_concurrently(small, long_chats, GREEDY) == alone
        assert small._core.scheduler.num_preemptions > 0
        wait_idle(small)
        assert small.kv_pages_in_use() == 0


def test_a_stream_past_the_context_holds_at_most_its_page_cap(tmp_path):
    """6,000 tokens generated by a model with a 2,048-token context under a 512-token window and
    4 sinks: at every step the sequence holds at most the plan's page cap; none after it ends,
    and none after an abort."""
    model = make_hf_llama(str(tmp_path / "m"), num_layers=1, hidden_size=32, intermediate_size=64,
                          num_heads=2, num_kv_heads=1, max_position_embeddings=2048)
    core = EngineCore(EngineConfig(model=model, sliding_window_size=512, attention_sink_size=4,
                                   max_single_sequence_length=30_000, prefill_chunk_size=128,
                                   prefix_cache_mode="disable", verbose=False))
    cap = core.plan.max_pages_per_sequence
    assert cap == 1 + cdiv(511 + 128, 16) + 1  # sinks, window and a chunk, one for alignment
    core.add_request("long", list(range(1000, 1300)),
                     SamplingParams(temperature=0, max_tokens=6_000, ignore_eos=True))
    seq = core.requests["long"].seqs[0]
    generated, most = 0, 0
    while core.has_work():
        for out in core.step():
            generated += sum(len(d.token_ids) for d in out.deltas)
        most = max(most, core.pool.num_used)
        assert core.pool.num_used <= cap
        if seq.num_computed > 2_000:  # decoding: the window and one step's token
            assert core.pool.num_used <= 1 + cdiv(511 + 1, 16) + 1
    assert generated == 6_000 and len(seq.token_ids) == 6_300
    assert core.pool.num_used == 0 and most > 30
    core.add_request("aborted", list(range(50, 250)),
                     SamplingParams(temperature=0, max_tokens=5_000, ignore_eos=True))
    for _ in range(800):
        core.step()
    assert core.pool.num_used > 0
    core.abort_request("aborted")
    assert core.pool.num_used == 0


@pytest.mark.parametrize("max_window_layers,bounded", [(0, True), (1, False)])
def test_a_model_whose_config_has_a_window_gets_it_without_a_flag(tmp_path, max_window_layers, bounded):
    """Qwen2 windows the layers from max_window_layers on (transformers' layer_types): all of
    them, or the second of two; greedy tokens past the window equal transformers'."""
    from transformers import AutoModelForCausalLM

    path = make_hf_llama(str(tmp_path / "qwen"), arch="qwen2", use_sliding_window=True,
                         sliding_window=24, max_window_layers=max_window_layers, seed=5)
    hf = AutoModelForCausalLM.from_pretrained(path).eval()
    assert hf.config.layer_types[1] == "sliding_attention"
    prompt = list(range(300, 340))
    with torch.inference_mode():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=40, min_new_tokens=40,
                          do_sample=False)[0, len(prompt):].tolist()
    dense = make_hf_llama(str(tmp_path / "dense"), arch="qwen2", seed=5)  # same weights, no window
    with torch.inference_mode():
        assert AutoModelForCausalLM.from_pretrained(dense).generate(
            torch.tensor([prompt]), max_new_tokens=40, min_new_tokens=40, do_sample=False
        )[0, len(prompt):].tolist() != ref
    with Engine(path, opt="O0", verbose=False) as engine:
        assert engine.plan.window.size == 24 and engine.plan.bounded is bounded
        assert engine.plan.window_layers == (None if bounded else (1,))
        assert generate_tokens(engine, prompt, SamplingParams(temperature=0, max_tokens=40,
                                                              ignore_eos=True)) == ref


@pytest.mark.parametrize("tree_width", [1, 2])
def test_speculation_under_a_window_keeps_greedy_output(sink_engine, long_chats, tree_width):
    """n-gram drafts (chains, and trees) verified under a window with sinks: rejected drafts roll
    back into pages the window kept, and the output is the one without speculation."""
    alone = [generate_tokens(sink_engine, p, GREEDY) for p in long_chats[:2]]
    with Engine(sliding_window_size=64, attention_sink_size=4, max_num_sequence=4,
                prefill_chunk_size=256, speculative_mode="ngram", spec_draft_length=4,
                spec_tree_width=tree_width, verbose=False) as spec:
        assert run_concurrently(spec, long_chats[:2], GREEDY) == alone
        assert spec.stats().spec_num_accepted_tokens > 0
        wait_idle(spec)
        assert spec.kv_pages_in_use() == 0


def _stream_beside_a_long_prompt(target: str, **spec) -> tuple[list[int], int, int]:
    """A stream decoding while a 3,900-token prompt is prefilled beside it, window 64 + 4 sinks:
    the stream's tokens, the most pages it held after a step, and the plan's cap."""
    core = EngineCore(EngineConfig(model=target, sliding_window_size=64, attention_sink_size=4,
                                   max_num_sequence=4, prefill_chunk_size=32, verbose=False,
                                   prefix_cache_mode="disable", max_single_sequence_length=4000, **spec))
    core.add_request("stream", list(range(100, 130)),
                     SamplingParams(temperature=0, max_tokens=600, ignore_eos=True))
    seq, tokens, most = core.requests["stream"].seqs[0], [], 0
    for step in range(10_000):
        if step == 5:
            core.add_request("long", list(range(300, 4200)),
                             SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
        for out in core.step():
            if out.request_id == "stream":
                tokens += [t for d in out.deltas for t in d.token_ids]
        if seq.pages:
            most = max(most, core.kv_manager.pages_held(seq))
        if not core.has_work():
            break
    assert core.pool.num_used == 0
    return tokens, most, core.plan.max_pages_per_sequence


@pytest.mark.parametrize("k", [0, 3])  # adaptive (often drafts nothing), fixed
def test_a_draft_model_under_a_window_keeps_up_and_the_page_cap(tmp_path, k):
    """small_draft under a window: the draft's KV keeps up with every decoding sequence (drafted
    or not), so the stream stays within its page cap; the output is the one without it."""
    target = make_hf_llama(str(tmp_path / "target"), num_layers=2, seed=1)
    draft = make_hf_llama(str(tmp_path / "draft"), num_layers=1, seed=2)
    plain, most, cap = _stream_beside_a_long_prompt(target)
    assert most <= cap
    spec, most, cap = _stream_beside_a_long_prompt(target, speculative_mode="small_draft",
                                                   additional_models=[draft], spec_draft_length=k)
    assert spec == plain and len(plain) == 600
    assert most <= cap
