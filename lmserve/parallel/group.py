"""The ranks of a parallel engine as one torch.distributed (gloo) group: starting them, checking
that they agree, rank 0's commands to the others, and failing fast when a rank is lost.

Two timeouts:

- start-up (``LMSERVE_START_TIMEOUT_S``, 300 s: loading takes a while), on the default group;
- every wait after that (``LMSERVE_COLLECTIVE_TIMEOUT_S``, 30 s): for a rank to take rank 0's
  next command (``parallel.commands``), for the ranks of a stage to meet in an all-reduce,
  which they do within every layer, and for the previous pipeline stage's output
  (``parallel.channels``). A rank that has not come for that long is dead or hung.

On one host all go through shared memory (``ShmCommands``, ``ShmAllReduce``, ``ShmChannel``),
and a watchdog thread ends rank 0's waits as soon as a started rank's process exits.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import pickle
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

import lmserve
from lmserve.config import EngineConfig, parse_opt
from lmserve.models.source import fingerprint
from lmserve.parallel.all_reduce import (
    AllReduce,
    GlooAllReduce,
    ShmAllReduce,
    create_segment,
    segment_bytes,
    shm_available,
)
from lmserve.parallel.channels import Channel, GlooChannel, ShmChannel, channel_segment_bytes
from lmserve.parallel.commands import Commands, GlooCommands, RankLost, ShmCommands, command_segment_bytes
from lmserve.parallel.placement import Placement, pin, placement

logger = logging.getLogger("lmserve")



def start_timeout_s() -> float:
    return float(os.environ.get("LMSERVE_START_TIMEOUT_S", 300))


def collective_timeout_s() -> float:
    return float(os.environ.get("LMSERVE_COLLECTIVE_TIMEOUT_S", 30))


class ParallelFailure(RuntimeError):
    """A rank died or stopped answering: the engine cannot go on."""


def world_size(config: EngineConfig) -> int:
    return (config.tensor_parallel_shards or 1) * (config.pipeline_parallel_stages or 1)


@dataclass(frozen=True)
class RankSpec:
    """What a rank started by another process is told, as JSON on its command line."""

    config: str  # EngineConfig.asjson()
    placement: dict[str, Any]  # Placement's fields, with its own rank and nothing to start
    cores: list[int]  # the host's cores
    local_index: int  # its place among its host's ranks
    local_ranks: int


class ParallelGroup:
    """This process's view of the ranks: ``start`` on the process that starts its host's
    ranks, then ``join`` on every rank."""

    def __init__(self, place: Placement, tensor: int, stages: int, all_reduce: Optional[AllReduce],
                 commands: Commands, timeout: float) -> None:
        self.place = place
        self.timeout = timeout  # of every collective, in seconds
        self.rank = place.rank
        self.tensor = tensor  # ranks each layer is split across
        self.stages = stages  # pipeline stages, each a range of layers on ``tensor`` ranks
        self.stage = place.rank // tensor
        self.all_reduce = all_reduce  # of this rank's stage (None: its layers are not split)
        self.commands = commands
        # This rank's ends of the pipeline's channels, by (sending rank, receiving rank).
        self.links: dict[tuple[int, int], Channel] = {}
        self.children: dict[int, subprocess.Popen] = {}
        self.lost: Optional[str] = None  # what the watchdog saw
        self.last_send = time.monotonic()
        self.send_seconds = 0.0  # rank 0's time handing out commands (benchmarks/parallel.py)
        self._closing = threading.Event()
        self._unpinned: Optional[tuple[set[int], int]] = None  # the calling thread's cores and threads before ``start``

    @staticmethod
    def start(config: EngineConfig) -> ParallelGroup:
        """Start this host's other ranks, then join the group (see ``placement``)."""
        if dist.is_initialized():
            raise RuntimeError("this process already runs a parallel engine (torch.distributed "
                               "has one default group a process): close it first")
        world = world_size(config)
        place = placement(world)
        cores = sorted(os.sched_getaffinity(0))
        local = len(place.spawns) + 1
        children = {}
        for i, rank in enumerate(place.spawns, start=1):
            spec = RankSpec(config.asjson(), asdict(place) | {"rank": rank, "spawns": ()}, cores,
                            i, local)
            # In a session of its own: a terminal's Ctrl-C (or a signal to the process group)
            # reaches rank 0, which drains and then stops the ranks; they die with it anyway.
            children[rank] = subprocess.Popen(
                [sys.executable, "-m", "lmserve.parallel.rank_main", json.dumps(asdict(spec))],
                start_new_session=True)
        unpinned = (os.sched_getaffinity(0), torch.get_num_threads())
        pin(cores, 0, local)
        try:
            group = ParallelGroup.join(place, config)
        except BaseException:
            for child in children.values():
                child.kill()
            _unpin(*unpinned)
            raise
        group.children = children
        group._unpinned = unpinned
        threading.Thread(target=group._watch, name="lmserve-rank-watchdog", daemon=True).start()
        return group

    @staticmethod
    def join(place: Placement, config: EngineConfig) -> ParallelGroup:
        """Meet the other ranks, agree on what is served, and set up the all-reduce of each
        stage's ranks and the channels between the stages."""
        dist.init_process_group("gloo", init_method=place.init_method, rank=place.rank,
                                world_size=place.world,
                                timeout=datetime.timedelta(seconds=start_timeout_s()))
        try:
            return ParallelGroup._meet(place, config)
        except BaseException:
            dist.destroy_process_group()  # (a refused start leaves the process free for another)
            raise

    @staticmethod
    def _meet(place: Placement, config: EngineConfig) -> ParallelGroup:
        """``join`` once the default group is up."""
        _check_agreement(config, place.rank)
        timeout = collective_timeout_s()
        collective = datetime.timedelta(seconds=timeout)
        gloo = GlooCommands(dist.new_group(backend="gloo", timeout=collective), place.world)
        tensor = config.tensor_parallel_shards or 1
        stages = config.pipeline_parallel_stages or 1
        stage = place.rank // tensor
        group = ParallelGroup(place, tensor, stages, None, gloo, timeout)
        links = pipeline_links(stages, tensor)
        # The ranks of one host meet in shared memory (LMSERVE_TRANSPORT=gloo: over gloo, as
        # across hosts, which benchmarks/parallel.py compares).
        if place.one_host and shm_available() and os.environ.get("LMSERVE_TRANSPORT") != "gloo":
            prefix = f"/dev/shm/lmserve-{place.master_port}"
            reduce_paths = [f"{prefix}-all-reduce-{s}" for s in range(stages)] if tensor > 1 else []
            link_paths = {link: f"{prefix}-link-{link[0]}-{link[1]}" for link in links}
            segments = [(path, segment_bytes(tensor)) for path in reduce_paths] + [
                (path, channel_segment_bytes()) for path in link_paths.values()] + [
                (f"{prefix}-commands", command_segment_bytes(place.world))]
            if place.rank == 0:
                for path, size in segments:
                    if os.path.exists(path):  # left by an engine that was killed on this port
                        os.unlink(path)
                    create_segment(path, size)
            dist.barrier()
            if tensor > 1:
                group.all_reduce = ShmAllReduce(reduce_paths[stage], place.rank % tensor, tensor,
                                                timeout, stage * tensor)
            group.commands = ShmCommands(segments[-1][0], place.rank, place.world, timeout, gloo,
                                         lambda: group.lost)
            group.links = {link: ShmChannel(path, link[0] + link[1] - place.rank, timeout,
                                            lambda: group.lost)
                           for link, path in link_paths.items() if place.rank in link}
            dist.barrier()
            if place.rank == 0:
                for path, _ in segments:
                    os.unlink(path)  # mapped by every rank: nothing is left behind, however they end
        else:
            # Every rank makes every group, in the same order (torch.distributed's rule).
            stage_groups = [dist.new_group(list(range(s * tensor, (s + 1) * tensor)),
                                           backend="gloo", timeout=collective)
                            for s in range(stages)] if tensor > 1 else []
            if stage_groups:
                group.all_reduce = GlooAllReduce(stage_groups[stage])
            if links:
                pipe = dist.new_group(backend="gloo", timeout=collective)
                group.links = {link: GlooChannel(pipe, link[0] + link[1] - place.rank)
                               for link in links if place.rank in link}
        return group

    # -- commands from rank 0 -------------------------------------------------------------------

    def send(self, command: Any) -> None:
        """Rank 0: hand ``command`` to every other rank (in the order they ``receive``)."""
        started = time.perf_counter()
        try:
            self.commands.send(pickle.dumps(command))
        except RankLost as lost:
            raise self.failure(lost.__cause__, lost.rank) from lost
        self.last_send = time.monotonic()
        self.send_seconds += time.perf_counter() - started

    def receive(self) -> Any:
        """The other ranks: rank 0's next command."""
        return pickle.loads(self.commands.receive())

    def keep_alive(self) -> None:
        """Rank 0, every second: a no-op command where the others' wait for commands times out
        (gloo), unless one went out within the second."""
        if self.commands.needs_keep_alive and time.monotonic() - self.last_send >= 1.0:
            self.send(("noop",))

    def channel_seconds(self) -> float:
        """This rank's time in the pipeline's channels (benchmarks/parallel.py)."""
        return sum(link.seconds for link in self.links.values())

    def barrier(self) -> None:
        dist.barrier()

    def describe(self) -> str:
        """This rank's place, for the start-up log."""
        shm = isinstance(self.commands, ShmCommands)
        stage = f"stage {self.stage} of {self.stages}, " if self.stages > 1 else ""
        return (f"rank {self.rank} of {self.place.world} on {self.place.nnodes} host(s), {stage}"
                f"layers split {self.tensor} ways, cores {sorted(os.sched_getaffinity(0))} with "
                f"{torch.get_num_threads()} thread(s), steps, all-reduces and activations through "
                f"{'shared memory' if shm else 'gloo'}")

    # -- failures -------------------------------------------------------------------------------

    def check(self) -> None:
        """Raise ``ParallelFailure`` if the last collective gave up on a rank."""
        if self.lost or (self.all_reduce is not None and self.all_reduce.failed_rank() is not None):
            raise self.failure(None)

    def failure(self, err: Optional[BaseException], rank: Optional[int] = None) -> ParallelFailure:
        """The error to stop the engine with, naming the rank that was lost where it is known
        (``rank``: the one a send to failed)."""
        if self.lost:
            return ParallelFailure(self.lost)
        waited = self.all_reduce and self.all_reduce.failed_rank()
        if waited is not None:
            return ParallelFailure(f"rank {waited} did not reach an all-reduce within "
                                   f"{self.timeout:g} s (LMSERVE_COLLECTIVE_TIMEOUT_S): "
                                   f"it is hung or gone")
        who = "a rank" if rank is None else f"rank {rank}"
        return ParallelFailure(f"{who} did not answer within {self.timeout:g} s "
                               f"(LMSERVE_COLLECTIVE_TIMEOUT_S): it is hung or gone"
                               + (f" ({err})" if err is not None else ""))

    def _watch(self) -> None:
        """Notice a started rank's exit at once: log it and end every rank's waits."""
        while not self._closing.wait(0.1):
            for rank, child in self.children.items():
                code = child.poll()
                if code is not None:
                    self.lost = f"rank {rank} (pid {child.pid}) exited with code {code}"
                    logger.error("parallel engine: %s", self.lost)
                    if isinstance(self.all_reduce, ShmAllReduce) and rank // self.tensor == self.stage:
                        self.all_reduce.fail(rank)
                    return

    def close(self, kill: bool = False) -> None:
        """Stop the other ranks (rank 0; ``kill``: at once, as when the start failed halfway)
        and leave the group."""
        self._closing.set()
        if kill:
            for child in self.children.values():
                child.kill()
        elif self.rank == 0 and not self.lost:
            try:
                self.send(("stop",))
            except ParallelFailure:
                pass
        for child in self.children.values():
            try:
                child.wait(timeout=10)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
        if dist.is_initialized():
            dist.destroy_process_group()
        if self._unpinned is not None:
            _unpin(*self._unpinned)
            self._unpinned = None


