"""Sampling defaults that fit the model, for what a request leaves unset (as vLLM does).

A Hugging Face directory carries them in ``generation_config.json``; a GGUF file carries none, so
lmserve uses llama.cpp's well-tried defaults there. Without them OpenAI's defaults apply
(temperature 1, top_p 1), at which a small model such as the built-in one often answers
nonsense. A request's explicit values always win; ``generation_config="none"`` (``--generation-
config none``) turns the defaults off.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

from lmserve.sampling_params import SamplingParams

# The sampling fields a model may set defaults for (generation_config.json's names).
FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
# llama.cpp's defaults (common/common.h, llama-server and llama-cli).
LLAMA_CPP_DEFAULTS = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05}
MODES = ("auto", "none")


@dataclass(frozen=True)
class GenerationDefaults:
    """Default values of the sampling ``FIELDS`` (only those the source sets) and where they come from."""

    values: dict[str, Any] = field(default_factory=dict)
    source: str = "off: OpenAI's defaults apply"

    def describe(self) -> str:
        """One line for ``lmserve plan`` and the start-up log."""
        if not self.values:
            return f"sampling defaults: none ({self.source})"
        shown = " ".join(f"{k}={v}" for k, v in self.values.items())
        return f"sampling defaults: {shown} ({self.source}; a request's own values win)"


def check_generation_config(mode: str) -> None:
    """Refuse a ``generation_config`` mode other than ``MODES``."""
    if mode not in MODES:
        raise ValueError(f"generation_config must be one of {', '.join(MODES)}, got {mode!r}")


def read_generation_defaults(model_path: str, mode: str = "auto") -> GenerationDefaults:
    """The sampling defaults of the model at ``model_path`` (a GGUF file or an HF directory).

    ``mode``: ``"auto"`` reads them from the model (llama.cpp's for a GGUF file); ``"none"``
    turns them off. Raises ``ValueError`` for another mode.
    """
    check_generation_config(mode)
    if mode == "none":
        return GenerationDefaults()
    if os.path.isfile(model_path):
        return GenerationDefaults(dict(LLAMA_CPP_DEFAULTS),
                                  "llama.cpp's defaults: a GGUF file carries no generation_config.json")
    path = os.path.join(model_path, "generation_config.json")
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except FileNotFoundError:
        return GenerationDefaults(source="the model has no generation_config.json: OpenAI's defaults apply")
    values = {k: config[k] for k in FIELDS if config.get(k) is not None}
    try:  # a bad value is the model's fault: refused at start, not in every request
        SamplingParams(**values)
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from None
    return GenerationDefaults(values, "from generation_config.json" if values
                              else "generation_config.json sets none: OpenAI's defaults apply")
