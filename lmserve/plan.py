"""The engine plan: batch, KV and prefill sizes resolved from the config, the model and memory.

``mode`` decides what is not given explicitly: ``local`` (batch 4) and ``interactive`` (batch 1)
keep KV for the context window; ``server`` takes the largest KV capacity the memory budget leaves.
The budget is ``gpu_memory_utilization`` (default 0.85) times the device's memory (on CPU: the
machine's RAM). From it come off the weights, the activation and logits workspace of one step at
the chosen batch and chunk, and a margin for the runtime itself; what remains, divided by the KV
bytes of one token, is the KV capacity. Every plan is checked against the budget, so an
impossible one is refused at start with the numbers rather than failing later.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Optional

from lmserve.attention import resolve_attention, resolve_kv_dtype
from lmserve.attention.base import AttentionShape
from lmserve.attention.window import AttentionWindow
from lmserve.cache.kv import KV_DTYPES, kv_bytes_per_head
from lmserve.config import (
    DEFAULT_DRAFT_OPT,
    MAX_ADAPTIVE_K,
    MAX_RUN,
    MAX_TREE_TOKENS,
    RUN_SECONDS,
    EngineConfig,
    OptFlags,
    parse_opt,
)
from lmserve.kernels.build import describe_kernels
from lmserve.layers.linear import FLOAT_DTYPES
from lmserve.models.args import ModelArgs
from lmserve.parallel.shard import check_shardable, shard_args
from lmserve.parallel.stages import stage_layers
from lmserve.scheduler import SCORED_ROWS_PER_STEP
from lmserve.speculative.draft_level import head_weight_format
from lmserve.speculative.eagle_heads import eagle_heads_size
from lmserve.speculative.medusa import medusa_heads_size
from lmserve.state_plan import StatePlan, batch_that_fits, plan_state
from lmserve.structured.xgrammar_lib import describe_structured_output
from lmserve.util import cdiv

DEFAULT_MODE = "local"
DEFAULT_MEMORY_UTILIZATION = 0.85
_MODE_BATCH: dict[str, int] = {"local": 4, "interactive": 1}
# Server mode: a batch beyond this buys no throughput on the devices we run on. A CPU prefills
# about a thousand tokens a second, so a chunk of 256 keeps a step near a quarter second: the
# decodes riding along stall little, and arrivals are prefilled in the next step or two instead
# of waiting for a long chunk (at concurrency 16 this halves the median time to first token at
# the same throughput; matmuls are as efficient at 256 rows as at 2048).
SERVER_BATCH = 128
SERVER_CHUNK = 256
# Python, torch and the tokenizer themselves, plus allocator slack; the larger of the two.
RUNTIME_MARGIN_BYTES = 768 << 20
RUNTIME_MARGIN_FRACTION = 0.05

# Bytes per entry of the embedding table, by act_dtype (integer activations leave it float32).
_TABLE_BYTES = {"float32": 4, "bfloat16": 2, "int8": 4, "int16": 4}
# Bytes per weight of each weight format, at most. Block formats hold 32 weights (4-bit, 8-bit
# or bf16 codes) with a float32 scale and zero (the int8 kernel keeps GGUF's as float16, half
# that); "native" keeps what the file has, at most bf16 blocks.
_WEIGHT_BYTES = {"float32": 4, "float16": 2, "bfloat16": (64 + 8) / 32, "int4": (16 + 8) / 32,
                 "int8": (32 + 8) / 32, "native": (64 + 8) / 32}
_GiB = 1 << 30


@dataclass(frozen=True)
class MemoryPlan:
    """Where the memory budget goes, in bytes."""

    device: int  # the device's memory (CPU: total RAM)
    budget: int  # gpu_memory_utilization * device
    weights: int
    kv_per_token: int  # keys and values of one token over all layers
    kv: int  # the whole KV pool
    workspace: int  # activations, attention gathers and logits of the largest step
    margin: int  # the runtime itself
    draft: int = 0  # of weights and kv: the draft model's weights and KV (small_draft)
    state: int = 0  # recurrent-state slots (Mamba-family models)
    # Of weights and kv: each parallel rank's (empty for one process).
    rank_weights: tuple[int, ...] = ()
    rank_kv: tuple[int, ...] = ()

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.state + self.workspace + self.margin


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
    weight_dtype: str  # how matmul weights are held (the opt level's weight format)
    kv_dtype: str
    act_dtype: str  # dtype of activations entering the attention projections and the head
    mlp_act_dtype: str  # ... entering the MLP's down projection
    gate_up_act_dtype: str  # ... entering its gate/up projection
    attention: str  # attention backend
    compile: bool  # the layers' torch ops compiled (opt compile=1)
    speculative: str  # the drafter and draft tokens per sequence and step, or "off"
    multi_step: str  # when one stream takes several tokens a step (engine/multi_step.py), or "off"
    draft_kv_dtype: Optional[str]  # the draft model's KV cache (same pages), None without one
    window: Optional[AttentionWindow]  # sliding-window attention of window_layers, or None
    window_layers: Optional[tuple[int, ...]]  # the windowed layers; None: every layer
    max_pages_per_sequence: int  # the most KV pages one sequence holds
    state: Optional[StatePlan]  # recurrent-state slots, for models with recurrent layers
    memory: MemoryPlan
    stage_layers: tuple[range, ...] = ()  # each pipeline stage's layers (none: one stage)

    @property
    def bounded(self) -> bool:
        """Every layer is windowed: a sequence's KV is bounded by its window, not its length."""
        return self.window is not None and self.window_layers is None

    def describe(self) -> str:
        """An aligned two-column table of the plan, for the start-up log and ``lmserve plan``."""
        rows = [(f.name, str(getattr(self, f.name))) for f in dataclasses.fields(self)
                if f.name not in ("memory", "window", "window_layers", "state", "stage_layers")]
        rows.insert(next(i for i, (name, _) in enumerate(rows) if name == "max_pages_per_sequence"),
                    ("sliding_window", _describe_window(self)))
        m = self.memory
        rows += [
            ("weights", _gib(m.weights)),
            ("kv_bytes_per_token", f"{m.kv_per_token:,}"),
            ("kv_cache", _gib(m.kv)),
            *([("recurrent_state", f"{_gib(m.state)} in {self.state.describe()}")]
              if self.state else []),
            ("workspace", _gib(m.workspace)),
            ("runtime_margin", _gib(m.margin)),
            *([(_DRAFT_ROWS.get(self.speculative.split(" ")[0].rstrip(","), "draft_model"),
                f"{_gib(m.draft)} of the weights and KV cache above")] if m.draft else []),
            *([("pipeline_stages", " | ".join(f"layers {r.start}-{r.stop - 1}"
                                               for r in self.stage_layers))]
              if self.stage_layers else []),
            *([("per_rank", _describe_ranks(m))] if m.rank_weights else []),
            ("expected_memory", f"{_gib(m.total)} of a {_gib(m.budget)} budget "
                                f"({_gib(m.device)} device)"),
            ("kernels", describe_kernels()),
            ("structured_output", describe_structured_output()),
        ]
        width = max(len(name) for name, _ in rows)
        return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)


