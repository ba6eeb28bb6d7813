"""EAGLE drafting (``speculative_mode="eagle"``): a one-layer head on the target's hidden states.

At position ``p`` the head reads the target's feature ``f_p`` (its final hidden state, or for
EAGLE-3 three inner ones side by side) and the next token ``x_{p+1}``, and predicts the feature
at ``p + 1``, whose head logits draft ``x_{p+2}``. Drafting goes on from its own predictions: the
pair (draft token, predicted feature) at the next position, one pass per depth for all drafting
sequences together. The head has its own paged KV for its layer (``build_eagle_runner``), indexed
by the target's page ids as a draft model's is (``KVCacheManager(with_draft=True)``).

The features come from the target's own passes (``ModelRunner.feature_layers``): the engine hands
the drafter those of every verified token (``observe``), kept per sequence until the head has
run them. ``Sequence.num_draft_computed`` counts the positions whose head KV was computed from
the target's true features; positions written from predicted ones while drafting are not
counted, and are written again from the true features once verified (EAGLE's own scheme). The
head lags the target by one token (position ``p`` needs ``x_{p+1}``). A sequence whose features
pile up while it does not draft (prefill chunks, adaptive steps without drafts) has them run
once ``CATCH_UP_TOKENS`` wait, so they never hold much memory. Drafts are the head's best tokens
(deterministic, q = 1), so verification needs no draft probabilities (see ``speculator``). With
``spec_tree_width`` w > 1 they form EAGLE-2's dynamic tree (``dynamic_tree``): each pass runs
the tree so far through the head (its nodes attend their ancestors only) to expand the w most
likely nodes of the newest depth by w tokens each. A node whose path the head finds unlikely
(``MIN_PATH_LOG_PROB``) is not expanded, chain or tree.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from lmserve.attention.base import AttentionShape
from lmserve.cache.kv import KV_DTYPES, KVCache
from lmserve.config import OptFlags
from lmserve.layers.fused import TorchOps
from lmserve.layers.rotary import RotaryEmbedding
from lmserve.plan import EnginePlan
from lmserve.request import Sequence
from lmserve.runner import ModelRunner, TargetWeights
from lmserve.scheduler import Batch, ScheduledChunk
from lmserve.speculative.draft_level import head_formats, head_linear
from lmserve.speculative.draft_vocab import to_token_ids
from lmserve.speculative.dynamic_tree import CandidateTree
from lmserve.speculative.eagle_heads import EagleHeads
from lmserve.speculative.tree import MIN_PATH_LOG_PROB
from lmserve.step import SeqStep, StepInput
from lmserve.worker import attention_backend

# Features a sequence may hold before the head runs them, drafting or not.
CATCH_UP_TOKENS = 64

_MIN_ROWS = 16  # a feature buffer's least room


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


class EagleModel:
    """The head's layer over the target's embedding and (EAGLE-1/2) head, its matrices at the
    drafter's level (``draft_level``), run by a ``ModelRunner`` like any model; ``forward`` also
    takes the features of the step's tokens."""

    def __init__(self, heads: EagleHeads, target: TargetWeights, level: OptFlags) -> None:
        """``target``: the target model's embedding and head, which the head shares."""
        self.args, self.version, self.target = heads.args, heads.version, target
        formats = head_formats(level)
        self.aux_layers = heads.aux_layers  # the target's features it reads (see EagleHeads)
        self.layer_ids = range(self.args.num_layers)  # (the runner's view of its layers)
        t = heads.tensors
        self.fc = head_linear([t["fc.weight"]], t.get("fc.bias"), formats)
        attn = "layer.self_attn."
        biases = [t.get(f"{attn}{p}_proj.bias") for p in "qkv"]
        bias = None if all(b is None for b in biases) else torch.cat([
            b if b is not None else torch.zeros(t[f"{attn}{p}_proj.weight"].shape[0])
            for p, b in zip("qkv", biases)])
        self.qkv = head_linear([t[f"{attn}{p}_proj.weight"] for p in "qkv"], bias, formats)
        self.o = head_linear([t[attn + "o_proj.weight"]], t.get(attn + "o_proj.bias"), formats)
        self.gate_up = head_linear([t["layer.mlp.gate_proj.weight"], t["layer.mlp.up_proj.weight"]],
                                   None, formats)
        self.down = head_linear([t["layer.mlp.down_proj.weight"]], None, formats)
        self.input_norm = t.get("layer.input_layernorm.weight")  # EAGLE-1/2: usually none
        self.hidden_norm = t.get("layer.hidden_norm.weight")  # EAGLE-3
        self.post_norm = t["layer.post_attention_layernorm.weight"]
        self.norm = t.get("norm.weight")
        lm_head = t.get("lm_head.weight")  # EAGLE-3's, over its draft vocabulary
        self.draft_to_target = heads.draft_to_target
        self.eps = self.args.rms_norm_eps
        if lm_head is None and self.draft_to_target is not None:  # EAGLE-1/2, fewer tokens
            lm_head = _head_rows(target, self.draft_to_target)
        # None: the target's own head, over its whole vocabulary (EAGLE-1/2)
        self.lm_head = None if lm_head is None else head_linear([lm_head], None, formats)

    def layer_calls(self, *args, **kwargs) -> None:
        return None  # torch ops only: the layer is small beside the target

    def rotary(self, max_positions: int, device: torch.device) -> RotaryEmbedding:
        a = self.args
        return RotaryEmbedding(a.head_dim, max_positions, a.rope_theta, a.rope_scaling, device)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, ctx, features: torch.Tensor,
                rows: torch.Tensor) -> torch.Tensor:
        """The head's hidden states ``(R, D)`` (before its final norm) at ``rows`` of tokens
        ``(T,)`` and the features ``(T, F)`` they follow: the target's (F = 2D for EAGLE-1/2's
        input, 3D for EAGLE-3's) or the head's own predictions (D). Every token's KV is
        written; the rest of the layer runs for ``rows`` only: in one layer a position's KV
        depends on its own input alone, and the other rows' outputs (the tokens the head catches
        up on, a tree's nodes run again) would be thrown away."""
        emb = self.target.embed[input_ids].float()
        f = features.float()
        if self.version == 1:
            x = self.fc(torch.cat([emb, f], dim=-1))
            h = x if self.input_norm is None else _rms_norm(x, self.input_norm, self.eps)
        else:
            x = self.fc(f) if f.shape[-1] != self.args.hidden_size else f.clone()
            # (an EAGLE-3 head has both norms: read_eagle_heads requires them)
            assert self.input_norm is not None and self.hidden_norm is not None
            h = torch.cat([_rms_norm(emb, self.input_norm, self.eps),
                           _rms_norm(x, self.hidden_norm, self.eps)], dim=-1)
        assert ctx.backend is not None  # (the head's runner is built with one)
        attn = ctx.backend.forward(ctx.attn_meta, self.qkv(h), ctx.cos, ctx.sin, ctx.kv.k[0],
                                   ctx.kv.v[0], windowed=bool(ctx.windowed) and ctx.windowed[0])
        x = x[rows] + self.o(attn[rows]).float()  # (R, D)
        gate, up = self.gate_up(_rms_norm(x, self.post_norm, self.eps)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up).float()

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits ``(S, V)`` over the target's vocabulary, or ``(S, V')`` over the
        head's draft vocabulary (``draft_to_target``) if it has one."""
        h = hidden if self.norm is None else _rms_norm(hidden, self.norm, self.eps)
        if self.lm_head is None:
            return self.target.logits(h.to(self.target.dtype))
        return self.lm_head(h).float()


