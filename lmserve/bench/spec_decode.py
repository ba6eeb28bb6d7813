"""Speculative-decoding counters read from the server's Prometheus ``/metrics``, before and after
a run, so the benchmark can report the acceptance the served requests saw (as vLLM's
``bench serve`` does). Understands lmserve's and vLLM's names (``lmserve:`` / ``vllm:``
prefixes); a server without them, or without ``/metrics``, reports nothing."""

from __future__ import annotations

import re
import urllib.request
from dataclasses import dataclass, field
from typing import Optional

_SAMPLE = re.compile(r'^(?:lmserve|vllm):spec_decode_(\w+?)(?:_total)?(?:\{([^}]*)\})?\s+([0-9.eE+-]+)$')
_POSITION = re.compile(r'(?:^|,)position="(\d+)"')


@dataclass
class SpecDecodeCounts:
    """Counter values (or their difference over a run)."""

    num_drafts: float = 0.0
    num_draft_tokens: float = 0.0
    num_accepted_tokens: float = 0.0
    accepted_per_pos: dict[int, float] = field(default_factory=dict)

    def __sub__(self, before: SpecDecodeCounts) -> SpecDecodeCounts:
        return SpecDecodeCounts(
            self.num_drafts - before.num_drafts,
            self.num_draft_tokens - before.num_draft_tokens,
            self.num_accepted_tokens - before.num_accepted_tokens,
            {p: v - before.accepted_per_pos.get(p, 0.0) for p, v in self.accepted_per_pos.items()},
        )

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens over draft tokens."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def acceptance_length(self) -> float:
        """Tokens per verify step of a drafting sequence: the accepted drafts plus the target's."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0


def parse_spec_decode(text: str) -> Optional[SpecDecodeCounts]:
    """The spec-decode counters in a Prometheus text exposition; None if there are none."""
    counts, found = SpecDecodeCounts(), False
    for line in text.splitlines():
        match = _SAMPLE.match(line.strip())
        if match is None:
            continue
        name, labels, value = match.group(1), match.group(2) or "", float(match.group(3))
        pos = _POSITION.search(labels)
        if name == "num_accepted_tokens_per_pos" and pos is not None:
            counts.accepted_per_pos[int(pos.group(1))] = value
        elif name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
            setattr(counts, name, value)
        else:
            continue
        found = True
    return counts if found else None


def scrape_spec_decode(base_url: str, timeout: float = 5.0) -> Optional[SpecDecodeCounts]:
    """The server's spec-decode counters now; None when it has no ``/metrics`` or none there."""
    try:
        with urllib.request.urlopen(base_url + "/metrics", timeout=timeout) as response:
            return parse_spec_decode(response.read().decode("utf-8", "replace"))
    except (OSError, ValueError):
        return None


def format_spec_decode(counts: SpecDecodeCounts, width: int) -> list[str]:
    """Lines for the result table, vLLM's section."""
    lines = [f"{'Speculative Decoding':-^{width}}"]

    def row(label: str, value: str) -> None:
        lines.append(f"{label:<40} {value:<10}")

    row("Acceptance rate (%):", f"{100 * counts.acceptance_rate:.2f}")
    row("Acceptance length:", f"{counts.acceptance_length:.2f}")
    row("Drafts:", f"{counts.num_drafts:.0f}")
    row("Draft tokens:", f"{counts.num_draft_tokens:.0f}")
    row("Accepted tokens:", f"{counts.num_accepted_tokens:.0f}")
    if counts.num_drafts:
        lines.append("Per-position acceptance (%):")
        for pos, accepted in sorted(counts.accepted_per_pos.items()):
            lines.append(f"  Position {pos}: {100 * accepted / counts.num_drafts:.2f}")
    return lines
