"""Speculative decoding against none, side by side in one run, on the built-in model.

Input-grounded prompts (rewrite, extract from or edit a given text or code: what prompt lookup
is for) and plain chat prompts, each sent ``--concurrency`` at a time (greedy, or seeded
sampling at ``--temperature``; output lengths drawn around ``--max-tokens``, the same for every
configuration), to engines with speculation off, the drafter (``--mode``) with fixed draft
lengths, and with the adaptive length (spec_draft_length=0), each as a chain or as trees
(``--widths``, spec_tree_width). ``--mode small_draft`` drafts with the built-in model itself
at the draft's level (O3 by default; ``--draft-opts`` runs each length at each level given) for
a target at ``--opt`` (e.g. O0: the exact reference output at a quantized model's speed).
``--mode eagle`` and ``--mode medusa`` draft with the heads in ``--heads DIR`` (written by
``lmserve train-heads --kind eagle|medusa --out DIR``).

Each configuration's engine lives in its own process for the whole run (as a server's would:
the adaptive length keeps what it learned); in every round each workload and concurrency is
measured by every configuration in turn, back to back, in a rotating order (at one stream
request by request: one configuration's request, then the next one's, ...). Reported: the
median of the rounds' output tokens per second (end to end, prefill included) and of the
streams' decode speed (tokens after each request's first over the time from its first token to
its last: what speculation speeds up), the median of the rounds' ratios to speculation off
(each taken within its round: this machine's speed changes by up to 2x between stretches of a
few seconds; from 4 rounds on, with their quartiles), the acceptance (accepted drafts / drafts)
and the mean tokens per verify step. Every engine's output is checked to be token for token
the output with speculation off.

    .venv/bin/python benchmarks/speculative.py [--mode ngram|small_draft|eagle|medusa] \
        [--heads DIR] [--rounds 3] [--concurrency 1 4 16] [--lengths 0 2 4 8] [--widths 1 3] \
        [--opt O2] [--max-tokens 96] [--length-spread 0.75] [--requests 2] \
        [--draft-opts O3 O2] [--temperature 0.7 --top-p 0.95]
"""

from __future__ import annotations

import argparse
import math
import multiprocessing
import os
import random
import statistics
import sys
import threading
import time
from dataclasses import dataclass
from typing import Optional

from lmserve import Engine, SamplingParams
from lmserve.kernels.build import cpu_name
from lmserve.models.builtin import builtin_model_path

HERE = os.path.dirname(os.path.abspath(__file__))

CODE = '''def load_orders(path):
    orders = []
    with open(path) as f:
        for line in f:
            fields = line.strip().split(",")
            if len(fields) != 4:
                continue
            order_id, customer, amount, date = fields
            orders.append({"id": order_id, "customer": customer,
                           "amount": float(amount), "date": date})
    return orders
'''


def grounded_prompts() -> list[str]:
    with open(os.path.join(HERE, "data", "perplexity_text.txt")) as f:
        paragraphs = [p for p in f.read().split("\n\n") if p.strip()]
    asks = [
        "Rewrite the following text word for word, changing nothing:\n\n{}",
        "Copy the first three sentences of this text exactly:\n\n{}",
        "Here is a passage.\n\n{}\n\nQuote the sentence that mentions the river, exactly.",
        "Correct the spelling in this text and return the whole text:\n\n{}",
    ]
    prompts = [ask.format(p) for ask, p in zip(asks * 4, paragraphs)]
    prompts += [
        f"Rename the function load_orders to read_orders in this code and return all of it:\n\n{CODE}",
        f"Add a docstring to this function and return the whole function:\n\n{CODE}",
        f"Return this code unchanged, then say what it does:\n\n{CODE}",
    ]
    return prompts


CHAT = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue.",
    "Tell me a very short story about a robot who learns to paint.",
    "Give three tips for learning a new language.",
    "Why do cats purr?",
]


