"""libgomp's spinning, which ``import lmserve`` sets before torch loads it (lmserve/openmp.py),
and the engine thread's check that its kernel threads still spin (engine/thread_check.py).

Each case runs in a fresh interpreter: libgomp reads its settings once, when torch loads it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from lmserve.openmp import SETTINGS


def python(code: str, **env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k not in SETTINGS}  # (this process set them)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**clean, **env}, timeout=120, check=True)


def test_importing_lmserve_before_torch_sets_libgomp_spinning():
    show = "import lmserve, os; print(os.environ.get('OMP_WAIT_POLICY'), os.environ.get('GOMP_SPINCOUNT'))"
    assert python(show).stdout.split() == ["active", "300000"]
    assert python("import torch; " + show).stdout.split() == ["None", "None"]  # too late to act
    assert python(show, OMP_WAIT_POLICY="passive").stdout.split() == ["passive", "None"]  # the user's


# Another thread has run multithreaded torch work; then an engine-like thread checks its regions.
CHECK = """
import logging, threading
{first}
import torch
from lmserve.engine.thread_check import SLOW_REGION_S, ThreadSyncCheck
logging.basicConfig()
torch.set_num_threads(2)
(torch.randn(1000, 1000) * 2).sum()  # this thread keeps an OpenMP team of its own from now on
seconds = []
engine = threading.Thread(target=lambda: seconds.append(ThreadSyncCheck().maybe_check(0.0)))
engine.start()
engine.join()
print(seconds[0] > SLOW_REGION_S)
"""


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="two threads need two CPUs to spin")
@pytest.mark.parametrize("lmserve_first", [True, False])
def test_kernel_threads_spin_after_another_thread_ran_torch_unless_torch_came_first(lmserve_first):
    done = python(CHECK.format(first="import lmserve" if lmserve_first else ""))
    slow = done.stdout.split() == ["True"]
    assert slow is not lmserve_first, done.stdout
    assert ("slow to start" in done.stderr) is slow and ("Import lmserve before torch" in done.stderr) is slow
