"""``lmserve bench``: dataset generators, metric arithmetic, report, and a run against
``lmserve serve`` on a loopback port."""

import argparse
import json
import math
import os
import socket
import subprocess
import sys
import time
import urllib.request

import numpy as np
import pytest

from lmserve.bench.cli import add_bench_parser, build_parser, run
from lmserve.bench.client import CHAT_ENDPOINT, COMPLETIONS_ENDPOINT, Target, arrival_times
from lmserve.bench.datasets import (
    BENCH_SCHEMA,
    SampleRequest,
    json_schema_dataset,
    length_range,
    random_dataset,
    shared_prefix_dataset,
)
from lmserve.bench.metrics import RequestResult, compute_metrics, latency_samples, summarize, tpot
from lmserve.bench.report import RunInfo, format_table, percentile_word, result_dict
from lmserve.bench.spec_decode import SpecDecodeCounts, parse_spec_decode
from lmserve.bench.tokenizers import LocalTokenizer
from lmserve.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    """The built-in model's tokenizer, the one the tiny test models have too."""
    return LocalTokenizer(None)


# ---------------------------------------------------------------------------------------------
# Datasets


@pytest.mark.parametrize("length, ratio, expected", [
    (100, 0.0, (100, 100)),
    (100, 0.5, (50, 150)),  # vLLM: [int(L(1-R)), int(L(1+R))]
    (7, 0.3, (4, 9)),  # int() truncates both ends
    (1, 0.9, (1, 1)),  # never below 1
])
def test_length_range_is_vllms(length, ratio, expected):
    assert length_range(length, ratio) == expected


@pytest.mark.parametrize("ratio", [1.0, -0.1, 1.5])
def test_length_range_refuses_ratios_outside_0_1(ratio):
    with pytest.raises(ValueError, match="range ratio"):
        length_range(10, ratio)


def test_random_prompts_have_exact_lengths_in_range(tokenizer):
    requests = random_dataset(tokenizer, num_prompts=40, input_len=64, output_len=16,
                              range_ratio=0.25, seed=1)
    assert len(requests) == 40
    for r in requests:
        assert 48 <= r.prompt_len <= 80
        assert 12 <= r.output_len <= 20
        # The reported length is what the tokenizer measures on the text that is sent.
        assert len(tokenizer.encode(r.prompt)) == r.prompt_len
    # The range is used, not just its middle.
    assert len({r.prompt_len for r in requests}) > 5
    assert len({r.prompt for r in requests}) == 40


def test_random_dataset_is_repeatable_by_seed(tokenizer):
    def make(seed):
        return random_dataset(tokenizer, 5, 32, 8, range_ratio=0.5, seed=seed)

    assert make(3) == make(3)
    assert make(3) != make(4)


def test_random_prompts_hold_no_special_tokens(tokenizer):
    special = set(Tokenizer.from_model(None).hf.added_tokens_decoder)
    for r in random_dataset(tokenizer, 10, 256, 4, seed=2):
        assert not special & set(tokenizer.encode(r.prompt))


def test_shared_prefix_prompts_share_their_prefix_tokens(tokenizer):
    prefix_len, num_prefixes = 48, 3
    requests = shared_prefix_dataset(tokenizer, num_prompts=14, prefix_len=prefix_len,
                                     num_prefixes=num_prefixes, suffix_len=16, output_len=4,
                                     range_ratio=0.5, seed=5)
    assert len(requests) == 14
    groups: dict[tuple[int, ...], list[list[int]]] = {}
    for r in requests:
        ids = tokenizer.encode(r.prompt)
        assert len(ids) == r.prompt_len
        assert 8 <= r.prompt_len - prefix_len <= 24
        groups.setdefault(tuple(ids[:prefix_len]), []).append(ids[prefix_len:])
    # K prefixes, the prompts split evenly among them (14 = 5 + 5 + 4), suffixes all distinct.
    assert sorted(len(g) for g in groups.values()) == [4, 5, 5]
    suffixes = [tuple(s) for g in groups.values() for s in g]
    assert len(set(suffixes)) == len(suffixes)
    # Shuffled: the prompts of one prefix do not come in a block or a strict rotation.
    order = [next(i for i, p in enumerate(groups) if tokenizer.encode(r.prompt)[:prefix_len] == list(p))
             for r in requests]
    assert order != sorted(order)
    assert order != [i % num_prefixes for i in range(len(order))]