def pipeline_links(stages: int, tensor: int) -> list[tuple[int, int]]:
    """The pipeline's channels as (sending rank, receiving rank): each stage's ranks to their
    counterparts in the next stage (each holds the whole residual stream), and the last stage's
    first rank back to rank 0, which samples."""
    if stages == 1:
        return []
    forward = [(s * tensor + t, (s + 1) * tensor + t) for s in range(stages - 1) for t in range(tensor)]
    return forward + [((stages - 1) * tensor, 0)]


def _unpin(cores: set[int], threads: int) -> None:
    """Give the thread that started the ranks its cores back (a process may go on without
    them, as tests and benchmarks do)."""
    os.sched_setaffinity(0, cores)
    torch.set_num_threads(threads)


def _check_agreement(config: EngineConfig, rank: int) -> None:
    """Refuse to serve when the ranks load different things (two hosts, two model files)."""
    mine = {"lmserve": lmserve.__version__, "model": fingerprint(config),
            "opt": parse_opt(config.opt), "tensor_parallel_shards": config.tensor_parallel_shards,
            "pipeline_parallel_stages": config.pipeline_parallel_stages}
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    differences = [f"rank {r} has {key}={theirs[key]!r} where rank 0 has {everyone[0][key]!r}"
                   for r, theirs in enumerate(everyone) for key in theirs
                   if theirs[key] != everyone[0][key]]
    if differences:
        raise ValueError("the ranks do not agree on what to serve: " + "; ".join(differences))
