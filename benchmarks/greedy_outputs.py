"""The built-in model's greedy outputs at O0-O3, to hold a refactoring to "behaviour unchanged".

Each level runs the test suite's chat prompts and the long prompt together, then one alone, then
again with prompt-lookup speculation, greedy, and records every token id. ``--save`` writes
them; ``--check`` compares a run with a saved file and exits 1 on any difference, naming it.

    .venv/bin/python benchmarks/greedy_outputs.py --save /tmp/before.json   # on the old commit
    .venv/bin/python benchmarks/greedy_outputs.py --check /tmp/before.json  # on the new one
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading

from lmserve import Engine, SamplingParams

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from prompts import CHAT_PROMPTS, long_prompt  # noqa: E402

LEVELS = ("O0", "O1", "O2", "O3")
MAX_TOKENS = 48


def _generate(engine: Engine, prompts: list[list[int]]) -> list[list[int]]:
    """Greedy continuations of ``prompts``, all in flight at once."""
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    results: list[list[int]] = [[] for _ in prompts]

    def run(i: int) -> None:
        for out in engine.generate(prompts[i], params):
            results[i] += [t for d in out.deltas for t in d.token_ids]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def outputs(level: str) -> dict[str, list[list[int]]]:
    """Token ids per run of one level: together, alone, and with prompt lookup."""
    runs: dict[str, list[list[int]]] = {}
    for name, config in (("plain", {}), ("ngram", {"speculative_mode": "ngram", "spec_draft_length": 4})):
        engine = Engine(opt=level, max_num_sequence=8, max_total_sequence_length=8192, verbose=False, **config)
        try:
            messages = [[{"role": "user", "content": p}] for p in [*CHAT_PROMPTS, long_prompt()]]
            prompts = [engine.tokenizer.apply_chat_template(m) for m in messages]
            runs[f"{name}/together"] = _generate(engine, prompts)
            runs[f"{name}/alone"] = _generate(engine, prompts[:1])
        finally:
            engine.shutdown()
    return runs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    action = parser.add_mutually_exclusive_group(required=True)
    action.add_argument("--save", metavar="FILE", help="write the outputs to FILE")
    action.add_argument("--check", metavar="FILE", help="compare with the outputs saved in FILE")
    parser.add_argument("--opt", action="append", choices=LEVELS, help="levels to run (default: all)")
    args = parser.parse_args()
    results = {level: outputs(level) for level in args.opt or LEVELS}
    if args.save:
        with open(args.save, "w") as f:
            json.dump(results, f)
        print(f"saved {sum(len(r) for r in results.values())} runs to {args.save}")
        return 0
    with open(args.check) as f:
        saved = json.load(f)
    differences = [f"{level} {run} prompt {i}" for level, runs in results.items() for run, seqs in runs.items()
                   for i, seq in enumerate(seqs) if saved[level][run][i] != seq]
    for line in differences:
        print("differs:", line)
    print(f"{len(differences)} of {sum(len(s) for r in results.values() for s in r.values())} outputs differ")
    return 1 if differences else 0


if __name__ == "__main__":
    sys.exit(main())
