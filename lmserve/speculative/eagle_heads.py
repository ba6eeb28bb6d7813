"""Reading EAGLE draft heads (``speculative_mode="eagle"``) in the layouts people publish.

An EAGLE head is one Llama decoder layer that runs on the target's hidden states beside its
tokens (SafeAILab/EAGLE; the draft model is ``additional_models[0]``, a directory with a
one-layer Llama ``config.json`` and the weights):

* EAGLE-1/2: ``fc`` maps [token embedding; the target's final hidden state] (2D) to D (with or
  without a bias; a bias is kept), then ``layers.0.*`` without an input norm. The target's
  embedding and head are shared.
* EAGLE-3: ``fc`` maps three of the target's inner hidden states side by side (3D) to D;
  ``midlayer.*`` attends over [normed embedding; normed hidden] (2D inputs to q/k/v), then
  ``norm`` and its own ``lm_head`` over a reduced draft vocabulary, mapped to the target's by
  ``d2t`` (draft id + ``d2t[id]``). The hidden states are the inputs of layers 2, L/2 and L-3
  (vLLM's choice), or of ``eagle_aux_hidden_state_layer_ids`` when the config has them.

Weights load from safetensors; a ``.pt``/``.bin`` file only with ``torch.load(weights_only=True)``.
A leading ``model.`` in tensor names (some conversions) is dropped. An EAGLE-1/2 head may have a
draft vocabulary beside it (``draft_vocab.py``).
"""

from __future__ import annotations

import dataclasses
import glob
import json
import math
import os
from dataclasses import dataclass
from typing import Optional

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from lmserve.config import EngineConfig
from lmserve.models.args import ModelArgs
from lmserve.speculative.draft_vocab import FILE as DRAFT_VOCAB_FILE
from lmserve.speculative.draft_vocab import read_draft_vocab

_FILES = ("model.safetensors", "pytorch_model.bin", "pytorch_model.pt")
_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")


@dataclass
class EagleHeads:
    """An EAGLE head: its ``version`` (1: EAGLE-1/2, 3: EAGLE-3), the hyper-parameters of its
    layer (``args``, one layer), its tensors by canonical name (``fc.*``, ``layer.*`` in a Llama
    layer's names, and for EAGLE-3 ``norm.weight``, ``lm_head.weight``), EAGLE-3's draft-to-target
    vocabulary map and the target layers whose inputs it reads (``aux_layers``; () for EAGLE-1/2:
    the final hidden state)."""

    version: int
    args: ModelArgs
    tensors: dict[str, torch.Tensor]
    aux_layers: tuple[int, ...] = ()
    # (Vd,) the target id of each draft id: EAGLE-3's d2t, or an EAGLE-1/2 head's draft
    # vocabulary (draft_vocab.py); None: the whole vocabulary.
    draft_to_target: Optional[torch.Tensor] = None


def eagle_weights_file(path: str) -> str:
    """The weights file of the EAGLE head at ``path`` (a directory or the file itself)."""
    if os.path.isfile(path):
        return path
    for name in _FILES:
        if os.path.isfile(os.path.join(path, name)):
            return os.path.join(path, name)
    found = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if len(found) == 1:
        return found[0]
    raise FileNotFoundError(f"{path} holds no EAGLE head weights (looked for {', '.join(_FILES)} "
                            f"or one *.safetensors file)")


def eagle_heads_size(path: str) -> int:
    """The number of weights in the head's file at ``path``, from the file's header where it
    is safetensors (for the plan)."""
    file = eagle_weights_file(path)
    if not file.endswith(".safetensors"):
        return sum(t.numel() for t in _load(file).values())
    with safe_open(file, framework="pt") as f:
        return sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())


def _load(file: str) -> dict[str, torch.Tensor]:
    if file.endswith(".safetensors"):
        return load_file(file)
    return torch.load(file, map_location="cpu", weights_only=True)  # never a full unpickle


