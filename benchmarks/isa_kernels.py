"""The matmul kernels built for each instruction set this CPU runs, side by side.

Runs ``benchmarks/matmul_kernels.py`` once per ISA (``LMSERVE_ISA``; one process each, as a
server picks its ISA once), in interleaved rounds, and prints each lmserve kernel's median
GFLOP/s per ISA and its ratio to the first one listed. The outputs are the same bits on every
ISA (tests/test_kernel_isas.py), so this is the whole difference between them; but for the
bf16 kernel on AMX tiles, whose sums differ in their last bits (kernels/block_gemm.cpp).

    .venv/bin/python benchmarks/isa_kernels.py [--rounds 3] [--rows 1 16 256] [--isas amx avx512]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from collections import defaultdict

from lmserve.kernels.build import ISA_ENV, supported_isas

SCRIPT = os.path.join(os.path.dirname(__file__), "matmul_kernels.py")
KERNELS = ["lmserve int8", "lmserve int16", "lmserve bfloat16", "lmserve float32"]


def one_run(isa: str, rows: list[int], seconds: float) -> dict[tuple[str, str], float]:
    """GFLOP/s by (shape and rows, kernel) of one run of matmul_kernels.py on ``isa``."""
    out = subprocess.run([sys.executable, SCRIPT, "--rows", *map(str, rows), "--seconds", str(seconds)],
                         env={**os.environ, ISA_ENV: isa}, capture_output=True, text=True, check=True).stdout
    lines = out.splitlines()
    result = {}
    for line in lines[2:]:
        head, cells = line[:28].strip(), line[28:].split(")")
        for kernel, cell in zip(KERNELS, cells):
            result[(head, kernel)] = float(cell.split("(")[0])
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16, 256])
    ap.add_argument("--seconds", type=float, default=0.2)
    ap.add_argument("--isas", nargs="+", help="these of the ISAs this CPU runs (default: all)")
    args = ap.parse_args()
    isas = [isa.name for isa in supported_isas() if not args.isas or isa.name in args.isas]
    runs: dict[str, list] = defaultdict(list)
    for _ in range(args.rounds):
        for isa in isas:
            runs[isa].append(one_run(isa, args.rows, args.seconds))
    keys = list(runs[isas[0]][0])
    median = {isa: {k: statistics.median(r[k] for r in runs[isa]) for k in keys} for isa in isas}
    print(f"median GFLOP/s of {args.rounds} interleaved rounds; ratio to {isas[0]}")
    print(f"{'shape, rows':28} {'kernel':18} " + " ".join(f"{isa:>16}" for isa in isas))
    for shape, kernel in keys:
        best = median[isas[0]][(shape, kernel)]
        cells = [f"{median[isa][(shape, kernel)]:7.0f} ({median[isa][(shape, kernel)] / best:4.2f}x)"
                 for isa in isas]
        print(f"{shape:28} {kernel:18} " + " ".join(f"{c:>16}" for c in cells))


if __name__ == "__main__":
    main()
