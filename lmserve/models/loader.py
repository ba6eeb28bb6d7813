"""Pick the reader for a model reference: nothing (the built-in model), a GGUF file or a Hugging Face directory."""

from __future__ import annotations

import hashlib
import os
from typing import Literal, Optional, Union, overload

import torch

from lmserve.layers.blocks import BlockWeight
from lmserve.models.args import ModelArgs
from lmserve.models.builtin import builtin_model_path
from lmserve.models.gguf_reader import read_gguf_args, read_gguf_weights
from lmserve.models.hf_reader import read_hf_args, read_hf_weights


def resolve_model_path(model: Optional[str]) -> str:
    """Return the absolute path of the model to load, checking that its format is one lmserve reads.

    ``None`` means the built-in model; otherwise ``model`` must be a ``.gguf`` file or a
    directory holding a Hugging Face ``config.json``.
    """
    if model is None:
        return builtin_model_path()
    path = os.path.abspath(os.path.expanduser(model))
    if not os.path.exists(path):
        raise FileNotFoundError(f"model path {model!r} does not exist")
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise ValueError(f"directory {model!r} has no config.json, so it is not a Hugging Face model directory")
        return path
    if path.lower().endswith(".gguf"):
        return path
    raise ValueError(f"model {model!r} is neither a .gguf file nor a Hugging Face model directory")


def read_model_args(model: Optional[str]) -> ModelArgs:
    """Read a model's hyper-parameters without loading its weights (e.g. to plan memory)."""
    path = resolve_model_path(model)
    return read_hf_args(path) if os.path.isdir(path) else read_gguf_args(path)


@overload
def load_weights(model: Optional[str], keep_blocks: Literal[False] = False) -> dict[str, torch.Tensor]: ...
@overload
def load_weights(model: Optional[str], keep_blocks: bool) -> dict[str, torch.Tensor | BlockWeight]: ...
def load_weights(model: Optional[str], keep_blocks: bool = False) -> Union[dict[str, torch.Tensor],
                                                                           dict[str, torch.Tensor | BlockWeight]]:
    """Load a model's weights keyed by Hugging Face Llama names: float32 tensors, except GGUF
    block-quantized matrices (Q4_0, Q4_1, Q8_0, Q5_0, Q4_K) with ``keep_blocks``, which stay ``BlockWeight``."""
    path = resolve_model_path(model)
    return read_hf_weights(path) if os.path.isdir(path) else read_gguf_weights(path, keep_blocks)


def model_fingerprint(path: str) -> str:
    """A digest of a model's files (a GGUF file or a Hugging Face directory, resolved): their
    sizes and 16 samples of 64 KiB spread over each (hashing whole files of tens of GB would
    hold up every start)."""
    files = [path] if os.path.isfile(path) else sorted(
        os.path.join(path, f) for f in os.listdir(path) if f.endswith((".json", ".safetensors", ".gguf")))
    digest = hashlib.sha256()
    for name in files:
        size = os.path.getsize(name)
        digest.update(f"{os.path.basename(name)}:{size};".encode())
        with open(name, "rb") as f:
            for i in range(16):
                f.seek(size * i // 16)
                digest.update(f.read(1 << 16))
    return digest.hexdigest()[:16]