def read_eagle_heads(path: str, target: ModelArgs) -> EagleHeads:
    """The EAGLE head at ``path``, checked against the target: a missing, stray or misshapen
    tensor, or a head whose sizes do not fit the target, is refused with the numbers."""
    config_path, config = _read_config(path)
    file = eagle_weights_file(path)
    raw = _load(file)
    tensors = {name.removeprefix("model."): t for name, t in raw.items()}
    version = 3 if any(n.startswith("midlayer.") for n in tensors) else 1
    layer = "midlayer." if version == 3 else "layers.0."
    tensors = {("layer." + n[len(layer):]) if n.startswith(layer) else n: t for n, t in tensors.items()}
    tensors.pop("embed_tokens.weight", None)  # a copy of the target's, which is used instead
    args = eagle_layer_args(config, target)
    d, td = args.hidden_size, target.hidden_size
    if d != td:
        raise ValueError(f"{file}: the EAGLE head's hidden size is {d}, the model's {td}: a head "
                         f"must be trained for this model")
    if int(config.get("vocab_size", target.vocab_size)) != target.vocab_size:
        raise ValueError(f"{config_path}: vocab_size is {config['vocab_size']}, the model has "
                         f"{target.vocab_size} tokens: a head must share the model's vocabulary")
    q, kv = args.num_heads * args.head_dim, args.num_kv_heads * args.head_dim
    attn_in = 2 * d if version == 3 else d
    expected = {
        "fc.weight": (d, 3 * td if version == 3 else 2 * td),
        "layer.self_attn.q_proj.weight": (q, attn_in),
        "layer.self_attn.k_proj.weight": (kv, attn_in),
        "layer.self_attn.v_proj.weight": (kv, attn_in),
        "layer.self_attn.o_proj.weight": (d, q),
        "layer.mlp.gate_proj.weight": (args.intermediate_size, d),
        "layer.mlp.up_proj.weight": (args.intermediate_size, d),
        "layer.mlp.down_proj.weight": (d, args.intermediate_size),
        "layer.post_attention_layernorm.weight": (d,),
    }
    optional = {"fc.bias": (d,), "layer.input_layernorm.weight": (d,), "norm.weight": (d,)}
    optional |= {f"layer.self_attn.{p}.bias": (expected[f"layer.self_attn.{p}.weight"][0],) for p in _ATTN}
    aux: tuple[int, ...] = ()
    draft_to_target: Optional[torch.Tensor] = None
    if version == 3:
        vd = int(config.get("draft_vocab_size") or target.vocab_size)
        expected |= {"layer.input_layernorm.weight": (d,), "layer.hidden_norm.weight": (d,),
                     "norm.weight": (d,), "lm_head.weight": (vd, d)}
        optional |= {"t2d": (target.vocab_size,)}
        if vd != target.vocab_size:
            expected |= {"d2t": (vd,)}
        else:
            optional |= {"d2t": (vd,)}
        aux = _aux_layers(config, target)
    for name, tensor in tensors.items():
        shape = expected.get(name, optional.get(name))
        if shape is None:
            raise ValueError(f"{file} has tensor '{name}', which is not part of an EAGLE-{version} "
                             f"head (expected {', '.join(sorted(expected))})")
        if tuple(tensor.shape) != shape:
            raise ValueError(f"{file}: tensor '{name}' is {tuple(tensor.shape)}, the model needs "
                             f"{shape}")
    missing = sorted(set(expected) - set(tensors))
    if missing:
        raise ValueError(f"{file} lacks the EAGLE-{version} tensors {', '.join(missing)}")
    if "d2t" in tensors:
        draft_to_target = torch.arange(len(tensors["d2t"])) + tensors.pop("d2t").long()
        tensors.pop("t2d", None)
        if int(draft_to_target.min()) < 0 or int(draft_to_target.max()) >= target.vocab_size:
            raise ValueError(f"{file}: tensor 'd2t' maps draft tokens outside the model's "
                             f"vocabulary of {target.vocab_size}")
    vocab = read_draft_vocab(path, target.vocab_size)
    if vocab is not None:
        if version == 3:
            raise ValueError(f"{file}: an EAGLE-3 head has its own draft vocabulary (d2t); "
                             f"remove {DRAFT_VOCAB_FILE}")
        draft_to_target = vocab
    floats = {n: t.float() for n, t in tensors.items()}
    return EagleHeads(version, args, floats, aux, draft_to_target)


