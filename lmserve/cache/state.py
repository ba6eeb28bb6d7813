"""Recurrent state (Mamba-family layers): a pool of fixed-size slots instead of per-token KV.

A slot holds one sequence's state in every recurrent layer: the last ``conv_kernel - 1`` inputs
of the causal convolution and the selective scan's state. A running sequence owns one slot (its
state after its computed tokens) and, with ``max_history_size`` h, h more that a step with draft
tokens fills with the states after each of its tokens, so that rejected drafts are undone by
copying one of them back (``KVCacheManager.rollback``). Prefix-cache snapshots are slots too.
"""

from __future__ import annotations

import torch

from lmserve.models.args import SSMArgs


def state_bytes_per_slot(ssm: SSMArgs, num_layers: int) -> int:
    """Bytes of one slot: ``num_layers`` recurrent layers' float32 state."""
    return num_layers * ssm.state_floats * 4


class StateCache:
    """The slots' tensors, per recurrent layer: ``conv[i]`` ``(S, conv_dim, K - 1)`` and
    ``ssm[i]`` ``(S, *SSMArgs.ssm_state_shape)``, float32."""

    def __init__(self, ssm: SSMArgs, num_layers: int, num_slots: int,
                 device: torch.device | str = "cpu") -> None:
        self.conv = [torch.zeros(num_slots, ssm.conv_dim, ssm.conv_kernel - 1, device=device)
                     for _ in range(num_layers)]
        self.ssm = [torch.zeros(num_slots, *ssm.ssm_state_shape, device=device)
                    for _ in range(num_layers)]

    def copy(self, pairs: list[tuple[int, int]]) -> None:
        """Copy slot ``src`` to slot ``dst`` for each pair, in order (a later pair sees the
        earlier copies)."""
        for src, dst in pairs:
            for t in (*self.conv, *self.ssm):
                t[dst] = t[src]
