"""make_plan: mode presets, explicit overrides, page count, refusals; the start-up table."""

import dataclasses
import re

import pytest

from lmserve.config import EngineConfig, parse_opt
from lmserve.models.args import ModelArgs
from lmserve.plan import (
    RUNTIME_MARGIN_BYTES,
    SERVER_BATCH,
    SERVER_CHUNK,
    _multi_step,
    make_plan,
    weight_bytes,
    workspace_bytes,
)
from lmserve.util import cdiv

GiB = 1 << 30


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
    plan = make_plan(EngineConfig(mode=mode), _args(2048), device_memory=16 * GiB)
    assert (plan.mode, plan.max_num_sequence) == (mode or "local", batch)
    assert plan.max_total_sequence_length == plan.max_single_sequence_length == 2048
    assert (plan.prefill_chunk_size, plan.page_size, plan.num_pages) == (2048, 16, 128)
    assert (plan.weight_dtype, plan.kv_dtype, plan.attention) == ("native", "bfloat16", "cpu_paged")  # O2


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


def test_weight_and_kv_bytes_follow_the_model_and_opt():
    args = _args()
    # Per layer: q,k,v,o = 64*(4+2+2)*16 + 64*64 = 12288, mlp 3*64*128 = 24576; embed + head.
    matrices = 2 * (12288 + 24576) + 2 * 256 * 64
    assert weight_bytes(args, "float16") == matrices * 2 + 5 * 64 * 4
    # int4 blocks: 16 bytes of codes + float32 scale and zero per 32 weights; the embedding
    # table stays dense bfloat16 for the lookup, the head is blocks.
    layers = 2 * (12288 + 24576)
    assert weight_bytes(args, "int4") == layers * 0.75 + 256 * 64 * (2 + 0.75) + 5 * 64 * 4
    f32 = make_plan(EngineConfig(opt="O0"), args, device_memory=16 * GiB).memory
    bf16 = make_plan(EngineConfig(opt="O1"), args, device_memory=16 * GiB).memory
    assert f32.kv_per_token == 2 * 2 * 2 * 16 * 4 == 2 * bf16.kv_per_token
    int8 = make_plan(EngineConfig(opt="O3"), args, device_memory=16 * GiB).memory
    assert int8.kv_per_token == 2 * 2 * (2 * 16 + 12)  # codes, scales, the keys' code sums
    assert f32.weights == weight_bytes(args, "float32") and bf16.weights == weight_bytes(args, "bfloat16")
    assert weight_bytes(args, "bfloat16") == layers * 2.25 + 256 * 64 * (2 + 2.25) + 5 * 64 * 4


def test_int8_kv_falls_back_to_bfloat16_where_the_kernel_cannot_serve(monkeypatch):
    from lmserve.attention import cpu_paged

    monkeypatch.setattr(cpu_paged, "why_unsupported", lambda shape, dtype: "no AVX-512 (simulated)")
    plan = make_plan(EngineConfig(opt="O3"), _args(), device_memory=16 * GiB)
    assert plan.kv_dtype == "bfloat16" and plan.memory.kv_per_token == 2 * 2 * 2 * 16 * 2


def test_int8_kv_falls_back_to_bfloat16_on_pages_of_fewer_than_4_tokens(monkeypatch):
    from lmserve.attention import cpu_paged

    monkeypatch.setattr(cpu_paged, "why_unsupported", lambda shape, dtype: None)  # the kernel serves
    kv_dtype = {page: make_plan(EngineConfig(opt="O3", kv_cache_page_size=page), _args(),
                                device_memory=16 * GiB).kv_dtype for page in (2, 4)}
    assert kv_dtype == {2: "bfloat16", 4: "int8"}  # values go 4 tokens to a word