def _head_rows(target, token_ids: torch.Tensor) -> torch.Tensor:
    """The rows ``(V', D)`` of the target's head for ``token_ids``, in float32: its embedding's
    when they are tied, else its head run once on the identity (which dequantizes it exactly:
    a one-hot row quantizes to itself)."""
    if target.args.tie_word_embeddings:
        return target.embed[token_ids].float()
    eye = torch.eye(target.args.hidden_size).to(target.dtype)
    return target.logits(eye).t()[token_ids].contiguous()


def build_eagle_runner(heads: EagleHeads, target: TargetWeights, plan: EnginePlan,
                       level: OptFlags, device: torch.device) -> ModelRunner:
    """The head's runner at the drafter's ``level``: its model over the target's embedding and
    head, and a one-layer KV cache over the plan's pages (the target's page ids) in the plan's
    draft KV type."""
    args = heads.args
    shape = AttentionShape(args.num_heads, args.num_kv_heads, args.head_dim)
    kv_dtype = plan.draft_kv_dtype
    assert kv_dtype is not None  # (planned for an EAGLE head's layer, as for a draft model)
    backend = attention_backend(shape, kv_dtype, level, plan.page_size)
    kv = KVCache(1, plan.num_pages, plan.page_size, args.num_kv_heads, args.head_dim,
                 KV_DTYPES[kv_dtype], device, backend.keys_transposed)
    positions = min(plan.max_single_sequence_length, args.context_length)
    return ModelRunner(EagleModel(heads, target, level), kv, backend, TorchOps(), positions, device,
                       window=plan.window if plan.bounded else None)


