"""Paged attention over a mixed flat batch equals dense causal attention per sequence, for every
backend; the C++ kernel computes each row bit-identically whatever the batch around it."""

import sys

import pytest
import torch

from lmserve.attention import cpu_paged
from lmserve.attention.base import AttentionInput, AttentionShape, create_backend
from lmserve.cache.kv import KVCache
from lmserve.layers.rotary import RotaryEmbedding, apply_rotary
from lmserve.util import cdiv

H, KVH, HD, PAGE = 4, 2, 16, 4
SHAPE = AttentionShape(H, KVH, HD)
BACKENDS = ["torch_native", "cpu_paged"]
needs_kernel = pytest.mark.skipif(
    cpu_paged.why_unsupported(SHAPE, torch.bfloat16) is not None,
    reason=f"C++ kernel unavailable: {cpu_paged.why_unsupported(SHAPE, torch.bfloat16)}")


def dense_attention(q, k, v):
    """Reference: (L, H, hd) queries over (L, KVH, hd) keys/values, causal, GQA by repeat."""
    rep = H // KVH
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * HD**-0.5
    L = q.shape[0]
    scores = scores.masked_fill(torch.triu(torch.ones(L, L, dtype=torch.bool), 1), float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def run_step(backend, caches, full, pages, query_lens, done, rotary=None):
    """One step where seq i has ``done[i]`` tokens cached and adds ``query_lens[i]``; ``full``
    holds each sequence's fused qkv rows. Without ``rotary`` the angles are zero (no rotation)."""
    hd = backend.shape.head_dim
    qkv = torch.cat([f[d : d + n] for f, n, d in zip(full, query_lens, done)])
    pos = torch.cat([torch.arange(d, d + n) for n, d in zip(query_lens, done)])
    if rotary is None:
        cos, sin = torch.ones(len(pos), hd), torch.zeros(len(pos), hd)
    else:
        cos, sin = rotary.lookup(pos)
    inp = AttentionInput(query_lens, [d + n for n, d in zip(query_lens, done)], pages)
    meta = backend.prepare(inp, PAGE, torch.device("cpu"))
    return backend.forward(meta, qkv, cos, sin, *caches).view(-1, H, hd)


def make_caches(backend, num_pages, dtype=torch.float32):
    """One layer's key and value caches, zero, in the backend's layout (see KVCache)."""
    kv = KVCache(1, num_pages, PAGE, KVH, backend.shape.head_dim, dtype,
                 keys_transposed=backend.keys_transposed)
    return kv.k[0], kv.v[0]


def key_at(backend, k_cache, slot):
    """The cached key ``(KVH, hd)`` in ``slot``, whatever the backend's layout."""
    if backend.keys_transposed:
        return k_cache[slot // PAGE, :, :, slot % PAGE]
    return k_cache[slot]


def split(qkv, hd=HD):
    L = qkv.shape[0]
    q, k, v = qkv.split([H * hd, KVH * hd, KVH * hd], -1)
    return q.view(L, H, hd), k.view(L, KVH, hd), v.view(L, KVH, hd)


@pytest.mark.parametrize("name", [BACKENDS[0], pytest.param(BACKENDS[1], marks=needs_kernel)])
def test_decode_prefill_and_prefix_chunk_in_one_batch_match_dense(name):
    torch.manual_seed(0)
    backend = create_backend(name, SHAPE)
    caches = make_caches(backend, 16)
    # Three sequences with full contexts of 7, 5 and 9 tokens, on scattered pages.
    lens = [7, 5, 9]
    pages = [[9, 2], [5, 14], [0, 11, 6]]
    full = [torch.randn(L, (H + 2 * KVH) * HD) for L in lens]

    # Step 1: seq 0 prefills 6, seq 1 prefills all 5, seq 2 prefills 4 (a first chunk).
    out1 = run_step(backend, caches, full, pages, [6, 5, 4], [0, 0, 0])
    # Step 2: seq 0 decodes its 7th token, seq 2 prefills its remaining 5 after a cached prefix;
    # seq 1 re-attends its last token as a decode (query 1 token at position 4, already cached).
    out2 = run_step(backend, caches, full, pages, [1, 1, 5], [6, 4, 4])

    ref = [dense_attention(*split(f)) for f in full]
    tol = dict(atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out1[:6], ref[0][:6], **tol)
    torch.testing.assert_close(out1[6:11], ref[1], **tol)
    torch.testing.assert_close(out1[11:15], ref[2][:4], **tol)
    torch.testing.assert_close(out2[0], ref[0][6], **tol)
    torch.testing.assert_close(out2[1], ref[1][4], **tol)
    torch.testing.assert_close(out2[2:], ref[2][4:], **tol)
    # Keys landed in the right slots: seq 2's 6th token (position 5) is on page 11, offset 1.
    torch.testing.assert_close(key_at(backend, caches[0], 11 * PAGE + 1), split(full[2])[1][5])


@needs_kernel
@pytest.mark.parametrize("hd", [16, 64, 128])  # 64 and 128 are compiled for their size
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_torch_path_with_rotary_and_bf16_cache(dtype, hd):
    """Rotation, bf16 cache store and attention against the torch backend (tolerance: one bf16
    rounding of the output, 1e-2 relative; 1e-5 in float32)."""
    torch.manual_seed(1)
    rotary = RotaryEmbedding(hd, 64, 10000.0)
    pages = [[3, 7, 1, 12, 4], [8, 2, 9]]
    full = [torch.randn(L, (H + 2 * KVH) * hd).to(dtype) for L in (19, 10)]
    outs, keys, values = [], [], []
    for name in BACKENDS:
        backend = create_backend(name, AttentionShape(H, KVH, hd))
        c = make_caches(backend, 16, torch.bfloat16)
        a = run_step(backend, c, full, pages, [12, 10], [0, 0], rotary)
        b = run_step(backend, c, full, pages, [7, 0], [12, 10], rotary)
        outs.append(torch.cat([a, b]).float())
        keys.append(torch.stack([key_at(backend, c[0], slot) for slot in range(64)]).float())
        values.append(c[1].float())
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(outs[1], outs[0], **tol)
    torch.testing.assert_close(keys[1], keys[0], **tol)
    torch.testing.assert_close(values[1], values[0], **tol)
    # The cached keys are the rotated keys: position 13 of seq 0 sits on page 12, offset 1.
    _, k, _ = split(full[0].float(), hd)
    cos, sin = rotary.lookup(torch.tensor([13]))
    rotated = apply_rotary(k[13:14], cos, sin)[0]
    torch.testing.assert_close(keys[1][12 * PAGE + 1], rotated, atol=1e-2, rtol=1e-2)


@needs_kernel
@pytest.mark.parametrize("hd", [16, 48, 64, 80, 128, 256])  # value sums in 1 to 4 chunks of 64 dims
@pytest.mark.parametrize("page", [4, 16, 24, 32])  # 16, 32: a few rows read the cache directly
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (6, 2), (8, 2)])  # 1 to 4 query heads a KV head
@pytest.mark.parametrize("cache", [torch.bfloat16, torch.int8])
def test_kernel_rows_do_not_depend_on_batch_company(cache, hd, page, heads, monkeypatch):
    """A token's output is bit-identical decoded alone, decoded with others, or inside a prefill
    chunk long or short (its keys identical): the kernel's per-row arithmetic never depends on
    the batch, whichever of its paths (a float32 copy of each key block shared by many rows, or
    up to 4 rows reading the cache, 4 blocks at a time) computes the row, from a bf16 or an int8
    cache. The long sequence (150 tokens) takes the second path over several chunks of blocks,
    on scattered pages."""
    for name, value in (("PAGE", page), ("H", heads[0]), ("KVH", heads[1])):
        monkeypatch.setattr(sys.modules[__name__], name, value)
    torch.manual_seed(2)
    backend = create_backend("cpu_paged", AttentionShape(H, KVH, hd))
    lengths = (150, 30, 23)
    counts = [cdiv(n, page) for n in lengths]
    order = torch.randperm(sum(counts)).tolist()
    pages = [order[sum(counts[:i]) : sum(counts[: i + 1])] for i in range(3)]
    # float32 rows and outputs (a bf16 output would round most one-bit differences away)
    full = [torch.randn(L, (H + 2 * KVH) * hd) for L in lengths]

    def fresh():
        return make_caches(backend, sum(counts), cache)

    # Whole prompt of seq 0 in one chunk.
    whole = run_step(backend, fresh(), full, pages, [150, 0, 0], [0, 0, 0])
    # Prefilled in chunks beside other sequences (the last a short one), then decoded with company.
    c = fresh()
    run_step(backend, c, full, pages, [60, 30, 5], [0, 0, 0])
    run_step(backend, c, full, pages, [86, 0, 15], [60, 30, 5])
    short = run_step(backend, c, full, pages, [3, 0, 1], [146, 30, 20])[:3]
    company = run_step(backend, c, full, pages, [1, 0, 1], [149, 30, 21])[0]
    # Decoded alone.
    alone = run_step(backend, c, full, pages, [1, 0, 0], [149, 30, 22])[0]
    assert torch.equal(whole[146:149], short)
    assert torch.equal(whole[149], company) and torch.equal(whole[149], alone)


