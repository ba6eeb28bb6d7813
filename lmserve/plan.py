"""The engine plan: the concrete batch, KV and prefill sizes resolved from config and model."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from lmserve.config import EngineConfig
from lmserve.models.args import ModelArgs

# Batch size per mode when max_num_sequence is not given. "server" is missing on purpose: it
# sizes batch and KV from the memory budget, which is not built yet.
_MODE_BATCH: dict[str, int] = {"local": 4, "interactive": 1}
DEFAULT_MODE = "local"


@dataclass(frozen=True)
class EnginePlan:
    """Resolved limits the scheduler, KV cache and runner are built with."""

    mode: str  # the mode that produced the inferred values
    max_num_sequence: int  # most sequences running at once
    max_total_sequence_length: int  # KV cache capacity in tokens, all sequences together
    max_single_sequence_length: int  # longest one sequence, prompt plus output
    prefill_chunk_size: int  # most tokens in one prefill step
    page_size: int  # tokens per KV page
    num_pages: int  # pages in the KV pool

    def describe(self) -> str:
        """An aligned two-column table of the plan, for the start-up log."""
        rows = [(f.name, str(getattr(self, f.name))) for f in dataclasses.fields(self)]
        width = max(len(name) for name, _ in rows)
        return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)


def make_plan(config: EngineConfig, args: ModelArgs) -> EnginePlan:
    """Resolve the config's limits against the model.

    Values given in the config always win; the rest come from the mode's preset and the model's
    context window. Raises ``ValueError`` (with the numbers) when the result cannot work, and
    ``NotImplementedError`` for mode "server".
    """
    mode = config.mode or DEFAULT_MODE
    if mode not in _MODE_BATCH:
        raise NotImplementedError(f"mode={mode!r} (memory-based planning) is not implemented yet")
    # The KV cache holds the full context window: sliding-window attention, which would let it
    # hold less, is not built yet (check_supported refuses sliding_window_size).
    context = args.context_length
    batch = _given_or(config.max_num_sequence, _MODE_BATCH[mode])
    total = _given_or(config.max_total_sequence_length, context)
    single = _given_or(config.max_single_sequence_length, min(context, total))
    chunk = _given_or(config.prefill_chunk_size, min(context, total))
    if single > context:
        raise ValueError(
            f"max_single_sequence_length={single} exceeds the model's context window of "
            f"{context} tokens"
        )
    # An explicit single length over an explicit total is refused by EngineConfig itself; an
    # explicit chunk can still exceed the total inferred here.
    if chunk > total:
        raise ValueError(
            f"prefill_chunk_size={chunk} exceeds max_total_sequence_length={total}: "
            f"the KV cache could never hold one chunk"
        )
    page = config.kv_cache_page_size
    return EnginePlan(
        mode=mode,
        max_num_sequence=batch,
        max_total_sequence_length=total,
        max_single_sequence_length=single,
        prefill_chunk_size=chunk,
        page_size=page,
        num_pages=-(-total // page),  # ceil: the last page may be partly used
    )


def _given_or(given: int | None, inferred: int) -> int:
    return inferred if given is None else given
