"""Two builds of a C++ kernel timed against each other, interleaved rep by rep in one process.

This machine's speed swings by 10-20% between runs, more than most kernel changes are worth, so
separate runs cannot compare two builds; alternating them call batch by call batch and comparing
medians can. Each build is the kernel's source at a git revision (``WORKTREE`` for the files as
they are), compiled with the engine's own flags next to that revision's ``simd.h``.

- ``int8_gemm``: the layers' shapes (4-bit, ``--bits 8`` 8-bit; one int8 digit, as O3; ``--digits
  2`` as O2) at each of ``--rows``, 30 copies of the weights cycled and the caches flushed before
  each call, so they come from memory as in the model; GFLOP/s, whether the builds' outputs are
  bit-identical, and each build's time for one layer's four matmuls relative to the first build.
- ``dense_gemm``: O0's float32 matmul over a whole model's weights (30 layers' four matrices and
  the head, each once, as a step reads them: 537 MB) at each of ``--rows``; milliseconds for
  the whole model, whether the builds' outputs are bit-identical.
- ``paged_attention``: one layer's attention call on an int8 KV cache (O3; ``--kv bf16``: O1/O2's)
  over 30 layers' caches with each sequence's pages shuffled: a 256-token prefill, decode of 16
  streams of 325 tokens, and both in one batch. Each build fills its own caches (their layout may
  differ between revisions); also prints how far the outputs are apart.
- ``fused_ops``: a layer's norm (residual add + RMSNorm, 576 wide) and SiLU(gate) * up (1536
  wide) at each of ``--rows``, 1000 calls through ctypes a timing.

    .venv/bin/python benchmarks/kernel_ab.py int8_gemm --base 8d04870 [--new WORKTREE] [--rows 1 16 256]
    .venv/bin/python benchmarks/kernel_ab.py dense_gemm --base 4c0c353 --rows 1 4 7 8
    .venv/bin/python benchmarks/kernel_ab.py paged_attention --base 0529f40 [--kv bf16]
    .venv/bin/python benchmarks/kernel_ab.py fused_ops --base 3708ff8 --rows 1 16
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from lmserve.attention.base import AttentionInput, AttentionShape
from lmserve.attention.cpu_paged import CpuPagedBackend
from lmserve.kernels.build import compile_flags
from lmserve.layers.blocks import BlockWeight
from lmserve.layers.linear import BlockLinear
from lmserve.util import cdiv

KERNELS = Path("lmserve/kernels")
ROOT = Path(__file__).resolve().parent.parent
LAYERS = 30
FLUSH_BYTES = 128 << 20  # four times the L3 of the machines here
GEMM_SHAPES = [(3072, 576), (576, 1536), (960, 576), (576, 576)]  # gate/up, down, q/k/v, o
H, KVH, HD, PAGE = 9, 3, 64, 16  # SmolLM2-135M
ATTENTION_BATCHES = [("prefill 256", [256], [256]), ("decode 16 x 325", [1] * 16, [325] * 16),
                     ("prefill 240 + decode 16 x 325", [240] + [1] * 16, [240] + [325] * 16)]


def build(kernel: str, rev: str, into: Path) -> ctypes.CDLL:
    """``kernel``.cpp at ``rev`` compiled into ``into``, with that revision's headers."""
    src = into / rev
    src.mkdir()
    for name in [f"{kernel}.cpp", *(h.name for h in (ROOT / KERNELS).glob("*.h"))]:
        path = KERNELS / name
        if rev == "WORKTREE":
            text = (ROOT / path).read_text()
        else:
            shown = subprocess.run(["git", "show", f"{rev}:{path}"], cwd=ROOT, capture_output=True, text=True)
            if shown.returncode and name.endswith(".h"):
                continue  # a header that revision had not
            shown.check_returncode()
            text = shown.stdout
        (src / name).write_text(text)
    subprocess.run(["g++", *compile_flags(kernel), str(src / f"{kernel}.cpp"), "-o", str(src / "k.so")],
                   check=True)
    return ctypes.CDLL(str(src / "k.so"))


