"""Block weights (GGUF Q4_0/Q4_1/Q8_0 kept as they are) and the C++ block matmul."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from lmserve.layers.blocks import BlockWeight, from_gguf_blocks
from lmserve.layers.linear import (
    BlockLinear,
    DenseLinear,
    block_kernel_unavailable,
    dense_kernel_unavailable,
    int8_kernel_unavailable,
    make_linear,
)

needs_kernel = pytest.mark.skipif(block_kernel_unavailable() is not None,
                                  reason=f"C++ kernel unavailable: {block_kernel_unavailable()}")
needs_int8_kernel = pytest.mark.skipif(int8_kernel_unavailable() is not None,
                                       reason=f"C++ int8 kernel unavailable: {int8_kernel_unavailable()}")
GGUF_TYPES = ["Q4_0", "Q4_1", "Q8_0", "Q5_0"]


def gguf_tensor(type_name: str, n: int, k: int, seed: int = 0):
    """Raw GGUF bytes of a random (n, k) matrix and gguf's own dequantization of them."""
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)
    qtype = GGMLQuantizationType[type_name]
    raw = quantize(w, qtype)  # (n, bytes per row)
    return raw, torch.from_numpy(dequantize(raw, qtype).reshape(n, k))


@pytest.mark.parametrize("type_name", GGUF_TYPES)
def test_gguf_blocks_hold_exactly_the_files_weights(type_name):
    raw, ref = gguf_tensor(type_name, 48, 96)
    blocks = from_gguf_blocks(raw, type_name, 48, 96)
    assert blocks.bits == (4 if type_name.startswith("Q4") else 8)
    assert torch.equal(blocks.dequantize(), ref)  # float32 scale/zero: no re-rounding


def test_q4_k_super_blocks_hold_exactly_the_files_weights():
    """Q4_K's super-blocks of 256, random bytes (every pattern of the packed 6-bit scales and
    mins, fp16 d and dmin of either sign), as blocks of 32: gguf's own dequantization exactly."""
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, (6, 3 * 144), dtype=np.uint8)
    constants = rng.standard_normal((6, 3, 2)).astype(np.float16)  # finite d and dmin
    raw.reshape(6, 3, 144)[..., :4] = constants.view(np.uint8)
    blocks = from_gguf_blocks(raw, "Q4_K", 6, 768)
    ref = torch.from_numpy(dequantize(raw, GGMLQuantizationType.Q4_K).reshape(6, 768))
    assert blocks.bits == 4 and blocks.shape == (6, 768)
    assert torch.equal(blocks.dequantize(), ref)


def test_bf16_blocks_hold_the_bf16_weights():
    w = torch.randn(8, 64)
    assert torch.equal(BlockWeight.quantize(w, 16).dequantize(), w.bfloat16().float())


@pytest.mark.parametrize("bits", [4, 8])
def test_quantize_rounds_each_weight_to_within_half_a_step(bits):
    w = torch.randn(16, 128)
    b = BlockWeight.quantize(w, bits)
    err = (b.dequantize() - w).abs().reshape(16, 4, 32)
    assert (err <= b.scale.unsqueeze(-1) * 0.5 + 1e-6).all()


@needs_kernel
@pytest.mark.parametrize("type_name", GGUF_TYPES)
@pytest.mark.parametrize("m", [1, 5, 8, 37])
def test_block_matmul_matches_dense_with_bf16_weights(type_name, m):
    """The kernel rounds each weight to bfloat16 once and accumulates in float32: it equals a
    float32 matmul with bf16-rounded weights and inputs to 1e-4 relative of the output scale."""
    raw, dense = gguf_tensor(type_name, 70, 160, seed=m)
    layer = BlockLinear(from_gguf_blocks(raw, type_name, 70, 160), None)
    x = torch.randn(m, 160).bfloat16()
    out = layer(x)
    ref = x.float() @ dense.bfloat16().float().T
    assert out.dtype == torch.bfloat16 and out.shape == (m, 70)
    scale = ref.abs().max()
    assert ((out.float() - ref).abs() <= 1e-2 * ref.abs() + 1e-4 * scale).all()


