"""The entry point of a rank started by the process that starts its host's ranks:
``python -m lmserve.parallel.rank_main SPEC`` (``group.RankSpec`` as JSON)."""

from __future__ import annotations

import ctypes
import json
import logging
import os
import signal
import sys

from lmserve.config import EngineConfig
from lmserve.models.source import use_kernels_of
from lmserve.parallel.group import ParallelGroup, RankSpec
from lmserve.parallel.placement import Placement, pin
from lmserve.parallel.rank import serve_rank


def _die_with_parent(parent: int) -> None:
    """Get SIGKILL when the process that started this one ends, however it ends (Linux)."""
    try:
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # it ended before the line above
        os._exit(1)


def main(argv: list[str]) -> int:
    spec = RankSpec(**json.loads(argv[1]))
    parent = os.getppid()
    _die_with_parent(parent)
    config = EngineConfig.from_json(spec.config)
    logging.basicConfig(format=f"%(asctime)s lmserve rank {spec.placement['rank']}: %(message)s",
                        level=logging.INFO if config.verbose else logging.WARNING)
    pin(spec.cores, spec.local_index, spec.local_ranks)
    place = Placement(**{**spec.placement, "spawns": tuple(spec.placement["spawns"])})
    use_kernels_of(config)  # before the group loads its all-reduce kernel
    return serve_rank(config, ParallelGroup.join(place, config))


if __name__ == "__main__":
    sys.exit(main(sys.argv))