def run_batch(engine: Engine, prompts: list[list[int]], params: list[SamplingParams],
              concurrency: int) -> tuple[float, int, list[list[int]], float, int]:
    """Send the prompts ``concurrency`` at a time, each with its ``params``; (seconds, output
    tokens, outputs, decode seconds, decode tokens): the last two summed over requests from each
    one's first token on."""
    outputs: list = [None] * len(prompts)
    decode: list = [(0.0, 0)] * len(prompts)
    next_index = iter(range(len(prompts)))
    lock = threading.Lock()

    def worker() -> None:
        while True:
            with lock:
                i = next(next_index, None)
            if i is None:
                return
            tokens, first = [], None
            for o in engine.generate(prompts[i], params[i]):
                new = [t for d in o.deltas for t in d.token_ids]
                if new and first is None:
                    first, after_first = time.perf_counter(), len(tokens) + len(new)
                tokens += new
            outputs[i] = tokens
            if first is not None:
                decode[i] = (time.perf_counter() - first, len(tokens) - after_first)

    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return (time.perf_counter() - start, sum(len(o) for o in outputs), outputs,
            sum(s for s, _ in decode), sum(n for _, n in decode))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--mode", choices=["ngram", "small_draft", "eagle", "medusa"], default="ngram")
    ap.add_argument("--heads", help="the EAGLE or Medusa heads' directory (--mode eagle|medusa)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--lengths", type=int, nargs="+", default=[0, 2, 4, 8],
                    help="draft lengths to run (0 = adaptive)")
    ap.add_argument("--widths", type=int, nargs="+", default=[1],
                    help="tree widths to run each length with (1 = a chain)")
    ap.add_argument("--opt", default=None)
    ap.add_argument("--draft-opts", nargs="+", default=[None],
                    help="the drafter's levels to run each length with (the draft_opt knob; "
                         "default: the engine's, O3)")
    ap.add_argument("--max-tokens", type=int, default=96,
                    help="output tokens a request on average (see --length-spread)")
    ap.add_argument("--length-spread", type=float, default=0.75,
                    help="output lengths are drawn (seeded, the same for every configuration) "
                         "from max-tokens x [1 - spread, 1 + spread]; 0: all max-tokens long")
    ap.add_argument("--requests", type=int, default=2,
                    help="requests per stream in a measurement (at least the workload's prompts): "
                         "the last of them finish unevenly where drafting speeds answers up "
                         "unevenly, and more make that tail a smaller part")
    ap.add_argument("--workloads", nargs="+", default=["grounded", "chat"])
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="sample at this temperature (seeded, so every configuration's output "
                         "is still checked against speculation off's); default greedy")
    ap.add_argument("--top-p", type=float, default=1.0)
    args = ap.parse_args()
    if (args.heads is None) != (args.mode in ("ngram", "small_draft")):
        ap.error("--heads goes with --mode eagle or medusa, and only with them")

    draft = {"ngram": {}, "small_draft": {"additional_models": [builtin_model_path()]}}.get(
        args.mode, {"additional_models": [args.heads]})
    if args.draft_opts != [None] and (args.mode == "ngram" or "draft_opt" in (args.opt or "")):
        ap.error("--draft-opts goes with a draft model or heads (not --mode ngram), and instead "
                 "of a draft_opt knob in --opt")
    configs = {"off": {}} | {
        (f"{args.mode} k={k}" if k else f"{args.mode} adaptive") + (f" w={w}" if w > 1 else "")
        + (f" {d}" if d else ""):
            dict(speculative_mode=args.mode, spec_draft_length=k, spec_tree_width=w, **draft)
            | ({"opt": ";".join(filter(None, [args.opt, f"draft_opt={d}"]))} if d else {})
        for d in args.draft_opts for k in args.lengths for w in args.widths
    }
    sampling = f"temperature {args.temperature}, top_p {args.top_p}" if args.temperature else "greedy"
    print(f"CPU: {cpu_name()}; opt {args.opt or 'default'}; {args.mode}; {sampling}; "
          f"{args.max_tokens} tokens per request (spread {args.length_spread}); "
          f"median of {args.rounds} rounds", flush=True)

    # One process per configuration, built once (a long-lived server's engine; the adaptive
    # length keeps what it learned), and every measurement of a round taken by each
    # configuration in turn, back to back: this machine's speed changes by up to 2x from one
    # few-second stretch to the next, so a ratio is taken within a round, between neighbours in
    # time. (Engines in separate processes: two in one process slow each other down.)
    workers = {name: _Worker(kwargs, args) for name, kwargs in configs.items()}
    num_prompts = {"grounded": len(grounded_prompts()), "chat": len(CHAT)}
    # (metric, workload, concurrency, config) -> tokens/s a round, and its ratio to off's
    rates: dict[tuple, list[float]] = {}
    ratios: dict[tuple, list[float]] = {}
    accept: dict[tuple, list[tuple[int, int, int]]] = {}
    for r in range(args.rounds):
        for workload in args.workloads:
            for c in args.concurrency:
                names = list(configs)
                names = names[r % len(names):] + names[: r % len(names)]  # rotate the order
                got = _measure(workers, names, workload, c,
                               _num_requests(num_prompts[workload], c, args))
                for name, m in got.items():
                    accept.setdefault((workload, c, name), []).append(m.counts)
                    if m.outputs != got["off"].outputs:
                        sys.exit(f"{name}: output differs from speculation off ({workload}, c={c})")
                    for metric in METRICS:
                        key = (metric, workload, c, name)
                        rates.setdefault(key, []).append(getattr(m, metric))
                        ratios.setdefault(key, []).append(getattr(m, metric) / getattr(got["off"], metric))
        print(f"round {r + 1} done", flush=True)
    for worker in workers.values():
        worker.close()

    width = 44 if args.rounds >= 4 else 34
    for workload in args.workloads:
        for metric, title in METRICS.items():
            spread = "; its rounds' quartiles" if args.rounds >= 4 else ""
            print(f"\n{workload} prompts, {title} (ratio to off{spread}); acceptance; tokens per step")
            print(f"{'config':<28}" + "".join(f"{'c=' + str(c):>{width}}" for c in args.concurrency))
            for name in configs:
                cells = []
                for c in args.concurrency:
                    rate = statistics.median(rates[(metric, workload, c, name)])
                    ratio = _ratio(ratios[(metric, workload, c, name)])
                    drafts, drafted, accepted = (sum(x) for x in zip(*accept[(workload, c, name)]))
                    acceptance = (f" {accepted / drafted:4.0%} {1 + accepted / drafts:4.2f}"
                                  if drafts else " " * 10)
                    cells.append(f"{rate:8.1f} ({ratio}){acceptance}")
                print(f"{name:<28}" + "".join(f"{cell:>{width}}" for cell in cells))