class _Pending:
    """A sequence's target features not yet run by the head: rows for positions from ``start``,
    in a buffer with room to grow, so that a step's rows are copied once (``append``)."""

    def __init__(self, start: int, features: torch.Tensor) -> None:
        self.start = start
        self._buffer = features.new_empty((max(len(features), _MIN_ROWS), features.shape[1]))
        self._buffer[: len(features)] = features
        self._size = len(features)

    @property
    def features(self) -> torch.Tensor:
        return self._buffer[: self._size]  # (n, F)

    @property
    def end(self) -> int:
        return self.start + self._size

    def append(self, rows: torch.Tensor) -> None:
        """The features of the positions from ``end`` on."""
        size = self._size + len(rows)
        if size > len(self._buffer):
            grown = self._buffer.new_empty((max(size, 2 * len(self._buffer)), self._buffer.shape[1]))
            grown[: self._size] = self.features
            self._buffer = grown
        self._buffer[self._size : size] = rows
        self._size = size

    def drop(self, n: int) -> None:
        """Forget the first ``n`` rows (run by the head); a buffer grown for a prefill chunk
        shrinks back."""
        rest = self._buffer[n : self._size]
        if len(self._buffer) > 2 * max(CATCH_UP_TOKENS, len(rest)):
            self._buffer = rest.new_empty((max(len(rest), _MIN_ROWS), rest.shape[1]))
        self._buffer[: len(rest)] = rest.clone() if len(rest) > n else rest  # (overlapping)
        self.start, self._size = self.start + n, len(rest)


class EagleDrafter:
    """Drafts from an EAGLE head's runner: a chain of its best tokens, or (``width`` > 1) an
    EAGLE-2 dynamic tree; at most ``max_pass_tokens`` tokens a catch-up pass."""

    # Each draft is a pass of the head, and heads trained here are right 15-30% of the time:
    # from 4 the adaptive length ran at 0.85x plain decoding at the O0 target (Zen 4).
    adaptive_start = 1

    def __init__(self, runner: ModelRunner, aux_layers: tuple[int, ...], max_pass_tokens: int,
                 width: int = 1) -> None:
        self.runner = runner
        self.feature_layers = aux_layers  # (): the target's final hidden states
        self.max_pass_tokens = max_pass_tokens
        self.width = width

    @staticmethod
    def observe(seq: Sequence, start: int, features: torch.Tensor) -> None:
        """The target's features of the tokens of ``seq`` from position ``start`` that a step
        verified; kept (as the sequence's draft state) until the head runs them."""
        pending: Optional[_Pending] = seq.draft_state
        if pending is not None and pending.end == start:
            pending.append(features)
        else:  # the first, or after a preemption or a reused prefix: the head restarts there
            seq.draft_state = _Pending(start, features)

    def offer(self, seq: Sequence, cap: int) -> int:
        pending: Optional[_Pending] = seq.draft_state
        # The head drafts from the feature of the token before the newest (x_n follows f_{n-1}).
        ready = pending is not None and pending.start <= seq.num_draft_computed \
            and pending.end == len(seq.token_ids) - 1
        return cap if ready else 0

    def num_nodes(self, seq: Sequence, depth: int) -> int:
        return depth * self.width

    @staticmethod
    def behind(seq: Sequence) -> int:
        return _backlog(seq)

    def propose(self, batch: Batch, depths: dict[ScheduledChunk, int]) -> None:
        drafting = [c for c, depth in depths.items() if depth]
        lagging = [c for c in batch.chunks if c not in depths and _backlog(c.seq) >= CATCH_UP_TOKENS]
        trees: dict[ScheduledChunk, CandidateTree] = {}
        # Per drafting chunk: the nodes the head has run (depth by depth), and the feature each
        # one reads (the head's hidden state at its parent) or, once run, its own hidden state.
        ran: dict[ScheduledChunk, list[int]] = {}
        inputs: dict[ScheduledChunk, list[torch.Tensor]] = {}
        outputs: dict[ScheduledChunk, dict[int, torch.Tensor]] = {}
        for c, ((tokens, log_probs), h) in self._catch_up(drafting + lagging, set(drafting)).items():
            trees[c] = CandidateTree()
            trees[c].add_children(-1, tokens, log_probs)
            ran[c], inputs[c], outputs[c] = [], [], {-1: h}
        drafting = [c for c in drafting if c in trees]
        for depth in range(1, max((depths[c] for c in drafting), default=0)):
            deeper = [c for c in drafting if depths[c] > depth]
            expand = {}
            for c in deeper:  # within the chunk's slots: node i's head KV goes to slot start + i
                nodes = trees[c].frontier(depth, min(self.width, c.num_lookahead - len(ran[c])))
                expand[c] = [i for i in nodes if trees[c].values[i] >= MIN_PATH_LOG_PROB]
                ran[c] += expand[c]
                inputs[c] += [outputs[c][trees[c].parents[i]] for i in expand[c]]
            deeper = [c for c in deeper if expand[c]]
            if not deeper:
                break
            # The head re-runs each chunk's nodes so far, as a tree, for its new ones' logits;
            # a chain above all of them keeps its KV (at width 1: the whole chain).
            kept = {c: _common_chain(trees[c], ran[c]) for c in deeper}
            steps = [SeqStep(start=c.seq.num_draft_computed + kept[c],
                             token_ids=[trees[c].token_ids[i] for i in ran[c][kept[c]:]],
                             page_table=list(c.seq.pages), num_logits=len(expand[c]),
                             tree_parents=_step_parents(trees[c], ran[c][kept[c]:])) for c in deeper]
            features = torch.stack([f for c in deeper for f in inputs[c][kept[c]:]])
            logits = self.runner.execute(StepInput(steps), features)
            hidden = self.runner.last_hidden
            assert hidden is not None  # (set by execute)
            top, row = self._top(logits), 0
            for c in deeper:
                for node in expand[c]:
                    trees[c].add_children(node, *top[row])
                    outputs[c][node] = hidden[row]
                    row += 1
        for c in drafting:
            c.draft = trees[c].select(c.num_lookahead)

    def _top(self, logits: torch.Tensor) -> list[tuple[list[int], list[float]]]:
        """Each row's ``width`` best token ids, best first, with their log-probabilities."""
        if not logits.numel():
            return []
        best = logits.float().log_softmax(dim=-1).topk(self.width, dim=-1)
        ids = to_token_ids(best.indices, self.runner.model.draft_to_target).tolist()
        return list(zip(ids, best.values.tolist()))

    def _catch_up(self, chunks: list[ScheduledChunk], drafting: set[ScheduledChunk]
                  ) -> dict[ScheduledChunk, tuple[tuple[list[int], list[float]], torch.Tensor]]:
        """Run each chunk's pending features through the head, in passes of at most
        ``max_pass_tokens``; returns, for each ``drafting`` chunk, the head's best tokens after
        its newest token and its hidden state there (the first draft and its feature)."""
        first: dict[ScheduledChunk, tuple[tuple[list[int], list[float]], torch.Tensor]] = {}
        while pending := [c for c in chunks if _backlog(c.seq)]:
            steps, ran, budget = [], [], self.max_pass_tokens
            for c in pending:
                seq, state = c.seq, c.seq.draft_state
                start = seq.num_draft_computed
                n = min(_backlog(seq), budget)
                if n <= 0:
                    break
                wants = c in drafting and n == _backlog(seq)
                rows = state.features[start - state.start : start - state.start + n]
                steps.append((SeqStep(start=start, token_ids=seq.token_ids[start + 1 : start + 1 + n],
                                      page_table=list(seq.pages), num_logits=1 if wants else 0), rows))
                ran.append(c)
                budget -= n
            logits = self.runner.execute(StepInput([s for s, _ in steps]),
                                         torch.cat([rows for _, rows in steps]))
            hidden = self.runner.last_hidden
            assert hidden is not None  # (set by execute)
            top = self._top(logits)
            row = 0
            for c, (step, _) in zip(ran, steps):
                seq, state = c.seq, c.seq.draft_state
                seq.num_draft_computed += len(step.token_ids)
                state.drop(seq.num_draft_computed - state.start)
                if step.num_logits:
                    first[c] = (top[row], hidden[row])
                    row += 1
        return first


