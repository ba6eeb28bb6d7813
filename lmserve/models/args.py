"""Architecture hyper-parameters of a decoder model, independent of the file format."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional


@dataclass
class ModelArgs:
    """What the model code needs to know about an architecture.

    Filled by the GGUF reader (from ``llama.*`` metadata) or by the Hugging Face
    reader (from ``config.json``); the model code never looks at either format.
    """

    architecture: str  # registry key, e.g. "llama", "qwen2", "mistral"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # Hugging Face style rope scaling dict ({"rope_type": "llama3", "factor": ...}) or None.
    rope_scaling: Optional[dict[str, Any]] = None
    context_length: int = 2048  # the model's context window (max position embeddings)
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2 has biases on q/k/v
    sliding_window: Optional[int] = None  # the model's own sliding window, if it has one
    # The layers that have it (transformers' layer_types "sliding_attention"); None: every layer.
    sliding_window_layers: Optional[tuple[int, ...]] = None
    bos_token_id: Optional[int] = None
    eos_token_ids: list[int] = field(default_factory=list)
