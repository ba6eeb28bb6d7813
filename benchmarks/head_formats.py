"""An EAGLE head's matmuls at each drafter level, side by side.

One pass of the built-in model's EAGLE-1 head multiplies six matrices: ``fc`` (2D -> D), fused
q/k/v, o, fused gate/up, down, and the draft vocabulary's head (``--vocab`` rows). They are
built as ``speculative/draft_level.py`` builds them for each level (random weights of the real shapes)
and timed in interleaved rounds; printed: the median time of a pass's six matmuls per level
and rows, and its ratio to float32 (O0, the heads' own numbers).

    .venv/bin/python benchmarks/head_formats.py [--rounds 5] [--rows 1 16 64] [--vocab 4127]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

from lmserve.config import parse_opt
from lmserve.speculative.draft_level import head_formats, head_linear

D, FFN = 576, 1536  # the built-in model's hidden and MLP sizes
LEVELS = ("O0", "O1", "O2", "O3")


def head_matrices(vocab: int) -> dict[str, tuple[list[tuple[int, int]], int]]:
    """Each matmul's stacked parts (rows, columns) and its input width."""
    kv = 192  # 3 KV heads of 64
    return {"fc": ([(D, 2 * D)], 2 * D), "qkv": ([(D, D), (kv, D), (kv, D)], D), "o": ([(D, D)], D),
            "gate_up": ([(FFN, D), (FFN, D)], D), "down": ([(D, FFN)], FFN), "head": ([(vocab, D)], D)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--vocab", type=int, default=4127, help="draft vocabulary rows of the head")
    ap.add_argument("--repeats", type=int, default=10, help="passes timed a round (their median)")
    args = ap.parse_args()
    torch.manual_seed(0)
    shapes = head_matrices(args.vocab)
    weights = {name: [torch.randn(*p) * 0.02 for p in parts] for name, (parts, _) in shapes.items()}
    layers = {level: {name: head_linear(weights[name], None, head_formats(parse_opt(level)))
                      for name in shapes} for level in LEVELS}
    times: dict[tuple[str, int], list[float]] = {(lv, r): [] for lv in LEVELS for r in args.rows}
    for round_ in range(args.rounds):
        order = LEVELS[round_ % len(LEVELS):] + LEVELS[: round_ % len(LEVELS)]  # rotate who goes first
        for rows in args.rows:
            inputs = {name: torch.randn(rows, width) for name, (_, width) in shapes.items()}
            for level in order:
                passes = []
                for _ in range(args.repeats):
                    start = time.perf_counter()
                    for name, layer in layers[level].items():
                        layer(inputs[name])
                    passes.append(time.perf_counter() - start)
                times[(level, rows)].append(statistics.median(passes))
    print(f"CPU: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads; "
          f"a pass's six matmuls, median of {args.rounds} rounds (ratio to O0)")
    print(f"{'level':<6}" + "".join(f"{f'{r} rows':>22}" for r in args.rows))
    for level in LEVELS:
        cells = []
        for rows in args.rows:
            ms = statistics.median(times[(level, rows)]) * 1e3
            ratio = ms / (statistics.median(times[("O0", rows)]) * 1e3)
            cells.append(f"{ms:9.3f} ms ({ratio:5.2f}x)")
        print(f"{level:<6}" + "".join(f"{c:>22}" for c in cells))


if __name__ == "__main__":
    main()
