"""One-stream decode and 512-token prefill: lmserve against llama.cpp, in one run, same GGUF file.

llama.cpp is driven through llama-cpp-python with as many threads as torch uses: either
``pip install llama-cpp-python`` (it builds llama.cpp from source, about 7 minutes on 2 cores), or
its Python part alone (``CMAKE_ARGS=-DLLAMA_BUILD=OFF pip install --no-deps`` its sdist, and
``diskcache``) over a build of ``scripts/build_llama_cpp.sh`` named by
``LLAMA_CPP_LIB_PATH=OUT_DIR/bin``, which is how a native and an AVX2 build are compared. Both
engines prefill fresh prompts (lmserve's prefix cache is off, llama.cpp's context is reset) and
decode greedily with end-of-sequence ignored. lmserve is timed end to end through its Python API
(streaming, sampling and detokenizing included); llama.cpp only inside its ``eval`` calls. The
numbers are medians of ``--repeats`` runs.
Each engine runs in its own process: both use OpenMP, and sharing one process would give
OpenMP more worker threads than cores.

    .venv/bin/python benchmarks/cpu_vs_llama_cpp.py [--opt O2 --opt O3] [--repeats 5] [--model FILE.gguf]

(the built-in model unless ``--model`` names another GGUF file).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import multiprocessing
import os
import random
import statistics
import time

import numpy as np

# lmserve before torch: its import sets libgomp's spinning (lmserve/openmp.py).
from lmserve import Engine  # isort: skip
import torch

from lmserve.models.builtin import builtin_model_path


def _prompt(tokenizer_vocab: int, n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, tokenizer_vocab - 100) for _ in range(n)]


def lmserve_run(model: str, opt: str, prompt_len: int, decode: int, repeats: int) -> tuple[float, float]:
    """(prefill tokens/s, decode tokens/s) of one stream."""
    engine = Engine(model, opt=opt, prefix_cache_mode="disable", verbose=False)
    vocab = engine._core.args.vocab_size
    prefill, decoding = [], []
    for r in range(repeats + 1):  # the first run warms up
        ids = _prompt(vocab, prompt_len, seed=r)
        start = time.perf_counter()
        stream = engine.completions.create(prompt=ids, max_tokens=decode + 1, temperature=0,
                                           ignore_eos=True, stream=True)
        first = None
        for _ in stream:
            if first is None:
                first = time.perf_counter()
        end = time.perf_counter()
        if r:
            prefill.append(prompt_len / (first - start))
            decoding.append(decode / (end - first))
    engine.shutdown()
    return statistics.median(prefill), statistics.median(decoding)


def llama_cpp_run(model: str, prompt_len: int, decode: int, repeats: int) -> tuple[float, float]:
    from llama_cpp import Llama

    threads = torch.get_num_threads()
    llm = Llama(model_path=model, n_ctx=2048, n_batch=512, n_threads=threads,
                n_threads_batch=threads, verbose=False)
    prefill, decoding = [], []
    for r in range(repeats + 1):
        ids = _prompt(llm.n_vocab(), prompt_len, seed=r)
        llm.reset()
        # Only llama.cpp's own work is timed (eval); the greedy pick from its logits is not,
        # so llama-cpp-python's Python overhead never counts against it.
        start = time.perf_counter()
        llm.eval(ids)
        prefill_s = time.perf_counter() - start
        decode_s = 0.0
        for _ in range(decode):
            # the last token's logits, read in place (llama-cpp-python keeps none without logits_all)
            logits = np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),))
            token = int(np.argmax(logits))
            start = time.perf_counter()
            llm.eval([token])
            decode_s += time.perf_counter() - start
        if r:
            prefill.append(prompt_len / prefill_s)
            decoding.append(decode / decode_s)
    return statistics.median(prefill), statistics.median(decoding)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--opt", action="append", help="lmserve opt levels to run (default: O2)")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--decode", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--model", default=None, help="a GGUF file (default: the built-in model)")
    args = ap.parse_args()
    model = args.model or builtin_model_path()
    opts = args.opt or ["O2"]

    def in_process(fn, *fn_args):
        ctx = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(1, mp_context=ctx) as pool:
            return pool.submit(fn, *fn_args).result()

    rows = []
    lp, ld = in_process(llama_cpp_run, model, args.prompt_len, args.decode, args.repeats)
    rows.append((f"llama.cpp ({os.environ.get('LLAMA_CPP_LIB_PATH', 'llama-cpp-python')})", lp, ld))
    for opt in opts:
        p, d = in_process(lmserve_run, model, opt, args.prompt_len, args.decode, args.repeats)
        rows.append((f"lmserve opt={opt}", p, d))

    name = "built-in SmolLM2-135M Q4_1" if args.model is None else os.path.basename(model)
    print(f"\n{name}, {torch.get_num_threads()} threads, "
          f"prefill {args.prompt_len} tokens, decode {args.decode} tokens, median of {args.repeats}")
    print(f"{'engine':32} {'prefill tok/s':>14} {'x llama.cpp':>12} {'decode tok/s':>13} {'x llama.cpp':>12}")
    for name, p, d in rows:
        print(f"{name:32} {p:14.1f} {p / lp:12.2f} {d:13.1f} {d / ld:12.2f}")


if __name__ == "__main__":
    main()