def _common_chain(tree: CandidateTree, nodes: list[int]) -> int:
    """How many of ``nodes`` (the head's nodes so far, depth by depth, the newest last) lead
    them one per depth: every later node descends from those, so their KV in slots
    ``start + i`` is exactly the ancestors' that the later nodes attend, and a pass need not run
    them again."""
    depths = [tree.depths[m] for m in nodes]
    n = 0
    while n < len(nodes) - 1 and depths.count(n + 1) == 1:
        n += 1
    return n


def _step_parents(tree: CandidateTree, nodes: list[int]) -> list[int]:
    """Each of ``nodes``' parent as its index in ``nodes``; -1 for a parent in the head's
    cached context (the newest token, or the last node of a kept chain)."""
    index = {node: i for i, node in enumerate(nodes)}
    return [index.get(tree.parents[node], -1) for node in nodes]


def _backlog(seq: Sequence) -> int:
    """Positions the head can run now: from its count up to the token before the newest, with
    the target's features at hand and the target's KV pages there (after a preemption,
    features kept from before it wait until the target has recomputed their positions)."""
    state: Optional[_Pending] = seq.draft_state
    if state is None or state.start > seq.num_draft_computed:
        return 0
    end = min(state.end, len(seq.token_ids) - 1, seq.num_computed)
    return max(0, end - seq.num_draft_computed)
