"""The recurrent-state part of the engine plan (Mamba-family models): slots, history, snapshots.

A recurrent layer keeps a fixed-size state per sequence instead of KV per token, so memory is
sized in slots (as MLC LLM sizes its RNN-state models: batch and history, no per-token cache):
each running sequence takes ``1 + max_history_size`` slots (its state and, for rolling back
rejected drafts, one per draft position), and the prefix cache keeps ``snapshots`` more (states at
the end of finished sequences and at prompt-chunk boundaries, ``cache.snapshots``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from lmserve.cache.state import state_bytes_per_slot
from lmserve.config import MAX_ADAPTIVE_K, EngineConfig
from lmserve.models.args import ModelArgs


@dataclass(frozen=True)
class StatePlan:
    """Slots of recurrent state and what they are for."""

    max_num_sequence: int
    history: int  # states a sequence keeps to roll back this many tokens (max_history_size)
    snapshots: int  # prefix-cache snapshots (0: no state reuse)
    bytes_per_slot: int  # every recurrent layer's state of one sequence

    @property
    def num_slots(self) -> int:
        return self.max_num_sequence * (1 + self.history) + self.snapshots

    @property
    def bytes(self) -> int:
        return self.num_slots * self.bytes_per_slot

    def describe(self) -> str:
        return (f"{self.num_slots} slots of {self.bytes_per_slot / (1 << 20):.2f} MiB: "
                f"{self.max_num_sequence} sequences x (1 + {self.history} history) "
                f"+ {self.snapshots} prefix-cache snapshots")


def check_state_kind(config: EngineConfig, args: ModelArgs) -> None:
    """Refuse a ``kv_state_kind`` or ``max_history_size`` the model cannot use, and the features
    not built for recurrent layers, each with a message that says why."""
    kind, name = args.kv_state_kind, f"model architecture {args.architecture!r}"
    if config.kv_state_kind == "kv_cache" and kind == "rnn_state":
        hybrid = " (and a KV cache for its attention layers)" if args.attention_layers else ""
        raise ValueError(f"kv_state_kind='kv_cache', but {name} has recurrent layers "
                         f"{list(args.ssm_layers)}, which keep rnn_state{hybrid}: leave "
                         f"kv_state_kind unset (None) or set it to 'rnn_state'")
    if config.kv_state_kind == "rnn_state" and kind == "kv_cache":
        raise ValueError(f"kv_state_kind='rnn_state', but {name} is an attention model with no "
                         f"recurrent layers: leave kv_state_kind unset (None) or set it to 'kv_cache'")
    if kind == "kv_cache":
        if config.max_history_size is not None:
            raise ValueError(f"max_history_size={config.max_history_size} applies to recurrent-"
                             f"state models, but {name} has no recurrent layers (attention rolls "
                             f"back by freeing KV pages)")
        return
    if config.sliding_window_size is not None:
        raise ValueError(f"sliding_window_size is not supported on {name}, which has recurrent layers")
    if config.speculative_mode in ("small_draft", "eagle"):
        raise ValueError(f"speculative_mode={config.speculative_mode!r} is not supported on "
                         f"{name}, which has recurrent layers (the draft's KV shares the target's "
                         f"pages); use speculative_mode='ngram' or 'medusa'")
    if config.speculative_mode != "disable" and config.spec_tree_width > 1:
        raise ValueError(f"spec_tree_width={config.spec_tree_width}: draft trees are not supported "
                         f"on {name}, whose recurrent state follows one chain of tokens")


def plan_state(config: EngineConfig, args: ModelArgs, batch: int) -> Optional[StatePlan]:
    """The slots for ``batch`` sequences, or None for a model without recurrent layers."""
    check_state_kind(config, args)
    if not args.ssm_layers:
        return None
    deepest = (config.spec_draft_length or MAX_ADAPTIVE_K) if config.speculative_mode != "disable" else 0
    history = config.max_history_size
    if history is None:
        history = deepest
    elif history < deepest:
        raise ValueError(f"max_history_size={history} is less than the deepest draft ({deepest} "
                         f"tokens): rejected drafts could not be rolled back; raise it or lower "
                         f"spec_draft_length")
    fixed, per_sequence = _snapshots(config)
    assert args.ssm is not None  # a model with recurrent layers has their args
    return StatePlan(batch, history, fixed + per_sequence * batch,
                     state_bytes_per_slot(args.ssm, len(args.ssm_layers)))


def batch_that_fits(config: EngineConfig, args: ModelArgs, room: int, most: int) -> int:
    """Server mode: as many sequences (at least 1, at most ``most``) as their state slots fit
    in ``room`` bytes, with the snapshots: a fixed number of them first, or their share of each
    sequence."""
    one = plan_state(config, args, 1)
    assert one is not None  # asked only for a model with recurrent layers
    fixed, per_sequence = _snapshots(config)
    each = (1 + one.history + per_sequence) * one.bytes_per_slot
    return max(1, min(most, (room - fixed * one.bytes_per_slot) // each))


def _snapshots(config: EngineConfig) -> tuple[int, int]:
    """Prefix-cache snapshots: (a fixed number, a number per sequence), from
    ``prefix_cache_max_num_recycling_seqs`` (None: one per sequence; -1, unbounded: four)."""
    recycling = config.prefix_cache_max_num_recycling_seqs
    if config.prefix_cache_mode == "disable" or recycling == 0:
        return 0, 0
    if recycling is None or recycling == -1:
        return 0, 1 if recycling is None else 4
    return recycling, 0