@needs_int8_kernel
@pytest.mark.parametrize("type_name", GGUF_TYPES)
@pytest.mark.parametrize("m", [1, 5, 37])
@pytest.mark.parametrize("act, digit_step", [("int8", 1 / 2), ("int16", 1 / 512)])
def test_integer_activations_err_by_at_most_their_rounding(type_name, m, act, digit_step):
    """int8/int16 activations multiply the file's exact weights: each output differs from a
    float64 matmul by at most the activation rounding, sum over blocks of |w| * d * step (d =
    the block's max |x| / 127; step 1/2 for one digit, 1/512 for two), plus float32 slack."""
    raw, dense = gguf_tensor(type_name, 70, 160, seed=m)
    layer = BlockLinear(from_gguf_blocks(raw, type_name, 70, 160), None, act)
    assert layer.digits == {"int8": 1, "int16": 2}[act]
    assert layer.consts.dtype == torch.float16  # GGUF's block constants are float16 values
    x = torch.randn(m, 160)
    x[:, 7] *= 20  # an outlier channel, as LLM activations have
    out = layer(x)
    assert out.dtype == torch.float32 and out.shape == (m, 70)
    ref = x.double() @ dense.double().T
    d = x.reshape(m, 5, 32).abs().amax(-1).double() / 127  # (m, G)
    bound = (d * digit_step) @ dense.abs().reshape(70, 5, 32).sum(-1).double().T  # (m, N)
    slack = 1e-6 * (x.abs().double() @ dense.abs().double().T)
    assert ((out.double() - ref).abs() <= bound * 1.01 + slack).all()
    # bf16 inputs are quantized the same way (their values widen exactly); bf16 out
    x16 = x.bfloat16()
    assert torch.equal(layer(x16), layer(x16.float()).bfloat16())


@needs_int8_kernel
@pytest.mark.parametrize("type_name", GGUF_TYPES)
def test_float16_block_constants_give_the_float32_result(type_name):
    """Constants kept as float16 (when exact) are the same numbers as float32 ones."""
    raw, _ = gguf_tensor(type_name, 40, 96)
    layer = BlockLinear(from_gguf_blocks(raw, type_name, 40, 96), None, "int16")
    x = torch.randn(6, 96)
    half = layer(x)
    layer.consts = layer.consts.float()
    assert torch.equal(layer(x), half)
    # constants float16 cannot hold stay float32
    assert BlockLinear(BlockWeight.quantize(torch.randn(16, 64), 4), None, "int8").consts.dtype == torch.float32


@needs_int8_kernel
@pytest.mark.parametrize("act", ["int8", "int16"])
def test_integer_activations_edge_cases(act):
    codes = torch.full((16, 1, 16), 0x99, dtype=torch.uint8)  # 4-bit codes 9: every weight 9
    layer = BlockLinear(BlockWeight(codes, torch.ones(16, 1), None, 4), None, act)
    # A remainder of just under half a step: the second digit carries instead of clipping.
    x = torch.full((1, 32), 10.499)
    x[0, 0] = 127.0  # d = 1
    step = 1 / 2 if act == "int8" else 1 / 512
    assert (layer(x)[0] - 9 * x.sum()).abs().max() <= step * 9 * 32 * 1.01
    # NaN or inf in a block gives NaN outputs, as a float matmul would, not finite numbers.
    for bad in (float("nan"), float("inf")):
        y = torch.randn(2, 32)
        y[1, 5] = bad
        out = layer(y)
        assert out[1].isnan().all() and out[0].isfinite().all()
    # Blocks too small for 127 / max|x| to be finite count as zeros.
    assert layer(torch.full((1, 32), 1e-38)).abs().max() < 1e-30
    # Shapes the kernel cannot take are refused before it reads anything.
    with pytest.raises(ValueError, match=r"taking \(M, 32\)"):
        layer(torch.randn(2, 16))


@needs_int8_kernel
def test_int16_activations_are_closer_than_float32_ones():
    """Two int8 digits plus exact weights beat the bf16 kernel's hi+lo activations (whose
    weights are rounded to bf16) by far on a float64 reference."""
    raw, dense = gguf_tensor("Q4_1", 64, 512, seed=5)
    blocks = from_gguf_blocks(raw, "Q4_1", 64, 512)
    x = torch.randn(9, 512)
    ref = x.double() @ dense.double().T

    def err(act):
        return ((BlockLinear(blocks, None, act)(x).double() - ref).abs().max() / ref.abs().max()).item()

    assert err("int16") < 1e-4 and err("int16") * 20 < err("float32") < err("int8")


