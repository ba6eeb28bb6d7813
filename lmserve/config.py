"""EngineConfig: every knob a user can set on the engine, checked when the config is built.

The field names, types, defaults and the JSON round trip follow the seed interface exactly, so a
config written for that engine loads here. The field annotations are also the source of the type
checks below, which is why they stay real ``typing`` objects (no ``from __future__ import
annotations`` in this file).
"""

import dataclasses
import functools
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import (  # noqa: UP035  (List / Tuple: the seed's spelling of the field types)
    Any,
    Final,
    List,
    Literal,
    Optional,
    Tuple,
    Union,
    get_args,
    get_origin,
    get_type_hints,
)

Dtype = Literal["float32", "bfloat16", "float16"]
KvDtype = Literal["float32", "bfloat16", "float16", "int8"]


WeightFormat = Literal["float32", "bfloat16", "float16", "int8", "int4", "native"]
AttentionKernel = Literal["torch_native", "cpu_paged"]
ActDtype = Literal["float32", "bfloat16", "int8", "int16"]


@dataclass(frozen=True)
class OptFlags:
    """The optimisation knobs an ``opt`` string resolves to."""

    # How matmul weights are held: float32/float16 dense (torch matmul); bfloat16 in the block
    # kernel; "native" keeps a GGUF file's Q4_0 / Q4_1 / Q8_0 / Q5_0 / Q4_K blocks as they are (other
    # weights bfloat16); "int4"/"int8" round every weight to 32-wide blocks of that many bits.
    weight_dtype: WeightFormat = "float32"
    # dtype of the paged KV cache. int8 stores each key and value as codes with a float scale per
    # token and head (about half of bfloat16's bytes), and the kernel then computes the scores
    # and the weighted values as integer dot products (with the query quantized likewise, and the
    # softmax weights as 16-bit codes); it needs attention=cpu_paged, and where the C++ kernel
    # cannot run, or pages do not hold a multiple of 4 tokens, the cache is bfloat16 (logged).
    kv_dtype: KvDtype = "float32"
    # dtype of the activations entering the attention projections (q/k/v, o) and the head. With
    # block weights, float32 is multiplied as two bfloat16 halves: about 16 significant bits, at
    # twice the dot-product work. int8 quantizes them per block of 32 (as llama.cpp does) and
    # multiplies with integer dot products, 2-3x faster than bfloat16; int16 adds a second int8
    # digit for the rounding error (about 15 bits a block, twice int8's work). Integer
    # activations apply to 4-/8-bit blocks; a layer with bf16 weights gets them as float32.
    act_dtype: ActDtype = "float32"
    # the same for the MLP (gate/up, down: three quarters of a layer's weights); None = act_dtype
    mlp_act_dtype: Optional[ActDtype] = None
    # the same for the MLP's gate/up projection alone (half of a layer's weights); None =
    # mlp_act_dtype. A knob given without these narrower ones sets them too: act_dtype the MLP's
    # and gate/up's, mlp_act_dtype gate/up's. One tensor type through the MLP: int8, int16 and
    # float32 mix, bfloat16 goes alone.
    gate_up_act_dtype: Optional[ActDtype] = None
    # torch_native: torch ops throughout. cpu_paged: lmserve's C++ kernels for attention and the
    # element-wise layer ops (residual + RMSNorm, SiLU * up).
    attention: AttentionKernel = "torch_native"
    # torch.compile the layers' torch ops around attention (norms, projections, MLP): only on the
    # torch path (attention=torch_native, which compile=1 selects unless the attention knob is
    # given, and dense float32/float16 weights); with lmserve's C++ attention or block matmul
    # kernels, which torch.compile cannot see into, compile=1 is refused.
    compile: bool = False
    # The opt level of the draft model (small_draft) or the heads (eagle, medusa); None:
    # DEFAULT_DRAFT_OPT. A full-precision target verifying its own quantized weights is a real
    # use: the exact reference output at nearly the quantized speed.
    draft_opt: Optional[str] = None
    # A lone greedy sequence decodes several tokens a step, in one C++ call (engine/multi_step.py);
    # 0: a token a step.
    multi_step: bool = True

    def mlp_act_dtypes(self) -> tuple[ActDtype, ActDtype]:
        """The activations asked for into the MLP's gate/up and its down projection."""
        down = self.mlp_act_dtype or self.act_dtype
        return self.gate_up_act_dtype or down, down


