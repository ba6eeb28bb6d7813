"""One greedy sequence's next tokens, pass after pass, in one C++ call: a draft model's drafts
(``spec.draft_model``) and a lone sequence's tokens (``engine.multi_step``).

A pass of one token is a few milliseconds of kernels (the built-in model at O3: the layers
2.7 ms, the head 0.9) and, run from Python, half a millisecond more: building the step's
tensors, the call list's arguments, a torch ``topk`` or ``argmax`` over the vocabulary, all with
caches the weights just swept. A ``GreedyChain`` prepares the step's metadata once for every pass
of the chain, as for one step of all its tokens, and runs one call list pass after pass
(``CallList.run_passes``): the token's embedding and a greedy pick that feeds the next pass
(``kernels/decode_chain.cpp``) around the layers' calls, the final norm and the head, stopping
after a token that ends the chain (a near tie, a stop token). The same kernels on the same
inputs: the same tokens and KV bits as passes from Python (tests/test_greedy_chain.py).
"""

from __future__ import annotations

import ctypes
from typing import Optional

import torch

from lmserve.attention.base import AttentionInput
from lmserve.attention.cpu_paged import CpuPagedBackend
from lmserve.kernels.build import load_kernel_library
from lmserve.layers.call_list import THREADS, CallList, Slot, address, float_word
from lmserve.layers.fused import FusedOps
from lmserve.models.llama import LlamaModel
from lmserve.runner import ModelRunner

# The chain's own slots, beside the layers' (the buffers, "x", "tokens", the attention's).
_TOKEN, _NEXT, _LEAD, _STOP = Slot("chain.token"), Slot("chain.next"), Slot("chain.lead"), Slot("chain.stop")
_STOP_IDS, _NUM_STOP_IDS, _MARGIN = Slot("chain.stop_ids"), Slot("chain.num_stop_ids"), Slot("chain.margin")
_HIDDEN, _LOGITS = Slot("chain.hidden"), Slot("chain.logits")


def _library() -> Optional[ctypes.CDLL]:
    return load_kernel_library("decode_chain", {})  # (its packed calls go by address)


class GreedyChain:
    """``run``: one sequence's greedy tokens from a runner (a draft model's, or the target's)."""

    @staticmethod
    def build(runner: ModelRunner) -> Optional[GreedyChain]:
        """A chain over ``runner``'s model, or None where a pass is not all C++ kernels (see
        ``LlamaModel.layer_calls``), or has more than a plain decoder's (a sliding window,
        recurrent state, parallel ranks, inner features kept for drafters)."""
        if not isinstance(runner, ModelRunner):
            return None
        model = runner.model
        plain = (runner.layer_calls is not None and runner.window is None and runner.states is None
                 and runner.all_reduce is None and runner.feature_layers is None)
        if not (plain and isinstance(model, LlamaModel) and model.first and model.last
                and model.lm_head is not None and model.lm_head.packable(model.dtype)
                and getattr(model, "embed", None) is not None and model.embed.is_contiguous()
                and model.embed.dtype in (torch.float32, torch.bfloat16)
                and model.lm_head.n <= model.embed.shape[0]):  # (every pick has an embedding)
            return None
        lib = _library()
        return None if lib is None else GreedyChain(runner, lib)

    def __init__(self, runner: ModelRunner, lib: ctypes.CDLL) -> None:
        self.runner = runner
        model, ops, backend = runner.model, runner.ops, runner.backend
        assert isinstance(ops, FusedOps) and isinstance(backend, CpuPagedBackend)
        self.backend = backend
        self.buffers = {name: torch.empty(1, width, dtype=dtype)
                        for name, (width, dtype) in runner.layer_calls.buffers.items()}
        self.x = torch.empty(1, model.args.hidden_size)
        self.hidden = torch.empty(1, model.args.hidden_size, dtype=model.dtype)
        self.logits = torch.empty(1, model.lm_head.n, dtype=model.dtype)  # (the head's output dtype)
        tokens = Slot("tokens")
        embed = model.embed
        calls = [
            [address(lib.lm_embed_row_packed), embed.data_ptr(), int(embed.dtype == torch.bfloat16),
             embed.shape[1], _TOKEN, Slot("x")],
            *model.packed_layer_calls(backend, ops, runner.kv),
            ops.packed_add_rms_norm(Slot("x"), Slot("down"), self.buffers["down"].dtype, model.norm,
                                    model.args.rms_norm_eps, _HIDDEN, model.dtype, tokens),
            model.lm_head.packed_call(_HIDDEN, model.dtype, _LOGITS, tokens),
            [address(lib.lm_greedy_pick_packed), _LOGITS, int(model.dtype == torch.bfloat16),
             model.lm_head.n, _MARGIN, _STOP_IDS, _NUM_STOP_IDS, _NEXT, _LEAD, _STOP],
        ]
        self.calls = CallList(calls)

    def run(self, token: int, start: int, page_table: list[int], passes: int,
            stop_ids: list[int], margin: float) -> list[int]:
        """Up to ``passes`` greedy tokens after ``token`` at position ``start`` (its KV and the
        new tokens' but the last are written in the pages of ``page_table``); it stops after a
        token that leads the next best by less than ``margin`` or is one of ``stop_ids``."""
        runner, backend = self.runner, self.backend
        meta = backend.prepare(AttentionInput(query_lens=[passes], context_lens=[start + passes],
                                                     page_tables=[page_table]),
                                      runner.kv.page_size, runner.device)
        cos, sin = runner.rotary.lookup(torch.arange(start, start + passes))
        cos, sin = cos.contiguous(), sin.contiguous()
        chain = torch.zeros(passes + 1, dtype=torch.int64)  # the token, then each pass's pick
        chain[0] = token
        leads = torch.zeros(passes, dtype=torch.float32)
        stop = torch.zeros(1, dtype=torch.int32)
        stops = torch.tensor(stop_ids or [0], dtype=torch.int64)
        values = {name: b.data_ptr() for name, b in self.buffers.items()}
        values |= {"x": self.x.data_ptr(), "tokens": 1, THREADS.name: torch.get_num_threads(),
                   _HIDDEN.name: self.hidden.data_ptr(), _LOGITS.name: self.logits.data_ptr(),
                   _TOKEN.name: chain.data_ptr(), _NEXT.name: chain.data_ptr() + 8,
                   _LEAD.name: leads.data_ptr(), _STOP.name: stop.data_ptr(),
                   _STOP_IDS.name: stops.data_ptr(), _NUM_STOP_IDS.name: len(stop_ids),
                   _MARGIN.name: float_word(margin)}
        values |= backend.call_values(meta, cos, sin)
        strides = backend.token_strides(meta, cos, sin) | {_TOKEN.name: 8, _NEXT.name: 8, _LEAD.name: 4}
        done = self.calls.run_passes(values, passes, strides, stop)
        return chain[1 : done + 1].tolist()
