"""Paged attention over a mixed flat batch equals dense causal attention per sequence."""

import torch

from lmserve.attention.base import AttentionInput, create_backend

H, KVH, HD, PAGE = 4, 2, 8, 4


def dense_attention(q, k, v):
    """Reference: (L, H, hd) queries over (L, KVH, hd) keys/values, causal, GQA by repeat."""
    rep = H // KVH
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * HD**-0.5
    L = q.shape[0]
    scores = scores.masked_fill(torch.triu(torch.ones(L, L, dtype=torch.bool), 1), float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def test_decode_prefill_and_prefix_chunk_in_one_batch_match_dense():
    torch.manual_seed(0)
    backend = create_backend("torch_native")
    k_cache = torch.zeros(64, KVH, HD)
    v_cache = torch.zeros(64, KVH, HD)
    # Three sequences with full contexts of 7, 5 and 9 tokens, on scattered pages.
    lens = [7, 5, 9]
    pages = [[9, 2], [5, 14], [0, 11, 6]]
    full = [(torch.randn(L, H, HD), torch.randn(L, KVH, HD), torch.randn(L, KVH, HD)) for L in lens]

    def step(query_lens, done):
        """Run one step where seq i has ``done[i]`` tokens cached and adds ``query_lens[i]``."""
        qs, ks, vs = [], [], []
        for (q, k, v), n, d in zip(full, query_lens, done):
            qs.append(q[d : d + n]), ks.append(k[d : d + n]), vs.append(v[d : d + n])
        inp = AttentionInput(query_lens, [d + n for n, d in zip(query_lens, done)], pages)
        meta = backend.prepare(inp, PAGE, torch.device("cpu"))
        return backend.forward(meta, torch.cat(qs), torch.cat(ks), torch.cat(vs),
                               k_cache, v_cache, HD**-0.5)

    # Step 1: seq 0 prefills 6, seq 1 prefills all 5, seq 2 prefills 4 (a first chunk).
    out1 = step([6, 5, 4], [0, 0, 0])
    # Step 2: seq 0 decodes its 7th token, seq 2 prefills its remaining 5 after a cached prefix;
    # seq 1 re-attends its last token as a decode (query 1 token at position 4, already cached).
    out2 = step([1, 1, 5], [6, 4, 4])

    ref = [dense_attention(*f) for f in full]
    torch.testing.assert_close(out1[:6], ref[0][:6], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out1[6:11], ref[1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out1[11:15], ref[2][:4], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out2[0], ref[0][6], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out2[1], ref[1][4], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out2[2:], ref[2][4:], atol=1e-5, rtol=1e-5)
    # Keys landed in the right slots: seq 2's 6th token (position 5) is on page 11, offset 1.
    torch.testing.assert_close(k_cache[11 * PAGE + 1], full[2][1][5])
