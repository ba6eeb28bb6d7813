"""The parts of pipeline parallelism on their own: how the layers are split into stages, the
shared-memory channel between stages, and the scheduler keeping batches in flight apart."""

from __future__ import annotations

import pytest
import torch

from lmserve.cache.manager import KVCacheManager
from lmserve.cache.pages import PagePool
from lmserve.models.args import ModelArgs
from lmserve.parallel.all_reduce import create_segment
from lmserve.parallel.channels import SLOT_BYTES, SLOTS, ShmChannel, channel_segment_bytes
from lmserve.parallel.commands import RankLost
from lmserve.parallel.group import pipeline_links
from lmserve.parallel.stages import layer_params, stage_layers, stage_weights
from lmserve.request import SeqStatus
from lmserve.scheduler import Scheduler
from test_parallel_parts import needs_shm, through
from test_scheduler import seq


def args(num_layers=30, vocab=49152, **kw) -> ModelArgs:
    return ModelArgs(architecture="llama", vocab_size=vocab, hidden_size=576, intermediate_size=1536,
                     num_layers=num_layers, num_heads=9, num_kv_heads=3, head_dim=64,
                     context_length=8192, **kw)


def test_stage_zero_takes_fewer_layers_for_the_head_it_also_runs():
    a = args()
    head = a.vocab_size * a.hidden_size / layer_params(a)
    assert head == pytest.approx(8)  # the built-in model's head: eight of its layers
    assert stage_layers(a, 2, env={}) == (range(0, 11), range(11, 30))  # 11 + 8.x vs 19
    assert stage_layers(a, 3, env={}) == (range(0, 4), range(4, 17), range(17, 30))  # 12, 13, 13
    # Split two ways, the layers cost half as much beside the head, which is not split.
    assert stage_layers(a, 2, tensor=2, env={}) == (range(0, 7), range(7, 30))  # 7 + 16 vs 23
    # A small vocabulary: an even split, the remainder to the later stages.
    assert stage_layers(args(num_layers=7, vocab=64), 3, env={}) == (range(0, 1), range(1, 4), range(4, 7))


def test_a_partition_by_hand_and_splits_that_cannot_work():
    assert stage_layers(args(), 2, env={"LMSERVE_PP_LAYER_PARTITION": "15,15"}) == (
        range(0, 15), range(15, 30))
    with pytest.raises(ValueError, match=r"LMSERVE_PP_LAYER_PARTITION='10,10' must give each of "
                                         r"the 2 stages at least one layer, 30 layers in all"):
        stage_layers(args(), 2, env={"LMSERVE_PP_LAYER_PARTITION": "10,10"})
    with pytest.raises(ValueError, match=r"pipeline_parallel_stages=4 exceeds the model's 3 layers"):
        stage_layers(args(num_layers=3), 4, env={})
    with pytest.raises(ValueError, match=r"recurrent layers \(llama\)"):
        stage_layers(args(ssm_layers=(1,)), 2, env={})


def test_a_stage_keeps_its_layers_and_rank_0_the_embedding_and_head():
    names = ["model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"] + [
        f"model.layers.{i}.mlp.down_proj.weight" for i in range(4)]
    weights = {n: torch.zeros(1) for n in names}
    first = stage_weights(weights, range(0, 2), first=True, head=True)
    last = stage_weights(weights, range(2, 4), first=False, head=False)
    assert sorted(first) == sorted(names[:3] + names[3:5])
    assert sorted(last) == sorted(["model.norm.weight"] + names[5:])


def test_links_pass_each_stage_to_its_counterpart_and_the_last_back_to_rank_0():
    assert pipeline_links(1, 2) == []
    assert pipeline_links(2, 1) == [(0, 1), (1, 0)]
    assert pipeline_links(2, 2) == [(0, 2), (1, 3), (2, 0)]  # stage 1 is ranks 2 and 3


def _channel_ends(tmp_path, timeout_s=10.0) -> tuple[ShmChannel, ShmChannel]:
    path = str(tmp_path / "link")
    create_segment(path, channel_segment_bytes())
    return ShmChannel(path, 1, timeout_s), ShmChannel(path, 0, timeout_s)


@needs_shm
def test_shm_channel_streams_tensors_of_any_size_in_order(tmp_path):
    """A tensor larger than the whole ring goes through in pieces while the reader takes them;
    dtypes, shapes and empty tensors arrive as sent."""
    writer, reader = _channel_ends(tmp_path)
    big = torch.randn(SLOTS * SLOT_BYTES // 4 + 12345 // 4, dtype=torch.float32).view(-1, 1)
    sent = [torch.randn(3, 576), big, torch.empty(0, 0), torch.randn(2, 5).bfloat16(),
            torch.arange(7, dtype=torch.int64)]
    got = through(writer.send, reader.receive, sent)
    assert len(got) == len(sent)
    for a, b in zip(sent, got):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


@needs_shm
def test_shm_channel_names_the_peer_that_does_not_come(tmp_path):
    writer, reader = _channel_ends(tmp_path, timeout_s=0.2)
    with pytest.raises(RankLost) as lost:
        reader.receive()  # nothing was sent
    assert lost.value.rank == 0
    for _ in range(SLOTS):
        writer.send(torch.zeros(SLOT_BYTES // 4 - 16))  # one slot each, taken by nobody
    with pytest.raises(RankLost) as lost:
        writer.send(torch.zeros(1))
    assert lost.value.rank == 1


def make(num_pages=32, page_size=4, max_seqs=4, chunk=16, depth=2):
    pool = PagePool(num_pages)
    return pool, Scheduler(KVCacheManager(pool, page_size), max_seqs, chunk, "hybrid",
                           pipeline_depth=depth)


def names(batch) -> list[str]:
    return [c.seq.request.request_id for c in batch.chunks]


def test_batches_in_flight_share_no_sequence_and_split_them_evenly():
    pool, s = make()
    seqs = [seq(n, 3) for n in "abcd"]
    for x in seqs:
        s.add(x)
    first, second = s.schedule(), s.schedule()
    assert names(first) == ["a", "b"] and names(second) == ["c", "d"]
    assert s.schedule() is None  # everyone is in flight
    for c in first.chunks:
        c.seq.token_ids.append(0)
    s.update(first)
    third = s.schedule()  # a and b decode while c and d are still in flight
    assert names(third) == ["a", "b"] and all(c.decode for c in third.chunks)


def test_a_sequence_in_flight_is_never_preempted_and_may_be_aborted():
    pool, s = make(num_pages=4, page_size=4)
    a, b = seq("a", 8), seq("b", 8)
    s.add(a)
    s.add(b)
    first = s.schedule()  # a alone: half the sequences
    second = s.schedule()
    assert names(first) == ["a"] and names(second) == ["b"] and pool.num_free == 0
    for c in first.chunks:
        c.seq.token_ids.append(0)
    s.update(first)
    # a's 9th token needs a page; b is in flight, so a waits rather than preempt it.
    assert s.schedule() is None and s.num_preemptions == 0 and b.status is SeqStatus.RUNNING
    s.finish(b)  # aborted in flight: its pages are free at once (each stage runs batches in order)
    assert pool.num_free == 2 and s.in_flight == {a} - {a}
    assert names(s.schedule()) == ["a"]