def interleaved(builds: dict, cases: list, run, reps: int) -> dict:
    """Median seconds of ``run(build, lib, case)`` per (build, case), the builds alternating rep
    by rep, each rep in another order, each call after the caches were flushed.

    Without the flush a build ran on what the build before it left in the 32 MiB L3 (a small
    matrix's 30 copies fit it whole): the second build of two timed 8-25% faster than the first
    with both the same code (Zen 4, int8_gemm at 1-16 rows), where in a model every layer's
    weights come from memory."""
    times = {(b, c): [] for b in builds for c in range(len(cases))}
    names = list(builds)
    flush = torch.ones(FLUSH_BYTES // 4)
    for rep in range(reps):
        for c, case in enumerate(cases):
            for b in names[rep % len(names):] + names[:rep % len(names)]:
                flush.sum()  # reads every line (clean ones: evicting them costs nothing later)
                start = time.perf_counter()
                run(b, builds[b], case)
                times[(b, c)].append(time.perf_counter() - start)
    return {k: statistics.median(v) for k, v in times.items()}


def gemm(builds: dict, rows: list[int], digits: int, reps: int, bits: int = 4) -> None:
    layers = {s: [BlockLinear(BlockWeight.quantize(torch.randn(*s), bits), None, "int8") for _ in range(LAYERS)]
              for s in GEMM_SHAPES}
    for lib in builds.values():
        lib.lm_int8_gemm.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                                     ctypes.c_void_p] + [ctypes.c_int] * 8
    for m in rows:
        cases = [(n, k, torch.randn(m, k), torch.empty(m, n)) for n, k in GEMM_SHAPES]

        def run(_, lib, case, m=m):
            n, k, x, out = case
            for lin in layers[(n, k)]:
                lib.lm_int8_gemm(x.data_ptr(), 1, lin.codes.data_ptr(), lin.consts.data_ptr(), out.data_ptr(),
                                 0, m, n, k, bits, digits, int(lin.consts.dtype == torch.float16), 2)

        t = interleaved(builds, cases, run, reps)
        first = next(iter(builds))
        for c, (n, k, x, out) in enumerate(cases):
            results = {}
            for b, lib in builds.items():
                out.fill_(float("nan"))  # a build that leaves an element unwritten is not "same"
                run(b, lib, (n, k, x, out))  # the last layer's output, kept per build
                results[b] = out.clone()
            same = all(torch.equal(results[b], results[first]) for b in builds)
            print(f"M={m:<4d} {n}x{k}: " + "  ".join(
                f"{b} {2 * m * n * k * LAYERS / t[(b, c)] / 1e9:6.0f} GFLOP/s" for b in builds)
                + f"  same bits: {same}")
        layer = {b: sum(t[(b, c)] for c in range(len(cases))) for b in builds}
        print(f"M={m:<4d} one layer's matmuls, time relative to {first}: "
              + "  ".join(f"{b} {layer[b] / layer[first]:.3f}" for b in builds))


def dense_gemm(builds: dict, rows: list[int], reps: int) -> None:
    weights = [torch.randn(n, k) * 0.02 for _ in range(LAYERS) for n, k in GEMM_SHAPES]
    weights.append(torch.randn(49152, 576) * 0.02)
    for lib in builds.values():
        lib.lm_dense_gemm.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int] * 4
    cases = [(m, {k: torch.randn(m, k) for k in (576, 1536)}, [torch.empty(m, w.shape[0]) for w in weights])
             for m in rows]

    def run(_, lib, case):
        m, xs, outs = case
        for w, out in zip(weights, outs):
            lib.lm_dense_gemm(xs[w.shape[1]].data_ptr(), w.data_ptr(), out.data_ptr(), m, *w.shape, 2)

    t = interleaved(builds, cases, run, reps)
    first = next(iter(builds))
    for c, case in enumerate(cases):
        results = {}
        for b, lib in builds.items():
            for out in case[2]:
                out.fill_(float("nan"))
            run(b, lib, case)
            results[b] = [out.clone() for out in case[2]]
        same = all(all(map(torch.equal, results[b], results[first])) for b in builds)
        print(f"M={case[0]:<4d} whole model: " + "  ".join(
            f"{b} {t[(b, c)] * 1e3:6.2f} ms ({t[(b, c)] / t[(first, c)]:.3f})" for b in builds)
            + f"  same bits: {same}")


# The KV caches' flags for lm_paged_attention (float32 q/k/v and out) and their flat sizes.
KV_FLAGS = {"int8": 16, "bf16": 2}


