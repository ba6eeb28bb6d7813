"""libgomp's spinning, which ``import lmserve`` sets as it loads torch's libgomp
(lmserve/openmp.py), and the engine thread's check that its kernel threads still spin
(engine/thread_check.py).

Each case runs in a fresh interpreter: libgomp reads its settings once, when it loads, and
prints them with ``OMP_DISPLAY_ENV=verbose``."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from lmserve.kernels.build import why_unavailable
from lmserve.openmp import SETTINGS, torch_libgomp


def python(code: str, **env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k not in SETTINGS}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**clean, **env}, timeout=120, check=True)


@pytest.mark.skipif(torch_libgomp() is None, reason="this torch has no libgomp of its own")
def test_importing_lmserve_before_torch_sets_libgomp_spinning_in_this_process_only():
    show = ("import lmserve, os, torch; torch.ones(1); "
            "print(lmserve.openmp.status, *(os.environ.get(k) for k in lmserve.openmp.SETTINGS))")
    done = python(show, OMP_DISPLAY_ENV="verbose")
    assert done.stdout.split() == ["None"] * 4  # took, and no child process inherits them
    assert "OMP_WAIT_POLICY = 'ACTIVE'" in done.stderr and "GOMP_SPINCOUNT = '300000'" in done.stderr

    late = python("import torch; " + show, OMP_DISPLAY_ENV="verbose")
    assert "loaded before lmserve" in late.stdout and "OMP_WAIT_POLICY = 'PASSIVE'" in late.stderr

    users = python(show, OMP_DISPLAY_ENV="verbose", OMP_WAIT_POLICY="passive")
    assert "left as it is" in users.stdout and "OMP_WAIT_POLICY = 'PASSIVE'" in users.stderr


# torch loaded first (libgomp's defaults), and this thread runs multithreaded torch work with as
# many threads as there are CPUs, as will the engine-like thread: libgomp then manages more
# threads than CPUs, and the engine thread's kernel threads sleep between regions, which is
# slow whatever else the machine runs. (That importing lmserve first keeps them spinning is a
# speed claim, benchmarks/thread_sync.py's: an idle machine's timing, which a test cannot count on.)
CHECK = """
import json, logging, os, threading
import torch
from lmserve.engine.thread_check import ThreadSyncCheck, slow_region_s
logging.basicConfig()
torch.set_num_threads(len(os.sched_getaffinity(0)))
(torch.randn(1000, 1000) * 2).sum()  # this thread keeps an OpenMP team of its own from now on
seconds = []
def engine():
    check = ThreadSyncCheck()
    for now in (0.0, 1e9, 2e9, 3e9):  # each long past the interval: measured until it warns
        seconds.append(check.maybe_check(now))
    seconds.append(slow_region_s(torch.get_num_threads()))
thread = threading.Thread(target=engine)
thread.start()
thread.join()
print(json.dumps(seconds))
"""


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="no thread to wake on one CPU")
@pytest.mark.skipif(why_unavailable("parallel_probe") is not None, reason="the probe does not build here")
def test_engine_thread_warns_once_after_two_slow_checks():
    done = python(CHECK)
    first, second, third, fourth, bound = json.loads(done.stdout)
    assert first > bound and second > bound and third is None and fourth is None
    assert done.stderr.count("slow to start") == 1
    assert "kept its defaults (torch (or another user of libgomp) was loaded before lmserve)" in done.stderr
    assert "Import lmserve before torch" in done.stderr
