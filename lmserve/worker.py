"""Building a worker: one model at an opt level with its attention backend, paged KV cache and
runner, ready to run steps (``ModelRunner.execute``). The engine's target model is one; a draft
model for speculative decoding (small_draft) is a second, with its own KV tensors over the same
page ids."""

from __future__ import annotations

import logging
from typing import Optional, Union

import torch

from lmserve.attention import resolve_attention, why_no_int8_kv
from lmserve.attention.base import AttentionBackend, AttentionShape, create_backend
from lmserve.attention.cpu_paged import CpuPagedBackend
from lmserve.cache.kv import KV_DTYPES, KVCache
from lmserve.cache.state import StateCache
from lmserve.config import OptFlags
from lmserve.layers.compiled import CompiledLayerOps
from lmserve.layers.fused import FusedOps, TorchOps
from lmserve.layers.linear import FLOAT_DTYPES, resolve_act_dtype, resolve_mlp_acts, resolve_weight_format
from lmserve.layers.ssm_kernels import SSMKernels
from lmserve.models.args import ModelArgs
from lmserve.models.llama import LlamaModel
from lmserve.models.loader import load_weights
from lmserve.models.registry import model_class
from lmserve.parallel.all_reduce import AllReduce
from lmserve.parallel.shard import TensorShard, check_shardable, shard_args, shard_weights
from lmserve.parallel.stages import stage_weights
from lmserve.plan import EnginePlan
from lmserve.runner import ModelRunner

logger = logging.getLogger("lmserve")


def prepare_model(model_path: str, args: ModelArgs, opt: OptFlags,
                  shard: Optional[TensorShard] = None, layers: Optional[range] = None,
                  head: bool = True) -> LlamaModel:
    """Load the weights of ``model_path`` and prepare them as ``opt`` asks (the work a model
    library does ahead of time). ``shard``: this rank's part of a tensor-parallel model;
    ``layers``: a pipeline stage's (None: all); ``head``: build the language-model head (the
    rank that samples)."""
    weight_format = resolve_weight_format(opt.weight_dtype)
    blocks = weight_format not in FLOAT_DTYPES
    weights = load_weights(model_path, keep_blocks=blocks)
    if layers is not None:
        weights = stage_weights(weights, layers, layers.start == 0, head)
    if shard is not None:
        check_shardable(args, shard.size, blocks)
        weights = shard_weights(weights, args, shard)
        args = shard_args(args, shard.size)
    act = resolve_act_dtype(opt.act_dtype)
    mlp_act = resolve_mlp_acts(*opt.mlp_act_dtypes())
    return model_class(args.architecture)(args, weights, weight_format, act, mlp_act, head, layers)


def attention_backend(shape: AttentionShape, kv_dtype: str, opt: OptFlags,
                      page_size: int) -> AttentionBackend:
    """The attention ``opt`` asks for over the plan's ``kv_dtype`` cache, which is ``opt``'s
    unless that is int8 where only the C++ kernel reads it and it cannot (logged)."""
    if kv_dtype != opt.kv_dtype:
        logger.warning("kv_dtype=%s is unavailable here (%s); using a %s KV cache", opt.kv_dtype,
                       why_no_int8_kv(shape, page_size), kv_dtype)
    return create_backend(resolve_attention(opt.attention, shape, KV_DTYPES[kv_dtype]), shape)


def build_worker(model: LlamaModel, plan: EnginePlan, opt: OptFlags, device: torch.device,
                 all_reduce: Optional[AllReduce] = None) -> ModelRunner:
    """The runner of ``model`` (prepared, or loaded from a model library) over a KV cache of
    ``plan.num_pages`` pages; ``all_reduce`` sums a tensor-parallel rank's partial outputs."""
    args = model.args
    shape = AttentionShape(args.num_heads, args.num_kv_heads, args.head_dim)
    kv_dtype = KV_DTYPES[plan.kv_dtype]
    backend = None  # a model without attention layers (Mamba) has neither backend nor KV
    if args.attention_layers:
        backend = attention_backend(shape, plan.kv_dtype, opt, plan.page_size)
    num_layers = sum(i in model.layer_ids for i in args.attention_layers)
    kv = KVCache(num_layers, plan.num_pages, plan.page_size, args.num_kv_heads,
                 args.head_dim, kv_dtype, device, backend is not None and backend.keys_transposed)
    states = None
    if plan.state is not None and args.ssm is not None:  # (a plan has state slots for recurrent layers)
        states = StateCache(args.ssm, len(args.ssm_layers), plan.state.num_slots, device)
    # cpu_paged means lmserve's C++ kernels throughout: attention and the element-wise ops.
    ops: Union[FusedOps, TorchOps] = TorchOps()
    if isinstance(backend, CpuPagedBackend) or (backend is None and opt.attention == "cpu_paged"):
        ops = FusedOps.create() or ops
    compiled = CompiledLayerOps() if opt.compile else None  # parse_opt allows it on dense weights only
    # Positions past the context (streaming under a window) are computed as they come.
    positions = min(plan.max_single_sequence_length, args.context_length)
    # The C++ path has the recurrent layers' decode kernels too.
    ssm_kernels = SSMKernels.create() if states is not None and isinstance(ops, FusedOps) else None
    return ModelRunner(model, kv, backend, ops, positions, device, compiled, plan.window,
                       plan.window_layers, states, ssm_kernels, all_reduce)
