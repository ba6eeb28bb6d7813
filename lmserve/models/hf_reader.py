"""Read a Hugging Face model directory (config.json + safetensors) into ``ModelArgs`` and float32 tensors."""

from __future__ import annotations

import glob
import json
import os
import re
from typing import Any, Optional

import torch
from safetensors import safe_open

from lmserve.models.args import ModelArgs, SSMArgs
from lmserve.models.registry import family_of_hf
from lmserve.util import cdiv

_WEIGHT_NAME = re.compile(
    r"model\.embed_tokens\.weight|model\.norm\.weight|lm_head\.weight"
    r"|model\.layers\.\d+\.(input_layernorm|post_attention_layernorm)\.weight"
    r"|model\.layers\.\d+\.self_attn\.[qkvo]_proj\.(weight|bias)"
    r"|model\.layers\.\d+\.mlp\.(gate|up|down)_proj\.(weight|bias)"
    r"|model\.layers\.\d+\.mamba\.(conv1d\.(weight|bias)|(in|out|x|dt)_proj\.(weight|bias)"
    r"|A_log|D|dt_bias|norm\.weight)"
)
# Mamba's and Bamba's names -> the Llama-style names above (the mixer under "mamba.").
_RENAMES = [(re.compile(pattern), repl) for pattern, repl in (
    (r"backbone\.embeddings\.", "model.embed_tokens."),
    (r"backbone\.norm_f\.", "model.norm."),
    (r"backbone\.layers\.(\d+)\.norm\.", r"model.layers.\1.input_layernorm."),
    (r"backbone\.layers\.(\d+)\.mixer\.", r"model.layers.\1.mamba."),
    (r"model\.final_layernorm\.", "model.norm."),
    (r"model\.layers\.(\d+)\.pre_ff_layernorm\.", r"model.layers.\1.post_attention_layernorm."),
    (r"model\.layers\.(\d+)\.feed_forward\.", r"model.layers.\1.mlp."),
)]
# Old checkpoints saved the RoPE inverse frequencies, which are recomputed from the config.
_IGNORED_NAME = re.compile(r".*rotary_emb\.inv_freq")


