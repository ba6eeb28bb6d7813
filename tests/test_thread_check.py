"""libgomp's spinning, which ``import lmserve`` sets as it loads torch's libgomp
(lmserve/openmp.py), and the engine thread's check that its kernel threads still spin
(engine/thread_check.py)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest

from lmserve import openmp
from lmserve.engine import thread_check
from lmserve.kernels.build import why_unavailable


def python(code: str, **env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k not in openmp.SETTINGS}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**clean, **env}, timeout=120, check=True)


@pytest.mark.skipif(getattr(openmp.torch_libgomp(), "name", None) != openmp.KERNELS_LIBGOMP,
                    reason="torch has no libgomp.so.1 of its own here")
@pytest.mark.skipif(why_unavailable("parallel_probe") is not None, reason="the probe does not build here")
def test_importing_lmserve_before_torch_sets_libgomp_spinning_for_torch_and_the_kernels():
    """A fresh interpreter each (libgomp reads its settings once, when it loads, and prints them
    with OMP_DISPLAY_ENV=verbose): one libgomp, torch's and the kernels', with the settings; none
    left in the environment for child processes; too late after torch; a user's choice kept."""
    show = ("import lmserve, os, torch; torch.ones(1); "
            "from lmserve.engine.thread_check import parallel_region_seconds; parallel_region_seconds(2); "
            "print(lmserve.openmp.status, *(os.environ.get(k) for k in lmserve.openmp.SETTINGS), "
            "len(lmserve.openmp.libgomp_copies()))")
    done = python(show, OMP_DISPLAY_ENV="verbose")
    assert done.stdout.split() == ["None", "None", "None", "1"]
    assert done.stderr.count("OPENMP DISPLAY ENVIRONMENT BEGIN") == 1
    assert "OMP_WAIT_POLICY = 'ACTIVE'" in done.stderr and "GOMP_SPINCOUNT = '300000'" in done.stderr

    late = python("import torch; " + show, OMP_DISPLAY_ENV="verbose")
    assert "loaded before lmserve" in late.stdout and "OMP_WAIT_POLICY = 'PASSIVE'" in late.stderr

    users = python(show, OMP_DISPLAY_ENV="verbose", OMP_WAIT_POLICY="passive")
    assert "left as it is" in users.stdout and "OMP_WAIT_POLICY = 'PASSIVE'" in users.stderr


@pytest.mark.parametrize("set_by_lmserve", [True, False])
def test_engine_thread_warns_once_after_two_slow_checks_and_says_why(monkeypatch, caplog, set_by_lmserve):
    """The check's logic on given timings (real ones depend on the CPU and on what else runs:
    benchmarks/thread_sync.py measures them)."""
    timings = iter([1e-6, 50e-6, 1e-6, 50e-6, 50e-6, 50e-6])  # fast, slow, fast, slow, slow, -
    monkeypatch.setattr(thread_check, "parallel_region_seconds", lambda threads: next(timings))
    monkeypatch.setattr(thread_check.torch, "get_num_threads", lambda: 2)
    monkeypatch.setattr(openmp, "status", None if set_by_lmserve else "torch (...) was loaded before lmserve")
    check = thread_check.ThreadSyncCheck()
    check.done = False  # (whether or not the probe builds here)
    with caplog.at_level(logging.WARNING, logger="lmserve"):
        seen = [check.maybe_check(t) for t in (0.0, 10.0, 40.0, 80.0, 120.0, 160.0, 200.0)]
    # 10 s is inside the interval; the second slow check in a row (160 s) warns, and then no more
    assert seen == [1e-6, None, 50e-6, 1e-6, 50e-6, 50e-6, None]
    warnings = [r.getMessage() for r in caplog.records if "slow to start" in r.getMessage()]
    assert len(warnings) == 1 and "50.0 us" in warnings[0]
    if set_by_lmserve:
        assert "other programs or threads" in warnings[0]
    else:
        assert "was loaded before lmserve" in warnings[0] and "Import lmserve before torch" in warnings[0]
