"""The benchmark's outputs: vLLM's result table, its JSON result file, and latency histograms."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Optional

from lmserve.bench.metrics import (
    LATENCY_METRICS,
    BenchmarkMetrics,
    RequestResult,
    latency_samples,
    output_lens,
)
from lmserve.bench.spec_decode import SpecDecodeCounts, format_spec_decode

_TITLES = {  # metric -> (short name, section header), as vLLM prints them
    "ttft": ("TTFT", "Time to First Token"),
    "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
    "itl": ("ITL", "Inter-token Latency"),
    "e2el": ("E2EL", "End-to-end Latency"),
}
_WIDTH = 50


@dataclass(frozen=True)
class RunInfo:
    """How the benchmark was run: written next to the metrics in the result file."""

    backend: str  # vLLM's name for the endpoint type: "openai" or "openai-chat"
    model_id: str
    tokenizer_id: str
    num_prompts: int
    request_rate: float  # requests/s; inf = all at once
    max_concurrency: Optional[int]


def percentile_word(p: float) -> str:
    """A percentile as vLLM spells it in keys and labels: 99 -> "99", 99.9 -> "99.9"."""
    return str(int(p)) if int(p) == p else str(p)


def format_table(metrics: BenchmarkMetrics, info: RunInfo,
                 spec: Optional[SpecDecodeCounts] = None) -> str:
    """The result table, line for line as vLLM ``bench serve`` prints it (with its speculative
    decoding section when the server counted drafts during the run)."""
    lines = [f"{' Serving Benchmark Result ':=^{_WIDTH}}"]

    def row(label: str, value: Any, fmt: str = "") -> None:
        lines.append(f"{label:<40} {value:<10{fmt}}")

    row("Successful requests:", metrics.completed)
    row("Failed requests:", metrics.failed)
    if info.max_concurrency is not None:
        row("Maximum request concurrency:", info.max_concurrency)
    if not math.isinf(info.request_rate):
        row("Request rate configured (RPS):", info.request_rate, ".2f")
    row("Benchmark duration (s):", metrics.duration, ".2f")
    row("Total input tokens:", metrics.total_input)
    row("Total generated tokens:", metrics.total_output)
    row("Request throughput (req/s):", metrics.request_throughput, ".2f")
    row("Output token throughput (tok/s):", metrics.output_throughput, ".2f")
    row("Total token throughput (tok/s):", metrics.total_token_throughput, ".2f")
    for name in LATENCY_METRICS:
        short, header = _TITLES[name]
        dist = metrics.latencies[name]
        lines.append(f"{header:-^{_WIDTH}}")
        row(f"Mean {short} (ms):", dist.mean, ".2f")
        row(f"Median {short} (ms):", dist.median, ".2f")
        for p, value in dist.percentiles.items():
            row(f"P{percentile_word(p)} {short} (ms):", value, ".2f")
    if spec is not None and spec.num_drafts:
        lines += format_spec_decode(spec, _WIDTH)
    lines.append("=" * _WIDTH)
    return "\n".join(lines)


def result_dict(metrics: BenchmarkMetrics, results: Sequence[RequestResult], info: RunInfo,
                spec: Optional[SpecDecodeCounts] = None) -> dict[str, Any]:
    """The result file's content, with vLLM ``bench serve``'s keys (times in seconds in the
    per-request arrays, milliseconds in the statistics; spec-decode counts when drafted)."""
    result: dict[str, Any] = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "backend": info.backend,
        "endpoint_type": info.backend,
        "model_id": info.model_id,
        "tokenizer_id": info.tokenizer_id,
        "num_prompts": info.num_prompts,
        # JSON has no infinity; vLLM writes the string "inf".
        "request_rate": "inf" if math.isinf(info.request_rate) else info.request_rate,
        "burstiness": 1.0,  # Poisson arrivals
        "max_concurrency": info.max_concurrency,
        "duration": metrics.duration,
        "completed": metrics.completed,
        "failed": metrics.failed,
        "total_input_tokens": metrics.total_input,
        "total_output_tokens": metrics.total_output,
        "request_throughput": metrics.request_throughput,
        "output_throughput": metrics.output_throughput,
        "total_token_throughput": metrics.total_token_throughput,
        "input_lens": [r.prompt_len for r in results],
        "output_lens": output_lens(results),
        "ttfts": [r.ttft for r in results],
        "itls": [r.itl for r in results],
        "generated_texts": [r.generated_text for r in results],
        "errors": [r.error for r in results],
    }
    for name in LATENCY_METRICS:
        dist = metrics.latencies[name]
        result[f"mean_{name}_ms"] = dist.mean
        result[f"median_{name}_ms"] = dist.median
        result[f"std_{name}_ms"] = dist.std
        for p, value in dist.percentiles.items():
            result[f"p{percentile_word(p)}_{name}_ms"] = value
    if spec is not None and spec.num_drafts:
        result["spec_decode_acceptance_rate"] = 100 * spec.acceptance_rate
        result["spec_decode_acceptance_length"] = spec.acceptance_length
        result["spec_decode_num_drafts"] = spec.num_drafts
        result["spec_decode_draft_tokens"] = spec.num_draft_tokens
        result["spec_decode_accepted_tokens"] = spec.num_accepted_tokens
    return result


def write_result(path: str, result: dict[str, Any]) -> None:
    """Write ``result`` as JSON to ``path``."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=2)
        f.write("\n")


def plot_latencies(results: Sequence[RequestResult], path: str) -> None:
    """Histograms of TTFT, TPOT, ITL and E2EL (ms), with their median and p99, as a PNG."""
    try:
        import matplotlib
    except ImportError as err:
        raise RuntimeError("--plot needs matplotlib: pip install 'lmserve[plot]'") from err
    matplotlib.use("Agg")  # files only: no display is needed or wanted
    import matplotlib.pyplot as plt
    import numpy as np

    samples = latency_samples(results)
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    for ax, name in zip(axes.flat, LATENCY_METRICS):
        short, header = _TITLES[name]
        ms = np.asarray(samples[name]) * 1000.0
        ax.set_title(f"{header} ({len(ms)} samples)")
        ax.set_xlabel(f"{short} (ms)")
        ax.set_ylabel("count")
        if ms.size == 0:
            ax.text(0.5, 0.5, "no samples", ha="center", va="center", transform=ax.transAxes)
            continue
        ax.hist(ms, bins=min(50, max(10, ms.size // 4)), color="tab:blue", alpha=0.8)
        for value, label, style in ((np.median(ms), "median", "--"), (np.percentile(ms, 99), "p99", ":")):
            ax.axvline(value, color="black", linestyle=style, label=f"{label} {value:.1f} ms")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
