"""A built model as data: its object tree as JSON plus its tensors by name, and back.

A model is a small tree of plain objects (``LlamaModel`` -> layers -> linear layers) whose
leaves are tensors already in the form the engine runs (packed blocks, bf16 casts) and a few
numbers. ``to_tree`` walks it into JSON-able values, tensors replaced by names; ``from_tree``
rebuilds it without running any constructor, so nothing is prepared again. Only the classes in
``_classes`` may appear (the tree names classes and never calls anything it carries): anything
else is refused when the library is written, and a tree naming another class when it is read.
(A library also holds built kernels, which are native code: serve libraries you trust, as you
would any shared object.)
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch


def _classes() -> dict[str, type[object]]:
    """The classes a model's tree may hold."""
    from lmserve.layers.linear import BlockLinear, DenseLinear
    from lmserve.layers.ssm import MambaMixer
    from lmserve.models.args import ModelArgs, SSMArgs
    from lmserve.models.llama import LlamaLayer, LlamaModel
    from lmserve.models.mamba import MixerLayer

    return {c.__name__: c for c in (LlamaModel, LlamaLayer, MixerLayer, MambaMixer, DenseLinear,
                                    BlockLinear, ModelArgs, SSMArgs)}


def to_tree(obj: Any) -> tuple[Any, dict[str, torch.Tensor]]:
    """``obj`` as JSON-able data and the tensors it names (one name per tensor object, so a
    tensor held twice, as a tied embedding and head, is stored once)."""
    classes = _classes()
    tensors: dict[str, torch.Tensor] = {}
    names: dict[int, str] = {}

    def encode(value: Any, path: str) -> Any:
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        if isinstance(value, torch.Tensor):
            if id(value) not in names:
                names[id(value)] = path
                tensors[path] = value
            return {"tensor": names[id(value)]}
        if isinstance(value, torch.dtype):
            return {"dtype": str(value).removeprefix("torch.")}
        if isinstance(value, range):
            return {"range": [value.start, value.stop, value.step]}
        if isinstance(value, list):
            return [encode(v, f"{path}.{i}") for i, v in enumerate(value)]
        if isinstance(value, tuple):
            return {"tuple": [encode(v, f"{path}.{i}") for i, v in enumerate(value)]}
        if isinstance(value, dict) and all(isinstance(k, str) for k in value):
            return {"dict": {k: encode(v, f"{path}.{k}") for k, v in value.items()}}
        kind = type(value).__name__
        if classes.get(kind) is type(value):
            fields = ({f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
                      if dataclasses.is_dataclass(value) else vars(value))
            return {"object": kind,
                    "fields": {k: encode(v, f"{path}.{k}" if path else k) for k, v in fields.items()}}
        raise TypeError(f"{path or 'the model'}: a {kind} cannot be stored in a model library")

    return encode(obj, ""), tensors


def from_tree(tree: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """The object ``to_tree`` described, over ``tensors`` (not copied)."""
    classes = _classes()

    def decode(value: Any) -> Any:
        if isinstance(value, list):
            return [decode(v) for v in value]
        if not isinstance(value, dict):
            return value
        if value.keys() == {"object", "fields"}:
            cls = classes.get(value["object"])
            if cls is None:
                raise ValueError(f"the model's tree holds a {value['object']!r}, which lmserve does not load")
            fields = {k: decode(v) for k, v in value["fields"].items()}
            if dataclasses.is_dataclass(cls):
                return cls(**fields)
            obj = cls.__new__(cls)
            obj.__dict__.update(fields)
            return obj
        kind: Any
        body: Any  # JSON: what the kind says
        (kind, body), = value.items() if len(value) == 1 else [(None, None)]
        if kind == "tensor":
            if body not in tensors:
                raise ValueError(f"the model's tree names tensor {body!r}, which the file lacks")
            return tensors[body]
        if kind == "dtype" and isinstance(getattr(torch, str(body), None), torch.dtype):
            return getattr(torch, body)
        if kind == "range":
            return range(*body)
        if kind == "tuple":
            return tuple(decode(v) for v in body)
        if kind == "dict":
            return {k: decode(v) for k, v in body.items()}
        raise ValueError(f"the model's tree has an entry lmserve does not read: {value!r:.200}")

    return decode(tree)
