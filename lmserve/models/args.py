"""Architecture hyper-parameters of a decoder model, independent of the file format."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional


@dataclass(frozen=True)
class SSMArgs:
    """The shape of a model's Mamba (``version`` 1) or Mamba2 (2) mixers, as transformers names
    them: ``inner`` channels (expand x hidden) through a causal convolution of ``conv_kernel``
    taps, then a selective scan with ``state_size`` states per channel. Mamba2 splits ``inner``
    into ``num_heads`` heads that share B and C within ``n_groups`` groups."""

    version: int
    inner: int
    state_size: int
    conv_kernel: int
    num_heads: int = 0  # Mamba2 heads; Mamba has none (a state per channel)
    n_groups: int = 1  # Mamba2
    dt_rank: int = 0  # Mamba: the width of the low-rank time-step projection
    chunk_size: int = 256  # Mamba2: the scan's chunk (the reference's; any gives the same sums)
    conv_bias: bool = True
    proj_bias: bool = False
    dt_limit: tuple[float, float] = (0.0, float("inf"))  # Mamba2: time steps clamped to this

    @property
    def head_dim(self) -> int:
        return self.inner // self.num_heads if self.version == 2 else 1

    @property
    def conv_dim(self) -> int:
        """Channels through the convolution: x (Mamba), or x, B and C (Mamba2)."""
        return self.inner + (2 * self.n_groups * self.state_size if self.version == 2 else 0)

    @property
    def ssm_state_shape(self) -> tuple[int, ...]:
        """One sequence's scan state in one layer."""
        if self.version == 2:
            return (self.num_heads, self.head_dim, self.state_size)
        return (self.inner, self.state_size)

    @property
    def state_floats(self) -> int:
        """Floats of one sequence's state in one layer: the last ``conv_kernel - 1`` inputs of
        the convolution and the scan state."""
        n = 1
        for d in self.ssm_state_shape:
            n *= d
        return self.conv_dim * (self.conv_kernel - 1) + n


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
    rotary_dim: Optional[int] = None  # partial rotary: the leading dims rotated; None: all
    ssm: Optional[SSMArgs] = None  # the recurrent layers' mixer, for Mamba-family models
    ssm_layers: tuple[int, ...] = ()  # the layers with a recurrent mixer instead of attention
    bos_token_id: Optional[int] = None
    eos_token_ids: list[int] = field(default_factory=list)

    @property
    def attention_layers(self) -> tuple[int, ...]:
        """The layers that attend (and so have KV), in order."""
        return tuple(i for i in range(self.num_layers) if i not in self.ssm_layers)

    @property
    def kv_state_kind(self) -> str:
        """``rnn_state`` for a model with recurrent layers (hybrids too), else ``kv_cache``."""
        return "rnn_state" if self.ssm_layers else "kv_cache"