@needs_kernel
@pytest.mark.parametrize("bits", [4, 8, 16])
@pytest.mark.parametrize("act", ["bfloat16", "float32", "int8", "int16"])
def test_block_matmul_rows_do_not_depend_on_the_other_rows(bits, act):
    if act.startswith("int") and int8_kernel_unavailable():
        pytest.skip(f"C++ int8 kernel unavailable: {int8_kernel_unavailable()}")
    layer = BlockLinear(BlockWeight.quantize(torch.randn(96, 256), bits), None, act)
    x = torch.randn(70, 256).to(torch.bfloat16 if act == "bfloat16" else torch.float32)
    full = layer(x)
    for m in [1, 2, 7, 8, 9, 16, 33, 64, 65, 70]:
        part = layer(x[:m])
        assert torch.equal(part, full[:m]), m
        assert torch.equal(layer(x[m - 1 : m])[0], full[m - 1])


@needs_kernel
def test_int16_matmul_rows_are_the_same_from_reused_and_from_fresh_buffers():
    # Calls of up to 1 MiB of quantized activations reuse the calling thread's buffers, larger
    # ones allocate their own (kernels/int8_gemm.cpp, scratch); a reused buffer holds the
    # previous call's digits past this call's rows.
    if int8_kernel_unavailable():
        pytest.skip(f"C++ int8 kernel unavailable: {int8_kernel_unavailable()}")
    layer = BlockLinear(BlockWeight.quantize(torch.randn(48, 2048), 4), None, "int16")
    x = torch.randn(300, 2048)
    full = layer(x)  # 300 rows x 2048 x 2 digits: its own buffers
    for m in [256, 1, 300, 3]:  # 256 rows: exactly 1 MiB, reused
        assert torch.equal(layer(x[-m:]), full[-m:]), m


@needs_kernel
def test_make_linear_formats():
    raw, dense = gguf_tensor("Q4_1", 32, 64)
    blocks = from_gguf_blocks(raw, "Q4_1", 32, 64)
    other = torch.randn(16, 64)
    # native: blocks kept when every part is blocks of one width; otherwise bf16 in the kernel
    fused = make_linear([blocks, blocks], None, "native")
    assert isinstance(fused, BlockLinear) and (fused.n, fused.k, fused.bits) == (64, 64, 4)
    mixed = make_linear([blocks, other], None, "native")
    assert isinstance(mixed, BlockLinear) and mixed.bits == 16
    # integer activations for 4-/8-bit blocks; bf16 blocks take float activations
    if int8_kernel_unavailable() is None:
        assert make_linear([blocks], None, "native", "int16").digits == 2
        assert make_linear([blocks, other], None, "native", "int8").digits == 0
    # a dense copy only where torch must do it: float32/float16, or K not a multiple of 32
    assert isinstance(make_linear([torch.randn(8, 48)], None, "native"), DenseLinear)
    # int8: the 4-bit blocks and the dense part are rounded to 8-bit blocks
    assert make_linear([blocks, other], None, "int8").bits == 8
    # dense formats dequantize
    f32 = make_linear([blocks], None, "float32")
    assert torch.equal(f32.weight, dense)
    # bias is added after the matmul
    bias = torch.randn(32)
    x = torch.randn(3, 64).bfloat16()
    with_bias = make_linear([blocks], bias, "native")(x)
    torch.testing.assert_close(with_bias, make_linear([blocks], None, "native")(x) + bias.bfloat16())


