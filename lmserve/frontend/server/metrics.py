"""Prometheus metrics of the server, named as vLLM names its ``vllm:*`` ones, prefixed ``lmserve:``.

Two sources:

* per request, measured on the engine's output stream as it passes (``ServerMetrics.measure``):
  time to first token, inter-token latency, end-to-end latency, queue time, token counters and
  how each choice finished;
* the engine's state, read from ``engine.stats()`` at scrape time: running and waiting
  sequences, KV cache usage, preemptions, prefix cache queries and hits (tokens).

Each app has its own ``CollectorRegistry``, so several servers (or tests) in one process never
share or clash over metrics.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, Callable, Iterator
from contextlib import aclosing
from typing import Optional

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from lmserve.errors import InvalidRequestError
from lmserve.outputs import EngineStats, RequestOutput

FINISH_REASONS = ("stop", "length", "abort", "error")
# Seconds, from a fast CPU decode step to a long generation; shared by every latency histogram.
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                    25.0, 50.0, 100.0, 250.0, 500.0, 1000.0)


class _EngineCollector(Collector):
    """Gauges (and the preemption counter) read from the engine when Prometheus scrapes."""

    def __init__(self, stats: Callable[[], EngineStats]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        s = self._stats()
        yield GaugeMetricFamily("lmserve:num_requests_running", "Sequences in the running batch.",
                                value=s.num_running)
        yield GaugeMetricFamily("lmserve:num_requests_waiting", "Sequences waiting to be scheduled.",
                                value=s.num_waiting)
        yield GaugeMetricFamily("lmserve:kv_cache_usage_perc",
                                "Fraction of KV cache pages in use (0 to 1, as vLLM reports it).",
                                value=s.kv_pages_used / s.kv_pages_total if s.kv_pages_total else 0.0)
        yield CounterMetricFamily("lmserve:num_preemptions", "Sequences preempted since start.",
                                  value=s.num_preemptions)
        # vLLM's names: prompt tokens looked up in the prefix cache, and those found there.
        yield CounterMetricFamily("lmserve:prefix_cache_queries",
                                  "Prompt tokens looked up in the prefix cache.",
                                  value=s.prefix_cache_queried_tokens)
        yield CounterMetricFamily("lmserve:prefix_cache_hits",
                                  "Prompt tokens found in the prefix cache (not computed again).",
                                  value=s.prefix_cache_hit_tokens)
        # Speculative decoding, vLLM's names (all 0 when it is off).
        yield CounterMetricFamily("lmserve:spec_decode_num_drafts",
                                  "Verify steps of a sequence that had draft tokens.",
                                  value=s.spec_num_drafts)
        yield CounterMetricFamily("lmserve:spec_decode_num_draft_tokens", "Draft tokens verified.",
                                  value=s.spec_num_draft_tokens)
        yield CounterMetricFamily("lmserve:spec_decode_num_accepted_tokens",
                                  "Draft tokens accepted.", value=s.spec_num_accepted_tokens)
        per_pos = CounterMetricFamily("lmserve:spec_decode_num_accepted_tokens_per_pos",
                                      "Draft tokens accepted, by position in the draft (0: first).",
                                      labels=["position"])
        for pos, accepted in enumerate(s.spec_accepted_per_pos):
            per_pos.add_metric([str(pos)], accepted)
        yield per_pos


class ServerMetrics:
    """The server's metrics, in a registry of its own."""

    def __init__(self, stats: Callable[[], EngineStats]) -> None:
        """``stats`` is the engine's ``stats`` method, called at every scrape."""
        self.registry = CollectorRegistry()

        def histogram(name: str, doc: str) -> Histogram:
            return Histogram(name, doc, buckets=_LATENCY_BUCKETS, registry=self.registry)

        self.request_success = Counter(
            "lmserve:request_success", "Finished choices, by finish reason (stop, length, abort, error).",
            ["finished_reason"], registry=self.registry)
        for reason in FINISH_REASONS:  # listed at 0 from the start, so rates work at once
            self.request_success.labels(reason)
        self.prompt_tokens = Counter("lmserve:prompt_tokens", "Prompt tokens prefilled.",
                                     registry=self.registry)
        self.generation_tokens = Counter("lmserve:generation_tokens", "Tokens generated.",
                                         registry=self.registry)
        self.ttft = histogram("lmserve:time_to_first_token_seconds",
                              "From a request's arrival at the engine to its first token.")
        self.itl = histogram("lmserve:inter_token_latency_seconds",
                             "Between consecutive engine steps that gave a request tokens.")
        self.e2e = histogram("lmserve:e2e_request_latency_seconds",
                             "From arrival at the engine to the last token, for finished requests.")
        self.queue_time = histogram("lmserve:request_queue_time_seconds",
                                    "From arrival at the engine to the first step it took part in.")
        self.registry.register(_EngineCollector(stats))

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)

    async def measure(self, outputs: AsyncGenerator[RequestOutput, None], num_choices: int
                      ) -> AsyncGenerator[RequestOutput, None]:
        """Pass one engine request's outputs through, measuring them on the way.

        Choices that never finished are counted as "abort" when the stream is left early
        (client gone) and as "error" when the engine failed the request; a request the engine
        refused as invalid is not counted. Closing this iterator closes ``outputs`` (which
        aborts the engine request).
        """
        arrival = time.monotonic()
        last_tokens_at: Optional[float] = None
        finished = 0
        unfinished_reason: Optional[str] = "abort"
        async with aclosing(outputs):
            try:
                async for out in outputs:
                    now = time.monotonic()
                    num_tokens = sum(len(d.token_ids) for d in out.deltas)
                    if num_tokens:
                        if last_tokens_at is None:  # the prompt is prefilled: the first tokens
                            self.ttft.observe(now - arrival)
                            self.prompt_tokens.inc(len(out.prompt_token_ids))
                            if out.first_scheduled_time is not None:
                                self.queue_time.observe(max(out.first_scheduled_time - arrival, 0.0))
                        else:
                            self.itl.observe(now - last_tokens_at)
                        last_tokens_at = now
                        self.generation_tokens.inc(num_tokens)
                    for delta in out.deltas:
                        if delta.finish_reason is not None:
                            finished += 1
                            self.request_success.labels(delta.finish_reason).inc()
                    if out.finished and finished == num_choices:
                        self.e2e.observe(now - arrival)
                    yield out
            except InvalidRequestError:
                unfinished_reason = None  # refused before it ran: the engine never had it
                raise
            except Exception:
                unfinished_reason = "error"
                raise
            finally:
                if unfinished_reason is not None and finished < num_choices:
                    self.request_success.labels(unfinished_reason).inc(num_choices - finished)