# ---------------------------------------------------------------------------------------------
# Metrics


def _result(ttft, itl, output_tokens, prompt_len=10, latency=None):
    latency = ttft + sum(itl) if latency is None else latency
    return RequestResult(prompt_len=prompt_len, success=True, ttft=ttft, itl=list(itl),
                         latency=latency, output_tokens=output_tokens, generated_text="x")


def test_tpot_excludes_the_first_token():
    assert tpot(_result(0.5, [0.1, 0.1, 0.1, 0.1], 5)) == pytest.approx(0.1)  # (0.9 - 0.5) / 4
    assert tpot(_result(0.5, [], 1)) is None  # one token: no time per output token


def test_metrics_of_synthetic_results():
    results = [
        _result(0.100, [0.010, 0.020], 3, prompt_len=10),
        _result(0.200, [0.030], 2, prompt_len=20),
        _result(0.300, [], 1, prompt_len=30),
        RequestResult(prompt_len=40, error="HTTP 500: boom"),  # failed: counts nowhere
    ]
    m = compute_metrics(results, duration=2.0, percentiles=[50, 99, 99.9])
    assert (m.completed, m.failed) == (3, 1)
    assert (m.total_input, m.total_output) == (60, 6)
    assert m.request_throughput == pytest.approx(1.5)
    assert m.output_throughput == pytest.approx(3.0)
    assert m.total_token_throughput == pytest.approx(33.0)

    ttft = m.latencies["ttft"]
    assert ttft.mean == pytest.approx(200.0)
    assert ttft.median == pytest.approx(200.0)
    assert ttft.std == pytest.approx(np.std([100, 200, 300]))  # population std, as numpy's
    assert ttft.percentiles[99] == pytest.approx(298.0)  # linear interpolation
    assert ttft.percentiles[50] == pytest.approx(ttft.median)
    # TPOT: (0.13 - 0.1) / 2 and (0.23 - 0.2) / 1; the 1-token request has none.
    assert m.latencies["tpot"].mean == pytest.approx((15.0 + 30.0) / 2)
    # ITL: every gap of every request is one sample.
    assert m.latencies["itl"].mean == pytest.approx(20.0)
    assert m.latencies["itl"].median == pytest.approx(20.0)
    assert m.latencies["e2el"].mean == pytest.approx((130 + 230 + 300) / 3)


def test_a_metric_without_samples_reports_zeros():
    dist = summarize([], [99])
    assert (dist.mean, dist.median, dist.std, dist.percentiles) == (0.0, 0.0, 0.0, {99: 0.0})
    m = compute_metrics([RequestResult(prompt_len=5, error="refused")], duration=1.0)
    assert (m.completed, m.failed, m.total_input, m.request_throughput) == (0, 1, 0, 0.0)
    assert latency_samples([RequestResult(prompt_len=5)]) == {"ttft": [], "tpot": [], "itl": [], "e2el": []}


def test_compute_metrics_refuses_a_success_without_a_token_count():
    with pytest.raises(ValueError, match="output_tokens"):
        compute_metrics([_result(0.1, [], None)], duration=1.0)


# ---------------------------------------------------------------------------------------------
# Report


