"""libgomp's spinning, which ``import lmserve`` sets before torch loads it (lmserve/openmp.py),
and the engine thread's check that its kernel threads still spin (engine/thread_check.py).

Each case runs in a fresh interpreter: libgomp reads its settings once, when torch loads it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from lmserve.engine.thread_check import SLOW_REGION_S
from lmserve.openmp import SETTINGS


def python(code: str, **env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k not in SETTINGS}  # (this process set them)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**clean, **env}, timeout=120, check=True)


def test_importing_lmserve_before_torch_sets_libgomp_spinning():
    show = "import lmserve, os; print(*(os.environ.get(k) for k in lmserve.openmp.SETTINGS))"
    assert python(show).stdout.split() == ["active", "300000", "200"]
    assert python("import torch; " + show).stdout.split() == ["None"] * 3  # too late to act
    assert python(show, OMP_WAIT_POLICY="passive").stdout.split() == ["passive", "None", "None"]  # the user's


# torch imported first (libgomp's defaults), and this thread has run multithreaded torch work:
# an engine-like thread's kernel threads now sleep between regions, which is slow whatever else
# the machine runs. (That importing lmserve first keeps them spinning is a speed claim, made by
# benchmarks/thread_sync.py: an idle machine's timing, which a test cannot count on.)
CHECK = """
import json, logging, threading
import torch
from lmserve.engine.thread_check import ThreadSyncCheck
logging.basicConfig()
torch.set_num_threads(2)
(torch.randn(1000, 1000) * 2).sum()  # this thread keeps an OpenMP team of its own from now on
check, seconds = ThreadSyncCheck(), []
def engine():
    seconds.append(check.maybe_check(0.0))
    seconds.append(check.maybe_check(1e9))  # long past the interval: said once, not measured again
thread = threading.Thread(target=engine)
thread.start()
thread.join()
print(json.dumps(seconds))
"""


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="no thread to wake on one CPU")
def test_engine_thread_warns_once_its_kernel_threads_sleep_between_calls():
    done = python(CHECK)
    first, again = json.loads(done.stdout)
    assert first > SLOW_REGION_S and again is None
    assert "slow to start" in done.stderr and "Import lmserve before torch" in done.stderr
    assert done.stderr.count("slow to start") == 1