# The one place that says what each level means; change a preset here and nowhere else.
# O0 is the full-precision reference path: float32 weights, activations and KV, computed in
# lmserve's C++ kernels (float32 arithmetic in one fixed order per row; torch where they cannot
# be built; "O0;attention=torch_native" is torch throughout, and what compile=1 compiles).
# From O1 on the KV cache is bfloat16. O1 holds the
# weights in bfloat16 (bf16 activations). O2 (the default) multiplies a GGUF file's own 4-/8-bit
# blocks (no re-rounding) with activations quantized to two int8 digits per block (int16): more
# precise than bf16 activations and faster, with integer dot products; into the MLP's gate/up
# one digit, half that work on half the weights: the fastest mix that meets the quality bar of
# docs/performance.md (two digits everywhere is "O2;mlp_act_dtype=int16"). O3 uses one int8
# digit everywhere (llama.cpp's choice) and an int8 KV cache (half the bytes for decode's
# attention to read): fastest, and further from O0.
# (weight_dtype=int4 rounds every weight to 4 bits: for files that are not 4-bit already.)
# Every level computes each token the same way whatever its batch company, so greedy output does
# not depend on batching.
_BF16: Final = "bfloat16"
_DENSE_WEIGHTS = ("float32", "float16")  # weight formats held as torch tensors (compile=1 needs them)
OPT_LEVELS: dict[str, OptFlags] = {
    "O0": OptFlags(attention="cpu_paged"),
    "O1": OptFlags(weight_dtype=_BF16, kv_dtype=_BF16, act_dtype=_BF16, attention="cpu_paged"),
    "O2": OptFlags(weight_dtype="native", kv_dtype=_BF16, act_dtype="int16", gate_up_act_dtype="int8",
                   attention="cpu_paged"),
    "O3": OptFlags(weight_dtype="native", kv_dtype="int8", act_dtype="int8", attention="cpu_paged"),
}
DEFAULT_OPT_LEVEL = "O2"  # what ``opt=None`` means
DEFAULT_DRAFT_OPT = "O3"  # a draft model's or heads' level unless the knob draft_opt says otherwise
# Bounds the plan, the checks below and the engine share.
MAX_ADAPTIVE_K = 8  # the longest draft the adaptive length chooses (speculative/adaptive.py)
# Tokens one sequence's tree step may hold with its newest token: the C++ kernel keeps a tree
# token's ancestors as the bits of one 64-bit word.
MAX_TREE_TOKENS = 64
MAX_RUN, RUN_SECONDS = 8, 0.025  # a multi-step run's most tokens, and the time it aims at

_DTYPE_ALIASES = {"float32": "float32", "fp32": "float32", "f32": "float32",
                  "bfloat16": _BF16, "bf16": _BF16,
                  "float16": "float16", "fp16": "float16", "f16": "float16"}
_ACT_ALIASES = {**{k: v for k, v in _DTYPE_ALIASES.items() if v != "float16"}, "int8": "int8", "int16": "int16"}
# knob name -> accepted spellings of its value (matched lower-cased) -> the value in OptFlags
_KNOB_VALUES: dict[str, dict[str, Any]] = {
    "weight_dtype": {**_DTYPE_ALIASES, **{f: f for f in get_args(WeightFormat)}},
    "kv_dtype": {**_DTYPE_ALIASES, "int8": "int8"},
    "act_dtype": _ACT_ALIASES,
    "mlp_act_dtype": _ACT_ALIASES,
    "gate_up_act_dtype": _ACT_ALIASES,
    "attention": {a: a for a in get_args(AttentionKernel)},
    "compile": {"0": False, "1": True, "false": False, "true": True},
    "multi_step": {"0": False, "1": True, "false": False, "true": True},
    "draft_opt": {level.lower(): level for level in OPT_LEVELS},
}


def opt_without_draft_opt(opt: Optional[str]) -> Optional[str]:
    """``opt`` without its ``draft_opt`` knob (the drafter's level, not the model's);
    None when nothing else is left."""
    items = [item.strip() for item in (opt or "").split(";")
             if item.strip() and item.partition("=")[0].strip() != "draft_opt"]
    return ";".join(items) or None


