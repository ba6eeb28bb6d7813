"""Start-up time with and without a model library (``lmserve compile``, ``--model-lib``).

Time to first token after start: from launching ``lmserve serve`` to the first answered
``/v1/completions`` request (one token; the client polls ``/v1/models`` until the server
listens, then asks), for the
built-in model (or ``--model``) at each level, in rounds with the kinds interleaved:

- ``library``: ``lmserve serve --model-lib DIR`` (compiled once before the rounds);
- ``jit``: ``lmserve serve --opt LEVEL`` on a machine that has served before: kernels in the
  build cache, the GGUF tokenizer converted (a restart);
- ``jit-cold``: the same with an empty cache directory, as on a fresh machine or container
  (the kernels are compiled, the tokenizer converted).

Prints each kind's median and the speed-up of the library over both JIT kinds. The issue's goal:
at least 3x faster start with the library at O2 and O3.

    .venv/bin/python benchmarks/model_lib_start.py [--levels O2 O3] [--rounds 3] [--no-cold]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

from lmserve.kernels.build import cpu_name


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def time_to_first_token(serve_args: list[str], env: dict[str, str], timeout: float = 600) -> float:
    """Seconds from launching the server to its first answered completion (asked for as soon
    as ``/v1/models`` answers, which names the model)."""
    url = f"http://127.0.0.1:{free_port()}"
    log = tempfile.TemporaryFile()  # the server's output, shown if it fails
    started = time.perf_counter()
    server = subprocess.Popen([sys.executable, "-m", "lmserve.cli", "serve", "--port", url.rsplit(":", 1)[1],
                               "--log-level", "warning", *serve_args], env=env,
                              stdout=log, stderr=subprocess.STDOUT)
    try:
        while True:
            try:
                with urllib.request.urlopen(url + "/v1/models", timeout=timeout) as answer:
                    model = json.load(answer)["data"][0]["id"]
                break
            except urllib.error.HTTPError:
                raise
            except (urllib.error.URLError, ConnectionError):
                if server.poll() is not None:
                    log.seek(0)
                    raise RuntimeError(f"the server exited: {log.read().decode()[-2000:]}")
                if time.perf_counter() - started > timeout:
                    raise TimeoutError(f"no answer within {timeout} s") from None
                time.sleep(0.02)
        body = json.dumps({"model": model, "prompt": "The capital of France is", "max_tokens": 1,
                           "temperature": 0}).encode()
        request = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=timeout) as answer:
            json.load(answer)
        return time.perf_counter() - started
    finally:
        server.terminate()
        server.wait(30)
        log.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="GGUF file or HF directory (default: the built-in model)")
    parser.add_argument("--levels", nargs="+", default=["O2", "O3"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-cold", action="store_true", help="skip the empty-cache JIT starts")
    args = parser.parse_args()
    model = ["--model", args.model] if args.model else []
    print(f"CPU: {cpu_name()}; {args.rounds} rounds, medians")
    kinds = ["library", "jit"] + ([] if args.no_cold else ["jit-cold"])
    with tempfile.TemporaryDirectory() as tmp:
        results = {}
        for level in args.levels:
            lib = os.path.join(tmp, f"lib-{level}")
            started = time.perf_counter()
            subprocess.run([sys.executable, "-m", "lmserve.cli", "compile", *model, "--opt", level,
                            "--output", lib], check=True, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
            print(f"{level}: lmserve compile took {time.perf_counter() - started:.1f} s "
                  f"(kernels from the build cache)")
            times: dict[str, list[float]] = {k: [] for k in kinds}
            for round_ in range(args.rounds):
                for kind in kinds:
                    env = dict(os.environ)
                    if kind == "jit-cold":
                        env["LMSERVE_CACHE_DIR"] = tempfile.mkdtemp(dir=tmp)
                    serve = ["--model-lib", lib] if kind == "library" else [*model, "--opt", level]
                    times[kind].append(time_to_first_token(serve, env))
                print(f"  round {round_ + 1}: " + ", ".join(f"{k} {times[k][-1]:.2f} s" for k in kinds),
                      flush=True)
            results[level] = {k: statistics.median(v) for k, v in times.items()}
    print(f"\n{'level':6} " + " ".join(f"{k:>10}" for k in kinds) + "   jit/library"
          + ("   jit-cold/library" if "jit-cold" in kinds else ""))
    for level, r in results.items():
        line = f"{level:6} " + " ".join(f"{r[k]:>9.2f}s" for k in kinds) + f"   {r['jit'] / r['library']:>10.2f}x"
        if "jit-cold" in r:
            line += f"   {r['jit-cold'] / r['library']:>16.2f}x"
        print(line)


if __name__ == "__main__":
    main()
