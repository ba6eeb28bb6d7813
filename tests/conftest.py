"""Shared fixtures: engines are expensive to load, so tests share them per session."""

from __future__ import annotations

import os
import time

import pytest
import torch

from lmserve import Engine
from lmserve.models.builtin import builtin_model_path
from tiny_models import make_hf_llama

# Tests run on a shared 2-core machine; more threads than cores only adds contention.
torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture(scope="session")
def builtin_engine():
    """The built-in model on the full-precision path (opt O0), room for 8 sequences."""
    engine = Engine(opt="O0", max_num_sequence=8, max_total_sequence_length=8192, verbose=False)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    """A 2-layer random Llama saved as a Hugging Face directory (loads in a fraction of a second)."""
    return make_hf_llama(str(tmp_path_factory.mktemp("tiny") / "model"), num_layers=2, seed=3)


@pytest.fixture(scope="session")
def hf_builtin():
    """transformers' own float32 model from the built-in GGUF: the reference."""
    from transformers import AutoModelForCausalLM

    path = builtin_model_path()
    model = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32
    )
    return model.eval()


def wait_idle(engine: Engine, timeout: float = 30.0) -> None:
    """Wait until the engine thread has processed every request and abort."""
    deadline = time.monotonic() + timeout
    while not engine.is_idle():
        if time.monotonic() > deadline:
            raise AssertionError("engine still busy after %.0f s" % timeout)
        time.sleep(0.01)