def parse_opt(opt: Optional[str]) -> OptFlags:
    """Resolve an ``opt`` string to flags.

    Accepted forms: ``None`` (the default level, O2), a level ``"O0"``..``"O3"``, knobs
    ``"weight_dtype=bfloat16;compile=1"``, or a level followed by knobs that adjust it
    (``"O2;kv_dtype=bfloat16"``). Knobs not given keep the level's value. Raises ``ValueError``
    naming the offending item and listing what is valid.
    """
    items = [item.strip() for item in (opt or "").split(";") if item.strip()]
    level = DEFAULT_OPT_LEVEL
    if items and "=" not in items[0]:
        level = items.pop(0)
        if level not in OPT_LEVELS:
            raise ValueError(
                f"opt: unknown level {level!r} in {opt!r}; valid levels: {', '.join(OPT_LEVELS)} "
                f"(knobs are written name=value)"
            )
    updates: dict[str, Any] = {}
    for item in items:
        name, sep, value = (part.strip() for part in item.partition("="))
        if not sep:
            raise ValueError(
                f"opt: {item!r} in {opt!r} is not of the form name=value "
                f"(a level such as 'O2' may only come first)"
            )
        if name not in _KNOB_VALUES:
            valid = ", ".join(sorted(_KNOB_VALUES))
            raise ValueError(f"opt: unknown knob {name!r} in {opt!r}; valid knobs: {valid}")
        if name in updates:
            raise ValueError(f"opt: knob {name!r} is given more than once in {opt!r}")
        choices = _KNOB_VALUES[name]
        if value.lower() not in choices:
            valid = ", ".join(choices)
            raise ValueError(f"opt: invalid value {value!r} for knob {name!r}; valid: {valid}")
        updates[name] = choices[value.lower()]
    # A wider activation knob sets the narrower ones it is given without.
    for wide, narrow in (("act_dtype", "mlp_act_dtype"), ("mlp_act_dtype", "gate_up_act_dtype")):
        if wide in updates:
            updates.setdefault(narrow, None)
    compiled_attention = bool(updates.get("compile")) and "attention" not in updates
    if compiled_attention:
        updates["attention"] = "torch_native"  # what compile=1 compiles (O0's is the C++ kernel)
    flags = dataclasses.replace(OPT_LEVELS[level], **updates)
    gate_up, mlp = flags.mlp_act_dtypes()
    if gate_up != mlp and _BF16 in (gate_up, mlp):
        raise ValueError(f"opt: gate_up_act_dtype={gate_up} and the MLP's {mlp} "
                         f"in {opt!r}: one tensor type runs through the MLP, so bfloat16 "
                         f"activations go into all of it or none")
    if flags.kv_dtype == "int8" and flags.attention != "cpu_paged":
        why = " (compile=1 selects it)" if compiled_attention else ""
        raise ValueError(f"opt: kv_dtype=int8 needs attention=cpu_paged (the C++ kernel reads it), "
                         f"but {opt!r} has attention={flags.attention}{why}")
    if flags.compile and (flags.attention != "torch_native" or flags.weight_dtype not in _DENSE_WEIGHTS):
        why = (f"attention={flags.attention} is lmserve's C++ kernel" if flags.attention != "torch_native"
               else f"weight_dtype={flags.weight_dtype} multiplies in lmserve's C++ matmul kernel")
        raise ValueError(
            f"opt: compile=1 compiles the torch path (attention=torch_native with weight_dtype "
            f"float32 or float16, e.g. 'O0;compile=1'), but in {opt!r} {why}, which torch.compile "
            f"cannot see into")
    return flags


