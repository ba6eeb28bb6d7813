"""``lmserve bench``: a serving benchmark against any OpenAI-compatible server.

``add_bench_parser`` adds the subcommand to the ``lmserve`` command line; ``main`` runs it on
its own (``python -m lmserve.bench``). See docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
from collections.abc import Sequence
from typing import Any, Optional

from lmserve.bench.datasets import (
    SampleRequest,
    json_schema_dataset,
    length_range,
    random_dataset,
    shared_prefix_dataset,
)

_ENDPOINTS = ("/v1/completions", "/v1/chat/completions")
_BACKENDS = {"/v1/completions": "openai", "/v1/chat/completions": "openai-chat"}  # vLLM's names


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


def _range_ratio(text: str) -> float:
    value = float(text)
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {text}")
    return value


def _percentiles(text: str) -> list[float]:
    try:
        values = [float(p) for p in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if not all(0 < p <= 100 for p in values):
        raise argparse.ArgumentTypeError(f"percentiles must be in (0, 100], got {text!r}")
    return values


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    server = parser.add_argument_group("server")
    server.add_argument("--base-url", default="http://127.0.0.1:8000", metavar="URL",
                        help="the server's root URL, without /v1 (default: %(default)s)")
    server.add_argument("--model", metavar="NAME",
                        help="model name to send (default: the first one GET /v1/models lists)")
    server.add_argument("--endpoint", choices=_ENDPOINTS, default=_ENDPOINTS[0],
                        help="API to benchmark (default: %(default)s)")
    server.add_argument("--api-key", metavar="K", default=os.environ.get("OPENAI_API_KEY"),
                        help="bearer token (default: $OPENAI_API_KEY, if set)")
    server.add_argument("--tokenizer", metavar="PATH",
                        help="tokenizer to build and measure prompts with: a Hugging Face "
                             "directory or GGUF file (default: the server's /tokenize if it has "
                             "one, else the built-in model's)")

    data = parser.add_argument_group("dataset")
    data.add_argument("--dataset", choices=("random", "shared-prefix", "json-schema"), default="random",
                      help="random: prompts of random tokens; shared-prefix: K random prefixes, "
                           "each followed by distinct random suffixes; json-schema: random prompts, "
                           "each request asking for output that follows a JSON schema "
                           "(response_format; structured_outputs on /v1/completions) "
                           "(default: %(default)s)")
    data.add_argument("--json-schema", metavar="FILE.json",
                      help="json-schema: the schema (default: a typical record schema, "
                           "lmserve.bench.datasets.BENCH_SCHEMA)")
    data.add_argument("--num-prompts", type=_positive_int, default=1000, metavar="N",
                      help="number of requests (default: %(default)s)")
    data.add_argument("--random-input-len", type=_positive_int, default=1024, metavar="I",
                      help="prompt tokens; for shared-prefix, the suffix's (default: %(default)s)")
    data.add_argument("--random-output-len", type=_positive_int, default=128, metavar="O",
                      help="tokens to generate per request (default: %(default)s)")
    data.add_argument("--random-range-ratio", type=_range_ratio, default=0.0, metavar="R",
                      help="lengths are drawn uniformly from [L*(1-R), L*(1+R)], as in vLLM "
                           "(default: %(default)s)")
    data.add_argument("--shared-prefix-len", type=_positive_int, default=256, metavar="P",
                      help="shared-prefix: tokens in each prefix (default: %(default)s)")
    data.add_argument("--num-prefixes", type=_positive_int, default=10, metavar="K",
                      help="shared-prefix: number of distinct prefixes (default: %(default)s)")
    data.add_argument("--seed", type=int, default=0, metavar="S",
                      help="seed of the prompts and the arrival times (default: %(default)s)")

    load = parser.add_argument_group("load")
    load.add_argument("--max-concurrency", type=_positive_int, metavar="C",
                      help="most requests in flight at once (default: no limit)")
    load.add_argument("--request-rate", type=_positive_float, default=math.inf, metavar="RPS",
                      help="requests per second, Poisson arrivals; inf sends all at once "
                           "(default: %(default)s)")
    load.add_argument("--ignore-eos", action="store_true",
                      help="generate exactly the requested tokens (sends ignore_eos: true)")
    load.add_argument("--temperature", type=float, default=0.0, metavar="T",
                      help="sampling temperature (default: %(default)s, greedy)")

    out = parser.add_argument_group("output")
    out.add_argument("--metric-percentiles", type=_percentiles, default=[99.0], metavar="P[,P...]",
                     help="percentiles to report, e.g. 50,90,99 (default: 99)")
    out.add_argument("--result-file", metavar="FILE.json",
                     help="write the results (vLLM bench serve's JSON keys) to this file")
    out.add_argument("--plot", metavar="FILE.png",
                     help="draw TTFT, TPOT, ITL and E2EL histograms to this PNG (needs matplotlib)")
    out.add_argument("--no-progress", action="store_true", help="no progress bar")


def add_bench_parser(subparsers: Any) -> None:
    """Add the ``bench`` subcommand to ``subparsers`` (an ``add_subparsers()`` result); it sets
    ``handler=run`` and ``parser`` defaults, like the other ``lmserve`` subcommands."""
    bench = subparsers.add_parser(
        "bench", help="benchmark an OpenAI-compatible server",
        description="Benchmark the serving performance of an OpenAI-compatible server (lmserve, "
                    "vLLM, llama.cpp, ...) with vLLM bench serve's metrics.")
    _add_arguments(bench)
    bench.set_defaults(handler=run, parser=bench)


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _dataset(args: argparse.Namespace, tokenizer: Any) -> list[SampleRequest]:
    input_range = length_range(args.random_input_len, args.random_range_ratio)
    output_range = length_range(args.random_output_len, args.random_range_ratio)
    if args.dataset == "random":
        _log(f"sampling input_len from {list(input_range)} and output_len from {list(output_range)}")
        return random_dataset(tokenizer, args.num_prompts, args.random_input_len,
                              args.random_output_len, args.random_range_ratio, args.seed)
    if args.dataset == "json-schema":
        schema = None
        if args.json_schema:
            with open(args.json_schema, encoding="utf-8") as f:
                schema = json.load(f)
        _log(f"sampling input_len from {list(input_range)} and output_len from {list(output_range)}; "
             f"every request asks for a JSON schema")
        return json_schema_dataset(tokenizer, args.num_prompts, args.random_input_len,
                                   args.random_output_len, args.random_range_ratio, args.seed, schema)
    _log(f"{args.num_prefixes} prefixes of {args.shared_prefix_len} tokens; sampling suffix_len "
         f"from {list(input_range)} and output_len from {list(output_range)}")
    return shared_prefix_dataset(tokenizer, args.num_prompts, args.shared_prefix_len,
                                 args.num_prefixes, args.random_input_len, args.random_output_len,
                                 args.random_range_ratio, args.seed)


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Run the benchmark ``args`` describe; returns the exit status (1 if nothing succeeded)."""
    if args.json_schema and args.dataset != "json-schema":
        parser.error("--json-schema needs --dataset json-schema")
    # aiohttp, tqdm and the tokenizers load only here, so `lmserve --help` stays quick.
    import aiohttp

    from lmserve.bench.client import Target, check_request, first_model, run_load
    from lmserve.bench.metrics import compute_metrics
    from lmserve.bench.report import RunInfo, format_table, plot_latencies, result_dict, write_result
    from lmserve.bench.spec_decode import scrape_spec_decode
    from lmserve.bench.tokenizers import resolve_tokenizer

    base_url = args.base_url.rstrip("/")
    try:
        model = args.model or asyncio.run(first_model(base_url, args.api_key))
        tokenizer = resolve_tokenizer(args.tokenizer, base_url, model, args.api_key)
        _log(f"model: {model}; tokenizer: {tokenizer.name}")
        requests = _dataset(args, tokenizer)
        target = Target(base_url, args.endpoint, model, args.api_key, args.temperature, args.ignore_eos)
        _log("starting an initial single-prompt test run...")
        test = asyncio.run(check_request(target, requests[0]))
        if not test.success:
            _log(f"{parser.prog}: error: the test request failed, check the arguments: {test.error}")
            return 1
        rate = "inf" if math.isinf(args.request_rate) else args.request_rate
        _log(f"benchmarking {len(requests)} requests at {rate} requests/s, max concurrency "
             f"{args.max_concurrency or 'unlimited'}")
        spec_before = scrape_spec_decode(base_url)
        results, duration = asyncio.run(run_load(target, requests, args.request_rate,
                                                 args.max_concurrency, args.seed, not args.no_progress))
        spec_after = scrape_spec_decode(base_url)
    except KeyboardInterrupt:
        return 130
    except (OSError, aiohttp.ClientError, ValueError, RuntimeError, KeyError) as err:
        # The server is unreachable or answers something unexpected (e.g. no /v1/models).
        _log(f"{parser.prog}: error: {type(err).__name__}: {err}")
        return 1
    for result in results:
        if result.success and result.output_tokens is None:
            # No usage chunk: count the text's tokens, as vLLM does (a slight overcount is
            # possible where the text re-tokenizes into more pieces).
            result.output_tokens = len(tokenizer.encode(result.generated_text))
    metrics = compute_metrics(results, duration, args.metric_percentiles)
    info = RunInfo(_BACKENDS[args.endpoint], model, tokenizer.name, args.num_prompts,
                   args.request_rate, args.max_concurrency)
    spec = spec_after - spec_before if spec_before and spec_after else None
    print(format_table(metrics, info, spec), flush=True)
    if errors := [r.error for r in results if not r.success]:
        _log(f"{len(errors)} requests failed; the first error: {errors[0]}")
    if args.result_file:
        write_result(args.result_file, result_dict(metrics, results, info, spec))
    if args.plot:
        plot_latencies(results, args.plot)
    return 0 if metrics.completed else 1


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``python -m lmserve.bench`` (the same flags as ``lmserve bench``)."""
    parser = argparse.ArgumentParser(prog="lmserve bench",
                                     description="Benchmark an OpenAI-compatible server.")
    _add_arguments(parser)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run ``lmserve bench`` from ``argv``; returns the exit status."""
    parser = build_parser()
    return run(parser.parse_args(argv), parser)
