"""The load benchmark's pieces (bench/busy.py): busy processes that always stop, and its table."""

from __future__ import annotations

import os

import pytest

from blockspec.bench.busy import Run, busy_processes, table


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="reads /proc")
def test_busy_processes_run_and_stop_even_on_ctrl_c() -> None:
    with pytest.raises(KeyboardInterrupt):
        with busy_processes(2) as procs:
            pids = [p.pid for p in procs]
            assert len(pids) == 2 and all(_alive(pid) and p.poll() is None for pid, p in zip(pids, procs))
            raise KeyboardInterrupt
    assert not any(_alive(pid) for pid in pids)
    with busy_processes(0) as none:
        assert none == []


def test_table_reports_medians_and_what_busy_keeps_of_quiet() -> None:
    runs = {("quiet", "plain"): [Run(100.0, 1.0, 1.0, 2), Run(90.0, 1.0, 1.0, 2), Run(110.0, 1.0, 1.0, 2)],
            ("quiet", "dflash"): [Run(130.0, 2.2, 0.1, 2)],
            ("busy", "plain"): [Run(55.0, 1.0, 1.0, 1)],
            ("busy", "dflash"): [Run(66.0, 2.0, 0.2, 1)]}
    lines = table(runs, busy=1)
    assert lines[2] == "| quiet | 100.0 | 130.0 | 1.30x | 2.20 | 10% | 2 |"
    assert lines[3] == "| beside 1 busy process | 55.0 | 66.0 | 1.20x | 2.00 | 20% | 1 |"
    assert lines[4] == "| busy / quiet | 0.55 | 0.51 | | | | |"
    assert len(table({k: v for k, v in runs.items() if k[0] == "quiet"}, busy=0)) == 3