@pytest.mark.parametrize("name,cache", [
    ("torch_native", torch.float32),
    *(pytest.param("cpu_paged", c, marks=needs_kernel) for c in (torch.float32, torch.bfloat16, torch.int8))])
@pytest.mark.parametrize("page", [4, 16])  # 16: the decoded row reads the cache directly
@pytest.mark.parametrize("bad", [3, 17])  # a lane of the first 16-key block, or of the second
def test_a_nan_key_makes_exactly_the_rows_that_see_it_nan(name, cache, page, bad, monkeypatch):
    """A NaN key (token ``bad``, KV head 0) poisons the rows of KV head 0's query heads that
    attend to it, in a prefill and in the decode after it, as torch's softmax does; earlier rows
    and the other KV head's rows keep their bits. (A NaN at lane 3 of a row's first block once
    left parts of rows at 0: the max of 16 lanes with a NaN depends on its lane.)"""
    monkeypatch.setattr(sys.modules[__name__], "PAGE", page)
    torch.manual_seed(5)
    backend = create_backend(name, SHAPE)
    full = torch.randn(21, (H + 2 * KVH) * HD)
    poisoned = full.clone()
    poisoned[bad, H * HD] = float("nan")  # the first dimension of KV head 0's key
    pages = [[5, 2, 7, 0, 6, 3][: cdiv(21, page)]]
    outs = []
    for qkv in (full, poisoned):
        caches = make_caches(backend, 8, cache)
        prefill = run_step(backend, caches, [qkv], pages, [20], [0])
        outs.append(torch.cat([prefill, run_step(backend, caches, [qkv], pages, [1], [20])]))
    clean, out = outs
    G = H // KVH
    assert not clean.isnan().any()
    assert torch.equal(out[:bad], clean[:bad])
    assert out[bad:, :G].isnan().all()
    assert torch.equal(out[bad:, G:], clean[bad:, G:])


