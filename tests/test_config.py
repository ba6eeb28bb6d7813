"""EngineConfig: seed interface, JSON round trip, validation; opt parsing; unsupported features."""

import dataclasses
import typing
from typing import List, Literal, Optional, Tuple, Union  # noqa: UP035

import pytest

from lmserve.config import OPT_LEVELS, EngineConfig, OptFlags, parse_opt

# The seed's interface, in its order: (name, annotation, default).
SEED_FIELDS = [
    ("model", Optional[str], None),
    ("model_lib", Optional[str], None),
    ("additional_models", List[Union[str, Tuple[str, str]]], []),
    ("mode", Optional[Literal["local", "interactive", "server"]], None),
    ("tensor_parallel_shards", Optional[int], None),
    ("pipeline_parallel_stages", Optional[int], None),
    ("opt", Optional[str], None),
    ("gpu_memory_utilization", Optional[float], None),
    ("kv_cache_page_size", int, 16),
    ("max_num_sequence", Optional[int], None),
    ("max_total_sequence_length", Optional[int], None),
    ("max_single_sequence_length", Optional[int], None),
    ("prefill_chunk_size", Optional[int], None),
    ("sliding_window_size", Optional[int], None),
    ("attention_sink_size", Optional[int], None),
    ("max_history_size", Optional[int], None),
    ("kv_state_kind", Optional[Literal["kv_cache", "rnn_state"]], None),
    # The seed's four modes plus "ngram" (prompt lookup), an extension the peers all have.
    ("speculative_mode", Literal["disable", "small_draft", "eagle", "medusa", "ngram"], "disable"),
    ("spec_draft_length", int, 0),
    ("spec_tree_width", int, 1),
    ("prefix_cache_mode", Literal["disable", "radix"], "radix"),
    ("prefix_cache_max_num_recycling_seqs", Optional[int], None),
    ("prefill_mode", Literal["chunked", "hybrid"], "hybrid"),
    ("verbose", bool, True),
]

def _actual_fields():
    hints = typing.get_type_hints(EngineConfig)
    default = EngineConfig()
    return [(f.name, hints[f.name], getattr(default, f.name)) for f in dataclasses.fields(default)]


def test_fields_types_and_defaults_match_the_seed():
    assert _actual_fields() == SEED_FIELDS


def test_default_config_round_trips():
    config = EngineConfig()
    assert EngineConfig.from_json(config.asjson()) == config


def test_round_trip_keeps_every_field_and_model_pairs_as_tuples():
    config = EngineConfig(
        model="m.gguf",
        additional_models=[("draft.gguf", "draft-lib")],
        mode="interactive",
        opt="O0;compile=1",
        gpu_memory_utilization=0.5,
        kv_cache_page_size=32,
        max_num_sequence=3,
        max_total_sequence_length=4096,
        max_single_sequence_length=1024,
        prefill_chunk_size=512,
        sliding_window_size=256,
        attention_sink_size=4,
        kv_state_kind="rnn_state",
        max_history_size=2,
        speculative_mode="small_draft",
        spec_draft_length=5,
        spec_tree_width=2,
        prefix_cache_mode="disable",
        prefix_cache_max_num_recycling_seqs=-1,
        prefill_mode="chunked",
        verbose=False,
    )
    again = EngineConfig.from_json(config.asjson())
    assert again == config
    assert again.additional_models == [("draft.gguf", "draft-lib")]


def test_list_pairs_are_normalised_to_tuples_without_touching_the_callers_list():
    models = [["b", "b-lib"]]
    config = EngineConfig(speculative_mode="small_draft", additional_models=models)
    assert config.additional_models == [("b", "b-lib")]
    assert models == [["b", "b-lib"]]


def test_int_is_accepted_for_a_float_field():
    assert EngineConfig(gpu_memory_utilization=1).gpu_memory_utilization == 1