@dataclass
class EngineConfig:
    """How the engine is set up: model, batch and memory limits, KV cache and decoding features.

    Optional fields left at None let the engine decide; SPEC.md has the full story per field.
    Bad values are refused when the object is built (``TypeError`` for a wrong type,
    ``ValueError`` otherwise), with the field and the value in the message.

    Fields:
        model: path of a GGUF file or a Hugging Face directory; None = the built-in model (or,
            with model_lib, the library's; given, it must be the model compiled).
        model_lib: directory of a model library written by ``lmserve compile``; it starts
            without preparing anything, and its opt, tensor_parallel_shards and
            pipeline_parallel_stages replace the ones given. None = prepare at load.
        additional_models: extra models, each a path or a (path, model_lib) pair: the draft
            model (small_draft; a pair loads its library) or the EAGLE / Medusa heads.
        mode: "local" (batch 4), "interactive" (batch 1) or "server" (as much as memory
            allows); None = "local". Decides the limits below that are left unset.
        tensor_parallel_shards: processes each layer is split across; None = 1.
        pipeline_parallel_stages: processes the layer stack is split across; None = 1.
        opt: optimisation level "O0".."O3" and/or knobs, see ``parse_opt``; None = "O2".
        gpu_memory_utilization: fraction in (0, 1] of device memory the engine may use;
            None = 0.85.
        kv_cache_page_size: tokens per page of the paged KV cache.
        max_num_sequence: most sequences held in the KV cache at once.
        max_total_sequence_length: most tokens held in the KV cache at once, all sequences.
        max_single_sequence_length: longest one sequence may get, prompt plus output.
        prefill_chunk_size: most tokens in one prefill step.
        sliding_window_size: tokens each position attends to under sliding-window attention.
        attention_sink_size: leading tokens that stay visible under a sliding window.
        max_history_size: past recurrent states kept so a sequence can roll back.
        kv_state_kind: "kv_cache" or "rnn_state"; None = whatever the model needs.
        speculative_mode: "disable", "small_draft", "eagle" or "medusa"; also "ngram" (prompt
            lookup, no extra model; beyond the seed, as vLLM, SGLang and llama.cpp have it).
        spec_draft_length: tokens drafted per step; 0 = chosen each step from the load.
        spec_tree_width: candidates per draft position (tree verification when > 1).
        prefix_cache_mode: "radix" (share the KV of common prefixes) or "disable".
        prefix_cache_max_num_recycling_seqs: finished sequences whose KV is kept for reuse;
            None = max_num_sequence, 0 = none, -1 = no limit.
        prefill_mode: "chunked" (prefill and decode in separate steps) or "hybrid" (decode
            tokens ride along in prefill steps).
        verbose: log the resolved plan at start and statistics while running.
    """

    model: Optional[str] = None
    model_lib: Optional[str] = None
    additional_models: List[Union[str, Tuple[str, str]]] = field(default_factory=list)
    mode: Optional[Literal["local", "interactive", "server"]] = None
    tensor_parallel_shards: Optional[int] = None
    pipeline_parallel_stages: Optional[int] = None
    opt: Optional[str] = None
    gpu_memory_utilization: Optional[float] = None
    kv_cache_page_size: int = 16
    max_num_sequence: Optional[int] = None
    max_total_sequence_length: Optional[int] = None
    max_single_sequence_length: Optional[int] = None
    prefill_chunk_size: Optional[int] = None
    sliding_window_size: Optional[int] = None
    attention_sink_size: Optional[int] = None
    max_history_size: Optional[int] = None
    kv_state_kind: Optional[Literal["kv_cache", "rnn_state"]] = None
    speculative_mode: Literal["disable", "small_draft", "eagle", "medusa", "ngram"] = "disable"
    spec_draft_length: int = 0
    spec_tree_width: int = 1
    prefix_cache_mode: Literal["disable", "radix"] = "radix"
    prefix_cache_max_num_recycling_seqs: Optional[int] = None
    prefill_mode: Literal["chunked", "hybrid"] = "hybrid"
    verbose: bool = True

    def __post_init__(self) -> None:
        # JSON has no tuples: a (path, lib) pair comes back as a 2-element list. Normalise so
        # that from_json(c.asjson()) == c; anything else is left for the type check to refuse.
        if isinstance(self.additional_models, list):
            self.additional_models = [
                tuple(m) if isinstance(m, list) and len(m) == 2 else m
                for m in self.additional_models
            ]
        for name, hint in _field_hints().items():
            _check_type(name, getattr(self, name), hint)
        for name, ok, requirement in _VALUE_RULES:
            value = getattr(self, name)
            if value is not None and not ok(value):
                raise ValueError(f"{name} must be {requirement}, got {value!r}")
        parse_opt(self.opt)
        _check_combinations(self)

    def asjson(self) -> str:
        """The config as a JSON object string; ``from_json`` reads it back to an equal config."""
        return json.dumps(asdict(self))

    @staticmethod
    def from_json(json_str: str) -> "EngineConfig":
        """Build a config from a JSON object string; unknown keys are refused by name."""
        try:
            data = json.loads(json_str)
        except json.JSONDecodeError as e:
            raise ValueError(f"EngineConfig JSON is not valid JSON: {e}") from e
        if not isinstance(data, dict):
            raise ValueError(
                f"EngineConfig JSON must be an object, got {type(data).__name__}: {json_str!r}"
            )
        unknown = sorted(set(data) - set(_field_hints()))
        if unknown:
            raise ValueError(f"EngineConfig JSON has unknown keys: {', '.join(unknown)}")
        return EngineConfig(**data)