def kv_caches(kv: str, num_pages: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's zeroed key and value caches in the kernel's layout for ``kv``."""
    if kv == "int8":
        return (torch.zeros(num_pages * KVH * (HD + 8) * PAGE, dtype=torch.int8),
                torch.zeros(num_pages * KVH * (HD + 4) * PAGE, dtype=torch.int8))
    return (torch.zeros(num_pages * KVH * HD * PAGE, dtype=torch.bfloat16),
            torch.zeros(num_pages * KVH * HD * PAGE, dtype=torch.bfloat16))


def attention(builds: dict, kv: str, reps: int) -> None:
    backend = CpuPagedBackend(AttentionShape(H, KVH, HD))
    num_pages = 16 * 400 // PAGE + 64
    def call(lib, meta, qkv, q_buf, kc, vc, out):
        T = qkv.shape[0]
        cos, sin = torch.ones(T, HD), torch.zeros(T, HD)
        ptr = ctypes.c_void_p
        lib.lm_paged_attention(ptr(qkv.data_ptr()), ptr(cos.data_ptr()), ptr(sin.data_ptr()),
                               ptr(meta.slots.data_ptr()), ptr(q_buf.data_ptr()), ptr(kc.data_ptr()),
                               ptr(vc.data_ptr()), ptr(meta.pages.data_ptr()), ptr(meta.page_offset.data_ptr()),
                               ptr(meta.context.data_ptr()), None, None, ptr(out.data_ptr()), T, H, KVH,
                               HD, PAGE, ctypes.c_float(HD ** -0.5), KV_FLAGS[kv], 2,
                               None, None, None, None, 0, 0)  # no draft tree, no window

    for label, qlens, ctxs in ATTENTION_BATCHES:
        order = torch.randperm(num_pages, generator=torch.Generator().manual_seed(1)).tolist()
        tables, at = [], 0
        for c in ctxs:
            tables.append(order[at: at + cdiv(c, PAGE)])
            at += len(tables[-1])
        # Every sequence's whole context, prefilled through each build into its own caches.
        full = backend.prepare(AttentionInput(ctxs, ctxs, tables), PAGE, torch.device("cpu"))
        qkv_full = torch.randn(sum(ctxs), (H + 2 * KVH) * HD, generator=torch.Generator().manual_seed(2))
        caches = {}
        for b, lib in builds.items():
            caches[b] = [kv_caches(kv, num_pages) for _ in range(LAYERS)]
            for kc, vc in caches[b]:
                call(lib, full, qkv_full, torch.empty(sum(ctxs), H, HD), kc, vc, torch.empty(sum(ctxs), H * HD))
        # The step: each sequence's last qlens tokens again (their keys and values rewritten).
        ends = torch.tensor(ctxs).cumsum(0).tolist()
        qkv = torch.cat([qkv_full[e - q: e] for e, q in zip(ends, qlens)])
        meta = backend.prepare(AttentionInput(qlens, ctxs, tables), PAGE, torch.device("cpu"))
        q_buf, outs = torch.empty(len(qkv), H, HD), {b: torch.empty(len(qkv), H * HD) for b in builds}

        def run(b, lib, _, meta=meta, qkv=qkv, q_buf=q_buf, caches=caches, outs=outs):
            for kc, vc in caches[b]:  # each build reads the caches it filled
                call(lib, meta, qkv, q_buf, kc, vc, outs[b])

        t = interleaved(builds, [None], run, reps)
        first = next(iter(builds))
        print(f"{label:30}: " + "  ".join(f"{b} {t[(b, 0)] / LAYERS * 1e3:.3f} ms" for b in builds)
              + "  a layer; largest output difference from " + first + ": "
              + " ".join(f"{(outs[b] - outs[first]).abs().max():.1e}" for b in builds if b != first))


def fused_calls(m: int) -> list:
    """A layer's norm and SiLU over ``m`` rows, as (label, call(lib)) pairs."""
    x, delta, weight, normed = torch.randn(m, 576), torch.zeros(m, 576), torch.randn(576), torch.empty(m, 576)
    gate_up, out = torch.randn(m, 2 * 1536), torch.empty(m, 1536)
    return [("norm", lambda lib: lib.lm_add_rms_norm(x.data_ptr(), delta.data_ptr(), 0, weight.data_ptr(),
                                                     1e-5, normed.data_ptr(), 0, m, 576, 2)),
            ("SiLU", lambda lib: lib.lm_silu_mul(gate_up.data_ptr(), out.data_ptr(), 0, m, 1536, 2))]


def fused_ops(builds: dict, rows: list[int], reps: int) -> None:
    for lib in builds.values():
        lib.lm_add_rms_norm.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p,
                                        ctypes.c_float] + [ctypes.c_void_p] + [ctypes.c_int] * 4
        lib.lm_silu_mul.argtypes = [ctypes.c_void_p, ctypes.c_void_p] + [ctypes.c_int] * 4

    def run(_, lib, case):
        for _ in range(1000):
            case[1](lib)

    for m in rows:
        cases = fused_calls(m)
        t = interleaved(builds, cases, run, reps)
        for c, (label, _) in enumerate(cases):
            print(f"M={m:<4d} {label}: " + "  ".join(f"{b} {t[(b, c)] * 1e3:.2f} us a call" for b in builds))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("kernel", choices=["int8_gemm", "dense_gemm", "paged_attention", "fused_ops"])
    ap.add_argument("--base", required=True, help="git revision of the first build")
    ap.add_argument("--new", default="WORKTREE", help="git revision of the second (default: the files as they are)")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16, 256])
    ap.add_argument("--digits", type=int, choices=[1, 2], default=1)
    ap.add_argument("--bits", type=int, choices=[4, 8], default=4, help="int8_gemm: the weights' codes")
    ap.add_argument("--kv", choices=list(KV_FLAGS), default="int8", help="paged_attention: the KV cache")
    ap.add_argument("--reps", type=int, default=15)
    args = ap.parse_args()
    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory() as tmp:
        builds = {rev: build(args.kernel, rev, Path(tmp)) for rev in (args.base, args.new)}
        if args.kernel == "int8_gemm":
            gemm(builds, args.rows, args.digits, args.reps, args.bits)
        elif args.kernel == "dense_gemm":
            dense_gemm(builds, args.rows, args.reps)
        elif args.kernel == "fused_ops":
            fused_ops(builds, args.rows, args.reps)
        else:
            attention(builds, args.kv, args.reps)


if __name__ == "__main__":
    main()
