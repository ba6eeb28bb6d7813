"""lmserve: an LLM inference and serving engine in Python on PyTorch."""

from lmserve.config import EngineConfig
from lmserve.engine.async_engine import AsyncEngine
from lmserve.engine.engine import Engine
from lmserve.sampling_params import SamplingParams
from lmserve.structured.params import StructuredOutputsParams

__all__ = ["AsyncEngine", "Engine", "EngineConfig", "SamplingParams", "StructuredOutputsParams"]
__version__ = "0.1.0"