@functools.lru_cache(maxsize=None)
def _field_hints() -> dict[str, Any]:
    """Field name -> resolved annotation, in declaration order."""
    hints = get_type_hints(EngineConfig)
    return {f.name: hints[f.name] for f in dataclasses.fields(EngineConfig)}


def _check_type(name: str, value: Any, hint: Any) -> None:
    """TypeError when the value's type does not fit; ValueError for a string outside a Literal."""
    if not _is_instance(value, hint):
        raise TypeError(
            f"{name} must be {_describe(hint)}, got {value!r} ({type(value).__name__})"
        )
    arms = get_args(hint) if get_origin(hint) is Union else (hint,)
    allowed = [v for arm in arms if get_origin(arm) is Literal for v in get_args(arm)]
    if allowed and value is not None and value not in allowed:
        raise ValueError(f"{name} must be {_describe(hint)}, got {value!r}")


def _is_instance(value: Any, hint: Any) -> bool:
    """isinstance for the annotations EngineConfig uses; a Literal only checks the value's type
    here (its membership is a ValueError, checked by the caller). bool never counts as int."""
    origin, args = get_origin(hint), get_args(hint)
    if origin is Union:
        return any(_is_instance(value, a) for a in args)
    if origin is Literal:
        return any(type(value) is type(a) for a in args)
    if origin is list:
        return isinstance(value, list) and all(_is_instance(v, args[0]) for v in value)
    if origin is tuple:
        return (
            isinstance(value, tuple)
            and len(value) == len(args)
            and all(_is_instance(v, a) for v, a in zip(value, args))
        )
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, hint)


def _describe(hint: Any) -> str:
    """A readable spelling of an annotation for error messages."""
    origin, args = get_origin(hint), get_args(hint)
    if origin is Union:
        return " or ".join(_describe(a) for a in args)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin is list:
        return f"a list of ({_describe(args[0])})"
    if origin is tuple:
        return "a pair (" + ", ".join(_describe(a) for a in args) + ")"
    if hint is type(None):
        return "None"
    return hint.__name__


def _is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


# (field, predicate on a non-None value, what the message says it must be). Types are already
# checked when these run.
_VALUE_RULES: tuple[tuple[str, Callable[[Any], bool], str], ...] = (
    *(
        (name, lambda v: v >= 1, "a positive integer")
        for name in (
            "tensor_parallel_shards",
            "pipeline_parallel_stages",
            "max_num_sequence",
            "max_total_sequence_length",
            "max_single_sequence_length",
            "prefill_chunk_size",
            "sliding_window_size",
            "max_history_size",
        )
    ),
    # Page-granular kernels index within a page with bit masks / power-of-two block shapes.
    ("kv_cache_page_size", _is_power_of_two, "a positive power of two"),
    ("model", lambda v: v != "", "a non-empty path"),
    ("model_lib", lambda v: v != "", "a non-empty path"),
    (
        "additional_models",
        lambda v: all(path for m in v for path in ((m,) if isinstance(m, str) else m)),
        "a list of non-empty paths",
    ),
    ("gpu_memory_utilization", lambda v: 0 < v <= 1, "in (0, 1]"),
    ("attention_sink_size", lambda v: v >= 0, ">= 0"),
    ("spec_draft_length", lambda v: v >= 0, ">= 0 (0 = adaptive)"),
    ("spec_tree_width", lambda v: v >= 1, ">= 1"),
    ("prefix_cache_max_num_recycling_seqs", lambda v: v >= -1, ">= -1 (-1 = unbounded)"),
)


