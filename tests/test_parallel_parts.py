"""The parts of tensor parallelism on their own: weight shards (dense and GGUF blocks), the
shared-memory all-reduce and the shared-memory command channel."""

from __future__ import annotations

import dataclasses
import queue
import struct
import subprocess
import threading

import pytest
import torch

from lmserve.layers.blocks import BlockWeight
from lmserve.models.loader import load_weights, read_model_args
from lmserve.parallel.all_reduce import SLOT_BYTES, ShmAllReduce, create_segment, segment_bytes, shm_available
from lmserve.parallel.commands import COMMAND_BYTES, RankLost, ShmCommands, command_segment_bytes
from lmserve.parallel.shard import TensorShard, check_shardable, shard_args, shard_weights
from tiny_models import make_gguf_llama


@pytest.fixture(scope="module")
def q41_model(tmp_path_factory) -> str:
    return make_gguf_llama(str(tmp_path_factory.mktemp("q41") / "m.gguf"), "Q4_1", seed=5,
                           hidden_size=128, intermediate_size=256, num_heads=4, num_kv_heads=4,
                           tokenizer=False)


def _dense(w) -> torch.Tensor:
    return w.dequantize() if isinstance(w, BlockWeight) else w


@pytest.mark.parametrize("size", [2, 4])
def test_shards_of_blocks_add_up_to_the_layer(q41_model, size):
    """Each rank's q/k/v and gate/up rows and o/down columns are the file's own blocks (not
    re-quantized), and the ranks' partial outputs of o and down sum to the whole layer's."""
    args = read_model_args(q41_model)
    full = load_weights(q41_model, keep_blocks=True)
    parts = [shard_weights(full, args, TensorShard(r, size)) for r in range(size)]
    layer = "model.layers.1."
    for name, axis in (("self_attn.q_proj", 0), ("self_attn.k_proj", 0), ("mlp.up_proj", 0),
                       ("self_attn.o_proj", 1), ("mlp.down_proj", 1)):
        whole = full[layer + name + ".weight"]
        assert isinstance(whole, BlockWeight)
        pieces = [p[layer + name + ".weight"] for p in parts]
        assert all(isinstance(p, BlockWeight) and p.bits == 4 for p in pieces)
        assert torch.equal(torch.cat([p.codes for p in pieces], dim=axis), whole.codes)
        assert torch.equal(torch.cat([p.scale for p in pieces], dim=axis), whole.scale)
    x = torch.randn(3, args.num_heads * args.head_dim)
    o = full[layer + "self_attn.o_proj.weight"]
    heads = args.num_heads // size * args.head_dim
    partial = sum(x[:, r * heads:(r + 1) * heads] @ _dense(parts[r][layer + "self_attn.o_proj.weight"]).T
                  for r in range(size))
    torch.testing.assert_close(partial, x @ _dense(o).T, rtol=1e-5, atol=1e-5)
    rank_args = shard_args(args, size)
    assert (rank_args.num_heads, rank_args.num_kv_heads, rank_args.intermediate_size) == (
        args.num_heads // size, args.num_kv_heads // size, args.intermediate_size // size)
    assert parts[0][layer + "input_layernorm.weight"] is full[layer + "input_layernorm.weight"]


def test_a_split_that_does_not_fit_is_refused_with_the_numbers(q41_model):
    args = dataclasses.replace(read_model_args(q41_model), num_heads=8, num_kv_heads=2,
                               head_dim=16, intermediate_size=256)
    with pytest.raises(ValueError, match=r"tensor_parallel_shards=4 must divide the model's "
                                         r"num_kv_heads \(2\); values that fit: \[1, 2\]"):
        check_shardable(args, 4, blocks=False)
    wide = dataclasses.replace(args, num_kv_heads=8)
    # 8 ranks of 1 head: o's 16 inputs per rank would split its blocks of 32
    with pytest.raises(ValueError, match=r"o_proj's quantized blocks: each rank's 16 inputs are "
                                         r"not a multiple of 32; values that fit: \[1, 2, 4\]"):
        check_shardable(wide, 8, blocks=True)
    check_shardable(wide, 8, blocks=False)  # dense weights split anywhere
    with pytest.raises(ValueError, match="recurrent layers"):
        check_shardable(dataclasses.replace(args, ssm_layers=(0,)), 2, blocks=False)


needs_shm = pytest.mark.skipif(not shm_available(),
                               reason="the C++ kernels cannot be built here (see kernels/build.py)")


def _ranks(tmp_path, world: int, timeout_s: float = 10.0) -> list[ShmAllReduce]:
    path = str(tmp_path / "segment")
    create_segment(path, segment_bytes(world))
    return [ShmAllReduce(path, r, world, timeout_s) for r in range(world)]


def _together(fns) -> None:
    threads = [threading.Thread(target=f) for f in fns]  # ctypes lets go of the GIL
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)


