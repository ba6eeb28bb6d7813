"""The model families lmserve runs: one table, read by both file readers and the worker.

A family is known by its Hugging Face ``architectures`` name and its GGUF
``general.architecture``; the class that runs it is imported when first asked for.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Optional


@dataclass(frozen=True)
class Family:
    name: str  # ModelArgs.architecture
    hf_names: tuple[str, ...]  # config.json's "architectures"
    gguf_name: Optional[str]  # GGUF's general.architecture (None: no GGUF layout read)
    rope_permuted: bool = False  # llama.cpp's converter reordered its q/k rows for its RoPE kernel
    model: str = "lmserve.models.llama:LlamaModel"  # module:class


FAMILIES = (
    Family("llama", ("LlamaForCausalLM",), "llama", rope_permuted=True),
    Family("mistral", ("MistralForCausalLM",), "mistral", rope_permuted=True),  # llama's tensor layout
    Family("qwen2", ("Qwen2ForCausalLM",), "qwen2"),
    # Llama-style blocks with a recurrent mixer for attention (some, in a hybrid)
    Family("mamba", ("MambaForCausalLM",), None),
    Family("mamba2", ("Mamba2ForCausalLM",), None),
    Family("bamba", ("BambaForCausalLM",), None),
)
_BY_NAME = {f.name: f for f in FAMILIES}


def family(name: str) -> Family:
    """The family of ``ModelArgs.architecture`` ``name``."""
    if name not in _BY_NAME:
        raise ValueError(f"model architecture {name!r} is not supported; supported: {sorted(_BY_NAME)}")
    return _BY_NAME[name]


def family_of_hf(names: list[str], where: str) -> Family:
    """The family of the first of config.json's ``architectures`` lmserve knows."""
    known = [f for n in names for f in FAMILIES if n in f.hf_names]
    if not known:
        supported = ", ".join(n for f in FAMILIES for n in f.hf_names)
        raise ValueError(f"{where} has architectures {names}, which lmserve does not support "
                         f"(supported: {supported})")
    return known[0]


def family_of_gguf(name: Optional[str], path: str) -> Family:
    """The family of a GGUF file's ``general.architecture``."""
    known = [f for f in FAMILIES if f.gguf_name is not None and f.gguf_name == name]
    if not known:
        supported = ", ".join(sorted(f.gguf_name for f in FAMILIES if f.gguf_name))
        raise ValueError(f"GGUF file {path} has architecture '{name}', which lmserve does not support "
                         f"(supported: {supported})")
    return known[0]


def model_class(architecture: str) -> Any:
    """The class that runs ``architecture`` (imported now)."""
    module, _, cls = family(architecture).model.partition(":")
    return getattr(importlib.import_module(module), cls)