def test_result_dict_has_vllms_keys_and_the_table_its_lines():
    results = [_result(0.1, [0.01, 0.03], 3), RequestResult(prompt_len=7, error="HTTP 400: bad")]
    m = compute_metrics(results, duration=1.0, percentiles=[90, 99.9])
    info = RunInfo("openai", "m", "tok", 2, math.inf, 4)
    d = result_dict(m, results, info)
    for name in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "std", "p90", "p99.9"):
            assert f"{stat}_{name}_ms" in d
    assert d["request_rate"] == "inf" and d["max_concurrency"] == 4
    assert d["input_lens"] == [10, 7] and d["output_lens"] == [3, 0]
    assert d["ttfts"] == [0.1, 0.0] and d["itls"] == [[0.01, 0.03], []]
    assert d["errors"] == ["", "HTTP 400: bad"]
    assert (d["completed"], d["failed"], d["total_output_tokens"]) == (1, 1, 3)
    json.dumps(d, allow_nan=False)  # strict JSON: no inf or nan anywhere

    table = format_table(m, info)
    lines = table.splitlines()
    assert lines[0] == "============ Serving Benchmark Result ============"
    assert lines[-1] == "=" * 50
    assert "-----Time per Output Token (excl. 1st token)------" in lines
    assert "Maximum request concurrency:             4         " in lines
    assert not any(line.startswith("Request rate configured") for line in lines)  # inf: not shown
    assert any(line.startswith("P99.9 ITL (ms):") for line in lines)


def test_percentile_word():
    assert [percentile_word(p) for p in (99, 99.0, 99.9, 50)] == ["99", "99", "99.9", "50"]


# ---------------------------------------------------------------------------------------------
# Client and command line (no server)


def test_poisson_arrivals():
    assert arrival_times(5, math.inf, seed=0) == [0.0] * 5
    times = arrival_times(4000, 20.0, seed=0)
    assert times[0] == 0.0 and all(a <= b for a, b in zip(times, times[1:]))
    gaps = np.diff(times)
    assert np.mean(gaps) == pytest.approx(1 / 20, rel=0.1)
    assert np.std(gaps) == pytest.approx(1 / 20, rel=0.1)  # exponential: std == mean
    assert arrival_times(10, 20.0, seed=1) == arrival_times(10, 20.0, seed=1)


def test_request_bodies():
    request = SampleRequest("hi there", 2, 7)
    body = Target("http://h", COMPLETIONS_ENDPOINT, "m", ignore_eos=True).body(request)
    assert body == {"model": "m", "temperature": 0.0, "stream": True,
                    "stream_options": {"include_usage": True}, "prompt": "hi there",
                    "max_tokens": 7, "ignore_eos": True}
    chat = Target("http://h", CHAT_ENDPOINT, "m", temperature=0.5).body(request)
    assert chat["messages"] == [{"role": "user", "content": "hi there"}]
    assert chat["max_completion_tokens"] == 7 and "ignore_eos" not in chat
    constrained = SampleRequest("hi there", 2, 7, json_schema={"type": "object"})
    chat = Target("http://h", CHAT_ENDPOINT, "m").body(constrained)
    assert chat["response_format"] == {"type": "json_schema",
                                       "json_schema": {"name": "bench", "schema": {"type": "object"}}}
    assert Target("http://h", COMPLETIONS_ENDPOINT, "m").body(constrained)["structured_outputs"] == \
        {"json": {"type": "object"}}


def test_json_schema_dataset_is_the_random_one_asking_for_a_schema(tokenizer):
    plain = random_dataset(tokenizer, 4, 16, 8, seed=2)
    constrained = json_schema_dataset(tokenizer, 4, 16, 8, seed=2)
    assert [r.prompt for r in constrained] == [r.prompt for r in plain]
    assert all(r.json_schema == BENCH_SCHEMA for r in constrained)
    assert json_schema_dataset(tokenizer, 1, 16, 8, schema={"type": "object"})[0].json_schema == {"type": "object"}


def test_add_bench_parser_sets_handler_and_parser():
    parser = argparse.ArgumentParser(prog="lmserve")
    add_bench_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["bench", "--num-prompts", "3", "--request-rate", "2.5",
                              "--metric-percentiles", "50,99", "--dataset", "shared-prefix"])
    assert args.handler is run
    assert args.parser.prog == "lmserve bench"
    assert (args.num_prompts, args.request_rate, args.metric_percentiles) == (3, 2.5, [50.0, 99.0])
    defaults = parser.parse_args(["bench"])
    assert math.isinf(defaults.request_rate) and defaults.max_concurrency is None
    assert defaults.endpoint == "/v1/completions" and defaults.dataset == "random"


