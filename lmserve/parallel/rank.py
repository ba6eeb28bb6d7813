"""What a rank other than 0 does: build its part of the model, then run what rank 0 sends, step
by step, until told to stop (``serve_rank``). Rank 0 builds its part with ``build_rank`` too.

A rank's part is its stage's layers (``plan.stage_layers``; all of them without pipeline
stages), split ``group.tensor`` ways. A step's input comes from rank 0's command and, past the
first stage, the previous stage's residual stream; its output goes on to the next stage, or
(from the last stage's first rank) back to rank 0 as the final hidden rows."""

from __future__ import annotations

import logging
from typing import Optional

import torch

from lmserve.config import EngineConfig, OptFlags, parse_opt
from lmserve.models.source import ModelSource, open_model, use_kernels_of
from lmserve.parallel.commands import RankLost
from lmserve.parallel.group import ParallelGroup
from lmserve.parallel.shard import TensorShard
from lmserve.runner import ModelRunner
from lmserve.step import StepInput
from lmserve.worker import build_worker

logger = logging.getLogger("lmserve")


def rank_part(rank: int, tensor: int, stage_layers: tuple[range, ...]) -> tuple[Optional[TensorShard], Optional[range]]:
    """Rank ``rank``'s shard (None: no tensor parallelism) and its stage's layers (None: all)
    among ``tensor`` ranks per stage; rank 0 also holds the head."""
    shard = TensorShard(rank % tensor, tensor) if tensor > 1 else None
    return shard, stage_layers[rank // tensor] if stage_layers else None


def build_rank(source: ModelSource, opt: OptFlags, plan, group: ParallelGroup) -> ModelRunner:
    """This rank's part of the model over the plan's KV pages (rank 0 calls it too)."""
    shard, layers = rank_part(group.rank, group.tensor, plan.stage_layers)
    model = source.load_model(opt, group.rank, shard, layers, head=group.rank == 0)
    return build_worker(model, plan, opt, torch.device("cpu"), group.all_reduce)


def run_stage(runner: ModelRunner, group: ParallelGroup, step: StepInput) -> None:
    """Run this rank's part of ``step``: take the previous stage's residual stream (past the
    first stage) and pass the output on (to the next stage, or from the last stage's first rank
    back to rank 0)."""
    residual = None
    if group.stage > 0:
        residual = group.links[(group.rank - group.tensor, group.rank)].receive()
    out = runner.execute(step, logits=False, residual=residual)
    if group.stage < group.stages - 1:
        group.links[(group.rank, group.rank + group.tensor)].send(out)
    elif group.stages > 1 and group.rank % group.tensor == 0:
        group.links[(group.rank, 0)].send(out)


def serve_rank(config: EngineConfig, group: ParallelGroup) -> int:
    """Build this rank's worker on rank 0's plan and run rank 0's commands; the exit status."""
    plan = group.receive()
    config, source = open_model(config)
    runner = build_rank(source, parse_opt(config.opt), plan, group)
    logger.info("parallel engine: %s", group.describe())
    group.barrier()  # every rank is built and rank 0 is ready: steps may come
    while True:
        try:
            command = group.receive()
        except (RuntimeError, ConnectionError) as err:  # rank 0 is gone
            logger.error("rank %d: lost rank 0 (%s); exiting", group.rank, err)
            return 1
        kind = command[0]
        if kind == "step":
            try:
                run_stage(runner, group, command[1])
            except RankLost as lost:
                logger.error("rank %d: rank %d did not answer within %g s; exiting", group.rank,
                             lost.rank, group.timeout)
                return 1
            except RuntimeError as err:  # gloo's all-reduce gave up on a rank
                logger.error("rank %d: %s; exiting", group.rank, group.failure(err))
                return 1
        elif kind == "move_kv":
            runner.move_kv(command[1], command[2])
        elif kind == "discard_kv":
            free = command[2]
            runner.discard_kv(command[1], lambda p: free[p])
        elif kind == "stop":
            group.close()
            return 0
        if group.all_reduce is not None and group.all_reduce.failed_rank() is not None:
            logger.error("rank %d: %s; exiting", group.rank, group.failure(None))
            return 1


def serve_host_ranks(config: EngineConfig) -> int:
    """A launch whose first rank is not 0 (another host's, or torchrun's): start this host's
    other ranks and serve rank 0's commands until it stops; the exit status."""
    use_kernels_of(config)  # before the group loads its all-reduce kernel
    group = ParallelGroup.start(config)
    try:
        return serve_rank(config, group)
    finally:
        group.close(kill=True)