@needs_kernel
@pytest.mark.parametrize("m", [1, 9])
def test_float32_activations_keep_about_16_bits(m):
    """float32 inputs go through the kernel as bf16 hi + lo halves: the result is within 1e-4 of
    the output scale of a float32 matmul with the (bf16-rounded) weights, ~100x closer than with
    bf16 inputs, and float32 out."""
    raw, dense = gguf_tensor("Q4_1", 64, 512, seed=3)
    layer = BlockLinear(from_gguf_blocks(raw, "Q4_1", 64, 512), None)
    x = torch.randn(m, 512)
    ref = x @ dense.bfloat16().float().T
    out = layer(x)
    assert out.dtype == torch.float32
    err32 = (out - ref).abs().max() / ref.abs().max()
    err16 = (layer(x.bfloat16()).float() - ref).abs().max() / ref.abs().max()
    assert err32 < 1e-4 and err32 * 20 < err16


@pytest.mark.skipif(dense_kernel_unavailable() is not None,
                    reason=f"C++ kernel unavailable: {dense_kernel_unavailable()}")
def test_float32_dense_rows_do_not_depend_on_the_other_rows():
    """The float32 matmul (kernels/dense_gemm.cpp): every row the same bits whatever the row
    count, one row alone included (oneDNN's one-row path differs in the last bits, MKL's sgemm
    past each multiple of 8 rows); K = 100 is six vectors of 16 and a rest, K = 40 fewer
    vectors than a tile of 5-8 rows has parts, K = 8 only a rest; 9-16 rows are two tiles
    on each strip, 17 on are tiles of 4x4. Within float32 rounding of
    the float64 product, bias included."""
    for k in (8, 40, 96, 100):
        weight, bias, x = torch.randn(203, k), torch.randn(203), torch.randn(70, k)
        layer = DenseLinear(weight, bias, torch.float32)
        full = layer(x)
        for m in [1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 15, 16, 17, 33, 69]:
            assert torch.equal(layer(x[:m]), full[:m]), (k, m)
            assert torch.equal(layer(x[m - 1 : m])[0], full[m - 1]), (k, m)
        ref = (x.double() @ weight.double().T + bias.double()).float()
        torch.testing.assert_close(full, ref, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"input of shape \(3, 16\) for a linear layer taking \(M, 32\)"):
        DenseLinear(torch.randn(8, 32), None, torch.float32)(torch.randn(3, 16))


def test_float32_dense_rows_without_the_kernel_go_through_onednn(monkeypatch):
    """Where the kernel cannot be built, oneDNN: every row of a call of 2+ rows is the same
    bits whatever the row count; one row alone may differ in its last bits."""
    import lmserve.layers.linear as linear

    monkeypatch.setattr(linear, "dense_kernel_unavailable", lambda: "no compiler (simulated)")
    weight, bias, x = torch.randn(200, 96), torch.randn(200), torch.randn(70, 96)
    layer = DenseLinear(weight, bias, torch.float32)
    full = layer(x)
    for m in [2, 3, 7, 9, 17, 69]:
        assert torch.equal(layer(x[:m]), full[:m]), m
    ref = (x.double() @ weight.double().T + bias.double()).float()
    torch.testing.assert_close(full, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(layer(x[:1]), ref[:1], rtol=1e-5, atol=1e-5)
    assert not layer.packable(torch.float32)


@pytest.mark.parametrize("kernel", [True, False])
def test_mlp_activations_keep_one_tensor_type_when_the_int8_kernel_is_missing(monkeypatch, caplog, kernel):
    """O2's mix (one digit into gate/up, two into down): as asked with the int8 kernel; without
    it int8 would fall back to bfloat16 and int16 to float32, so gate/up takes down's float32.
    Each fallback is logged once (gate/up and down both int8: once)."""
    import lmserve.layers.linear as linear

    if not kernel:
        monkeypatch.setattr(linear, "int8_kernel_unavailable", lambda: "no compiler (simulated)")
    elif linear.int8_kernel_unavailable():
        pytest.skip(f"C++ int8 kernel unavailable: {linear.int8_kernel_unavailable()}")
    assert linear.resolve_mlp_acts("int8", "int16") == (("int8", "int16") if kernel else ("float32", "float32"))
    caplog.clear()
    assert linear.resolve_mlp_acts("int8", "int8") == (("int8", "int8") if kernel else ("bfloat16", "bfloat16"))
    assert len([r for r in caplog.records if "unavailable" in r.getMessage()]) == (0 if kernel else 1)
    assert linear.resolve_mlp_acts("bfloat16", "bfloat16") == ("bfloat16", "bfloat16")