# (keyword arguments, error type, the value as it must appear in the message). The field name
# (first keyword) must appear too.
BAD_VALUES = [
    ({"model": 3}, TypeError, "3"),
    ({"model": ""}, ValueError, "''"),
    ({"model_lib": ""}, ValueError, "''"),
    ({"additional_models": "draft"}, TypeError, "'draft'"),
    ({"additional_models": [3]}, TypeError, "[3]"),
    ({"additional_models": [["a"]]}, TypeError, "[['a']]"),
    ({"additional_models": [["a", "b", "c"]]}, TypeError, "[['a', 'b', 'c']]"),
    ({"additional_models": [("a", 1)]}, TypeError, "[('a', 1)]"),
    ({"additional_models": [""]}, ValueError, "['']"),
    ({"additional_models": [("a", "")]}, ValueError, "[('a', '')]"),
    ({"mode": "fast"}, ValueError, "'fast'"),
    ({"mode": 1}, TypeError, "1"),
    ({"tensor_parallel_shards": 0}, ValueError, "0"),
    ({"tensor_parallel_shards": True}, TypeError, "True"),
    ({"pipeline_parallel_stages": -1}, ValueError, "-1"),
    ({"opt": 2}, TypeError, "2"),
    ({"opt": "O9"}, ValueError, "'O9'"),
    ({"gpu_memory_utilization": 0}, ValueError, "0"),
    ({"gpu_memory_utilization": 1.5}, ValueError, "1.5"),
    ({"gpu_memory_utilization": float("nan")}, ValueError, "nan"),
    ({"gpu_memory_utilization": "0.5"}, TypeError, "'0.5'"),
    ({"gpu_memory_utilization": False}, TypeError, "False"),
    ({"kv_cache_page_size": 0}, ValueError, "0"),
    ({"kv_cache_page_size": 24}, ValueError, "24"),
    ({"kv_cache_page_size": 16.0}, TypeError, "16.0"),
    ({"kv_cache_page_size": None}, TypeError, "None"),
    ({"max_num_sequence": 0}, ValueError, "0"),
    ({"max_total_sequence_length": -5}, ValueError, "-5"),
    ({"max_single_sequence_length": 0}, ValueError, "0"),
    ({"prefill_chunk_size": 0}, ValueError, "0"),
    ({"prefill_chunk_size": "128"}, TypeError, "'128'"),
    ({"sliding_window_size": 0}, ValueError, "0"),
    ({"attention_sink_size": -1, "sliding_window_size": 8}, ValueError, "-1"),
    ({"attention_sink_size": 4}, ValueError, "4"),
    ({"attention_sink_size": 8, "sliding_window_size": 8}, ValueError,
     "attention_sink_size=8 must be smaller than sliding_window_size=8"),
    ({"max_history_size": 0}, ValueError, "0"),
    ({"max_history_size": 2, "kv_state_kind": "kv_cache"}, ValueError, "2"),
    ({"kv_state_kind": "paged"}, ValueError, "'paged'"),
    ({"speculative_mode": "lookahead"}, ValueError, "'lookahead'"),
    ({"speculative_mode": "small_draft", "additional_models": ["a", "b"]}, ValueError, "['a', 'b']"),
    ({"additional_models": ["d"]}, ValueError, "['d']"),  # speculation off: nothing uses it
    ({"opt": "O2;draft_opt=O3"}, ValueError, "'O2;draft_opt=O3'"),  # no draft model
    ({"speculative_mode": None}, TypeError, "None"),
    ({"speculative_mode": "small_draft"}, ValueError, "'small_draft'"),
    ({"spec_draft_length": -1}, ValueError, "-1"),
    ({"spec_tree_width": 0}, ValueError, "0"),
    ({"spec_draft_length": 4}, ValueError, "4"),  # speculation is off: it would do nothing
    ({"spec_tree_width": 2}, ValueError, "2"),
    # a tree too large to verify: 16 deep, 4 wide; adaptive (up to 8 deep), 8 wide
    ({"spec_tree_width": 4, "speculative_mode": "ngram", "spec_draft_length": 16}, ValueError,
     "spec_draft_length=16 times spec_tree_width=4 is 64"),
    ({"spec_tree_width": 8, "speculative_mode": "ngram"}, ValueError,
     "spec_draft_length=0 (adaptive, up to 8) times spec_tree_width=8 is 64"),
    ({"prefix_cache_mode": "lru"}, ValueError, "'lru'"),
    ({"prefix_cache_max_num_recycling_seqs": -2}, ValueError, "-2"),
    ({"prefill_mode": "split"}, ValueError, "'split'"),
    ({"verbose": 1}, TypeError, "1"),
    ({"max_single_sequence_length": 300, "max_total_sequence_length": 200}, ValueError, "300"),
    ({"prefill_chunk_size": 300, "max_total_sequence_length": 200}, ValueError, "300"),
]