def read_hf_args(model_dir: str) -> ModelArgs:
    """Read the architecture hyper-parameters from ``config.json`` (and ``generation_config.json``)."""
    config = _read_json(os.path.join(model_dir, "config.json"))
    if config is None:
        raise FileNotFoundError(f"{model_dir} has no config.json, so it is not a Hugging Face model directory")
    arch = family_of_hf(config.get("architectures") or [], f"{model_dir}/config.json").name
    if arch in ("mamba", "mamba2"):
        return _mamba_args(config, arch, _eos_ids(model_dir, config))
    hidden = int(config["hidden_size"])
    num_heads = int(config["num_attention_heads"])
    rope_theta, rope_scaling = _rope(config)
    sliding_window, window_layers = _sliding_window(config, arch)
    bos = config.get("bos_token_id")
    ssm: Optional[SSMArgs] = None
    ssm_layers: tuple[int, ...] = ()
    rotary_dim: Optional[int] = None
    if arch == "bamba":
        ssm = _bamba_mixer(config)
        attn = set(config.get("attn_layer_indices") or ())
        ssm_layers = tuple(i for i in range(int(config["num_hidden_layers"])) if i not in attn)
        head_dim = int(config.get("head_dim") or hidden // num_heads)
        # transformers' Bamba rotates half of each head, whatever its config says
        rotary_dim = int(head_dim * 0.5)
    return ModelArgs(
        architecture=arch,
        vocab_size=int(config["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(config["intermediate_size"]),
        num_layers=int(config["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(config.get("num_key_value_heads") or num_heads),
        head_dim=int(config.get("head_dim") or hidden // num_heads),
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-5)),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        context_length=int(config.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        attention_bias=arch == "qwen2" or bool(config.get("attention_bias", False)),
        sliding_window=int(sliding_window) if sliding_window else None,
        sliding_window_layers=window_layers,
        rotary_dim=rotary_dim,
        ssm=ssm,
        ssm_layers=ssm_layers,
        bos_token_id=int(bos) if bos is not None else None,
        eos_token_ids=_eos_ids(model_dir, config),
    )


def _eos_ids(model_dir: str, config: dict[str, Any]) -> list[int]:
    """End-of-sequence ids of ``config.json`` and ``generation_config.json``, in that order."""
    generation = _read_json(os.path.join(model_dir, "generation_config.json")) or {}
    eos_ids: list[int] = []
    for source in (config.get("eos_token_id"), generation.get("eos_token_id")):
        for token_id in source if isinstance(source, list) else [source]:
            if token_id is not None and int(token_id) not in eos_ids:
                eos_ids.append(int(token_id))
    return eos_ids


def _mamba_args(config: dict[str, Any], arch: str, eos_ids: list[int]) -> ModelArgs:
    """A Mamba or Mamba2 model: every layer a mixer, no attention and no MLP."""
    hidden = int(config["hidden_size"])
    inner = int(config.get("intermediate_size") or config.get("expand", 2) * hidden)
    common: dict[str, Any] = dict(inner=inner, state_size=int(config.get("state_size", 16)),
                  conv_kernel=int(config.get("conv_kernel", 4)),
                  conv_bias=bool(config.get("use_conv_bias", True)),
                  proj_bias=bool(config.get("use_bias", False)))
    if arch == "mamba":
        rank = config.get("time_step_rank", "auto")
        ssm = SSMArgs(version=1, dt_rank=cdiv(hidden, 16) if rank == "auto" else int(rank), **common)
    else:
        ssm = SSMArgs(version=2, num_heads=int(config["num_heads"]), n_groups=int(config.get("n_groups", 1)),
                      chunk_size=int(config.get("chunk_size", 256)), dt_limit=_dt_limit(config),
                      **common)
    layers = int(config["num_hidden_layers"])
    bos = config.get("bos_token_id")
    return ModelArgs(
        architecture=arch, vocab_size=int(config["vocab_size"]), hidden_size=hidden,
        intermediate_size=0, num_layers=layers, num_heads=0, num_kv_heads=0, head_dim=0,
        rms_norm_eps=float(config.get("layer_norm_epsilon", 1e-5)),
        # No positions: the length a model was trained on is not in its config.
        context_length=int(config.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", arch == "mamba")),
        ssm=ssm, ssm_layers=tuple(range(layers)),
        bos_token_id=int(bos) if bos is not None else None, eos_token_ids=eos_ids,
    )


def _bamba_mixer(config: dict[str, Any]) -> SSMArgs:
    hidden = int(config["hidden_size"])
    heads = int(config.get("mamba_n_heads", 128))
    return SSMArgs(version=2, inner=int(config.get("mamba_expand", 2)) * hidden,
                   state_size=int(config.get("mamba_d_state", 256)),
                   conv_kernel=int(config.get("mamba_d_conv", 4)), num_heads=heads,
                   n_groups=int(config.get("mamba_n_groups", 1)),
                   chunk_size=int(config.get("mamba_chunk_size", 256)),
                   conv_bias=bool(config.get("mamba_conv_bias", True)),
                   proj_bias=bool(config.get("mamba_proj_bias", False)),
                   dt_limit=_dt_limit(config))


def _dt_limit(config: dict[str, Any]) -> tuple[float, float]:
    """Mamba2's ``time_step_limit``; transformers 5 writes infinity as ``{"__float__": "Infinity"}``."""
    limit = config.get("time_step_limit") or (0.0, float("inf"))
    low, high = (float(v["__float__"]) if isinstance(v, dict) else float(v) for v in limit)
    return low, high


def _sliding_window(config: dict[str, Any], arch: str) -> tuple[Optional[int], Optional[tuple[int, ...]]]:
    """The model's window and the layers that have it (None: all), as transformers reads them:
    ``layer_types`` where the config lists them, else Qwen2's layers from ``max_window_layers``
    on (and only with ``use_sliding_window``: its configs carry a window even when it is off)."""
    window = config.get("sliding_window")
    if arch == "qwen2" and not config.get("use_sliding_window"):
        window = None
    if not window:
        return None, None
    layers = range(int(config["num_hidden_layers"]))
    types = config.get("layer_types")
    if types is not None:
        windowed = tuple(i for i in layers if types[i] == "sliding_attention")
    elif arch == "qwen2":
        windowed = tuple(i for i in layers if i >= int(config.get("max_window_layers", 28)))
    else:
        return int(window), None
    if not windowed:
        return None, None
    return int(window), None if len(windowed) == len(layers) else windowed


def read_hf_weights(model_dir: str) -> dict[str, torch.Tensor]:
    """Load every weight of a Hugging Face directory as float32, from safetensors files only,
    keyed by Llama-style names (a Mamba mixer's under ``model.layers.{i}.mamba.``).

    Pickle-based ``.bin``/``.pt`` checkpoints are refused: loading them can run arbitrary code.
    """
    tie = bool((_read_json(os.path.join(model_dir, "config.json")) or {}).get("tie_word_embeddings", False))
    weights: dict[str, torch.Tensor] = {}
    for file in _safetensors_files(model_dir):
        with safe_open(file, framework="pt") as handle:
            for name in handle.keys():
                if _IGNORED_NAME.fullmatch(name) or (tie and name == "lm_head.weight"):
                    continue
                key = name
                for pattern, repl in _RENAMES:
                    key = pattern.sub(repl, key)
                if not _WEIGHT_NAME.fullmatch(key):
                    raise ValueError(f"{file} has tensor '{name}', which lmserve does not know")
                weights[key] = handle.get_tensor(name).to(torch.float32)
    return weights


def _safetensors_files(model_dir: str) -> list[str]:
    index = _read_json(os.path.join(model_dir, "model.safetensors.index.json"))
    if index is not None:
        return [os.path.join(model_dir, f) for f in sorted(set(index["weight_map"].values()))]
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if files:
        return files
    pickles = [f for pattern in ("*.bin", "*.pt", "*.pth") for f in glob.glob(os.path.join(model_dir, pattern))]
    if pickles:
        raise ValueError(
            f"{model_dir} has only pickle checkpoints ({', '.join(sorted(os.path.basename(f) for f in pickles))}); "
            "lmserve loads safetensors only, because unpickling can run arbitrary code. Convert the model "
            "to safetensors (e.g. save_pretrained(dir, safe_serialization=True) in a trusted environment)."
        )
    raise FileNotFoundError(f"{model_dir} has no *.safetensors weight files")


def _rope(config: dict[str, Any]) -> tuple[float, Optional[dict[str, Any]]]:
    """RoPE base and scaling dict; transformers 5 folds both into ``rope_parameters``, v4 used
    ``rope_theta`` + ``rope_scaling`` (whose older spelling of ``rope_type`` is ``type``)."""
    params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    theta = float(params.pop("rope_theta", config.get("rope_theta", 10000.0)))
    if "type" in params:
        params["rope_type"] = params.pop("type")
    if params.get("rope_type", "default") == "default":
        return theta, None
    return theta, params


def _read_json(path: str) -> Optional[dict[str, Any]]:
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)