def test_server_mode_fills_the_budget_with_kv():
    args = _args(2048)
    kv_per_token = 2 * 2 * 2 * 16 * 2
    fixed = (weight_bytes(args, "native", "float32") + RUNTIME_MARGIN_BYTES
             + workspace_bytes(args, SERVER_BATCH, SERVER_CHUNK, 2048, kv_per_token, gathers_kv=False))
    device = 2 * (fixed + 100_008 * kv_per_token)  # KV for 100_008 tokens at utilization 0.5
    plan = make_plan(EngineConfig(mode="server", gpu_memory_utilization=0.5), args,
                     device_memory=device)
    m = plan.memory
    assert plan.max_num_sequence == SERVER_BATCH and plan.prefill_chunk_size == SERVER_CHUNK
    assert m.budget == device // 2 and m.margin == RUNTIME_MARGIN_BYTES
    assert plan.max_total_sequence_length == 100_000  # whole 16-token pages only
    assert m.workspace == workspace_bytes(args, SERVER_BATCH, SERVER_CHUNK, 2048, m.kv_per_token, False)
    # the torch attention path also budgets its padded KV gather
    o0 = make_plan(EngineConfig(mode="server", opt="O0;attention=torch_native"), args,
                   device_memory=device).memory
    assert o0.workspace == workspace_bytes(args, SERVER_BATCH, SERVER_CHUNK, 2048, o0.kv_per_token, True)
    assert o0.workspace - workspace_bytes(args, SERVER_BATCH, SERVER_CHUNK, 2048, o0.kv_per_token, False) \
        == 3 * SERVER_BATCH * 2048 * o0.kv_per_token // 2
    room = m.budget - m.weights - m.workspace - m.margin
    assert room // m.kv_per_token == 100_008
    assert m.total <= m.budget < m.total + 16 * m.kv_per_token  # within one page of the budget


def test_server_kv_is_capped_at_every_sequence_full():
    plan = make_plan(EngineConfig(mode="server", max_num_sequence=2), _args(512),
                     device_memory=64 * GiB)
    assert plan.max_total_sequence_length == 2 * 512


def test_explicit_values_win_in_server_mode_too():
    config = EngineConfig(mode="server", max_num_sequence=16, max_total_sequence_length=4096,
                          prefill_chunk_size=256)
    plan = make_plan(config, _args(2048), device_memory=8 * GiB)
    assert (plan.max_num_sequence, plan.max_total_sequence_length, plan.prefill_chunk_size) == (
        16, 4096, 256)


def test_weights_over_the_budget_are_refused_with_the_numbers():
    with pytest.raises(ValueError, match=r"need .* GiB, over the memory budget of 0.10 GiB"):
        make_plan(EngineConfig(mode="server", gpu_memory_utilization=0.1), _args(),
                  device_memory=1 * GiB)


def test_a_plan_over_the_budget_is_refused():
    config = EngineConfig(max_total_sequence_length=100_000_000, max_single_sequence_length=2048)
    with pytest.raises(ValueError, match=r"KV cache .* for 100000000 tokens\), over the memory budget"):
        make_plan(config, _args(2048), device_memory=4 * GiB)


def test_server_kv_too_small_for_one_sequence_is_refused():
    # Leaves room for a few hundred tokens only: less than one 2048-token sequence.
    args = _args(2048)
    fixed = (weight_bytes(args, "native", "float32") + RUNTIME_MARGIN_BYTES
             + workspace_bytes(args, 1, SERVER_CHUNK, 2048, 2 * 2 * 2 * 16 * 2, gathers_kv=False))
    device = int((fixed + 300 * 256) / 0.85) + 1
    with pytest.raises(ValueError, match="fewer than one sequence of max_single_sequence_length=2048"):
        make_plan(EngineConfig(mode="server", max_num_sequence=1), args, device_memory=device)


def test_describe_is_an_aligned_table():
    lines = make_plan(EngineConfig(), _args(2048), device_memory=16 * GiB).describe().splitlines()
    assert lines[0].split() == ["mode", "local"]
    assert ["num_pages", "128"] in [line.split() for line in lines]
    assert any(line.startswith("expected_memory") and "GiB budget" in line for line in lines)
    assert len({line.index(line.split()[1]) for line in lines}) == 1  # values in one column


def test_plan_command_prints_the_plan_without_loading_weights(capsys, monkeypatch):
    from lmserve import cli
    from lmserve.models import loader

    def no_weights(*_):
        raise AssertionError("lmserve plan must not load the weights")

    monkeypatch.setattr(loader, "load_weights", no_weights)
    assert cli.main(["plan", "--mode", "interactive", "--opt", "O0"]) == 0
    out = capsys.readouterr().out
    rows = dict(line.split(None, 1) for line in out.splitlines())
    assert rows["mode"] == "interactive" and rows["max_num_sequence"] == "1"
    assert rows["weight_dtype"] == "float32" and rows["kv_bytes_per_token"] == "46,080"
    assert "budget" in rows["expected_memory"]


