"""Llama-family decoder (Llama, Mistral, Qwen2) over a flat batch of tokens from many sequences,
and the Mamba family on the same frame: a Mamba or Mamba2 model is a stack of blocks whose
attention is a recurrent mixer (``models.mamba.MixerLayer``), a hybrid such as Bamba interleaves
those with attention blocks.

There is no batch dimension: ``T`` tokens of all scheduled sequences sit back to back, and the
attention backend knows which tokens belong to which sequence and where their KV pages are (the
recurrent layers: which slots hold their state, ``ForwardContext.state_meta``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional, TypeGuard, Union

import torch

from lmserve.attention.base import AttentionBackend
from lmserve.attention.cpu_paged import CpuPagedBackend, PagedMeta
from lmserve.cache.kv import KVCache
from lmserve.cache.state import StateCache
from lmserve.layers.blocks import BlockWeight
from lmserve.layers.call_list import THREADS, Arg, CallList, Slot, call_lists_available
from lmserve.layers.compiled import CompiledLayerOps
from lmserve.layers.fused import FusedOps, TorchOps
from lmserve.layers.linear import ACT_TENSOR_DTYPES, DenseLinear, Linear, MlpActs, Weight, dense_weight, make_linear
from lmserve.layers.rotary import RotaryEmbedding, partial_rotary_order
from lmserve.layers.ssm import StateMeta
from lmserve.layers.ssm_kernels import SSMKernels
from lmserve.models.args import ModelArgs
from lmserve.models.mamba import MixerLayer


@dataclass
class ForwardContext:
    """What every layer of one step shares: attention metadata, rotary angles, the KV cache."""

    backend: Optional[AttentionBackend]  # None: a model without attention layers (Mamba)
    attn_meta: object
    ops: Union[TorchOps, FusedOps]  # residual add + RMSNorm, SiLU * up
    cos: torch.Tensor  # (T, hd)
    sin: torch.Tensor  # (T, hd)
    kv: KVCache
    layer_calls: Optional[LayerCalls] = None  # the layers as one C++ call, where they can be
    compiled: Optional[CompiledLayerOps] = None  # opt compile=1: the torch ops as compiled graphs
    windowed: tuple[bool, ...] = ()  # per layer: it attends within the step's sliding window
    states: Optional[StateCache] = None  # the recurrent layers' state slots
    state_meta: Optional[StateMeta] = None  # which slots this step's sequences read and write
    ssm_kernels: Optional[SSMKernels] = None  # the recurrent layers' C++ decode kernels
    # Layers whose input (the residual stream before they run) ``forward`` keeps in
    # ``captured``, for drafters on the target's inner hidden states (EAGLE-3).
    capture: tuple[int, ...] = ()
    captured: dict[int, torch.Tensor] = field(default_factory=dict)
    # Tensor parallelism: sums o's and down's partial outputs over the ranks, in place.
    all_reduce: Optional[Callable[[torch.Tensor], None]] = None


@dataclass
class LayerCalls:
    """Every decoder layer of a step as one ``CallList``, and the buffers passed between calls."""

    calls: CallList
    buffers: dict[str, tuple[int, torch.dtype]]  # name -> (width, dtype), ``LlamaLayer.buffers``

    def run(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """Run the layers on the residual ``x`` (T, D) in place; returns the last MLP output."""
        tokens = x.shape[0]
        buffers = {name: torch.empty(tokens, width, dtype=dtype) for name, (width, dtype) in self.buffers.items()}
        values = {name: b.data_ptr() for name, b in buffers.items()}
        values |= {"x": x.data_ptr(), "tokens": tokens, THREADS.name: torch.get_num_threads()}
        cos, sin = ctx.cos.contiguous(), ctx.sin.contiguous()  # alive until the calls return
        backend, meta = ctx.backend, ctx.attn_meta
        # layer_calls builds a LayerCalls only on the C++ paged attention
        assert isinstance(backend, CpuPagedBackend) and isinstance(meta, PagedMeta)
        self.calls.run(values | backend.call_values(meta, cos, sin))
        return buffers["down"]


class LlamaLayer:
    """One decoder block with fused q/k/v and gate/up projections.

    The residual stream stays float32; matmul inputs are ``act`` (float32 on the reference
    path; bfloat16, or int8 quantized inside the matmul, on the fast ones) into q/k/v and o, and
    ``mlp_act`` into the MLP's two projections, so rounding does not pile up over the layers.
    """

    def __init__(self, args: ModelArgs, w: dict[str, Weight], prefix: str, fmt: str, act: str,
                 mlp_act: MlpActs, kv_index: int):
        """``kv_index``: this layer's place among the model's attention layers (its KV)."""
        def get(name: str) -> Weight:
            return w[prefix + name]

        attn = "self_attn."
        q, k, v = (get(attn + f"{p}_proj.weight") for p in "qkv")
        biases = [dense_weight(get(attn + f"{p}_proj.bias")) for p in "qkv"] if args.attention_bias else None
        if args.rotary_dim is not None:  # partial rotary (dense weights: Hugging Face models)
            order = partial_rotary_order(args.head_dim, args.rotary_dim)

            def reorder(t: torch.Tensor) -> torch.Tensor:  # each head's rows (and bias entries)
                return t.view(-1, args.head_dim, *t.shape[1:])[:, order].reshape(t.shape)

            q, k = reorder(dense_weight(q)), reorder(dense_weight(k))
            if biases is not None:
                biases[:2] = [reorder(b) for b in biases[:2]]
        qkv_bias = torch.cat(biases) if biases is not None else None
        self.kv_index = kv_index
        self.qkv = make_linear([q, k, v], qkv_bias, fmt, act)
        # Llama configs with attention_bias=True also have an o_proj bias
        o_bias = w.get(prefix + attn + "o_proj.bias")
        self.o = make_linear([get(attn + "o_proj.weight")], None if o_bias is None else dense_weight(o_bias), fmt,
                             act)
        self.gate_up = make_linear([get("mlp.gate_proj.weight"), get("mlp.up_proj.weight")], None, fmt,
                                   mlp_act.gate_up)
        self.down = make_linear([get("mlp.down_proj.weight")], None, fmt, mlp_act.down)
        self.norm1 = dense_weight(get("input_layernorm.weight")).float()
        self.norm2 = dense_weight(get("post_attention_layernorm.weight")).float()
        self.dtype = ACT_TENSOR_DTYPES[act]  # into q/k/v (and so into o: attention returns qkv's dtype)
        self.mlp_dtype = mlp_act.dtype  # into gate/up (and so into down)
        self.eps = args.rms_norm_eps

    def __call__(self, x: torch.Tensor, delta: Optional[torch.Tensor], ctx: ForwardContext,
                 layer: int) -> torch.Tensor:
        """Add the previous sublayer's output ``delta`` to the residual ``x`` (T, D) in place, run
        the block, and return its MLP output, which the next norm adds in turn."""
        ops, compiled = ctx.ops, ctx.compiled
        if compiled is not None:  # the same ops, as graphs shared by every layer (dense weights)
            assert isinstance(self.qkv, DenseLinear)  # parse_opt allows compile on dense weights only
            qkv = compiled.before_attention(x, delta, self.norm1, self.eps, self.dtype, self.qkv.weight,
                                            self.qkv.bias)
        else:
            qkv = self.qkv(ops.add_rms_norm(x, delta, self.norm1, self.eps, self.dtype))
        assert ctx.backend is not None  # (a model with attention layers has a backend)
        attn = ctx.backend.forward(
            ctx.attn_meta, qkv, ctx.cos, ctx.sin, ctx.kv.k[self.kv_index], ctx.kv.v[self.kv_index],
            windowed=bool(ctx.windowed) and ctx.windowed[layer],
        )  # (T, H * hd)
        if compiled is not None:
            assert isinstance(self.o, DenseLinear) and isinstance(self.gate_up, DenseLinear) \
                and isinstance(self.down, DenseLinear)  # dense weights, as above
            return compiled.after_attention(x, attn, self.o.weight, self.o.bias, self.norm2, self.eps,
                                            self.mlp_dtype, self.gate_up.weight, self.down.weight)
        o = self.o(attn)
        if ctx.all_reduce is not None:
            ctx.all_reduce(o)
        h = ops.add_rms_norm(x, o, self.norm2, self.eps, self.mlp_dtype)
        down = self.down(ops.silu_mul(self.gate_up(h)))
        if ctx.all_reduce is not None:
            ctx.all_reduce(down)
        return down

    def buffers(self, sinks: bool = False) -> dict[str, tuple[int, torch.dtype]]:
        """The step buffers between the calls of ``packed_calls``: name -> (width, dtype)
        (``sinks``: with the queries of windowed layers against their attention sinks)."""
        d, f, heads = self.o.n, self.gate_up.n // 2, self.o.k  # o maps heads * hd -> hidden
        return {"norm1": (d, self.dtype), "qkv": (self.qkv.n, self.dtype),
                "q_rotated": (heads, torch.float32), "attn": (heads, self.dtype), "o": (d, self.dtype),
                "norm2": (d, self.mlp_dtype), "gate_up": (2 * f, self.mlp_dtype),
                "act": (f, self.mlp_dtype), "down": (d, self.mlp_dtype)} | (
                    {"q_sink": (heads, torch.float32)} if sinks else {})

    def packed_calls(self, backend, ops: FusedOps, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     first: bool, windowed: bool = False, sinks: bool = False,
                     all_reduce=None) -> list[list[Arg]]:
        """``__call__`` as kernel calls for a ``CallList``: the same kernels on the same inputs in
        the same order, on the step buffers of ``buffers`` and the residual ``x``, in place; the
        MLP output is left in ``down``, which the next layer adds (none when ``first``).
        ``all_reduce``: tensor parallelism's (``ShmAllReduce``), after o and after down."""
        x, t, dt, mdt = Slot("x"), Slot("tokens"), self.dtype, self.mlp_dtype
        buf = {name: Slot(name) for name in self.buffers(sinks)}
        q_sink = buf["q_sink"] if windowed and sinks else 0
        d = self.o.n
        summed = ([[all_reduce.packed_call(buf["o"], dt, t, d)],
                   [all_reduce.packed_call(buf["down"], mdt, t, d)]] if all_reduce else [[], []])
        return [
            ops.packed_add_rms_norm(x, 0 if first else buf["down"], mdt, self.norm1, self.eps,
                                    buf["norm1"], dt, t),
            self.qkv.packed_call(buf["norm1"], dt, buf["qkv"], t),
            backend.packed_call(buf["qkv"], dt, buf["q_rotated"], k_cache, v_cache, buf["attn"], t,
                                windowed, q_sink),
            self.o.packed_call(buf["attn"], dt, buf["o"], t),
            *summed[0],
            ops.packed_add_rms_norm(x, buf["o"], dt, self.norm2, self.eps, buf["norm2"], mdt, t),
            self.gate_up.packed_call(buf["norm2"], mdt, buf["gate_up"], t),
            ops.packed_silu_mul(buf["gate_up"], buf["act"], mdt, t, self.gate_up.n // 2),
            self.down.packed_call(buf["act"], mdt, buf["down"], t),
            *summed[1],
        ]


class LlamaModel:
    """The whole decoder: embedding, layers, final norm and the language-model head."""

    def __init__(self, args: ModelArgs, weights: dict[str, Weight], weight_format: str,
                 act_dtype: str, mlp_act: Optional[MlpActs] = None, head: bool = True,
                 layers: Optional[range] = None):
        """``weight_format``: how matmul weights are held, see ``make_linear``; ``act_dtype``:
        activations entering the attention projections and the head (float32, bfloat16, int8);
        ``mlp_act``: entering the MLP's projections (None: act_dtype); ``head``: build the
        language-model head (not on a parallel rank that never samples); ``layers``: a
        pipeline stage's (None: all), whose KV and state are then the stage's own."""
        self.args = args
        self.dtype = ACT_TENSOR_DTYPES[act_dtype]
        self.layer_ids = range(args.num_layers) if layers is None else layers
        self.first = self.layer_ids.start == 0  # embeds the tokens
        self.last = self.layer_ids.stop == args.num_layers  # ends with the final norm
        embed = weights.get("model.embed_tokens.weight")
        if embed is not None:
            dense_embed = embed.dequantize() if isinstance(embed, BlockWeight) else embed
            self.embed = dense_embed.to(self.dtype)  # (V, D), looked up by token id
        mlp_act = mlp_act or MlpActs(act_dtype, act_dtype)
        attention, recurrent = args.attention_layers, args.ssm_layers
        before = self.layer_ids.start  # layers of earlier stages: not in this one's KV and state
        self.layers: list[Union[LlamaLayer, MixerLayer]] = [
            MixerLayer(args, weights, f"model.layers.{i}.", weight_format, act_dtype, mlp_act,
                       recurrent.index(i) - sum(r < before for r in recurrent)) if i in recurrent else
            LlamaLayer(args, weights, f"model.layers.{i}.", weight_format, act_dtype, mlp_act,
                       attention.index(i) - sum(a < before for a in attention))
            for i in self.layer_ids
        ]
        self.norm = dense_weight(weights["model.norm.weight"]).float()
        self.lm_head: Optional[Linear] = None
        if head:
            head_weight = weights.get("lm_head.weight")
            if head_weight is None or args.tie_word_embeddings:
                head_weight = embed
            assert head_weight is not None  # a model's head, or its embedding when tied
            self.lm_head = make_linear([head_weight], None, weight_format, act_dtype)
            if head_weight is embed and isinstance(self.lm_head, DenseLinear) \
                    and self.lm_head.weight.dtype == self.dtype:
                self.embed = self.lm_head.weight  # tied and dense in the same dtype: one copy

    def layer_calls(self, backend: AttentionBackend, ops: Union[TorchOps, FusedOps],
                    kv: KVCache, windowed: tuple[bool, ...] = (),
                    sinks: bool = False, all_reduce=None) -> Optional[LayerCalls]:
        """The layers as one C++ call a step, or None where a part of a layer is not a C++ kernel
        (the torch paths, dense weights other than float32 on a CPU, biases, an all-reduce over gloo) or the call-list
        runner did not build. ``windowed``: per layer, it attends within the step's sliding
        window (which has ``sinks``); ``all_reduce``: tensor parallelism's, or None."""
        layers = self.layers
        if not _attention_only(layers):
            return None
        if all_reduce is not None and all_reduce.packed_call is None:
            return None
        linears = [(m, dtype) for layer in layers
                   for m, dtype in ((layer.qkv, layer.dtype), (layer.o, layer.dtype),
                                    (layer.gate_up, layer.mlp_dtype), (layer.down, layer.mlp_dtype))]
        if not (isinstance(ops, FusedOps) and isinstance(backend, CpuPagedBackend) and call_lists_available()
                and all(m.packable(dtype) for m, dtype in linears)):
            return None
        return LayerCalls(CallList(self.packed_layer_calls(backend, ops, kv, windowed, sinks, all_reduce)),
                          layers[0].buffers(sinks))

    def packed_layer_calls(self, backend: CpuPagedBackend, ops: FusedOps, kv: KVCache,
                           windowed: tuple[bool, ...] = (), sinks: bool = False,
                           all_reduce=None) -> list[list[Arg]]:
        """Every layer's ``packed_calls`` in order (where ``layer_calls`` gives a ``LayerCalls``)."""
        layers = self.layers
        assert _attention_only(layers)  # as layer_calls checked
        return [call for i, layer in enumerate(layers)
                for call in layer.packed_calls(backend, ops, kv.k[i], kv.v[i], first=i == 0,
                                               windowed=bool(windowed) and windowed[i], sinks=sinks,
                                               all_reduce=all_reduce)]

    def rotary(self, max_positions: int, device: torch.device) -> RotaryEmbedding:
        a = self.args
        return RotaryEmbedding(a.head_dim, max_positions, a.rope_theta, a.rope_scaling, device,
                               a.rotary_dim)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, ctx: ForwardContext,
                residual: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Hidden states ``(T, D)`` after the final norm for the flat batch ``input_ids (T,)``;
        a pipeline stage's: from the previous stage's ``residual`` (not the first stage), and
        the float32 residual stream after its layers (not the last stage)."""
        # (T, D) float32 residual stream, updated in place
        x = self.embed[input_ids].float() if residual is None else residual
        if ctx.layer_calls is not None and not ctx.capture:
            delta = ctx.layer_calls.run(x, ctx)
        else:
            delta = None
            for i, layer in enumerate(self.layers):
                if i in ctx.capture:
                    ctx.captured[i] = x.clone() if delta is None else x + delta.float()
                delta = layer(x, delta, ctx, i)
        if not self.last:  # what the next stage's first norm would add, as the fused ops add it
            assert delta is not None  # a stage has layers
            return x.add_(delta.float())
        return ctx.ops.add_rms_norm(x, delta, self.norm, self.args.rms_norm_eps, self.dtype)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits ``(S, V)`` for the selected hidden states ``(S, D)``."""
        assert self.lm_head is not None  # asked only of a model built with its head
        return self.lm_head(hidden).float()


def _attention_only(layers: list[Union[LlamaLayer, MixerLayer]]) -> TypeGuard[list[LlamaLayer]]:
    """Whether every layer is an attention block (no recurrent mixer)."""
    return not any(isinstance(layer, MixerLayer) for layer in layers)