@pytest.mark.parametrize(
    "kwargs, error, shown", BAD_VALUES, ids=[f"{next(iter(k))}={v}" for k, _, v in BAD_VALUES]
)
def test_bad_values_are_refused_naming_field_and_value(kwargs, error, shown):
    with pytest.raises(error) as info:
        EngineConfig(**kwargs)
    assert type(info.value) is error  # a TypeError must not pass for a ValueError, nor back
    message = str(info.value)
    assert next(iter(kwargs)) in message
    assert shown in message


def test_from_json_names_unknown_keys():
    with pytest.raises(ValueError, match="unknown keys: batch_size, max_batch"):
        EngineConfig.from_json('{"mode": "local", "max_batch": 4, "batch_size": 2}')


@pytest.mark.parametrize("text", ["[1, 2]", '"local"', "null", "3"])
def test_from_json_refuses_non_objects(text):
    with pytest.raises(ValueError, match="must be an object"):
        EngineConfig.from_json(text)


def test_from_json_refuses_malformed_json():
    with pytest.raises(ValueError, match="not valid JSON"):
        EngineConfig.from_json("{mode: local}")


def test_from_json_validates_values():
    with pytest.raises(ValueError, match="kv_cache_page_size"):
        EngineConfig.from_json('{"kv_cache_page_size": 0}')


# ---- opt ----


def test_knob_table_covers_every_flag():
    from lmserve.config import _KNOB_VALUES

    assert set(_KNOB_VALUES) == {f.name for f in dataclasses.fields(OptFlags)}


def test_default_opt_is_level_o2():
    assert parse_opt(None) == parse_opt("") == parse_opt("O2") == OPT_LEVELS["O2"]


def _flags(weights, kv, attention="cpu_paged", compile=False, act=None, mlp=None, gate_up=None,
           multi_step=True):
    act = act or {"native": "int16", "float32": "float32"}.get(weights, "bfloat16")
    return OptFlags(weight_dtype=weights, kv_dtype=kv, act_dtype=act, mlp_act_dtype=mlp,
                    gate_up_act_dtype=gate_up, attention=attention, compile=compile,
                    multi_step=multi_step)


_O2 = {"gate_up": "int8"}  # O2's one digit into gate/up


@pytest.mark.parametrize(
    "level, expected",
    [
        ("O0", _flags("float32", "float32")),
        ("O1", _flags("bfloat16", "bfloat16")),
        ("O2", _flags("native", "bfloat16", **_O2)),
        ("O3", _flags("native", "int8", act="int8")),
    ],
)
def test_levels(level, expected):
    assert parse_opt(level) == expected


@pytest.mark.parametrize(
    "opt, expected",
    [
        # Knobs without a level adjust the default level, O2.
        ("weight_dtype=bfloat16;compile=0", _flags("bfloat16", "bfloat16", act="int16", **_O2)),
        ("kv_dtype=float16", _flags("native", "float16", **_O2)),
        ("O0;compile=1", _flags("float32", "float32", "torch_native", compile=True)),
        ("O0;compile=true", _flags("float32", "float32", "torch_native", compile=True)),
        ("O0;weight_dtype=f16;compile=1", _flags("float16", "float32", "torch_native", compile=True, act="float32")),
        ("O2;kv_dtype=float32", _flags("native", "float32", **_O2)),
        # A wider activation knob sets the narrower ones it comes without.
        ("O2;mlp_act_dtype=fp32", _flags("native", "bfloat16", mlp="float32")),
        ("O2;mlp_act_dtype=int16", _flags("native", "bfloat16", mlp="int16")),  # O2 before
        ("O2;act_dtype=int8", _flags("native", "bfloat16", act="int8")),
        ("O2;act_dtype=int8;gate_up_act_dtype=int16", _flags("native", "bfloat16", act="int8", gate_up="int16")),
        ("O3;gate_up_act_dtype=fp32", _flags("native", "int8", act="int8", gate_up="float32")),
        (" O0 ; weight_dtype = float16 ; ", _flags("float16", "float32", act="float32")),
        ("O0;attention=torch_native", _flags("float32", "float32", "torch_native")),
        # the spelling: short dtype names
        ("weight_dtype=int4;kv_dtype=bf16", _flags("int4", "bfloat16", act="int16", **_O2)),
        ("O0;attention=cpu_paged;weight_dtype=int8", _flags("int8", "float32", act="float32")),
        ("O2;act_dtype=bf16", _flags("native", "bfloat16", act="bfloat16")),
        ("O3;mlp_act_dtype=int16", _flags("native", "int8", act="int8", mlp="int16")),
        ("O3;kv_dtype=bf16", _flags("native", "bfloat16", act="int8")),
        ("O2;multi_step=0", _flags("native", "bfloat16", multi_step=False, **_O2)),
    ],
)
def test_knobs_adjust_the_level(opt, expected):
    assert parse_opt(opt) == expected


