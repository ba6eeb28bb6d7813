"""Paged attention on the built-in model's shapes: lmserve's C++ kernel against torch.

For each batch of a server load (a prefill chunk of 256 tokens, one after a cached prefix, 16
decode streams, one decode stream, a chunk beside 16 decodes) times one layer's attention call,
rotary embedding and KV store included, cycling over 30 layers' bfloat16 caches (each backend's
own layout) so the KV comes from memory as in the model; the kernel also on an int8 KV cache
(``kv_dtype=int8``). The peers on the same batch:

- ``torch_native``: lmserve's torch backend (gathers each sequence's pages, then torch's
  ``scaled_dot_product_attention``), the path without the kernel;
- ``torch sdpa``: ``scaled_dot_product_attention`` alone on K/V already contiguous and float32 per
  sequence, decode streams batched: torch's best case, with no paging and no cache store.

Prints milliseconds per layer, useful GFLOP/s (the causal scores and weighted values) and the
kernel's speed-up over each peer.

    .venv/bin/python benchmarks/attention_kernel.py [--seconds 0.5]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from lmserve.attention.base import AttentionInput, AttentionShape, create_backend
from lmserve.cache.kv import KVCache
from lmserve.util import cdiv

H, KVH, HD, PAGE, LAYERS = 9, 3, 64, 16, 30  # SmolLM2-135M
BATCHES = [  # (label, new tokens per sequence, context per sequence)
    ("prefill 256", [256], [256]),
    ("prefill 256 after 128 cached", [256], [384]),
    ("decode 16 x 325", [1] * 16, [325] * 16),
    ("decode 1 x 325", [1], [325]),
    ("prefill 240 + decode 16 x 325", [240] + [1] * 16, [240] + [325] * 16),
]


def per_call(fn, seconds: float) -> float:
    """Seconds per call over at least ``seconds``: the best of repeated 30-layer sweeps."""
    fn(0)
    best, start = float("inf"), time.perf_counter()
    while time.perf_counter() - start < seconds:
        t = time.perf_counter()
        for layer in range(LAYERS):
            fn(layer)
        best = min(best, (time.perf_counter() - t) / LAYERS)
    return best


def sdpa_inputs(qlens, ctxs):
    """Float32 q/k/v per sequence as torch wants them, decode streams stacked into one batch."""
    calls = []
    decode = [c for q, c in zip(qlens, ctxs) if q == 1]
    if decode:  # equal lengths here, so one batched call without a mask
        calls.append((torch.randn(len(decode), H, 1, HD), torch.randn(len(decode), KVH, decode[0], HD), None))
    for q, c in zip(qlens, ctxs):
        if q > 1:  # query i (at position c - q + i) sees keys 0 .. c - q + i
            mask = torch.ones(q, c, dtype=torch.bool).tril(c - q)
            calls.append((torch.randn(1, H, q, HD), torch.randn(1, KVH, c, HD), mask))
    return calls


def fill_int8(backend, caches, pages: int) -> None:
    """Writes random keys and values into every slot of the int8 caches through the kernel (its
    codes and scales), one prefill of all the slots a layer."""
    slots = pages * PAGE
    inp = AttentionInput([slots], [slots], [list(range(pages))])
    meta = backend.prepare(inp, PAGE, torch.device("cpu"))
    cos, sin = torch.ones(slots, HD), torch.zeros(slots, HD)
    for k, v in caches:
        backend.forward(meta, torch.randn(slots, (H + 2 * KVH) * HD), cos, sin, k, v)


def backend_call(backend, inp, qkv, cos, sin, caches):
    """One layer's attention call of ``backend`` on the batch ``inp``, by layer index."""
    meta = backend.prepare(inp, PAGE, torch.device("cpu"))
    return lambda layer: backend.forward(meta, qkv, cos, sin, *caches[layer])


def sdpa_call(qlens, ctxs):
    """torch's sdpa on the batch, K/V contiguous per sequence, by layer index."""
    calls = [sdpa_inputs(qlens, ctxs) for _ in range(LAYERS)]

    def run(layer: int) -> None:
        for q, kv, mask in calls[layer]:
            F.scaled_dot_product_attention(q, kv, kv, attn_mask=mask, enable_gqa=True)

    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=0.5)
    args = ap.parse_args()
    torch.manual_seed(0)
    shape = AttentionShape(H, KVH, HD)
    # (column, backend, KV dtype)
    runs = [("lmserve kernel", "cpu_paged", torch.bfloat16), ("kernel, int8 KV", "cpu_paged", torch.int8),
            ("torch_native", "torch_native", torch.bfloat16)]
    backends = {name: create_backend(name, shape) for name in ("cpu_paged", "torch_native")}
    pages = sum(cdiv(c, PAGE) for _, _, ctxs in BATCHES for c in ctxs)
    caches = {}  # each run's 30 layers in its backend's layout, random values (int8: written below)
    for column, name, dtype in runs:
        kv = KVCache(LAYERS, pages, PAGE, KVH, HD, dtype, keys_transposed=backends[name].keys_transposed)
        if dtype != torch.int8:
            for t in kv.k + kv.v:
                t.copy_(torch.randn(t.shape))
        caches[column] = list(zip(kv.k, kv.v))
    fill_int8(backends["cpu_paged"], caches["kernel, int8 KV"], pages)
    print(f"{torch.get_num_threads()} threads; ms per layer call (useful GFLOP/s)")
    print(f"{'batch':32}" + "".join(f"{c:>18}" for c, _, _ in runs) + f"{'torch sdpa':>18}  kernel speed-up")
    for label, qlens, ctxs in BATCHES:
        tables, first = [], 0
        for c in ctxs:
            tables.append(list(range(first, first + cdiv(c, PAGE))))
            first += len(tables[-1])
        inp = AttentionInput(qlens, ctxs, tables)
        T = sum(qlens)
        qkv = torch.randn(T, (H + 2 * KVH) * HD)
        cos, sin = torch.ones(T, HD), torch.zeros(T, HD)
        flops = sum(4 * H * HD * (p + 1) for q, c in zip(qlens, ctxs) for p in range(c - q, c))
        times = {column: per_call(backend_call(backends[name], inp, qkv, cos, sin, caches[column]), args.seconds)
                 for column, name, _ in runs}
        times["torch sdpa"] = per_call(sdpa_call(qlens, ctxs), args.seconds)
        cells = "".join(f"{1e3 * t:>9.3f} ({flops / t / 1e9:5.1f})" for t in times.values())
        ratios = ", ".join(f"{times[p] / times['lmserve kernel']:.2f}x {p}" for p in ("torch_native", "torch sdpa"))
        print(f"{label:32} {cells}  {ratios}")


if __name__ == "__main__":
    main()