@needs_shm
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_shm_all_reduce_sums_in_rank_order_on_every_rank(tmp_path, dtype):
    world = 3
    ranks = _ranks(tmp_path, world)
    rows = SLOT_BYTES // (64 * dtype.itemsize) + 5  # more than one round of the slots
    parts = [torch.randn(rows, 64).to(dtype) for _ in range(world)]
    expected = (parts[0].float() + parts[1].float() + parts[2].float()).to(dtype)
    outs = [p.clone() for p in parts]
    for _ in range(3):  # the buffers alternate between rounds
        outs = [p.clone() for p in parts]
        _together([lambda r=r: ranks[r](outs[r]) for r in range(world)])
        for out in outs:
            assert torch.equal(out, expected)
    assert all(r.failed_rank() is None for r in ranks)


@needs_shm
def test_shm_all_reduce_names_the_rank_that_did_not_come(tmp_path):
    ranks = _ranks(tmp_path, 2, timeout_s=0.3)
    t = torch.ones(2, 8)
    ranks[0](t)  # rank 1 never arrives
    assert ranks[0].failed_rank() == 1 and ranks[1].failed_rank() == 1
    ranks[1](t)  # every later call returns at once


class _Mailbox:
    """Stands in for gloo under ``ShmCommands`` (the commands too large for the segment)."""

    def __init__(self) -> None:
        self.queue: queue.SimpleQueue = queue.SimpleQueue()

    def send(self, data: bytes) -> None:
        self.queue.put(data)

    def receive(self) -> bytes:
        return self.queue.get(timeout=10)


def _command_ranks(tmp_path, timeout_s: float = 10.0):
    path = str(tmp_path / "commands")
    create_segment(path, command_segment_bytes(2))
    mailbox = _Mailbox()
    return [ShmCommands(path, r, 2, timeout_s, mailbox) for r in range(2)]


def through(send, receive, items: list) -> list:
    """``items`` sent one by one while a thread receives as many: what it received."""
    got: list = []
    reader = threading.Thread(target=lambda: got.extend(receive() for _ in items))
    reader.start()
    for item in items:
        send(item)
    reader.join(30)
    return got


@needs_shm
def test_shm_commands_arrive_in_order_and_large_ones_over_gloo(tmp_path):
    sender, receiver = _command_ranks(tmp_path)
    sent = [b"step 1", bytes(range(256)) * (COMMAND_BYTES // 256 + 1), b"", b"step 4"]
    assert through(sender.send, receiver.receive, sent) == sent


@needs_shm
def test_shm_commands_name_a_rank_that_stops_taking_them(tmp_path):
    sender, _ = _command_ranks(tmp_path, timeout_s=0.2)
    sender.send(b"taken by nobody")
    with pytest.raises(RankLost) as lost:
        sender.send(b"the next")
    assert lost.value.rank == 1


@needs_shm
def test_an_idle_rank_notices_that_rank_0_is_gone(tmp_path):
    sender, receiver = _command_ranks(tmp_path)
    dead = subprocess.Popen(["true"])
    dead.wait()
    struct.pack_into("<q", sender.map, 16, dead.pid)  # rank 0's pid, as if it had died
    with pytest.raises(ConnectionError, match=f"rank 0 \\(pid {dead.pid}\\) is gone"):
        receiver.receive()