def _read_config(path: str) -> tuple[str, dict]:
    """The head's ``config.json``: its path and contents."""
    directory = path if os.path.isdir(path) else os.path.dirname(path)
    config_path = os.path.join(directory, "config.json")
    if not os.path.isfile(config_path):
        raise FileNotFoundError(f"{directory} has no config.json (an EAGLE head's one-layer Llama "
                                f"config)")
    with open(config_path, encoding="utf-8") as f:
        return config_path, json.load(f)


def eagle_head_args(config: EngineConfig, target: ModelArgs) -> Optional[ModelArgs]:
    """The layer of ``speculative_mode="eagle"``'s head from its config alone (for a plan
    without weights); None for other modes."""
    if config.speculative_mode != "eagle":
        return None
    path = config.additional_models[0]
    assert isinstance(path, str)  # (EngineConfig takes a (path, model_lib) pair for small_draft only)
    try:
        return eagle_layer_args(_read_config(path)[1], target)
    except (OSError, ValueError) as err:  # (a damaged config.json: ValueError)
        raise type(err)(f"additional_models[0] (the EAGLE head): {err}") from None


def read_eagle_head(config: EngineConfig, target: ModelArgs) -> Optional[EagleHeads]:
    """``speculative_mode="eagle"``'s head (``additional_models[0]``), checked against the
    target; None for other modes. Errors name ``additional_models[0]``."""
    if config.speculative_mode != "eagle":
        return None
    path = config.additional_models[0]
    assert isinstance(path, str)  # (EngineConfig takes a (path, model_lib) pair for small_draft only)
    try:
        return read_eagle_heads(path, target)
    except (OSError, ValueError) as err:
        raise type(err)(f"additional_models[0] (the EAGLE head): {err}") from None


def eagle_layer_args(config: dict, target: ModelArgs) -> ModelArgs:
    """The head's layer as ``ModelArgs`` (one layer; positions as far as the target's)."""
    d = int(config.get("hidden_size", target.hidden_size))
    heads = int(config.get("num_attention_heads", target.num_heads))
    rope = config.get("rope_scaling")
    return dataclasses.replace(
        target, architecture="eagle", num_layers=1, hidden_size=d,
        intermediate_size=int(config.get("intermediate_size", target.intermediate_size)),
        num_heads=heads, num_kv_heads=int(config.get("num_key_value_heads") or (
            heads if "num_attention_heads" in config else target.num_kv_heads)),
        head_dim=int(config.get("head_dim") or d // heads),
        rms_norm_eps=float(config.get("rms_norm_eps", target.rms_norm_eps)),
        rope_theta=float(config.get("rope_theta", target.rope_theta)),
        rope_scaling=rope if rope else None, attention_bias=False, rotary_dim=None,
        sliding_window=None, sliding_window_layers=None, ssm=None, ssm_layers=())


def _aux_layers(config: dict, target: ModelArgs) -> tuple[int, ...]:
    """EAGLE-3's target layers whose inputs it reads."""
    eagle = config.get("eagle_config") or {}
    ids = eagle.get("eagle_aux_hidden_state_layer_ids") or config.get("eagle_aux_hidden_state_layer_ids")
    n = target.num_layers
    layers = tuple(int(i) for i in ids) if ids else (2, n // 2, n - 3)
    if len(layers) != 3 or any(not 0 <= i < n for i in layers):
        raise ValueError(f"an EAGLE-3 head reads three of the model's {n} layers; its config asks "
                         f"for layers {list(layers)}")
    return layers
