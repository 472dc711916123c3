"""Releasing a thread's OpenMP team (cpu/openmp.py): the team's threads really go, and torch
still computes the same afterwards, on this thread and on others."""

from __future__ import annotations

import os
import sys
import threading
import time

import pytest
import torch

from blockspec.cpu.openmp import release_thread_pool

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="GNU OpenMP is Linux-only here")


def _os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _wait_for(count: int, timeout: float = 5.0) -> int:
    deadline = time.monotonic() + timeout
    while _os_threads() != count and time.monotonic() < deadline:
        time.sleep(0.01)
    return _os_threads()


def test_release_frees_the_calling_threads_team_and_results_stay_the_same() -> None:
    saved = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        w, x = torch.randn(1024, 1024), torch.randn(1024, 256)
        expected = w @ x  # runs a parallel region: this thread now has a team of 2 (itself + 1)
        assert release_thread_pool()  # torch's wheel bundles GNU OpenMP
        base = _os_threads()
        assert torch.equal(w @ x, expected)  # the team comes back...
        assert _wait_for(base + 1) == base + 1
        assert release_thread_pool()  # ...and goes again
        assert _wait_for(base) == base
        out: list[torch.Tensor] = []
        worker = threading.Thread(target=lambda: out.append(w @ x))
        worker.start()
        worker.join()
        assert torch.equal(out[0], expected)
        assert release_thread_pool()  # nothing to free is fine too
    finally:
        torch.set_num_threads(saved)