def _ratio(ratios: list[float]) -> str:
    """The median of the rounds' ratios, and from 4 rounds on their first and third quartiles:
    how far one run of a few rounds may land from the median on this machine."""
    text = f"{statistics.median(ratios):5.2f}x"
    if len(ratios) >= 4:
        q1, _, q3 = statistics.quantiles(ratios, n=4)
        text += f" {q1:4.2f}-{q3:4.2f}"
    return text


# What each measurement reports: output tokens/s of the whole batch, prefill included, and the
# streams' decode speed (tokens after each request's first / the time from its first token to
# its last: what speculation changes, and the "one-stream decode" at c=1).
METRICS = {"output_rate": "output tokens/s, end to end",
           "decode_rate": "decode tokens/s per stream, after the first token"}


@dataclass
class Measurement:
    """One configuration's requests of one workload at one concurrency (or a part of them)."""

    seconds: float
    tokens: int
    outputs: list
    decode_seconds: float
    decode_tokens: int
    counts: tuple[int, ...]  # spec counters' increase: drafts, draft tokens, accepted

    @property
    def output_rate(self) -> float:
        return self.tokens / self.seconds

    @property
    def decode_rate(self) -> float:
        # (No decode to measure when every request stopped at its first token.)
        return self.decode_tokens / self.decode_seconds if self.decode_tokens else math.nan

    def __add__(self, other: Measurement) -> Measurement:
        return Measurement(self.seconds + other.seconds, self.tokens + other.tokens,
                           self.outputs + other.outputs, self.decode_seconds + other.decode_seconds,
                           self.decode_tokens + other.decode_tokens,
                           tuple(a + b for a, b in zip(self.counts, other.counts)))


