"""The float32 matmul of the full-precision level (O0): lmserve's kernel against torch's two.

For each of the built-in model's matrices (a layer's fused q/k/v, o, fused gate/up and down,
and the 49152-row head; random weights of the real shapes) and each row count, the median time
of lmserve's ``dense_gemm.cpp`` (what ``layers/linear.py``'s ``dense_linear`` runs), oneDNN
(``torch.ops.mkldnn._linear_pointwise``, what it ran before) and MKL (``F.linear``), timed in
interleaved rounds; and whether each gives the first row the same bits alone as among all rows
(batch invariance).

    .venv/bin/python benchmarks/dense_gemm.py [--rounds 5] [--rows 1 2 4 8 16 64]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch
import torch.nn.functional as F

from lmserve.layers.linear import dense_kernel_unavailable, dense_linear

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536),
          "head": (49152, 576)}
IMPLS = {
    "lmserve": lambda x, w: dense_linear(x, w, None),
    "oneDNN": lambda x, w: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""),
    "MKL": lambda x, w: F.linear(x, w),
}


def median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 64])
    ap.add_argument("--repeats", type=int, default=10, help="calls timed a round (their median)")
    args = ap.parse_args()
    if dense_kernel_unavailable():
        raise SystemExit(f"lmserve's float32 kernel is unavailable: {dense_kernel_unavailable()}")
    torch.manual_seed(0)
    weights = {name: torch.randn(n, k) * 0.02 for name, (n, k) in SHAPES.items()}
    names = list(IMPLS)
    times = {(impl, name, rows): [] for impl in names for name in SHAPES for rows in args.rows}
    for round_ in range(args.rounds):
        order = names[round_ % len(names):] + names[: round_ % len(names)]  # rotate who goes first
        for name, w in weights.items():
            for rows in args.rows:
                x = torch.randn(rows, w.shape[1])
                for impl in order:
                    fn = IMPLS[impl]
                    fn(x, w)  # warm
                    times[(impl, name, rows)].append(median_time(lambda: fn(x, w), args.repeats))
    print(f"CPU: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads; "
          f"median of {args.rounds} rounds, ms (ratio: oneDNN's time / lmserve's)")
    print(f"{'matrix':<8} {'N x K':>12} {'rows':>5} " + " ".join(f"{i:>9}" for i in names) + "  ratio")
    for name, (n, k) in SHAPES.items():
        for rows in args.rows:
            med = {impl: statistics.median(times[(impl, name, rows)]) * 1e3 for impl in names}
            print(f"{name:<8} {f'{n} x {k}':>12} {rows:>5} " + " ".join(f"{med[i]:9.3f}" for i in names)
                  + f"  {med['oneDNN'] / med['lmserve']:.2f}x")
    x = torch.randn(9, 576)
    for impl, fn in IMPLS.items():
        same = torch.equal(fn(x[:1], weights["head"])[0], fn(x, weights["head"])[0])
        print(f"{impl}: a row alone {'has' if same else 'does not have'} its bits in a 9-row call")


if __name__ == "__main__":
    main()
