"""Per-request measurements and the serving metrics computed from them.

The definitions are vLLM ``bench serve``'s, so that numbers compare directly:

* TTFT: from sending the request to the first chunk that carries generated text.
* ITL: the gaps between consecutive such chunks; every gap of every request is one sample.
* TPOT: per request, ``(e2el - ttft) / (output_tokens - 1)``; only requests with more than one
  output token have one.
* E2EL: from sending the request to its last chunk of generated text.
* Throughputs divide token (or request) counts of the successful requests by the benchmark's
  wall-clock duration.
* Statistics: mean, median, population standard deviation and linear-interpolated percentiles
  (numpy's defaults), in milliseconds; a metric without samples reports 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")


@dataclass
class RequestResult:
    """What the client measured for one request; times in seconds."""

    prompt_len: int
    success: bool = False
    error: str = ""
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0  # e2e: sending to the last chunk of generated text
    # From the server's usage chunk; None when it sent none (then counted from the text).
    output_tokens: Optional[int] = None
    generated_text: str = ""


@dataclass(frozen=True)
class Distribution:
    """Summary statistics of one latency metric, in milliseconds."""

    mean: float
    median: float
    std: float
    percentiles: dict[float, float]  # percentile (e.g. 99) -> value


@dataclass(frozen=True)
class BenchmarkMetrics:
    """The aggregate result of a benchmark run."""

    completed: int
    failed: int
    total_input: int
    total_output: int
    duration: float  # seconds
    request_throughput: float  # completed requests / s
    output_throughput: float  # output tokens / s
    total_token_throughput: float  # (input + output) tokens / s
    latencies: dict[str, Distribution]  # LATENCY_METRICS name -> its statistics


def tpot(result: RequestResult) -> Optional[float]:
    """Time per output token after the first, in seconds; None with fewer than 2 output tokens."""
    if not result.output_tokens or result.output_tokens < 2:
        return None
    return (result.latency - result.ttft) / (result.output_tokens - 1)


def latency_samples(results: Sequence[RequestResult]) -> dict[str, list[float]]:
    """The samples (seconds) of each latency metric, over the successful requests."""
    ok = [r for r in results if r.success]
    tpots = [t for t in map(tpot, ok) if t is not None]
    return {
        "ttft": [r.ttft for r in ok],
        "tpot": tpots,
        "itl": [gap for r in ok for gap in r.itl],
        "e2el": [r.latency for r in ok],
    }


def summarize(samples_s: Sequence[float], percentiles: Sequence[float]) -> Distribution:
    """Statistics of ``samples_s`` (seconds) in milliseconds; all 0 when there are none."""
    ms = np.asarray(samples_s, dtype=float) * 1000.0 if len(samples_s) else np.zeros(1)
    return Distribution(mean=float(ms.mean()), median=float(np.median(ms)), std=float(ms.std()),
                        percentiles={p: float(np.percentile(ms, p)) for p in percentiles})


def compute_metrics(results: Sequence[RequestResult], duration: float,
                    percentiles: Sequence[float] = (99.0,)) -> BenchmarkMetrics:
    """Aggregate ``results`` of a run that took ``duration`` seconds.

    Every successful result must have ``output_tokens`` set (from usage, or counted).
    """
    if duration <= 0:
        raise ValueError(f"duration must be positive, got {duration}")
    ok = [r for r in results if r.success]
    if any(r.output_tokens is None for r in ok):
        raise ValueError("a successful result has no output_tokens")
    total_input = sum(r.prompt_len for r in ok)
    total_output = sum(r.output_tokens or 0 for r in ok)
    samples = latency_samples(results)
    return BenchmarkMetrics(
        completed=len(ok),
        failed=len(results) - len(ok),
        total_input=total_input,
        total_output=total_output,
        duration=duration,
        request_throughput=len(ok) / duration,
        output_throughput=total_output / duration,
        total_token_throughput=(total_input + total_output) / duration,
        latencies={name: summarize(samples[name], percentiles) for name in LATENCY_METRICS},
    )


def output_lens(results: Sequence[RequestResult]) -> list[int]:
    """Output tokens per request, 0 for failed ones (vLLM's ``output_lens``)."""
    return [(r.output_tokens or 0) if r.success else 0 for r in results]
