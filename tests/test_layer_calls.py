"""The decoder layers as one C++ call list give exactly the bits of the layer-by-layer Python loop
(same kernels, same inputs, same order), for every kernel a layer can use, and are only used
where every part of a layer is a C++ kernel."""

import pytest
import torch

from lmserve import Engine
from lmserve.attention.base import AttentionInput, AttentionShape
from lmserve.attention.cpu_paged import why_unsupported
from lmserve.layers.linear import BlockLinear, DenseLinear, dense_kernel_unavailable, int8_kernel_unavailable
from lmserve.models.llama import ForwardContext
from lmserve.util import cdiv
from tiny_models import make_gguf_llama, make_hf_llama

needs_kernels = pytest.mark.skipif(
    why_unsupported(AttentionShape(4, 2, 16), torch.bfloat16) is not None or int8_kernel_unavailable() is not None
    or dense_kernel_unavailable() is not None,
    reason="C++ kernels unavailable on this machine")


def hidden_both_ways(engine: Engine, query_lens: list[int], done: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's final hidden states for one step (sequence i has ``done[i]`` tokens cached and
    adds ``query_lens[i]``) computed with the call list and with the Python loop (with the
    engine's sliding window, if any, on every layer)."""
    core = engine._core
    runner, page = core.runner, core.plan.page_size
    ctx_lens = [d + n for d, n in zip(done, query_lens)]
    tables = [core.pool.alloc(cdiv(c, page)) for c in ctx_lens]
    try:
        window = runner.window
        inp = AttentionInput(query_lens, ctx_lens, tables, window=window)
        positions = torch.cat([torch.arange(d, d + n) for d, n in zip(done, query_lens)])
        ids = torch.randint(0, core.args.vocab_size, (len(positions),), generator=torch.Generator().manual_seed(0))
        cos, sin = runner.rotary.lookup(positions)
        if window is not None:  # the sinks scored from moved positions
            inp.sink_cos, inp.sink_sin = runner.rotary.lookup(positions.clamp(max=window.size + window.sinks - 1))
        meta = runner.backend.prepare(inp, page, runner.device)
        out = []
        for calls in (runner.layer_calls, None):
            ctx = ForwardContext(runner.backend, meta, runner.ops, cos, sin, runner.kv, calls,
                                 windowed=runner.windowed)
            out.append(runner.model.forward(ids, ctx))
        return out[0], out[1]
    finally:
        for t in tables:
            core.pool.release(t)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    """The two sources, written once for every case (a file's metadata is read once, too)."""
    root = tmp_path_factory.mktemp("layer_calls")
    return {"gguf Q4_1": make_gguf_llama(str(root / "m.gguf"), "Q4_1", num_layers=3, hidden_size=64,
                                         intermediate_size=128),
            "safetensors": make_hf_llama(str(root / "m"), num_layers=3)}


@needs_kernels
@pytest.mark.parametrize("opt", ["O0", "O1", "O2", "O3"])
@pytest.mark.parametrize("source", ["gguf Q4_1", "safetensors"])
@pytest.mark.parametrize("window", [{}, {"sliding_window_size": 16, "attention_sink_size": 3}])
def test_layer_calls_match_the_python_loop_bit_for_bit(models, source, opt, window):
    path = models[source]
    engine = Engine(model=path, opt=opt, prefix_cache_mode="disable", max_num_sequence=4,
                    max_total_sequence_length=512, verbose=False, **window)
    try:
        assert engine._core.runner.layer_calls is not None
        # A prompt's first chunk and a second prompt, then the rest of the first beside a decode.
        with_calls, loop = hidden_both_ways(engine, [37, 5], [0, 0])
        assert torch.equal(with_calls, loop)
        with_calls, loop = hidden_both_ways(engine, [20, 1], [37, 5])
        assert torch.equal(with_calls, loop)
        assert with_calls.isfinite().all() and with_calls.abs().sum() > 0
        # Every matmul kernel is covered: int8 digits for GGUF blocks at O2/O3, bf16 blocks at
        # O1 and for the safetensors' weights at O2/O3, float32 dense weights at O0.
        linears = [m for layer in engine._core.runner.model.layers for m in (layer.qkv, layer.o, layer.down)]
        if opt == "O0":
            assert all(isinstance(m, DenseLinear) and m.weight.dtype == torch.float32 for m in linears)
        else:
            digits = {"O1": 0, "O2": 2, "O3": 1}[opt] if source.startswith("gguf") else 0
            assert all(isinstance(m, BlockLinear) and m.digits == digits for m in linears)
            # O2's gate/up takes one digit
            gate_ups = [layer.gate_up for layer in engine._core.runner.model.layers]
            assert all(m.digits == min(digits, 1) for m in gate_ups)
    finally:
        engine.shutdown()


def assert_layers_run_one_by_one(path: str, opt: str) -> None:
    engine = Engine(model=path, opt=opt, verbose=False)
    try:
        assert engine._core.runner.layer_calls is None
        out = engine.completions.create(prompt="Hello", max_tokens=3, temperature=0, ignore_eos=True)
        assert out.usage.completion_tokens == 3
    finally:
        engine.shutdown()


@needs_kernels
def test_layers_with_biases_run_one_by_one(tmp_path):
    """q/k/v biases (Qwen2) are added in Python, so those layers stay off the call list."""
    assert_layers_run_one_by_one(make_hf_llama(str(tmp_path / "qwen2"), num_layers=2, arch="qwen2"), "O2")


def test_no_layer_calls_on_the_torch_path(tiny_model_dir):
    assert_layers_run_one_by_one(tiny_model_dir, "O0;attention=torch_native")
    assert_layers_run_one_by_one(tiny_model_dir, "O0;weight_dtype=float16")  # torch's matmul
    # float32 weights on bf16 activations: the layers multiply in torch
    assert_layers_run_one_by_one(tiny_model_dir, "O1;weight_dtype=float32")
    assert_layers_run_one_by_one(tiny_model_dir, "O0;mlp_act_dtype=bf16")