def test_plan_command_reports_an_impossible_plan(capsys):
    from lmserve import cli

    assert cli.main(["plan", "--mode", "server", "--gpu-memory-utilization", "0.01"]) == 1
    assert "over the memory budget" in capsys.readouterr().err


def test_a_draft_model_shares_the_budget_and_its_context_bounds_the_sequence():
    target, draft = _args(2048), dataclasses.replace(_args(1024), num_layers=1)
    config = EngineConfig(mode="server", speculative_mode="small_draft", additional_models=["d"],
                          opt="O0;draft_opt=O3", max_single_sequence_length=1024)
    alone = make_plan(EngineConfig(mode="server", opt="O0", max_single_sequence_length=1024),
                      target, device_memory=int(0.95 * GiB))  # KV-bound: fewer pages than the cap
    plan = make_plan(config, target, device_memory=int(0.95 * GiB), draft_args=draft)
    m = plan.memory
    draft_weights = weight_bytes(draft, "native", "int8")
    assert m.weights == alone.memory.weights + draft_weights
    # The draft's KV over the same pages: one layer of int8 keys and values per token.
    assert m.kv_per_token > alone.memory.kv_per_token
    assert m.draft == draft_weights + plan.num_pages * 16 * (m.kv_per_token - alone.memory.kv_per_token)
    assert plan.num_pages < alone.num_pages  # the KV fills the budget; the draft takes a share
    assert plan.draft_kv_dtype == "int8" and alone.draft_kv_dtype is None
    assert "small_draft" in plan.speculative and "draft_model" in plan.describe()
    with pytest.raises(ValueError, match="context window of the model or its draft model of 1024"):
        make_plan(dataclasses.replace(config, max_single_sequence_length=2048), target,
                  device_memory=4 * GiB, draft_args=draft)


def test_a_draft_tree_is_shown_and_its_rows_counted_in_the_workspace():
    """A tree verifies depth x width draft tokens per sequence: the logit rows of the workspace
    count them all (a chain of the same depth asks fewer), where they are more than the rows
    held for scoring prompts."""
    args = _args(2048)
    chain = EngineConfig(mode="interactive", speculative_mode="ngram", spec_draft_length=4,
                         max_num_sequence=32)
    tree = dataclasses.replace(chain, spec_tree_width=3)
    plans = [make_plan(c, args, device_memory=4 * GiB) for c in (chain, tree)]
    assert plans[1].speculative == ("ngram, a tree of 3 candidates per depth, 4 deep per "
                                    "sequence and step")
    assert plans[0].memory.workspace < plans[1].memory.workspace


def test_a_window_on_every_layer_bounds_each_sequence_by_pages():
    windowed = dataclasses.replace(_args(2048), sliding_window=64)
    plan = make_plan(EngineConfig(prefill_chunk_size=32), windowed, device_memory=16 * GiB)
    assert plan.bounded and plan.max_single_sequence_length == 2048
    # The window's 63 older keys and a 32-token chunk, one page more for alignment; no sinks.
    assert plan.max_pages_per_sequence == cdiv(63 + 32, 16) + 1 == 7
    assert re.search(r"sliding_window +64 tokens on every layer\n", plan.describe())
    # Server mode sizes the KV for every sequence's page cap, not its length.
    server = make_plan(EngineConfig(mode="server", max_num_sequence=8, prefill_chunk_size=32),
                       windowed, device_memory=16 * GiB)
    assert server.max_total_sequence_length == 8 * 7 * 16
    dense = make_plan(EngineConfig(mode="server", max_num_sequence=8, prefill_chunk_size=32),
                      _args(2048), device_memory=16 * GiB)
    assert dense.max_total_sequence_length == 8 * 2048 and dense.max_pages_per_sequence == 128


