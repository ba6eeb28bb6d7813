"""Where a process sits among the ranks of a parallel engine, and which cores it runs on.

Three ways to start the ranks, as torchrun and vLLM users expect:

- one host (the default): the engine process is rank 0 and starts ranks 1..N-1 itself;
- several hosts, ``lmserve serve --nnodes K --node-rank R --master-addr A --master-port P`` on
  each (the CLI puts them in ``LMSERVE_NNODES``/``LMSERVE_NODE_RANK``/``MASTER_ADDR``/
  ``MASTER_PORT``): each host's process starts that host's other ranks; node 0's rank 0 serves;
- torchrun, whose ``RANK``/``WORLD_SIZE``/``LOCAL_WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT``
  say everything: every rank is its own launch and starts nothing.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Mapping


@dataclass(frozen=True)
class Placement:
    """This process's rank and how the ranks meet."""

    world: int  # ranks in all
    rank: int  # this process's
    nnodes: int  # hosts
    master_addr: str  # where rank 0's rendezvous store listens
    master_port: int
    spawns: tuple[int, ...]  # the ranks this process starts (its host's others)

    @property
    def one_host(self) -> bool:
        return self.nnodes == 1

    @property
    def init_method(self) -> str:
        return f"tcp://{self.master_addr}:{self.master_port}"


def placement(world: int, env: Mapping[str, str] = os.environ) -> Placement:
    """This process's place for ``world`` ranks, from the environment (see the module docstring)."""
    addr = env.get("MASTER_ADDR", "127.0.0.1")
    if "RANK" in env and "WORLD_SIZE" in env:  # torchrun
        if int(env["WORLD_SIZE"]) != world:
            raise ValueError(f"WORLD_SIZE={env['WORLD_SIZE']} from the launcher, but the engine "
                             f"needs tensor_parallel_shards x pipeline_parallel_stages = {world}")
        local = int(env.get("LOCAL_WORLD_SIZE", world))
        return Placement(world, int(env["RANK"]), world // local, addr, _port(env), ())
    nnodes, node = int(env.get("LMSERVE_NNODES", 1)), int(env.get("LMSERVE_NODE_RANK", 0))
    if nnodes < 1 or not 0 <= node < nnodes:
        raise ValueError(f"node rank {node} is not one of {nnodes} nodes")
    if world % nnodes:
        raise ValueError(f"{world} ranks (tensor_parallel_shards x pipeline_parallel_stages) do "
                         f"not spread evenly over {nnodes} nodes")
    if nnodes > 1 and "MASTER_PORT" not in env:
        raise ValueError("several nodes need the address and port of node 0's rendezvous: "
                         "--master-addr and --master-port")
    per_node = world // nnodes
    first = node * per_node
    port = _port(env) if "MASTER_PORT" in env else _free_port()
    return Placement(world, first, nnodes, addr, port, tuple(range(first + 1, first + per_node)))


def _port(env: Mapping[str, str]) -> int:
    return int(env["MASTER_PORT"])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pin(cores: list[int], local_index: int, local_ranks: int) -> None:
    """Run the calling thread (and the OpenMP threads it starts later) on the ``local_index``-th
    of ``local_ranks`` equal, disjoint shares of the host's ``cores``, so that ranks do not
    fight over cores; with fewer cores than ranks, on all of them with a thread each."""
    import torch

    if len(cores) < local_ranks:
        torch.set_num_threads(1)
        return
    share = len(cores) // local_ranks
    os.sched_setaffinity(0, cores[local_index * share:(local_index + 1) * share])
    torch.set_num_threads(share)