@pytest.mark.parametrize("argv, message", [
    (["--random-range-ratio", "1"], "argument --random-range-ratio: must be in [0, 1)"),
    (["--num-prompts", "0"], "argument --num-prompts: must be at least 1"),
    (["--request-rate", "0"], "argument --request-rate: must be positive"),
    (["--metric-percentiles", "0,99"], "argument --metric-percentiles: percentiles must be in"),
    (["--endpoint", "/v1/embeddings"], "argument --endpoint: invalid choice"),
])
def test_bad_flags_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(argv)
    assert message in capsys.readouterr().err


def test_a_schema_file_needs_the_json_schema_dataset(capsys):
    parser = build_parser()
    with pytest.raises(SystemExit):
        run(parser.parse_args(["--json-schema", "s.json"]), parser)
    assert "--json-schema needs --dataset json-schema" in capsys.readouterr().err


def test_unreachable_server_is_an_error_not_a_traceback(tiny_model_dir, capsys):
    port = _free_port()  # nothing listens there
    parser = build_parser()
    args = parser.parse_args(["--base-url", f"http://127.0.0.1:{port}", "--model", "m",
                              "--tokenizer", tiny_model_dir, "--num-prompts", "2",
                              "--random-input-len", "4", "--random-output-len", "2", "--no-progress"])
    assert run(args, parser) == 1
    assert "lmserve bench: error: the test request failed" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# End to end: lmserve serve on a loopback port, benchmarked by lmserve bench


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server_url(tiny_model_dir):
    """``lmserve serve`` of the tiny model on a free loopback port, ready (GET /health), with
    prompt-lookup speculation (the random model repeats itself, so drafts are accepted)."""
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "lmserve.cli", "serve", "--model", tiny_model_dir,
         "--port", str(port), "--max-num-sequence", "8", "--speculative-mode", "ngram",
         "--spec-draft-length", "3"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    try:
        while True:
            if proc.poll() is not None:
                pytest.fail(f"lmserve serve exited with {proc.returncode}:\n{proc.stdout.read()}")
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail("lmserve serve not healthy after 120 s")
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _bench(url: str, tmp_path, *flags: str) -> tuple[dict, subprocess.CompletedProcess]:
    result_file = tmp_path / "result.json"
    proc = subprocess.run(
        [sys.executable, "-m", "lmserve.cli", "bench", "--base-url", url,
         "--result-file", str(result_file), "--no-progress", *flags],
        capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONIOENCODING": "utf-8"},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(result_file.read_text()), proc


def test_bench_against_lmserve_serve(server_url, tmp_path):
    plot = tmp_path / "latency.png"
    r, proc = _bench(server_url, tmp_path, "--dataset", "random", "--num-prompts", "16",
                     "--random-input-len", "32", "--random-output-len", "24", "--ignore-eos",
                     "--max-concurrency", "4", "--plot", str(plot))
    assert "============ Serving Benchmark Result ============" in proc.stdout
    assert (r["completed"], r["failed"]) == (16, 0)
    assert r["errors"] == [""] * 16
    assert r["max_concurrency"] == 4 and r["request_rate"] == "inf" and r["num_prompts"] == 16
    # ignore_eos: every request generates exactly what it asked for.
    assert r["total_output_tokens"] == 16 * 24 and r["output_lens"] == [24] * 16
    assert r["input_lens"] == [32] * 16 and r["total_input_tokens"] == 16 * 32
    duration = r["duration"]
    assert duration > 0
    assert r["request_throughput"] == pytest.approx(16 / duration)
    assert r["output_throughput"] == pytest.approx(16 * 24 / duration)
    assert r["total_token_throughput"] == pytest.approx(16 * (32 + 24) / duration)
    for name in ("ttft", "tpot", "itl", "e2el"):
        assert r[f"p99_{name}_ms"] >= r[f"median_{name}_ms"] >= 0, name
        assert r[f"mean_{name}_ms"] >= 0 and r[f"std_{name}_ms"] >= 0, name
    assert len(r["ttfts"]) == len(r["itls"]) == 16
    assert all(0 < t * 1000 <= r["p99_e2el_ms"] + 1e-6 for t in r["ttfts"])
    # Each request's gaps stay within its own end-to-end time, which bounds the run.
    assert max(r["ttfts"][i] + sum(r["itls"][i]) for i in range(16)) <= duration
    assert r["mean_e2el_ms"] >= r["mean_ttft_ms"]
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # The server counted drafts during the run: the acceptance section, from its /metrics.
    assert "Speculative Decoding" in proc.stdout and "Acceptance length:" in proc.stdout
    assert 0 < r["spec_decode_draft_tokens"] <= 3 * r["spec_decode_num_drafts"]
    assert r["spec_decode_acceptance_rate"] == pytest.approx(
        100 * r["spec_decode_accepted_tokens"] / r["spec_decode_draft_tokens"])
    assert 1 <= r["spec_decode_acceptance_length"] <= 4


def test_bench_json_schema_dataset_against_lmserve_serve(server_url, tmp_path):
    r, _ = _bench(server_url, tmp_path, "--dataset", "json-schema", "--num-prompts", "6",
                  "--random-input-len", "16", "--random-output-len", "40", "--max-concurrency", "3",
                  "--endpoint", "/v1/chat/completions")
    assert (r["completed"], r["failed"]) == (6, 0)
    assert all(0 < n <= 40 for n in r["output_lens"])


def test_spec_decode_counters_are_read_from_lmservess_and_vllms_metrics():
    from prometheus_client import generate_latest

    from lmserve.frontend.server.metrics import ServerMetrics
    from lmserve.outputs import EngineStats

    stats = EngineStats(1, 0, 3, 10, 0, 5, 7, 9, 0, 0, 0, spec_num_drafts=4,
                        spec_num_draft_tokens=12, spec_num_accepted_tokens=6,
                        spec_accepted_per_pos=[3, 2, 1])
    ours = parse_spec_decode(generate_latest(ServerMetrics(lambda: stats).registry).decode())
    assert (ours.num_drafts, ours.num_draft_tokens, ours.num_accepted_tokens) == (4, 12, 6)
    assert ours.accepted_per_pos == {0: 3, 1: 2, 2: 1}
    assert (ours.acceptance_rate, ours.acceptance_length) == (0.5, 2.5)
    vllm = parse_spec_decode(
        "# TYPE vllm:spec_decode_num_drafts_total counter\n"
        'vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 10.0\n'
        "vllm:spec_decode_num_draft_tokens_total 30.0\n"
        "vllm:spec_decode_num_accepted_tokens_total 15.0\n")
    assert (vllm.num_drafts, vllm.num_accepted_tokens) == (10, 15)
    assert (vllm - SpecDecodeCounts(num_drafts=5, num_draft_tokens=10)).num_draft_tokens == 20
    assert parse_spec_decode("lmserve:prefix_cache_hits_total 3.0\n") is None


def test_bench_chat_shared_prefix_against_lmserve_serve(server_url, tmp_path):
    r, _ = _bench(server_url, tmp_path, "--endpoint", "/v1/chat/completions",
                  "--dataset", "shared-prefix", "--num-prompts", "8", "--shared-prefix-len", "24",
                  "--num-prefixes", "2", "--random-input-len", "8", "--random-output-len", "4",
                  "--ignore-eos", "--request-rate", "20", "--metric-percentiles", "50,90")
    assert (r["completed"], r["failed"]) == (8, 0)
    assert r["backend"] == "openai-chat" and r["request_rate"] == 20.0
    assert r["total_output_tokens"] == 8 * 4
    assert r["input_lens"] == [24 + 8] * 8
    assert r["p90_ttft_ms"] >= r["p50_ttft_ms"] == pytest.approx(r["median_ttft_ms"])