def _check_combinations(c: EngineConfig) -> None:
    """Refuse settings that contradict each other (each one valid on its own)."""
    if c.attention_sink_size is not None:
        if c.sliding_window_size is None:
            raise ValueError(
                f"attention_sink_size={c.attention_sink_size} needs sliding_window_size to be set"
            )
        if c.attention_sink_size >= c.sliding_window_size:
            # The sinks sit inside what a query may see: a window no larger than them is all sinks.
            raise ValueError(
                f"attention_sink_size={c.attention_sink_size} must be smaller than "
                f"sliding_window_size={c.sliding_window_size}"
            )
    if c.max_history_size is not None and c.kv_state_kind == "kv_cache":
        raise ValueError(
            f"max_history_size={c.max_history_size} only applies to kv_state_kind='rnn_state', "
            f"got kv_state_kind='kv_cache'"
        )
    pairs = [m for m in c.additional_models if isinstance(m, tuple)]
    if pairs and c.speculative_mode != "small_draft":
        raise ValueError(f"additional_models={c.additional_models!r}: a (path, model_lib) pair is a "
                         f"draft model compiled by lmserve compile, for speculative_mode='small_draft'; "
                         f"{c.speculative_mode!r} takes paths")
    if c.additional_models and c.speculative_mode in ("disable", "ngram"):
        raise ValueError(
            f"additional_models={c.additional_models!r} are draft models or heads, but "
            f"speculative_mode={c.speculative_mode!r} uses none (small_draft, eagle or medusa do)")
    if c.speculative_mode == "small_draft" and len(c.additional_models) > 1:
        raise ValueError(f"speculative_mode='small_draft' uses one draft model, but "
                         f"additional_models has {len(c.additional_models)}: {c.additional_models!r}")
    if (c.tensor_parallel_shards or 1) > 1 and parse_opt(c.opt).compile:
        raise ValueError(f"opt={c.opt!r} compiles the layers with torch.compile, which does not "
                         f"see tensor parallelism's all-reduce; with tensor_parallel_shards="
                         f"{c.tensor_parallel_shards} leave compile off")
    if parse_opt(c.opt).draft_opt is not None and c.speculative_mode in ("disable", "ngram"):
        raise ValueError(f"opt={c.opt!r} sets draft_opt, the level of a draft model or heads, but "
                         f"speculative_mode={c.speculative_mode!r} has neither")
    if c.speculative_mode not in ("disable", "ngram") and not c.additional_models:
        raise ValueError(
            f"speculative_mode={c.speculative_mode!r} needs its draft model or heads in "
            f"additional_models, got additional_models=[]"
        )
    if c.speculative_mode != "disable":
        k = c.spec_draft_length or MAX_ADAPTIVE_K
        if c.spec_tree_width > 1 and k * c.spec_tree_width >= MAX_TREE_TOKENS:
            length = (f"spec_draft_length={c.spec_draft_length}" if c.spec_draft_length else
                      f"spec_draft_length=0 (adaptive, up to {MAX_ADAPTIVE_K})")
            raise ValueError(
                f"{length} times spec_tree_width={c.spec_tree_width} is {k * c.spec_tree_width} "
                f"draft tokens per sequence and step; at most {MAX_TREE_TOKENS - 1} are verified "
                f"at once")
    if c.speculative_mode == "disable":
        for name, default in (("spec_draft_length", 0), ("spec_tree_width", 1)):
            if getattr(c, name) != default:
                raise ValueError(f"{name}={getattr(c, name)} needs speculative decoding, but "
                                 f"speculative_mode='disable'")
    if c.max_total_sequence_length is not None:
        for name in ("max_single_sequence_length", "prefill_chunk_size"):
            value = getattr(c, name)
            if name == "max_single_sequence_length" and c.sliding_window_size:
                continue  # a windowed sequence holds only its window's pages: the plan checks it
            if value is not None and value > c.max_total_sequence_length:
                raise ValueError(
                    f"{name}={value} exceeds max_total_sequence_length="
                    f"{c.max_total_sequence_length} (the KV cache could never hold it)"
                )