def make_plan(config: EngineConfig, args: ModelArgs, device_memory: Optional[int] = None,
              draft_args: Optional[ModelArgs] = None, draft_opt: Optional[OptFlags] = None,
              stage_layers_given: Optional[tuple[range, ...]] = None) -> EnginePlan:
    """Resolve the config's limits against the model and the memory budget.

    Values given in the config always win. ``device_memory`` defaults to the machine's RAM.
    ``draft_args``: the draft model of ``speculative_mode="small_draft"`` or the layer of an
    EAGLE head, whose weights and KV (a second set of tensors over the same pages, at the
    drafter's level ``draft_opt``, default the config's draft_opt knob) share the budget.
    ``stage_layers_given``: the pipeline stages'
    layers a model library was compiled with (else split here).
    Raises ``ValueError`` with the numbers when the plan cannot work.
    """
    opt = parse_opt(config.opt)
    mode = config.mode or DEFAULT_MODE
    device = device_memory if device_memory is not None else system_memory_bytes()
    util = config.gpu_memory_utilization or DEFAULT_MEMORY_UTILIZATION
    budget = int(util * device)
    models = [(args, opt)]
    eagle = config.speculative_mode == "eagle"
    draft_level = draft_opt or parse_opt(opt.draft_opt or DEFAULT_DRAFT_OPT)
    if draft_args is not None:  # a draft model, or an EAGLE head's layer (its own KV)
        models.append((draft_args, draft_level))
    kv_dtypes = [_kv_dtype(a, o, config.kv_cache_page_size) for a, o in models]
    stages = config.pipeline_parallel_stages or 1
    if stages > 1 and config.speculative_mode in ("medusa", "eagle"):
        raise ValueError(f"speculative_mode={config.speculative_mode!r} drafts from the hidden "
                         f"states of every token a step runs, which pipeline_parallel_stages="
                         f"{stages} leaves on the last stage; use ngram or small_draft")
    # Heads on the target's hidden states: their files' tensors at the drafter's level (an
    # EAGLE head's layer is ``draft_args``, which shares the target's embedding and head).
    heads = 0
    if config.speculative_mode in ("medusa", "eagle"):
        heads_dir = config.additional_models[0]
        assert isinstance(heads_dir, str)  # EngineConfig takes (path, model_lib) for small_draft only
        try:
            size = (eagle_heads_size if eagle else medusa_heads_size)(heads_dir)
        except FileNotFoundError as err:
            raise FileNotFoundError(f"additional_models[0]: {err}") from None
        heads = int(size * _WEIGHT_BYTES[head_weight_format(draft_level)])
    tensor = config.tensor_parallel_shards or 1
    layers_of_stages = stage_layers_given or (stage_layers(args, stages, tensor) if stages > 1 else ())
    rank_weights = rank_weight_bytes(args, opt, tensor, layers_of_stages) \
        if tensor * stages > 1 else ()
    weights = heads + sum(rank_weights or [weight_bytes(args, opt.weight_dtype, opt.act_dtype)]) + sum(
        weight_bytes(a, o.weight_dtype, o.act_dtype) for a, o in models[1: 1 if eagle else None])
    kv_per_token = sum(_kv_per_token(a, d) for (a, _), d in zip(models, kv_dtypes))
    margin = max(RUNTIME_MARGIN_BYTES, int(RUNTIME_MARGIN_FRACTION * budget))
    context = min(a.context_length for a, _ in models)
    # (A draft model attends with the same window: see EngineCore.)
    window, window_layers = resolve_window(config.sliding_window_size, config.attention_sink_size, args)
    bounded = window is not None and window_layers is None
    page = config.kv_cache_page_size
    # A draft model's KV may trail a sequence's by its newest token and accepted drafts: the
    # window's pages are kept for it too.
    lag = (config.spec_draft_length or MAX_ADAPTIVE_K) + 1 if draft_args is not None else 0

    def pages_per_sequence(single: int, chunk: int) -> int:
        """The most pages one sequence holds: its length's, or (every layer windowed) its
        window's."""
        dense = cdiv(single, page)
        if bounded:
            assert window is not None  # bounded: every layer has the window
            return min(dense, window.max_pages(page, chunk + lag))
        return dense

    def step_workspace(batch: int, chunk: int, single: int) -> int:
        # Verifying drafts wants a logit row per draft too, within the step's tokens.
        speculating = config.speculative_mode != "disable"
        max_drafts = ((config.spec_draft_length or MAX_ADAPTIVE_K) * config.spec_tree_width
                      if speculating else 0)
        if config.speculative_mode == "medusa":  # its medusa_choices may draft a whole tree
            max_drafts = MAX_TREE_TOKENS - 1
        rows = min(max(chunk, batch), batch * (1 + max_drafts))
        # A windowed layer's query sees at most its sinks, window and chunk: every query's,
        # when every layer is windowed, else a dense layer's sees its whole sequence.
        seen = 0 if window is None else min(single, window.sinks + window.size - 1 + chunk)
        # The draft's passes and the target's run one after the other.
        return max(workspace_bytes(a, batch, chunk, seen if bounded else single,
                                   _kv_per_token(a, d), _gathers_kv(a, o, d), rows, seen)
                   for (a, o), d in zip(models, kv_dtypes))

    recurrent_only = not args.attention_layers  # no KV at all: every layer is recurrent
    if mode == "server":
        batch = _given_or(config.max_num_sequence, SERVER_BATCH)
        chunk = _given_or(config.prefill_chunk_size, min(context, SERVER_CHUNK))
        single = _given_or(config.max_single_sequence_length, context)
        workspace = step_workspace(batch, chunk, single)
        room = budget - weights - workspace - margin
        held = pages_per_sequence(single, chunk)
        if args.ssm_layers and config.max_num_sequence is None:
            # As many sequences as their state slots fit, as MLC LLM sizes its RNN-state models
            # (a hybrid's KV pages are shared on demand, as an attention model's).
            batch = batch_that_fits(config, args, room, batch)
            workspace = step_workspace(batch, chunk, single)
            room = budget - weights - workspace - margin
        if args.ssm_layers:
            state = plan_state(config, args, batch)
            assert state is not None  # the model has recurrent layers
            room -= state.bytes
        # Whole pages only; more KV than every sequence at full length could never be used.
        fits = max(0, room // (page * kv_per_token)) * page if kv_per_token else 0
        total = _given_or(config.max_total_sequence_length,
                          batch * single if recurrent_only else min(fits, batch * held * page))
    else:
        batch = _given_or(config.max_num_sequence, _MODE_BATCH[mode])
        total = _given_or(config.max_total_sequence_length, context)
        single = _given_or(config.max_single_sequence_length, min(context, total))
        if recurrent_only and config.max_total_sequence_length is None:
            total = batch * single  # tokens only bound time: a sequence's state has one size
        chunk = _given_or(config.prefill_chunk_size, min(context, total))
        held = pages_per_sequence(single, chunk)
        if bounded and config.max_total_sequence_length is None:  # a stream's window and chunk
            total = max(total, held * page)
        workspace = step_workspace(batch, chunk, single)

    num_pages = 0 if recurrent_only else cdiv(total, page)  # ceil: the last page may be partly used
    state = plan_state(config, args, batch)
    draft = heads
    if draft_args is not None:
        draft = (heads or weight_bytes(draft_args, models[1][1].weight_dtype, models[1][1].act_dtype)) \
            + num_pages * page * _kv_per_token(draft_args, kv_dtypes[1])
    kv = num_pages * page * kv_per_token
    rank_kv = tuple(kv * len(layers_of_stages[r // tensor] if layers_of_stages else args.attention_layers)
                    // (len(args.attention_layers) * tensor) for r in range(len(rank_weights)))
    memory = MemoryPlan(device, budget, weights, kv_per_token, kv, workspace, margin, draft,
                        state.bytes if state else 0, rank_weights, rank_kv)
    if window is not None and config.speculative_mode != "disable":
        deepest = config.spec_draft_length or MAX_ADAPTIVE_K
        if window.size <= deepest:
            raise ValueError(f"a sliding window of {window.size} tokens must exceed the deepest "
                             f"draft ({deepest} tokens): a draft sees its whole path")
    _check(context, memory, total, single, chunk, util, draft_args is not None,
           window if bounded else None, held * page, recurrent_only)
    gate_up_act, down_act = opt.mlp_act_dtypes()
    return EnginePlan(mode, batch, total, single, chunk, page, num_pages,
                      opt.weight_dtype, kv_dtypes[0], opt.act_dtype,
                      down_act, gate_up_act, opt.attention, opt.compile,
                      _speculative(config, models),
                      _multi_step(config, opt, window is not None, state is not None, tensor * stages),
                      kv_dtypes[1] if draft_args else None,
                      window, window_layers, held, state, memory, layers_of_stages)


def _multi_step(config: EngineConfig, opt: OptFlags, windowed: bool, recurrent: bool,
                ranks: int) -> str:
    """The plan's line on multi-step decoding (engine/multi_step.py): when it runs, or why not."""
    drafts = config.speculative_mode in ("ngram", "small_draft")
    why_not = ("opt multi_step=0" if not opt.multi_step
               else "the heads read every token's hidden states"
               if config.speculative_mode in ("eagle", "medusa")
               else "a sliding window" if windowed else "recurrent layers" if recurrent
               else "parallel ranks" if ranks > 1
               else "the torch path" if opt.attention != "cpu_paged" else None)
    if why_not is not None:
        return f"off ({why_not})"
    where = ", where the drafter drafts nothing" if drafts else ""
    return (f"a greedy stream alone{where}: up to {MAX_RUN} tokens a step, about "
            f"{RUN_SECONDS * 1000:.0f} ms of them (with the C++ kernels)")


def resolve_window(size: Optional[int], sinks: Optional[int], args: ModelArgs
                   ) -> tuple[Optional[AttentionWindow], Optional[tuple[int, ...]]]:
    """The sliding window of the model's windowed layers and those layers (None: all): the
    model's own window, or ``size`` (``sliding_window_size``: on the layers the model windows, or
    on all of a model without a window), with ``sinks`` (``attention_sink_size``). (None, None)
    without a window."""
    own = args.sliding_window
    if size is not None and own is not None and size > own:
        raise ValueError(f"sliding_window_size={size} is larger than the model's own sliding window "
                         f"of {own} tokens: its layers were trained to see at most {own}")
    size = size or own
    if size is None:
        return None, None
    return AttentionWindow(size, sinks or 0), (
        args.sliding_window_layers if own is not None else None)


def _describe_ranks(m: MemoryPlan) -> str:
    """Each rank's weights and KV, ranks with the same numbers together."""
    groups: list[tuple[list[int], int, int]] = []
    for rank, (weights, kv) in enumerate(zip(m.rank_weights, m.rank_kv)):
        if groups and groups[-1][1:] == (weights, kv):
            groups[-1][0].append(rank)
        else:
            groups.append(([rank], weights, kv))
    return "; ".join(
        f"{'rank' if len(ranks) == 1 else 'ranks'} {ranks[0]}{'' if len(ranks) == 1 else f'-{ranks[-1]}'}: "
        f"weights {_gib(weights)}, KV {_gib(kv)}{'' if len(ranks) == 1 else ' each'}"
        for ranks, weights, kv in groups)


def _describe_window(plan: EnginePlan) -> str:
    if plan.window is None:
        return "off"
    layers = "every layer" if plan.window_layers is None else \
        f"layers {', '.join(map(str, plan.window_layers)) or 'none'}"
    unbounded = "" if plan.bounded else " (KV not bounded: dense layers)"
    return f"{plan.window.describe()} on {layers}{unbounded}"


def _kv_dtype(args: ModelArgs, opt: OptFlags, page_size: int) -> str:
    shape = AttentionShape(args.num_heads, args.num_kv_heads, args.head_dim)
    return resolve_kv_dtype(opt.kv_dtype, shape, page_size)


def _kv_per_token(args: ModelArgs, kv_dtype: str) -> int:
    return len(args.attention_layers) * args.num_kv_heads * kv_bytes_per_head(args.head_dim, kv_dtype)


# The plan's row for a drafter's own memory, by speculative mode.
_DRAFT_ROWS = {"medusa": "medusa_heads", "eagle": "eagle_head"}


def _speculative(config: EngineConfig, models: list[tuple[ModelArgs, OptFlags]]) -> str:
    if config.speculative_mode == "disable":
        return "off"
    k = config.spec_draft_length
    length = f"{k} draft tokens" if k else f"adaptive, 0-{MAX_ADAPTIVE_K} draft tokens"
    if config.spec_tree_width > 1:
        length = (f"a tree of {config.spec_tree_width} candidates per depth, "
                  f"{length.replace('draft tokens', 'deep')}")
    mode: str = config.speculative_mode
    if mode in ("eagle", "medusa"):
        level = parse_opt(config.opt).draft_opt or DEFAULT_DRAFT_OPT
        mode += (f" ({'a one-layer head' if mode == 'eagle' else 'heads'} on the model's hidden "
                 f"states, at {level}: weights {head_weight_format(parse_opt(level))})")
    elif len(models) > 1:
        draft, draft_opt = models[1]
        mode += (f" ({draft.architecture}, {draft.num_layers} layers, weights "
                 f"{draft_opt.weight_dtype})")
    return f"{mode}, {length} per sequence and step"


def head_bytes(args: ModelArgs, weight_format: str) -> int:
    """Bytes of the language-model head beyond the embedding table (none when they are one
    dense tensor)."""
    if weight_format in ("float32", "float16") and args.tie_word_embeddings:
        return 0
    return int(args.vocab_size * args.hidden_size * _WEIGHT_BYTES[weight_format])


def rank_weight_bytes(args: ModelArgs, opt: OptFlags, tensor: int,
                      stages: tuple[range, ...] = ()) -> tuple[int, ...]:
    """Each parallel rank's weights: its share of its stage's layers (of every layer without
    pipeline stages), the embedding table on the first stage, the head on rank 0 only (see
    ``parallel.shard`` and ``parallel.stages``)."""
    if tensor > 1:
        check_shardable(args, tensor, opt.weight_dtype not in FLOAT_DTYPES)
    part = shard_args(args, tensor) if tensor > 1 else args
    whole = weight_bytes(part, opt.weight_dtype, opt.act_dtype)
    head = head_bytes(args, opt.weight_dtype)
    ends = weight_bytes(dataclasses.replace(part, num_layers=0), opt.weight_dtype, opt.act_dtype)
    per_layer = (whole - ends) / args.num_layers  # (no recurrent layers: refused above)
    stages = stages or (range(args.num_layers),)
    return tuple(int(len(stages[r // tensor]) * per_layer + (ends - head if r < tensor else 4 * args.hidden_size)
                     + (head if r == 0 else 0)) for r in range(tensor * len(stages)))


def weight_bytes(args: ModelArgs, weight_format: str, act_dtype: str = "bfloat16") -> int:
    """Bytes of the model's weights as the engine holds them: the matmul weights in
    ``weight_format``, the embedding table dense in ``act_dtype`` (a separate copy when the
    weights are blocks), norms in float32."""
    d, hd = args.hidden_size, args.head_dim
    attn = d * (args.num_heads + 2 * args.num_kv_heads) * hd + args.num_heads * hd * d
    mlp = 3 * d * args.intermediate_size
    per_weight = _WEIGHT_BYTES[weight_format]
    embed = args.vocab_size * d
    dense = weight_format in ("float32", "float16")  # torch tensors; the head shares the table
    table = embed * (per_weight if dense else _TABLE_BYTES[act_dtype])
    head = head_bytes(args, weight_format)
    norms = (2 * args.num_layers + 1) * d
    matmuls = len(args.attention_layers) * attn + args.num_layers * mlp
    if args.ssm is not None:  # in/out projections as weight_format; the rest float32
        s = args.ssm
        proj = d * (s.inner + s.conv_dim + s.num_heads) if s.version == 2 else d * 2 * s.inner
        small = s.conv_dim * (s.conv_kernel + 1)  # the convolution and its bias
        if s.version == 1:  # x_proj, dt_proj and its bias, A (I x N), D
            small += s.inner * (s.dt_rank + 2 * s.state_size) + s.inner * (s.dt_rank + 1) \
                + s.inner * s.state_size + s.inner
        else:  # dt_bias, A and D per head; the gated norm
            small += 3 * s.num_heads + s.inner
        matmuls += len(args.ssm_layers) * (proj + s.inner * d)
        norms += len(args.ssm_layers) * small
    return int(matmuls * per_weight + table + head + norms * 4)


def _gathers_kv(args: ModelArgs, opt: OptFlags, kv_dtype: str) -> bool:
    """Whether this model's attention runs on the torch path here, whose decode gathers a padded
    float32 copy of the KV: asked for, or where the C++ kernel cannot serve it (as the engine)."""
    if not args.attention_layers:
        return False
    shape = AttentionShape(args.num_heads, args.num_kv_heads, args.head_dim)
    return resolve_attention(opt.attention, shape, KV_DTYPES[kv_dtype], log=False) == "torch_native"


def workspace_bytes(args: ModelArgs, batch: int, chunk: int, single: int, kv_per_token: int,
                    gathers_kv: bool = True, logit_rows: Optional[int] = None,
                    window_keys: int = 0) -> int:
    """Peak bytes of one step's temporaries beyond the weights and the KV pool.

    A step holds at most ``max(chunk, batch)`` tokens: their float32 activations (residual,
    q/k/v, the gate/up product, with one spare copy each), the logits of up to ``logit_rows``
    sampled rows (``batch``; more when drafts are verified) with the sampler's copies, and of
    the ``SCORED_ROWS_PER_STEP`` prompt tokens a step may score beside them (``prompt_logprobs``:
    the rows and their log-softmax), and, when
    attention ``gathers_kv`` (the torch path), the float32 KV that decode attention gathers for
    one layer at a time (at worst ``batch`` sequences padded to
    ``single`` tokens; under a sliding window the keys one query sees). The C++ paged kernel
    reads the pages in place. The torch path's windowed layers hold a chunk's float32 scores,
    sink scores and weights against the ``window_keys`` one of its queries may see.
    """
    tokens = max(chunk, batch)
    qkv = (args.num_heads + 2 * args.num_kv_heads) * args.head_dim
    activations = 2 * tokens * (4 * args.hidden_size + qkv + 2 * args.intermediate_size) * 4
    logits = (4 * (logit_rows or batch) + 2 * min(tokens, SCORED_ROWS_PER_STEP)) * args.vocab_size * 4
    per_layer_kv = kv_per_token // max(1, len(args.attention_layers))  # one token, one layer
    gather = 3 * batch * single * per_layer_kv if gathers_kv else 0  # pages + float32 copy
    scores = 3 * args.num_heads * tokens * window_keys * 4 if gathers_kv else 0
    return activations + logits + gather + scores + _mixer_workspace(args, batch, tokens)


def _mixer_workspace(args: ModelArgs, batch: int, tokens: int) -> int:
    """A recurrent layer's temporaries: its projections and convolution of the step's tokens,
    the decode sequences' states gathered and updated, and (Mamba2) the chunked scan's products
    for one sequence's chunk of prompt."""
    s = args.ssm
    if s is None:
        return 0
    per_token = 2 * s.inner + s.conv_dim + s.num_heads + 3 * s.conv_dim + 3 * s.inner
    states = 3 * batch * s.state_floats
    chunks = cdiv(tokens, s.chunk_size)
    scan = 3 * chunks * (s.chunk_size ** 2 * s.num_heads + s.num_heads * s.head_dim * s.state_size) \
        if s.version == 2 else 0
    return 4 * (tokens * per_token + states + scan)


def system_memory_bytes() -> int:
    """Total RAM of this machine."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _check(context: int, m: MemoryPlan, total: int, single: int, chunk: int, util: float,
           with_draft: bool, window: Optional[AttentionWindow], held: int,
           recurrent_only: bool = False) -> None:
    """``window``: the window of every layer (None if some layer is dense); ``held``: the most
    tokens' KV one sequence holds; ``recurrent_only``: no layer attends (no positions, no KV)."""
    if single > context and window is None and not recurrent_only:
        models = "the context window of the model or its draft model" if with_draft else \
            "the model's context window"
        raise ValueError(f"max_single_sequence_length={single} exceeds {models} "
                         f"of {context} tokens (only a model with a sliding window on every "
                         f"layer may run past it)")
    if single > context and window is not None and window.size + window.sinks > context:
        raise ValueError(f"max_single_sequence_length={single} runs past the context window of "
                         f"{context} tokens, which needs sliding_window_size + attention_sink_size "
                         f"({window.size} + {window.sinks}) within it: a query would see keys "
                         f"farther away than the model was trained on")
    fixed = m.weights + m.workspace + m.margin
    if fixed > m.budget:
        raise ValueError(
            f"the weights ({_gib(m.weights)}), one step's workspace ({_gib(m.workspace)}) and the "
            f"runtime margin ({_gib(m.margin)}) need {_gib(fixed)}, over the memory budget of "
            f"{_gib(m.budget)} ({util:g} of {_gib(m.device)}); raise gpu_memory_utilization or "
            f"lower max_num_sequence / prefill_chunk_size / max_single_sequence_length")
    if total < min(single, held) and not recurrent_only:
        need = f"max_single_sequence_length={single} tokens" if held >= single else \
            f"its sliding window and a prefill chunk ({held} tokens of pages)"
        raise ValueError(
            f"the KV cache holds {total} tokens, fewer than one sequence of {need} "
            f"({m.kv_per_token:,} bytes a token, {_gib(m.budget - fixed)} left for KV)")
    if chunk > total:
        raise ValueError(f"prefill_chunk_size={chunk} exceeds max_total_sequence_length={total}: "
                         f"the KV cache could never hold one chunk")
    if m.total > m.budget:
        raise ValueError(
            f"this plan needs {_gib(m.total)} (KV cache {_gib(m.kv)} for {total} tokens), over the "
            f"memory budget of {_gib(m.budget)} ({util:g} of {_gib(m.device)})")


def _gib(n: int) -> str:
    return f"{n / _GiB:.2f} GiB"


def _given_or(given: Optional[int], inferred: int) -> int:
    return inferred if given is None else given