def test_sliding_window_size_may_shrink_the_models_window_but_not_widen_it():
    windowed = dataclasses.replace(_args(2048), sliding_window=64)
    assert make_plan(EngineConfig(sliding_window_size=32), windowed).window.size == 32
    with pytest.raises(ValueError, match="sliding_window_size=128 is larger than the model's own "
                                         "sliding window of 64"):
        make_plan(EngineConfig(sliding_window_size=128), windowed)
    # On a model without one it windows every layer, with its sinks.
    plan = make_plan(EngineConfig(sliding_window_size=100, attention_sink_size=4), _args(2048))
    assert plan.bounded and (plan.window.size, plan.window.sinks) == (100, 4)
    assert "100 tokens + 4 sinks on every layer" in plan.describe()


def test_streaming_past_the_context_needs_a_window_within_it():
    config = dict(sliding_window_size=1000, attention_sink_size=4, max_single_sequence_length=10**6)
    plan = make_plan(EngineConfig(**config), _args(2048))
    # Local mode keeps KV for one stream: its sinks, window and a prefill chunk.
    assert plan.max_single_sequence_length == 10**6
    assert plan.max_total_sequence_length == (1 + cdiv(999 + 2048, 16) + 1) * 16
    # A KV capacity of its own choosing, far below the stream's length, is enough for its window.
    capped = make_plan(EngineConfig(**config, max_total_sequence_length=4096), _args(2048))
    assert capped.max_total_sequence_length == 4096 and capped.max_pages_per_sequence == 193
    with pytest.raises(ValueError, match=r"past the context window of 2048 tokens, which needs "
                                         r"sliding_window_size \+ attention_sink_size \(2046 \+ 4\)"):
        make_plan(EngineConfig(**config | dict(sliding_window_size=2046)), _args(2048))
    # A model whose window covers some layers only keeps full KV, so stays within its context.
    mixed = dataclasses.replace(_args(2048), sliding_window=64, sliding_window_layers=(1,))
    assert not make_plan(EngineConfig(), mixed).bounded
    assert "64 tokens on layers 1 (KV not bounded: dense layers)" in make_plan(EngineConfig(), mixed).describe()
    with pytest.raises(ValueError, match="exceeds the model's context window of 2048 tokens .only a "
                                         "model with a sliding window on every layer"):
        make_plan(EngineConfig(max_single_sequence_length=4096), mixed)


def test_a_window_must_exceed_the_deepest_draft():
    with pytest.raises(ValueError, match="sliding window of 8 tokens must exceed the deepest draft "
                                         r"\(8 tokens\)"):
        make_plan(EngineConfig(sliding_window_size=8, speculative_mode="ngram", spec_draft_length=8),
                  _args(2048))


def test_the_plan_budgets_torch_attention_where_the_kernel_cannot_serve_the_model():
    """O0 asks for the C++ attention, which reads each query's own pages; where it cannot serve
    the model (head_dim 24 is not a multiple of 16) the engine attends on the torch path, and
    the plan counts that path's padded float32 KV gather, as it does when asked for."""
    def workspace(args, opt):
        return make_plan(EngineConfig(mode="server", opt=opt), args, device_memory=16 * GiB).memory.workspace

    served, odd = _args(2048), dataclasses.replace(_args(2048), head_dim=24)
    assert workspace(served, "O0") < workspace(served, "O0;attention=torch_native")
    assert workspace(odd, "O0") == workspace(odd, "O0;attention=torch_native")


@pytest.mark.parametrize("config, line", [
    (EngineConfig(), "a greedy stream alone: up to 8 tokens a step"),
    (EngineConfig(speculative_mode="ngram"), "a greedy stream alone, where the drafter drafts nothing"),
    (EngineConfig(speculative_mode="ngram", spec_draft_length=4), "a greedy stream alone, where the drafter"),
    (EngineConfig(opt="O2;multi_step=0"), "off (opt multi_step=0)"),
    (EngineConfig(opt="O0;attention=torch_native"), "off (the torch path)"),
    (EngineConfig(sliding_window_size=256), "off (a sliding window)"),
])
def test_the_plan_says_when_a_lone_stream_decodes_several_tokens_a_step(config, line):
    assert make_plan(config, _args(2048), device_memory=16 * GiB).multi_step.startswith(line)
    medusa = EngineConfig(speculative_mode="medusa", additional_models=["heads"])
    assert _multi_step(medusa, parse_opt(None), False, False, 1) == \
        "off (the heads read every token's hidden states)"
