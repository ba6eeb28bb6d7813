"""Where the engine's model comes from: its files, prepared as they load (``ModelFiles``), or a
model library compiled ahead of time (``lmserve.library.ModelLibrary``). The engine, each rank
of a parallel engine and a draft model ask either one for the same things: hyper-parameters,
a rank's built model, the tokenizer, sampling defaults, a fingerprint for the ranks to agree on.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional, Union

from lmserve.config import EngineConfig, OptFlags
from lmserve.generation_defaults import GenerationDefaults, read_generation_defaults
from lmserve.kernels.build import use_prebuilt_kernels
from lmserve.library.library import ModelLibrary, library_fingerprint
from lmserve.models.llama import LlamaModel
from lmserve.models.loader import model_fingerprint, read_model_args, resolve_model_path
from lmserve.parallel.shard import TensorShard
from lmserve.tokenizer import Tokenizer
from lmserve.worker import prepare_model


class ModelFiles:
    """A GGUF file or a Hugging Face directory (None: the built-in model), prepared at load."""

    stage_layers = None  # the plan splits the layers itself

    def __init__(self, model: Optional[str]) -> None:
        self.path = resolve_model_path(model)
        self.args = read_model_args(self.path)

    @property
    def name(self) -> str:
        """The model's file or directory name."""
        return os.path.basename(self.path.rstrip("/"))

    def load_model(self, opt: OptFlags, rank: int = 0, shard: Optional[TensorShard] = None,
                   layers: Optional[range] = None, head: bool = True) -> LlamaModel:
        """Rank ``rank``'s part (``shard``, ``layers``, ``head``: see ``prepare_model``)."""
        return prepare_model(self.path, self.args, opt, shard, layers, head)

    def tokenizer(self) -> Tokenizer:
        return Tokenizer.from_model(self.path)

    def generation_defaults(self, mode: str = "auto") -> GenerationDefaults:
        return read_generation_defaults(self.path, mode)

    def describe(self) -> str:
        return self.path


ModelSource = Union[ModelFiles, ModelLibrary]


def use_kernels_of(config: EngineConfig) -> None:
    """Make this process load its C++ kernels from ``config``'s model library, never compiling
    (without one: build them here). Called where a process starts serving ``config``, before
    anything loads a kernel: ``open_model``, and a parallel engine's other ranks."""
    library = config.model_lib
    use_prebuilt_kernels(Path(library).expanduser().absolute() / "kernels" if library else None)


def open_model(config: EngineConfig) -> tuple[EngineConfig, ModelSource]:
    """The model ``config`` asks for, and the config to run it with: a library's own opt and
    parallel split replace what ``config`` gives (see ``ModelLibrary.apply``). This process's
    kernels come from the library, if any (a draft model's library uses them too: it was
    checked against the same code and CPU)."""
    use_kernels_of(config)
    if config.model_lib is None:
        return config, ModelFiles(config.model)
    library = ModelLibrary.open(config.model_lib, config.model)
    return library.apply(config), library


def open_draft_model(entry: Union[str, tuple[str, str]]) -> ModelSource:
    """An ``additional_models`` entry: a model's path, or ``(path, model_lib)``."""
    if isinstance(entry, str):
        return ModelFiles(entry)
    library = ModelLibrary.open(entry[1], entry[0])
    if library.info.ranks > 1:
        raise ValueError(f"{entry[1]} was compiled for {library.info.ranks} ranks; a draft model "
                         f"runs in one process: compile it without tensor or pipeline parallelism")
    return library


def fingerprint(config: EngineConfig) -> str:
    """A digest of what ``config`` serves (the model's files, or the library's contents), for
    the ranks of a parallel engine to agree on without loading anything."""
    if config.model_lib is not None:
        return library_fingerprint(config.model_lib)
    return model_fingerprint(resolve_model_path(config.model))
