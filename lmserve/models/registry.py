"""Architecture name -> model class."""

from __future__ import annotations

from lmserve.models.llama import LlamaModel

MODEL_CLASSES = {
    "llama": LlamaModel,
    "mistral": LlamaModel,
    "qwen2": LlamaModel,
    # Llama-style blocks with a recurrent mixer for attention (some, in a hybrid)
    "mamba": LlamaModel,
    "mamba2": LlamaModel,
    "bamba": LlamaModel,
}


def model_class(architecture: str):
    """The class that runs ``architecture``, or a clear error naming the supported ones."""
    if architecture not in MODEL_CLASSES:
        raise ValueError(
            f"model architecture {architecture!r} is not supported; supported: {sorted(MODEL_CLASSES)}"
        )
    return MODEL_CLASSES[architecture]