@pytest.mark.parametrize(
    "opt, pieces",
    [
        ("O7", ["'O7'", "O0, O1, O2, O3"]),
        ("fast=1", ["'fast'", "act_dtype, attention, compile, draft_opt, gate_up_act_dtype, kv_dtype, "
                              "mlp_act_dtype, multi_step, weight_dtype"]),
        # one tensor type through the MLP
        ("O2;gate_up_act_dtype=bf16", ["gate_up_act_dtype=bfloat16", "the MLP's int16", "all of it or none"]),
        ("O1;gate_up_act_dtype=int8", ["gate_up_act_dtype=int8", "the MLP's bfloat16"]),
        ("act_dtype=float16", ["'float16'", "'act_dtype'"]),
        ("compile=yes", ["'yes'", "'compile'", "0, 1, false, true"]),
        ("weight_dtype=int3", ["'int3'", "'weight_dtype'", "bfloat16", "int8, int4, native"]),
        ("kv_dtype=int4", ["'int4'", "'kv_dtype'", "float32"]),
        ("attention=flash", ["'flash'", "torch_native, cpu_paged"]),
        ("compile=1;O2", ["'O2'", "name=value"]),
        ("compile=1;compile=0", ["'compile'", "more than once"]),
        ("O0;attention=torch_native;kv_dtype=int8", ["kv_dtype=int8", "attention=cpu_paged", "attention=torch_native"]),
        ("O0;kv_dtype=int8;compile=1", ["kv_dtype=int8", "attention=torch_native (compile=1 selects it)"]),
        # compile=1 compiles torch ops; the C++ paths have none in their layers
        ("compile=1", ["compile=1", "weight_dtype=native multiplies in lmserve's C++ matmul"]),
        ("weight_dtype=int4;kv_dtype=bf16;compile=1", ["compile=1", "weight_dtype=int4"]),
        ("O1;attention=cpu_paged;compile=1", ["compile=1", "attention=cpu_paged is lmserve's C++ kernel"]),
        ("O0;weight_dtype=bf16;compile=1", ["weight_dtype=bfloat16 multiplies in lmserve's C++ matmul",
                                            "float32 or float16"]),
        ("O0;attention=cpu_paged;compile=1", ["compile=1", "attention=cpu_paged", "'O0;compile=1'"]),
    ],
)
def test_bad_opt_is_refused_with_the_valid_choices(opt, pieces):
    with pytest.raises(ValueError) as info:
        parse_opt(opt)
    for piece in pieces:
        assert piece in str(info.value)


def test_config_refuses_bad_opt_at_construction():
    with pytest.raises(ValueError, match="unknown knob 'cudagraph'"):
        EngineConfig(opt="cudagraph=1")


def test_a_model_library_pair_is_only_a_draft_model():
    with pytest.raises(ValueError, match=r"a \(path, model_lib\) pair is a draft model .* 'eagle' takes paths"):
        EngineConfig(speculative_mode="eagle", additional_models=[("head", "lib")])
    EngineConfig(speculative_mode="small_draft", additional_models=[("draft.gguf", "lib")])
