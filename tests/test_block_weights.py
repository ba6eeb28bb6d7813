"""Block weights (GGUF Q4_0/Q4_1/Q8_0 kept as they are) and the C++ block matmul."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from lmserve.layers.blocks import BlockWeight, from_gguf_blocks
from lmserve.layers.linear import BlockLinear, DenseLinear, block_kernel_unavailable, make_linear

needs_kernel = pytest.mark.skipif(block_kernel_unavailable() is not None,
                                  reason=f"C++ kernel unavailable: {block_kernel_unavailable()}")
GGUF_TYPES = ["Q4_0", "Q4_1", "Q8_0"]


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
    assert blocks.bits == (8 if type_name == "Q8_0" else 4)
    assert torch.equal(blocks.dequantize(), ref)  # float32 scale/zero: no re-rounding


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


@needs_kernel
def test_block_matmul_rows_do_not_depend_on_the_other_rows():
    raw, _ = gguf_tensor("Q4_1", 96, 256)
    layer = BlockLinear(from_gguf_blocks(raw, "Q4_1", 96, 256), None)
    x = torch.randn(70, 256).bfloat16()
    full = layer(x)
    for m in [1, 2, 7, 8, 9, 16, 33, 64, 65, 70]:
        part = layer(x[:m])
        assert torch.equal(part, full[:m]), m
        assert torch.equal(layer(x[m - 1 : m])[0], full[m - 1])


@needs_kernel
def test_make_linear_formats():
    raw, dense = gguf_tensor("Q4_1", 32, 64)
    blocks = from_gguf_blocks(raw, "Q4_1", 32, 64)
    other = torch.randn(16, 64)
    # native: blocks kept when every part is blocks of one width; otherwise dense bf16
    fused = make_linear([blocks, blocks], None, "native")
    assert isinstance(fused, BlockLinear) and fused.w.shape == (64, 64)
    mixed = make_linear([blocks, other], None, "native")
    assert isinstance(mixed, DenseLinear) and mixed.weight.dtype == torch.bfloat16
    # int8: the 4-bit blocks and the dense part are rounded to 8-bit blocks
    assert make_linear([blocks, other], None, "int8").w.bits == 8
    # dense formats dequantize
    f32 = make_linear([blocks], None, "float32")
    assert torch.equal(f32.weight, dense)
    # bias is added after the matmul
    bias = torch.randn(32)
    x = torch.randn(3, 64).bfloat16()
    with_bias = make_linear([blocks], bias, "native")(x)
    torch.testing.assert_close(with_bias, make_linear([blocks], None, "native")(x) + bias.bfloat16())
