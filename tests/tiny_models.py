"""Small random models for tests, as Hugging Face directories and GGUF files.

They have the built-in model's tokenizer (vocab 49152, chat template), so they are complete
models that every part of lmserve can load; only the weights are random. Nothing is downloaded.
"""

from __future__ import annotations

import copy
import functools
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter
from gguf.quants import quantize
from transformers import (
    BambaConfig,
    BambaForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    Mamba2Config,
    Mamba2ForCausalLM,
    MambaConfig,
    MambaForCausalLM,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from lmserve.models.builtin import builtin_model_path
from lmserve.models.gguf_reader import llama3_rope_divisors, open_gguf
from lmserve.tokenizer import Tokenizer

VOCAB_SIZE = 49152  # the built-in tokenizer's

_ARCHS = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}
# Hugging Face layer tensor suffix -> GGUF tensor suffix (the inverse of llama.cpp's naming).
_GGUF_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.o_proj.bias": "attn_output.bias",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_GGUF_GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def random_model(
    *,
    arch: str = "llama",
    num_layers: int = 2,
    hidden_size: int = 64,
    intermediate_size: int = 128,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    seed: int = 0,
    **config_overrides: Any,
) -> PreTrainedModel:
    """A random ``LlamaForCausalLM`` (or ``Qwen2ForCausalLM``) with the built-in tokenizer's vocab.

    Every parameter is random, norms included (around 1), so a test notices swapped tensors.
    """
    config_cls, model_cls = _ARCHS[arch]
    settings: dict[str, Any] = dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    settings.update(copy.deepcopy(config_overrides))  # transformers edits rope dicts in place
    config = config_cls(**settings)
    generator = torch.Generator().manual_seed(seed)
    # Built for real (not on the meta device): buffers such as the rotary frequencies must hold
    # their computed values, or the in-memory model disagrees with a reloaded copy.
    model = model_cls(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            param.copy_(1 + 0.1 * noise if "norm" in name else 0.05 * noise)
    if config.tie_word_embeddings:
        model.tie_weights()
    return model.eval()


def make_hf_llama(model_dir: str, **model_args: Any) -> str:
    """Save a random model (``random_model(**model_args)``) as a Hugging Face directory with
    safetensors weights and the built-in tokenizer; return the directory."""
    model = random_model(**model_args)
    model.save_pretrained(model_dir)
    _builtin_tokenizer().hf.save_pretrained(model_dir)
    return str(model_dir)


def make_gguf_llama(path: str, qtype: str = "F32", *, arch: str = "llama", tokenizer: bool = True,
                    **model_args: Any) -> str:
    """Write a random model (``random_model(arch=arch, **model_args)``) as a GGUF file.

    2-D weights are stored as ``qtype`` (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0/Q5_1 or Q4_K), norms as
    F32, the way llama.cpp does; q/k rows are permuted like llama.cpp's converter (llama only)
    and the tokenizer metadata is the built-in model's (``tokenizer=False`` leaves it out, which
    makes the file ~0.7 s quicker to read when a test only needs weights). Returns ``path``.
    """
    model = random_model(arch=arch, **model_args)
    config = model.config
    quant = GGMLQuantizationType[qtype]
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer = GGUFWriter(path, arch)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    rope = dict(config.rope_parameters)
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_rope_dimension_count(head_dim)
    if head_dim != config.hidden_size // config.num_attention_heads:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_vocab_size(config.vocab_size)
    for key, value, vtype, sub_type in _builtin_tokenizer_metadata() if tokenizer else []:
        writer.add_key_value(key, value, vtype, sub_type)

    tensors: dict[str, np.ndarray] = {}
    for name, value in model.state_dict().items():
        if config.tie_word_embeddings and name == "lm_head.weight":
            continue  # llama.cpp omits output.weight for tied models
        if arch == "llama" and ".q_proj." in name:
            value = _permute_rope_rows(value, config.num_attention_heads)
        elif arch == "llama" and ".k_proj." in name:
            value = _permute_rope_rows(value, config.num_key_value_heads)
        tensors[_gguf_name(name)] = value.float().numpy()
    if rope.get("rope_type") == "llama3":
        tensors["rope_freqs.weight"] = llama3_rope_divisors(rope, rope["rope_theta"], head_dim).float().numpy()
    for name, array in tensors.items():
        if array.ndim == 1 or quant == GGMLQuantizationType.F32:
            writer.add_tensor(name, array)
        else:
            raw = quantize_q4_k(array) if quant == GGMLQuantizationType.Q4_K else quantize(array, quant)
            writer.add_tensor(name, raw, raw_dtype=quant)

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def quantize_q4_k(w: np.ndarray) -> np.ndarray:
    """``w`` (rows, cols a multiple of 256) as Q4_K bytes (rows, cols / 256 * 144), which gguf
    cannot write: per block of 32 a min/max 4-bit grid (the min at most 0, as the format's mins
    subtract), its scale and min rounded to 6-bit multiples of the super-block's fp16 d and dmin."""
    rows, cols = w.shape
    blocks = w.astype(np.float32).reshape(rows, cols // 256, 8, 32)
    low = np.minimum(blocks.min(-1), 0)  # (R, S, 8)
    step = (blocks.max(-1) - low) / 15
    d = (step.max(-1, keepdims=True) / 63).astype(np.float16)
    dmin = (-low.min(-1, keepdims=True) / 63).astype(np.float16)
    sc = np.clip(np.round(step / np.maximum(d.astype(np.float32), 1e-30)), 0, 63).astype(np.uint8)
    m = np.clip(np.round(-low / np.maximum(dmin.astype(np.float32), 1e-30)), 0, 63).astype(np.uint8)
    scale, zero = d.astype(np.float32) * sc, -dmin.astype(np.float32) * m
    q = np.clip(np.round((blocks - zero[..., None]) / np.maximum(scale[..., None], 1e-30)), 0, 15).astype(np.uint8)
    packed = np.concatenate([(sc[..., :4] & 63) | ((sc[..., 4:] >> 4) << 6),
                             (m[..., :4] & 63) | ((m[..., 4:] >> 4) << 6),
                             (sc[..., 4:] & 15) | ((m[..., 4:] & 15) << 4)], axis=-1)  # (R, S, 12)
    runs = q[..., 0::2, :] | (q[..., 1::2, :] << 4)  # (R, S, 4, 32): blocks 2j and 2j+1
    return np.concatenate([d.view(np.uint8), dmin.view(np.uint8), packed, runs.reshape(rows, -1, 128)],
                          axis=-1).reshape(rows, -1)


_RECURRENT = {"mamba": (MambaConfig, MambaForCausalLM), "mamba2": (Mamba2Config, Mamba2ForCausalLM),
              "bamba": (BambaConfig, BambaForCausalLM)}


def random_recurrent_model(arch: str, seed: int = 0, **config: Any) -> PreTrainedModel:
    """A random ``MambaForCausalLM``, ``Mamba2ForCausalLM`` or ``BambaForCausalLM`` (``arch``
    mamba, mamba2, bamba) with the built-in tokenizer's vocab: small shapes unless ``config``
    says otherwise, every parameter random (A_log and the time-step biases around the values
    the models are initialised with, so that state decays at many rates)."""
    config_cls, model_cls = _RECURRENT[arch]
    settings: dict[str, Any] = dict(vocab_size=VOCAB_SIZE, hidden_size=64, num_hidden_layers=2,
                                    bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    if arch == "mamba":
        settings |= dict(state_size=8, conv_kernel=4, expand=2)
    elif arch == "mamba2":
        settings |= dict(state_size=16, num_heads=8, head_dim=16, n_groups=2, conv_kernel=4,
                         expand=2, chunk_size=16)
    else:
        settings |= dict(num_hidden_layers=3, attn_layer_indices=[1], intermediate_size=128,
                         num_attention_heads=4, num_key_value_heads=2, mamba_n_heads=8,
                         mamba_d_state=16, mamba_n_groups=2, mamba_chunk_size=16,
                         max_position_embeddings=2048)
    settings.update(config)
    model = model_cls(config_cls(**settings))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if name.endswith("A_log"):  # decays exp(-exp(A_log) * dt) between about 0.3 and 1
                param.copy_(torch.log(torch.rand(param.shape, generator=generator) * 2 + 0.1))
            elif name.endswith("dt_bias") or name.endswith("dt_proj.bias"):
                param.copy_(-1 + 0.5 * noise)
            elif "norm" in name:
                param.copy_(1 + 0.1 * noise)
            elif "conv1d" in name:
                param.copy_(0.3 * noise)
            else:
                param.copy_(0.05 * noise)
    return model.eval()


def make_hf_recurrent(model_dir: str, arch: str, seed: int = 0, **config: Any) -> str:
    """Save ``random_recurrent_model(arch, seed, **config)`` as a Hugging Face directory with
    the built-in tokenizer; return the directory."""
    random_recurrent_model(arch, seed, **config).save_pretrained(model_dir)
    _builtin_tokenizer().hf.save_pretrained(model_dir)
    return str(model_dir)


@functools.lru_cache(maxsize=1)
def _builtin_tokenizer() -> Tokenizer:
    return Tokenizer.from_model(builtin_model_path())


@functools.lru_cache(maxsize=1)
def _builtin_tokenizer_metadata() -> list[tuple[str, Any, GGUFValueType, Any]]:
    """The built-in GGUF's ``tokenizer.*`` key/values, as GGUFWriter.add_key_value arguments."""
    reader = open_gguf(builtin_model_path())
    entries = []
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        vtype = field.types[0]
        sub_type = field.types[-1] if vtype == GGUFValueType.ARRAY else None
        entries.append((key, field.contents(), vtype, sub_type))
    return entries


def _gguf_name(hf_name: str) -> str:
    if hf_name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[hf_name]
    _, _, layer, suffix = hf_name.split(".", 3)  # model.layers.{i}.{suffix}
    return f"blk.{layer}.{_GGUF_LAYER_NAMES[suffix]}"


def _permute_rope_rows(weight: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's q/k permutation: each head's rows (2, head_dim/2) become (head_dim/2, 2)."""
    half = weight.shape[0] // n_head // 2
    return weight.reshape(n_head, 2, half, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)