def _num_requests(num_prompts: int, concurrency: int, args: argparse.Namespace) -> int:
    """Enough requests that every concurrency keeps its streams busy."""
    return max(num_prompts, args.requests * concurrency)


def _output_lengths(workload: str, concurrency: int, num_requests: int,
                    args: argparse.Namespace) -> list[int]:
    """Each request's output length, the same in every configuration's process. Equal lengths
    made a batch's requests finish together without speculation and at different times with
    it, and that alone moved both measures: spec off, 8 grounded streams, lengths of 24-168
    against all 96 (the same tokens in all) gave 1.06-1.31x the output and 0.80-1.08x the
    decode speed per stream (prefills then land inside other requests' decoding)."""
    rng = random.Random(f"{workload} {concurrency} {num_requests}")
    low = max(1, round(args.max_tokens * (1 - args.length_spread)))
    high = max(low, round(args.max_tokens * (1 + args.length_spread)))
    return [rng.randint(low, high) for _ in range(num_requests)]


def _measure(workers: dict, names: list[str], workload: str, concurrency: int,
             num_requests: int) -> dict[str, Measurement]:
    """Each configuration's measurement, in the order of ``names``. One stream's requests run
    one after another anyway, so there the configurations take turns request by request (each
    pair a second apart, not ten: the ratios of a round then differ by a few percent where
    this machine's stretches made them differ by 15-25%); more streams run all their requests
    in one go (a batch's requests overlap, and its tail is part of what is measured)."""
    if concurrency > 1:
        return {name: workers[name].run(workload, concurrency) for name in names}
    got: dict[str, Measurement] = {}
    for i in range(num_requests):
        for name in names:
            m = workers[name].run(workload, 1, i)
            got[name] = got[name] + m if name in got else m
    return got


class _Worker:
    """A configuration's engine in its own process, running one measurement at a time."""

    def __init__(self, kwargs: dict, args: argparse.Namespace) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_serve, args=(child, kwargs, args), daemon=True)
        self.process.start()
        self.conn.recv()  # built and warm (one at a time: builds do not overlap)

    def run(self, workload: str, concurrency: int, request: Optional[int] = None) -> Measurement:
        """The workload's requests at ``concurrency``, or only the one numbered ``request``."""
        self.conn.send((workload, concurrency, request))
        return Measurement(*self.conn.recv())

    def close(self) -> None:
        self.conn.send(None)
        self.process.join()


def _serve(conn, kwargs: dict, args: argparse.Namespace) -> None:
    engine = Engine(**({"opt": args.opt} | kwargs), max_num_sequence=max(args.concurrency),
                    verbose=False)
    tok = engine.tokenizer
    workloads = {name: [tok.apply_chat_template([{"role": "user", "content": p}]) for p in texts]
                 for name, texts in (("grounded", grounded_prompts()), ("chat", CHAT))}
    run_batch(engine, workloads["chat"][:1], [SamplingParams(temperature=0, max_tokens=4)], 1)
    conn.send("ready")
    while (command := conn.recv()) is not None:
        workload, c, request = command
        prompts = workloads[workload]
        n = _num_requests(len(prompts), c, args)
        batch = (prompts * (1 + n // len(prompts)))[:n]
        params = [SamplingParams(temperature=args.temperature, top_p=args.top_p, max_tokens=length,
                                 ignore_eos=True, seed=0 if args.temperature else None)
                  for length in _output_lengths(workload, c, n, args)]
        if request is not None:
            batch, params = batch[request : request + 1], params[request : request + 1]
        before = _counts(engine)
        conn.send((*run_batch(engine, batch, params, c),
                   tuple(a - b for a, b in zip(_counts(engine), before))))
    engine.shutdown()


def _counts(engine: Engine) -> tuple[int, int, int]:
    s = engine.stats()
    return (s.spec_num_drafts, s.spec_num_draft_tokens, s.spec_num_accepted_tokens)


if __name__ == "__main__":
    main()