@needs_kernel
@pytest.mark.parametrize("page", [4, 16])  # 16: the decoded rows read the cache directly
@pytest.mark.parametrize("hd", [16, 64, 128])
def test_int8_cache_stays_close_to_float32(hd, page, monkeypatch):
    """An int8 cache (codes with a scale per token and head; keys and the query multiplied as
    int8 codes, the softmax weights as 16-bit codes against the value codes) against a float32 one on
    the same steps, prefill then decode: outputs of size about 3 agree within 5e-2, and the
    stored codes decode to the keys and values within half a step of max|x| / 127, the keys'
    code sums stored beside them."""
    monkeypatch.setattr(sys.modules[__name__], "PAGE", page)
    torch.manual_seed(3)
    rotary = RotaryEmbedding(hd, 64, 10000.0)
    pages = [[3, 7, 1, 12, 4], [8, 2, 9]]
    full = [torch.randn(L, (H + 2 * KVH) * hd) for L in (19, 10)]
    backend = create_backend("cpu_paged", AttentionShape(H, KVH, hd))
    outs, caches = [], []
    for dtype in (torch.float32, torch.int8):
        c = make_caches(backend, 16, dtype)
        a = run_step(backend, c, full, pages, [12, 10], [0, 0], rotary)
        b = run_step(backend, c, full, pages, [7, 0], [12, 10], rotary)
        outs.append(torch.cat([a, b]))
        caches.append(c)
    torch.testing.assert_close(outs[1], outs[0], atol=5e-2, rtol=0)
    (k32, v32), (k8, v8) = caches
    slots = [p * page + o for p in pages[0] for o in range(page)][:19]
    for slot in slots:  # rows of 4 * page bytes: the keys' codes 4 dimensions a row, scales, sums
        pg, off = divmod(slot, page)
        rows = k8[pg].reshape(KVH, hd // 4 + 2, page, 4)
        codes = rows[:, : hd // 4, off, :].reshape(KVH, hd)
        scale = rows[:, hd // 4].reshape(KVH, 4 * page).view(torch.float32)[:, off]  # (KVH,)
        sums = rows[:, hd // 4 + 1].reshape(KVH, 4 * page).view(torch.int32)[:, off]
        assert torch.equal(sums, codes.sum(1, dtype=torch.int32))
        key = codes.float() * scale[:, None]
        assert (key - k32[pg, :, :, off]).abs().max() <= k32[pg, :, :, off].abs().max() / 254 + 1e-6
        # values: rows of hd words per 4 keys (a word holds the 4 keys' codes of one dimension), scales
        flat = v8[pg].reshape(KVH, (hd + 4) * page)
        v_codes = flat[:, : hd * page].reshape(KVH, page // 4, hd, 4)[:, off // 4, :, off % 4]
        v_scale = flat[:, hd * page :].contiguous().view(torch.float32)[:, off]
        value = v_codes.float() * v_scale[:, None]
        assert (value - v32[slot]).abs().max() <= v32[slot].abs().max() / 254 + 1e-6


# A draft tree after 37 cached tokens: the root (the newest token), a chain of 3 below it, and
# siblings at depths 1, 2 and 3 (parents index the step's tokens; -1: the root's).
TREE_PARENTS = [-1, 0, 1, 2, 0, 1, 1, 2, 7]


def tree_masks(parents):
    masks = []
    for i, p in enumerate(parents):
        masks.append((masks[p] if p >= 0 else 0) | 1 << i)
    return masks


def run_tree_step(backend, caches, rows, pages, done, masks, rotary):
    """One step of a draft tree's tokens (``rows``: their qkv) after ``done`` cached tokens."""
    depth = torch.tensor([m.bit_count() - 1 for m in masks])
    cos, sin = rotary.lookup(done + depth)
    inp = AttentionInput([len(masks)], [done + len(masks)], [pages], tree_masks=[masks])
    meta = backend.prepare(inp, PAGE, torch.device("cpu"))
    return backend.forward(meta, rows, cos, sin, *caches).view(len(masks), H, -1)


@pytest.mark.parametrize("name,cache", [
    ("torch_native", torch.float32),
    *(pytest.param("cpu_paged", c, marks=needs_kernel) for c in (torch.float32, torch.bfloat16, torch.int8))])
@pytest.mark.parametrize("page", [4, 16])  # 16: the chain's decode rows read the cache directly
@pytest.mark.parametrize("hd", [16, 64])
def test_draft_tree_tokens_attend_as_their_chain_would(name, cache, page, hd, monkeypatch):
    """Each token of a draft tree, verified in one step, gets the output its chain (the cached
    prefix, its ancestors, itself) gets when run as plain tokens: bit-identical with the C++
    kernel (so a verified draft's KV and logits are those of decoding it), within float32
    rounding with torch; and every tree token's key lands in its own slot of the step."""
    monkeypatch.setattr(sys.modules[__name__], "PAGE", page)
    torch.manual_seed(6)
    backend = create_backend(name, AttentionShape(H, KVH, hd))
    rotary = RotaryEmbedding(hd, 128, 10000.0)
    done, masks = 37, tree_masks(TREE_PARENTS)
    prefix = torch.randn(done, (H + 2 * KVH) * hd)
    rows = torch.randn(len(masks), (H + 2 * KVH) * hd)
    n_pages = cdiv(done + len(masks), page)
    pages = torch.randperm(2 * n_pages)[:n_pages].tolist()

    caches = make_caches(backend, 2 * n_pages, cache)
    run_step(backend, caches, [prefix], [pages], [done], [0], rotary)
    tree = run_tree_step(backend, caches, rows, pages, done, masks, rotary)
    keys = [key_at(backend, caches[0], pages[(done + i) // page] * page + (done + i) % page)
            for i in range(len(masks))] if cache != torch.int8 else []

    for i, m in enumerate(masks):
        path = [j for j in range(len(masks)) if m >> j & 1]
        chain = torch.cat([prefix, rows[path]])
        c = make_caches(backend, 2 * n_pages, cache)
        run_step(backend, c, [chain], [pages], [done], [0], rotary)
        # the chain's last token decoded, after its ancestors as one chunk
        if len(path) > 1:
            run_step(backend, c, [chain], [pages], [len(path) - 1], [done], rotary)
        alone = run_step(backend, c, [chain], [pages], [1], [done + len(path) - 1], rotary)[0]
        if name == "cpu_paged":
            assert torch.equal(tree[i], alone), f"tree token {i}"
        else:
            torch.testing.assert_close(tree[i], alone, atol=1e-5, rtol=1e-5)
        if keys:  # its key (rotated at its depth) sits at its own step slot
            at = done + len(path) - 1
            torch.testing.assert_close(keys[i], key_at(backend, c[0], pages[at // page] * page + at % page))


@pytest.mark.parametrize("name,cache", [
    ("torch_native", torch.float32), ("torch_native", torch.bfloat16),
    *(pytest.param("cpu_paged", c, marks=needs_kernel) for c in (torch.float32, torch.bfloat16, torch.int8))])
@pytest.mark.parametrize("page", [4, 16])
def test_moved_tree_path_reads_as_if_decoded_in_place(name, cache, page, monkeypatch):
    """After a tree step, the accepted path's KV moved into place (``KVCache.move``) is the KV
    its chain has: the next token attends it exactly as after decoding the chain, in every cache
    layout (keys by slot or transposed, float or int8 codes with their scales)."""
    monkeypatch.setattr(sys.modules[__name__], "PAGE", page)
    torch.manual_seed(7)
    backend = create_backend(name, SHAPE)
    rotary = RotaryEmbedding(HD, 128, 10000.0)
    done, masks = 37, tree_masks(TREE_PARENTS)
    path = [0, 1, 2, 7, 8]  # the root, then depths 1 to 4
    prefix = torch.randn(done, (H + 2 * KVH) * HD)
    rows = torch.randn(len(masks), (H + 2 * KVH) * HD)
    after = torch.randn(1, (H + 2 * KVH) * HD)  # the token after the accepted path
    n_pages = cdiv(done + len(masks), page)
    pages = torch.randperm(2 * n_pages)[:n_pages].tolist()
    chain = torch.cat([prefix, rows[path], after])
    at = done + len(path)
    outs = []
    for tree in (True, False):
        kv = KVCache(1, 2 * n_pages, page, KVH, HD, cache, keys_transposed=backend.keys_transposed)
        caches = (kv.k[0], kv.v[0])
        run_step(backend, caches, [chain], [pages], [done], [0], rotary)
        if tree:
            run_tree_step(backend, caches, rows, pages, done, masks, rotary)
            slot = [pages[(done + j) // page] * page + (done + j) % page for j in range(len(masks))]
            kv.move([slot[j] for j in path[3:]], [slot[3], slot[4]])
        else:
            run_step(backend, caches, [chain], [pages], [len(path)], [done], rotary)
        outs.append(run_step(backend, caches, [chain], [pages], [1], [at], rotary))
    if name == "cpu_paged":
        assert torch.equal(outs[0], outs[1])
    else:
        torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)
