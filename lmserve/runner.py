"""Turns a step (plain data, ``lmserve.step``) into flat tensors, runs the model, and returns the
logits asked for. ``Runner`` is what the engine calls, on one process's ``ModelRunner`` or on a
parallel engine's ``ParallelRunner``; ``TargetWeights`` what a drafter may use of the target."""

from __future__ import annotations

from typing import Any, Callable, Optional, Protocol

import torch

from lmserve.attention.base import AttentionBackend, AttentionInput
from lmserve.attention.window import AttentionWindow
from lmserve.cache.kv import KVCache
from lmserve.cache.state import StateCache
from lmserve.layers.compiled import CompiledLayerOps
from lmserve.layers.ssm import StateMeta, StateRun
from lmserve.layers.ssm_kernels import SSMKernels
from lmserve.models.args import ModelArgs
from lmserve.models.llama import ForwardContext
from lmserve.parallel.all_reduce import AllReduce
from lmserve.step import StepInput


class TargetWeights(Protocol):
    """What a drafter on the target (an EAGLE head) uses of it: the embedding and the head."""

    args: ModelArgs
    dtype: torch.dtype
    embed: torch.Tensor  # (V, D)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits ``(R, V)`` of final hidden states ``(R, D)``."""
        ...


class Runner(Protocol):
    """The target model's runner as the engine uses it."""

    model: Any  # the model: a drafter sees it as ``TargetWeights``
    # Hidden states kept for drafters on them (see ``ModelRunner``): which, and the last step's.
    feature_layers: Optional[tuple[int, ...]]
    features: Optional[torch.Tensor]

    def execute(self, step: StepInput, features: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The step's logits ``(step.num_logits, V)``, computed now."""
        ...

    def submit(self, step: StepInput) -> Callable[[], torch.Tensor]:
        """Start the step; the call returned gives its logits (with pipeline stages, later)."""
        ...

    def move_kv(self, src_slots: list[int], dst_slots: list[int]) -> None:
        """Move KV between cache slots (a verified draft tree's path into place)."""
        ...

    def discard_kv(self, pages: list[int], is_free: Callable[[int], bool]) -> None:
        """Give the memory of free KV ``pages`` back to the system."""
        ...

    def keep_alive(self) -> None:
        """Called every second, busy or idle (a parallel engine's ranks wait for steps)."""
        ...

    def close(self) -> None:
        """Stop what the runner started (a parallel engine's result thread)."""
        ...


class ModelRunner:
    """Owns the model, the KV tensors and the attention backend; one ``execute`` per step."""

    def __init__(self, model, kv: KVCache, backend: Optional[AttentionBackend], ops, max_positions: int,
                 device: torch.device, compiled: Optional[CompiledLayerOps] = None,
                 window: Optional[AttentionWindow] = None,
                 window_layers: Optional[tuple[int, ...]] = None,
                 states: Optional[StateCache] = None,
                 ssm_kernels: Optional[SSMKernels] = None,
                 all_reduce: Optional[AllReduce] = None) -> None:
        """``ops``: the element-wise layer ops (``layers.fused.TorchOps`` or ``FusedOps``);
        ``states``: the recurrent layers' state slots (Mamba-family models), or None, and
        ``ssm_kernels`` their C++ decode kernels (or None: the torch path);
        ``compiled``: the layers' torch ops as compiled graphs (opt compile=1), or None;
        ``window``: the sliding window of ``window_layers`` (None: every layer), or None;
        ``max_positions``: the rotary table's (later positions are computed when met);
        ``all_reduce``: a tensor-parallel rank's, which sums the layers' partial outputs."""
        self.model = model
        self.compiled = compiled
        self.kv = kv
        self.backend = backend
        self.ops = ops
        self.device = device
        self.window = window
        self.states = states
        self.ssm_kernels = ssm_kernels
        self.all_reduce = all_reduce
        layers = model.layer_ids if window_layers is None else window_layers
        self.windowed = tuple(window is not None and i in layers for i in model.layer_ids)
        self.rotary = model.rotary(max_positions, device)
        self.last_hidden: Optional[torch.Tensor] = None  # the last step's, of its logit rows
        # What drafters on the target's hidden states draft from, kept for every token of the
        # last step (``features``): None, nothing; (), the final hidden states (Medusa,
        # EAGLE-1/2); layer ids, those layers' inputs side by side (EAGLE-3).
        self.feature_layers: Optional[tuple[int, ...]] = None
        self.features: Optional[torch.Tensor] = None  # (T, F)
        self.layer_calls = model.layer_calls(backend, ops, kv, self.windowed,
                                             window is not None and window.sinks > 0, all_reduce)

    def execute(self, step: StepInput, features: Optional[torch.Tensor] = None,
                logits: bool = True, residual: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Logits ``(step.num_logits, V)``: each sequence's rows, for its last ``num_logits``
        tokens in order, sequences in step order. ``features``: a row per token of the step, for
        a model that reads them beside the tokens (an EAGLE draft). ``logits=False``: the hidden
        states of those rows instead (a parallel rank that does not sample). A pipeline stage
        starts from the previous one's ``residual`` (T, D) and, unless it is the last, returns
        its own."""
        input_ids: list[int] = []
        positions: list[int] = []
        rows: list[int] = []  # flat index of each token whose logits are wanted
        runs: list[StateRun] = []  # the recurrent layers' view of each sequence
        for s in step.seqs:
            if self.states is not None:
                runs.append(StateRun(len(input_ids), len(s.token_ids), s.state_slot, s.start == 0,
                                     s.history_slots))
            input_ids += s.token_ids
            positions += s.positions()
            rows += range(len(input_ids) - s.num_logits, len(input_ids))

        state_meta = None
        if self.states is not None:
            self.states.copy(step.state_copies)
            state_meta = StateMeta(runs)
        trees = [s.tree_masks() for s in step.seqs]
        attn_in = AttentionInput(
            query_lens=[len(s.token_ids) for s in step.seqs],
            context_lens=[s.context_len for s in step.seqs],
            page_tables=[s.page_table for s in step.seqs],
            tree_masks=trees if any(t is not None for t in trees) else None,
            window=self.window,
            dense_layers=not all(self.windowed),
        )
        pos = torch.tensor(positions, device=self.device)
        cos, sin = self.rotary.lookup(pos)
        window = self.window
        if window is not None and window.sinks and max(positions, default=0) > window.last_sink_position:
            # Some query scores its sinks from a moved position (attention/window.py).
            attn_in.sink_cos, attn_in.sink_sin = self.rotary.lookup(
                pos.clamp(max=window.last_sink_position))
        ctx = ForwardContext(
            backend=self.backend,
            attn_meta=self.backend and self.backend.prepare(attn_in, self.kv.page_size, self.device),
            ops=self.ops,
            cos=cos,
            sin=sin,
            kv=self.kv,
            layer_calls=self.layer_calls,
            compiled=self.compiled,
            windowed=self.windowed,
            states=self.states,
            state_meta=state_meta,
            ssm_kernels=self.ssm_kernels,
            capture=self.feature_layers or (),
            all_reduce=self.all_reduce,
        )
        ids = torch.tensor(input_ids, device=self.device)
        if features is not None:  # (an EAGLE draft: the head's layer finishes the logit rows only)
            picked = torch.tensor(rows, dtype=torch.long, device=self.device)
            self.last_hidden = self.model.forward(ids, ctx, features, picked)  # (R, D)
            return self.model.logits(self.last_hidden) if rows and logits else self.last_hidden
        hidden = self.model.forward(ids, ctx, residual)
        if not self.model.last:
            return hidden  # the residual stream, for the next stage
        if self.feature_layers is not None:
            self.features = torch.cat([ctx.captured[i] for i in self.feature_layers], dim=-1) \
                if self.feature_layers else hidden
        if not rows:
            self.last_hidden = hidden.new_empty((0, 0))
            return self.last_hidden
        # The hidden state of each logit row (an EAGLE draft's next input).
        self.last_hidden = hidden[torch.tensor(rows, device=self.device)]  # (R, D)
        return self.model.logits(self.last_hidden) if logits else self.last_hidden  # (R, V)

    def submit(self, step: StepInput) -> Callable[[], torch.Tensor]:
        """``execute`` as the engine starts a step (see ``ParallelRunner.submit``): at once."""
        logits = self.execute(step)
        return lambda: logits

    def discard_kv(self, pages: list[int], is_free: Callable[[int], bool]) -> None:
        """Give the memory of free KV ``pages`` back to the system (``KVCache.discard``)."""
        self.kv.discard(pages, is_free)

    def move_kv(self, src_slots: list[int], dst_slots: list[int]) -> None:
        """Move KV between cache slots (a verified draft tree's path into place)."""
        self.kv.move(src_slots, dst_slots)

    def keep_alive(self) -> None:
        """Nothing waits on one process."""

    def close(self) -> None:
        """Nothing to stop in one process."""
