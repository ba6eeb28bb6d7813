"""make_plan: mode presets, explicit overrides, page count, refusals; the start-up table."""

import pytest

from lmserve.config import EngineConfig
from lmserve.models.args import ModelArgs
from lmserve.plan import EnginePlan, make_plan


def _args(context_length: int = 2048) -> ModelArgs:
    return ModelArgs(
        architecture="llama",
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        context_length=context_length,
    )


@pytest.mark.parametrize("mode, batch", [(None, 4), ("local", 4), ("interactive", 1)])
def test_mode_presets_use_the_context_window(mode, batch):
    plan = make_plan(EngineConfig(mode=mode), _args(2048))
    assert plan == EnginePlan(
        mode=mode or "local",
        max_num_sequence=batch,
        max_total_sequence_length=2048,
        max_single_sequence_length=2048,
        prefill_chunk_size=2048,
        page_size=16,
        num_pages=128,
    )


def test_explicit_values_win_over_the_preset():
    config = EngineConfig(
        mode="interactive",
        max_num_sequence=8,
        max_total_sequence_length=10_000,
        max_single_sequence_length=1000,
        prefill_chunk_size=256,
        kv_cache_page_size=64,
    )
    plan = make_plan(config, _args(2048))
    assert (plan.mode, plan.max_num_sequence) == ("interactive", 8)
    assert plan.max_total_sequence_length == 10_000
    assert plan.max_single_sequence_length == 1000
    assert plan.prefill_chunk_size == 256
    assert (plan.page_size, plan.num_pages) == (64, 157)  # ceil(10000 / 64)


def test_a_small_kv_budget_caps_the_inferred_sequence_and_chunk():
    plan = make_plan(EngineConfig(max_total_sequence_length=1000), _args(2048))
    assert plan.max_single_sequence_length == plan.prefill_chunk_size == 1000
    assert plan.num_pages == 63  # ceil(1000 / 16)


def test_a_large_kv_budget_keeps_single_sequences_to_the_context_window():
    plan = make_plan(EngineConfig(max_total_sequence_length=8192), _args(2048))
    assert plan.max_single_sequence_length == plan.prefill_chunk_size == 2048
    assert plan.num_pages == 512


def test_single_sequence_longer_than_the_context_window_is_refused():
    with pytest.raises(ValueError, match="max_single_sequence_length=4096 .* 2048"):
        make_plan(EngineConfig(max_single_sequence_length=4096), _args(2048))


def test_a_prefill_chunk_over_the_inferred_kv_capacity_is_refused():
    with pytest.raises(ValueError, match="prefill_chunk_size=1024 .*total_sequence_length=512"):
        make_plan(EngineConfig(prefill_chunk_size=1024), _args(512))


def test_a_prefill_chunk_may_exceed_the_context_window_within_the_kv_capacity():
    config = EngineConfig(prefill_chunk_size=1024, max_total_sequence_length=4096)
    assert make_plan(config, _args(512)).prefill_chunk_size == 1024


def test_server_mode_is_not_planned_yet():
    with pytest.raises(NotImplementedError, match="server"):
        make_plan(EngineConfig(mode="server"), _args())


def test_describe_is_an_aligned_table():
    lines = make_plan(EngineConfig(), _args(2048)).describe().splitlines()
    assert lines[0].split() == ["mode", "local"]
    assert ["num_pages", "128"] in [line.split() for line in lines]
    assert len(lines) == 7
    assert len({line.index(line.split()[1]) for line in lines}) == 1  # values in one column
