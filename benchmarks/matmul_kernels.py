"""The matmul kernels side by side on the built-in model's shapes: GFLOP/s and accuracy.

For each layer shape (q/k/v, o, gate/up, down with 4-bit blocks; the head with 8-bit blocks) and
rows M (1: decode of one stream, 16: a decode batch, 256: a prefill chunk), times lmserve's
block kernel with each activation type (int8 and int16 in kernels/int8_gemm.cpp; bfloat16 and
float32 as bf16 hi + lo in kernels/block_gemm.cpp), and O0's float32 kernel on the weights
dequantized (kernels/dense_gemm.cpp), against torch's own matmul on those (float32 and
bfloat16). Also prints each one's error against a float64 matmul of the exact weights,
relative to the output's largest value, on activations with an outlier channel (as LLM hidden
states have). Random weights quantized by the gguf package to the
file's types (Q4_1 layers, Q8_0 head), read as the engine reads them.

    .venv/bin/python benchmarks/matmul_kernels.py [--rows 1 16 256] [--seconds 0.3]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from gguf.quants import quantize

from lmserve.layers.blocks import from_gguf_blocks
from lmserve.layers.linear import BlockLinear, dense_linear

SHAPES = [("q/k/v", 960, 576, "Q4_1"), ("o", 576, 576, "Q4_1"), ("gate/up", 3072, 576, "Q4_1"),
          ("down", 576, 1536, "Q4_1"), ("head", 49152, 576, "Q8_0")]
ACTS = ["int8", "int16", "bfloat16", "float32"]


def rate(fn, seconds: float) -> float:
    """Seconds per call, over at least ``seconds`` of calls."""
    fn()
    start, calls = time.perf_counter(), 0
    while time.perf_counter() - start < seconds:
        fn()
        calls += 1
    return (time.perf_counter() - start) / calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16, 256])
    ap.add_argument("--seconds", type=float, default=0.3)
    args = ap.parse_args()
    torch.manual_seed(0)
    print(f"{torch.get_num_threads()} threads; GFLOP/s (error vs float64, relative to max |y|)")
    names = [f"lmserve {a}" for a in ACTS] + ["lmserve dense float32", "torch float32", "torch bfloat16"]
    print(f"{'shape':22} {'M':>4}  " + "  ".join(f"{n:>22}" for n in names))
    rng = np.random.default_rng(0)
    for label, n, k, gguf_type in SHAPES:
        w = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
        blocks = from_gguf_blocks(quantize(w, GGMLQuantizationType[gguf_type]), gguf_type, n, k)
        dense = blocks.dequantize()
        dense16 = dense.bfloat16()
        layers = {a: BlockLinear(blocks, None, a) for a in ACTS}
        for m in args.rows:
            x = torch.randn(m, k)
            x[:, 3] *= 20  # an outlier channel
            ref = x.double() @ dense.double().T
            runs = {f"lmserve {a}": (lambda a=a: layers[a](x.bfloat16() if a == "bfloat16" else x))
                    for a in ACTS}
            runs["lmserve dense float32"] = lambda: dense_linear(x, dense, None)  # O0's (dense_gemm.cpp)
            runs["torch float32"] = lambda: F.linear(x, dense)
            runs["torch bfloat16"] = lambda: F.linear(x.bfloat16(), dense16)
            cells = []
            for name in names:
                seconds = rate(runs[name], args.seconds)
                err = ((runs[name]().double() - ref).abs().max() / ref.abs().max()).item()
                cells.append(f"{2 * m * n * k / seconds / 1e9:7.0f} ({err:8.1e})")
            print(f"{label + f' {n}x{k} {gguf_type}':22} {m:>4}  " + "  ".join(f"{c:>22}" for c in cells))


if __name__ == "__main__":
    main()
