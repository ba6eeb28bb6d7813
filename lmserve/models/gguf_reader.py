"""Read a GGUF file (llama.cpp's format) into ``ModelArgs`` and Hugging Face-named float32 tensors."""

from __future__ import annotations

import functools
import math
import os
from typing import Any, Literal, Optional, Union, overload

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, ReaderTensor
from gguf.quants import dequantize

from lmserve.layers.blocks import BlockWeight, from_gguf_blocks, gguf_block_types
from lmserve.models.args import ModelArgs
from lmserve.models.registry import family, family_of_gguf

_Q = GGMLQuantizationType
_SUPPORTED_TYPES = {
    _Q.F32, _Q.F16, _Q.BF16,
    _Q.Q4_0, _Q.Q4_1, _Q.Q5_0, _Q.Q5_1, _Q.Q8_0,
    _Q.Q2_K, _Q.Q3_K, _Q.Q4_K, _Q.Q5_K, _Q.Q6_K,
}  # fmt: skip

_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_output.bias": "self_attn.o_proj.bias",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
# Llama 3.x files carry their rope scaling as per-frequency divisors instead of metadata;
# it is turned back into ModelArgs.rope_scaling, so it is not a weight.
_ROPE_FREQS = "rope_freqs.weight"


def read_gguf_args(path: str) -> ModelArgs:
    """Read the architecture hyper-parameters of a GGUF file without dequantizing any weight."""
    reader = open_gguf(path)
    gguf_arch = _get(reader, "general.architecture")
    arch = family_of_gguf(gguf_arch, path).name
    hidden = int(_required(reader, f"{gguf_arch}.embedding_length", path))
    num_heads = int(_required(reader, f"{gguf_arch}.attention.head_count", path))
    tensors = {t.name: t for t in reader.tensors}
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    if tokens is not None:
        vocab_size = len(tokens.data)
    else:
        vocab_size = int(tensors["token_embd.weight"].shape[-1])  # GGUF shape is (hidden, vocab)
    rope_theta = _get_float(reader, f"{gguf_arch}.rope.freq_base", 10000.0)
    head_dim = int(_get(reader, f"{gguf_arch}.attention.key_length", hidden // num_heads))
    rope_scaling = _rope_scaling_from_metadata(reader, gguf_arch)
    if rope_scaling is None and _ROPE_FREQS in tensors:
        divisors = _to_torch(tensors[_ROPE_FREQS], path).double()
        rope_scaling = _llama3_scaling_from_divisors(divisors, rope_theta, head_dim, path)
    eos_ids: list[int] = []
    # eot/eom are Llama 3's end-of-turn tokens; generation must stop on them too.
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        token_id = _get(reader, f"tokenizer.ggml.{key}")
        if token_id is not None and int(token_id) not in eos_ids:
            eos_ids.append(int(token_id))
    bos = _get(reader, "tokenizer.ggml.bos_token_id")
    sliding_window = _get(reader, f"{gguf_arch}.attention.sliding_window")
    return ModelArgs(
        architecture=arch,
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=int(_required(reader, f"{gguf_arch}.feed_forward_length", path)),
        num_layers=int(_required(reader, f"{gguf_arch}.block_count", path)),
        num_heads=num_heads,
        num_kv_heads=int(_get(reader, f"{gguf_arch}.attention.head_count_kv", num_heads)),
        head_dim=head_dim,
        rms_norm_eps=_get_float(reader, f"{gguf_arch}.attention.layer_norm_rms_epsilon", 1e-5),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        context_length=int(_get(reader, f"{gguf_arch}.context_length", 2048)),
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors,
        sliding_window=int(sliding_window) if sliding_window else None,
        bos_token_id=int(bos) if bos is not None else None,
        eos_token_ids=eos_ids,
    )


@overload
def read_gguf_weights(path: str, keep_blocks: Literal[False] = False) -> dict[str, torch.Tensor]: ...
@overload
def read_gguf_weights(path: str, keep_blocks: bool) -> dict[str, torch.Tensor | BlockWeight]: ...
def read_gguf_weights(path: str, keep_blocks: bool = False) -> Union[dict[str, torch.Tensor],
                                                                      dict[str, torch.Tensor | BlockWeight]]:
    """Every weight of a GGUF file keyed by Hugging Face Llama/Qwen2 names, dequantized to float32
    or, with ``keep_blocks``, Q4_0/Q4_1/Q8_0/Q5_0/Q4_K matrices kept as the file's blocks (``BlockWeight``).

    The q/k rows that llama.cpp's converter permuted are put back, so the result equals the
    original Hugging Face checkpoint up to quantization error.
    """
    reader = open_gguf(path)
    gguf_arch = _get(reader, "general.architecture")
    arch = family_of_gguf(gguf_arch, path).name
    num_heads = int(_required(reader, f"{gguf_arch}.attention.head_count", path))
    num_kv_heads = int(_get(reader, f"{gguf_arch}.attention.head_count_kv", num_heads))
    weights: dict[str, torch.Tensor | BlockWeight] = {}
    for tensor in reader.tensors:
        if tensor.name == _ROPE_FREQS:
            continue
        hf_name = _hf_name(tensor.name)
        if hf_name is None:
            raise ValueError(
                f"GGUF file {path} has tensor '{tensor.name}', which lmserve does not know for arch '{gguf_arch}'"
            )
        value: torch.Tensor | BlockWeight
        if keep_blocks and tensor.tensor_type.name in gguf_block_types() and len(tensor.shape) == 2:
            cols, rows = (int(n) for n in tensor.shape)
            value = from_gguf_blocks(tensor.data, tensor.tensor_type.name, rows, cols)
        else:
            value = _to_torch(tensor, path)
        heads = {".attn_q.": num_heads, ".attn_k.": num_kv_heads}
        for part, n_head in heads.items():
            if family(arch).rope_permuted and part in tensor.name:
                if isinstance(value, BlockWeight):
                    value = value.map_rows(functools.partial(_unpermute_rope_rows, n_head=n_head))
                else:
                    value = _unpermute_rope_rows(value, n_head)
        weights[hf_name] = value
    return weights


class _PlainArrayReader(GGUFReader):
    """A GGUFReader that slices the mapped file as a plain ndarray.

    GGUFReader slices its np.memmap once per string of the tokenizer arrays (~100k), and each
    memmap slice pays Python-level bookkeeping; a plain view of the same mapping parses ~3x faster.
    """

    @property  # type: ignore[override]  # a plain ndarray where the stub says np.memmap, on purpose
    def data(self) -> np.ndarray:
        return self._data

    @data.setter
    def data(self, value: np.ndarray) -> None:
        self._data = value.view(np.ndarray)  # still backed by the memmap, which stays alive as .base


@functools.lru_cache(maxsize=2)
def _open_cached(path: str, size: int, mtime_ns: int) -> GGUFReader:
    try:
        return _PlainArrayReader(path)
    except ValueError as e:  # bad magic, unknown version, empty file
        raise ValueError(f"{path} is not a GGUF file lmserve can read: {e}") from e


def open_gguf(path: str) -> GGUFReader:
    """Open (memory-map) a GGUF file, reusing the last two readers: parsing the tokenizer arrays
    takes about a second, and a model's args, weights and tokenizer are read one after the other."""
    path = os.path.abspath(path)
    stat = os.stat(path)
    return _open_cached(path, stat.st_size, stat.st_mtime_ns)


def _get(reader: GGUFReader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _required(reader: GGUFReader, key: str, path: str) -> Any:
    value = _get(reader, key)
    if value is None:
        raise ValueError(f"GGUF file {path} lacks the metadata key '{key}'")
    return value


@overload
def _get_float(reader: GGUFReader, key: str, default: float) -> float: ...
@overload
def _get_float(reader: GGUFReader, key: str, default: None = None) -> Optional[float]: ...
def _get_float(reader: GGUFReader, key: str, default: Optional[float] = None) -> Optional[float]:
    """A float metadata value, as the decimal it was written from (GGUF stores 1e-5 as the
    float32 9.99999975e-06; its shortest float32 repr gives back 1e-05)."""
    value = _get(reader, key)
    return default if value is None else float(str(np.float32(value)))


def _hf_name(gguf_name: str) -> Optional[str]:
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    prefix, _, rest = gguf_name.partition(".")
    layer, _, suffix = rest.partition(".")
    if prefix == "blk" and layer.isdigit() and suffix in _LAYER_TENSORS:
        return f"model.layers.{layer}.{_LAYER_TENSORS[suffix]}"
    return None


def _to_torch(tensor: ReaderTensor, path: str) -> torch.Tensor:
    """Dequantize one GGUF tensor to a float32 torch tensor in PyTorch (row-major) shape."""
    qtype = tensor.tensor_type
    if qtype not in _SUPPORTED_TYPES:
        raise ValueError(
            f"GGUF tensor '{tensor.name}' in {path} has type {qtype.name}, "
            f"which lmserve cannot dequantize (supported: {', '.join(sorted(t.name for t in _SUPPORTED_TYPES))})"
        )
    if qtype == _Q.F32:
        values = np.array(tensor.data, dtype=np.float32)  # copy: the memmap is read-only
    else:
        values = dequantize(tensor.data, qtype)
    # GGUF lists dimensions fastest-first (ne[0] is the row length); PyTorch lists them slowest-first.
    shape = tuple(int(n) for n in reversed(tensor.shape.tolist()))
    return torch.from_numpy(values.reshape(shape))


def _unpermute_rope_rows(weight: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation.

    The converter views each head's rows as (2, head_dim/2) — HF's rotate-half pairing — and
    transposes them to (head_dim/2, 2) so the rotated pairs are adjacent (GPT-J style).
    Viewing the stored rows as (head_dim/2, 2) and transposing back restores the HF order.
    """
    rows = weight.shape[0]
    if rows % (2 * n_head):
        raise ValueError(f"cannot un-permute a q/k tensor of {rows} rows into {n_head} heads")
    half = rows // n_head // 2
    return weight.reshape(n_head, half, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape).contiguous()


def _rope_scaling_from_metadata(reader: GGUFReader, gguf_arch: str) -> Optional[dict[str, Any]]:
    """Translate llama.cpp's ``rope.scaling.*`` keys into a Hugging Face rope scaling dict."""
    prefix = f"{gguf_arch}.rope.scaling."
    rope_type = _get(reader, prefix + "type")
    factor = _get_float(reader, prefix + "factor")
    if rope_type is None:
        legacy_linear = _get_float(reader, f"{gguf_arch}.rope.scale_linear")  # pre-2024 files
        if legacy_linear is None or legacy_linear == 1.0:
            return None
        rope_type, factor = "linear", legacy_linear
    if rope_type == "none":
        return None
    if rope_type not in ("linear", "yarn"):
        raise ValueError(f"GGUF rope scaling type '{rope_type}' is not supported (supported: linear, yarn)")
    scaling: dict[str, Any] = {"rope_type": rope_type, "factor": factor}
    original = _get(reader, prefix + "original_context_length")
    if original is not None:
        scaling["original_max_position_embeddings"] = int(original)
    attn_factor = _get_float(reader, prefix + "attn_factor")
    if attn_factor is not None:
        scaling["attention_factor"] = attn_factor
    return scaling


def _llama3_scaling_from_divisors(
    divisors: torch.Tensor, rope_theta: float, head_dim: int, path: str
) -> dict[str, Any]:
    """Recover Llama 3's rope scaling parameters from the ``rope_freqs`` divisors llama.cpp stores.

    Llama 3 divides the inverse frequency by 1 (short wavelengths), by ``factor`` (long ones) and in
    between by ``1 / ((1 - s) / factor + s)`` with ``s = (L / wavelen - low) / (high - low)``,
    ``L`` the original context. Only ``L / low`` and ``L / high`` matter, so with ``low = 1`` the
    middle band's ``s``, linear in ``1 / wavelen``, determines ``L`` and ``high``. The result is
    checked by recomputing every divisor.
    """
    factor = float(divisors.max())
    inv_freq = rope_theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    inv_wavelen = inv_freq / (2 * math.pi)
    middle = (divisors > 1 + 1e-4) & (divisors < factor - 1e-4)
    # Llama 3.1's published values, used when too few frequencies fall in the middle band to fit.
    original, high = 8192.0, 4.0
    if int(middle.sum()) >= 2:
        smooth = (1 / divisors[middle] - 1 / factor) / (1 - 1 / factor)
        x = inv_wavelen[middle]
        slope = float(((x - x.mean()) * (smooth - smooth.mean())).sum() / ((x - x.mean()) ** 2).sum())
        intercept = float(smooth.mean() - slope * x.mean())
        if intercept < 0:
            original, high = slope / -intercept, 1 + 1 / -intercept
    scaling = {
        "rope_type": "llama3",
        "factor": float(f"{factor:.6g}"),  # drop float32 noise: 8.0000001 -> 8.0
        "low_freq_factor": 1.0,
        "high_freq_factor": float(f"{high:.6g}"),
        "original_max_position_embeddings": int(round(original)),
    }
    if not torch.allclose(llama3_rope_divisors(scaling, rope_theta, head_dim), divisors, rtol=1e-3):
        raise ValueError(f"GGUF file {path} has a rope_freqs tensor that is not Llama 3 rope scaling")
    return scaling


def llama3_rope_divisors(scaling: dict[str, Any], rope_theta: float, head_dim: int) -> torch.Tensor:
    """The per-frequency divisors llama.cpp stores as ``rope_freqs`` for a Llama 3 rope scaling dict."""
    factor = float(scaling["factor"])
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    original = float(scaling["original_max_position_embeddings"])
    inv_freq = rope_theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    wavelen = 2 * math.pi / inv_freq
    smooth = (original / wavelen - low) / (high - low)
    middle_band = 1 / ((1 - smooth) / factor + smooth)
    divisors = torch.where(wavelen > original / low, torch.full_like(wavelen, factor), middle_band)
    return torch.where(wavelen < original / high, torch.ones_like(wavelen), divisors)
