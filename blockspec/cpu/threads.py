"""Intra-op threads that follow the cores other processes leave free.

Every parallel region of the C kernels (and of PyTorch's CPU operators) ends at a barrier where
each of its threads waits for the others. When a thread shares its core with another busy process,
the scheduler runs it only every few milliseconds, and every barrier waits that long: beside ONE
CPU-bound process on a 2-core machine, 2 threads decoded an order of magnitude slower than 1
(docs/DESIGN.md section 12). So between decoding steps, at most every `INTERVAL` seconds,
`follow_free_cores` measures how much CPU time the other processes took on the cores this process
may run on (/proc/stat, less this process's own time) and sets torch's intra-op thread count to
the cores they leave free; the C kernels take `torch.get_num_threads()` at every call.
The output does not depend on it: every kernel computes each element in a fixed order whatever
the thread split (cpu/csrc), so a greedy run gives the same tokens whatever thread counts it
passed through (tests/cpu/test_threads.py).
Why not fewer spins at the barriers instead (GOMP_SPINCOUNT, OMP_WAIT_POLICY, read once when
OpenMP loads): on a loaded machine, 2 threads waiting passively decoded about as fast as 1
thread spinning, both far faster than 2 spinning (docs/DESIGN.md section 12). A passive wait
would also pay a wake-up at every barrier of a quiet machine, where the spinning keeps the small
kernels fast (not measured: no quiet machine at hand); one thread fewer gains as much under load
and leaves the quiet case as it was.

The count only moves down from where it was first found (torch's default: one per core, or the
caller's own `torch.set_num_threads`; more threads than CPUs are left alone), and never where the
user chose it: OMP_NUM_THREADS set, BLOCKSPEC_THREADS=off (leave torch's count alone) or
BLOCKSPEC_THREADS=N (N threads, fixed), a command's --threads (`pin`), or a
`torch.set_num_threads` call after decoding started (noticed at the next check: the governor then
stands down for good).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from blockspec.errors import ConfigError

ENV = "BLOCKSPEC_THREADS"
INTERVAL = 0.5  # seconds between two looks at /proc/stat (each a small fraction of a step; 50 ticks a core a window)
# Hysteresis: a thread stays while the other processes leave it at least STAY of a core, and one
# more starts once they leave it ADD of one. Staying is hard because the costs are lopsided: a
# thread too many on a busy core costs many times a step (the barriers above), a thread too few at
# most the second core's share (docs/DESIGN.md section 12). And beside a busy process, 2 threads
# on 2 cores leave it only part of a core (the scheduler shares them between 3 runnable threads),
# which must still read as a core taken.
STAY = 0.6
ADD = 0.75


@dataclass(frozen=True)
class Sample:
    """CPU time counters at one moment: `busy` and `total` clock ticks summed over this process's
    CPUs (/proc/stat; total counts idle time too), and `own` seconds this process (and the children
    it waited for) has run."""

    busy: int
    total: int
    own: float

    def __post_init__(self) -> None:
        if self.busy < 0 or self.total < self.busy or self.own < 0:
            raise ValueError(f"inconsistent CPU counters: busy {self.busy}, total {self.total}, own {self.own}")


def parse_stat(text: str, cpus: set[int]) -> tuple[int, int]:
    """(busy, total) ticks of the `cpuN` lines of /proc/stat whose N is in `cpus`. Busy: user,
    nice, system, irq, softirq and steal (time a hypervisor gave another guest is as lost as time
    another process took); total adds idle and iowait. guest time is already part of user."""
    busy = total = 0
    for line in text.splitlines():
        name, _, rest = line.partition(" ")
        if not name.startswith("cpu") or not name[3:].isdigit() or int(name[3:]) not in cpus:
            continue
        f = [int(v) for v in rest.split()[:8]] + [0] * 8
        user, nice, system, idle, iowait, irq, softirq, steal = f[:8]
        b = user + nice + system + irq + softirq + steal
        busy += b
        total += b + idle + iowait
    return busy, total


def others_cores(before: Sample, after: Sample, cpus: int, hz: float) -> float | None:
    """Cores' worth of CPU time the other processes took between two samples over `cpus` CPUs
    ticking `hz` times a second (None: no tick passed)."""
    ticks = after.total - before.total
    if ticks <= 0:
        return None
    wall = ticks / hz / cpus
    others = (after.busy - before.busy) / hz - (after.own - before.own)
    return max(0.0, others) / wall


def threads_for(others: float, cpus: int, current: int, ceiling: int) -> int:
    """The thread count for the next steps (1..ceiling), from the cores' worth of CPU time the
    other processes use, the CPUs this process may run on and the count now."""
    free = cpus - others
    most = int(free + 1 - STAY)  # more threads than this share a busy core
    least = int(free + 1 - ADD)  # this many have a core each
    return max(1, min(ceiling, most if current > most else max(current, least)))


class Governor:
    """Sets torch's intra-op thread count of the calling thread before each decoding step: the
    cores other processes leave free (`fixed`: that count, always). One per process
    (`follow_free_cores`); per-thread state, since an OpenMP thread count is a per-thread setting
    (the engine decodes on a thread of its own)."""

    def __init__(self, cpus: int, ceiling: int, read: Callable[[], Sample | None], *, hz: float = 100.0,
                 clock: Callable[[], float] = time.monotonic, interval: float = INTERVAL,
                 fixed: int | None = None, get: Callable[[], int] = torch.get_num_threads,
                 set: Callable[[int], None] = torch.set_num_threads) -> None:
        if cpus < 1 or ceiling < 1 or (fixed is not None and fixed < 1):
            raise ValueError(f"need cpus, ceiling and fixed >= 1, got {cpus}, {ceiling}, {fixed}")
        self.cpus, self.ceiling, self.fixed = cpus, ceiling, fixed
        self.threads = fixed if fixed is not None else ceiling  # the count the next steps run
        self.others: float | None = None  # the other processes' load at the last look, in cores
        self.stood_down = False  # someone else set the count: it is theirs from now on
        self._read, self._hz, self._clock, self._interval = read, hz, clock, interval
        self._get, self._set = get, set
        self._lock = threading.Lock()
        self._mine = threading.local()  # .count: what this governor last set on that thread
        self._last = read() if fixed is None else None
        self._at = clock()

    def follow(self) -> int:
        """Brings the calling thread's count up to date (a look at the load when `interval` has
        passed); returns the count its next step runs."""
        current = self._get()
        if self.stood_down:
            return current
        mine = getattr(self._mine, "count", None)
        if mine is not None and current != mine:
            self.stood_down = True  # torch.set_num_threads from elsewhere: respected
            return current
        with self._lock:
            if self.fixed is None and self._clock() - self._at >= self._interval:
                self._look()
            threads = self.threads
        if current != threads:
            self._set(threads)
        self._mine.count = threads
        return threads

    def _look(self) -> None:
        sample = self._read()
        self._at = self._clock()
        if sample is None or self._last is None:
            self._last = sample
            return
        others = others_cores(self._last, sample, self.cpus, self._hz)
        self._last = sample
        if others is not None:
            self.others = others
            self.threads = threads_for(others, self.cpus, self.threads, self.ceiling)


def _cpus() -> set[int]:
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return set(range(os.cpu_count() or 1))


def read_sample(cpus: set[int]) -> Sample | None:
    """The counters now, or None where /proc/stat cannot be read (not Linux)."""
    try:
        with open("/proc/stat") as f:
            busy, total = parse_stat(f.read(), cpus)
    except (OSError, ValueError):
        return None
    if total <= 0:
        return None
    t = os.times()
    # Children this process waited for (the kernels' compiler at the first load) worked for it:
    # counted as its own, they do not read as another process's load.
    return Sample(busy, total, t.user + t.system + t.children_user + t.children_system)


_create = threading.Lock()
_governor: Governor | None = None
_decided = False


def setting(env: dict[str, str] | None = None) -> int | str:
    """What the environment asks for: "auto" (follow the free cores), "off", or a fixed count."""
    env = os.environ if env is None else env
    if env.get("OMP_NUM_THREADS"):
        return "off"  # the user's OpenMP setting, as torch applied it
    raw = env.get(ENV, "auto").strip().lower() or "auto"
    if raw in ("auto", "off"):
        return raw
    if raw.isdigit() and int(raw) >= 1:
        return int(raw)
    raise ConfigError(f"{ENV} must be 'auto', 'off' or a thread count >= 1, got {env[ENV]!r}")


def governor() -> Governor | None:
    """This process's governor, created at the first call (None: turned off, or no /proc/stat)."""
    global _governor, _decided
    with _create:
        if not _decided:
            _decided = True
            mode = setting()
            cpus = _cpus()
            found = torch.get_num_threads()
            if mode == "auto" and found > len(cpus):
                mode = "off"  # more threads than CPUs is nobody's default: the caller's choice
            if mode != "off":
                sample = read_sample(cpus) if mode == "auto" else None
                if mode != "auto" or sample is not None:
                    _governor = Governor(len(cpus), found, lambda: read_sample(cpus),
                                         hz=float(os.sysconf("SC_CLK_TCK")),
                                         fixed=None if mode == "auto" else mode)
        return _governor


def follow_free_cores() -> int | None:
    """Called between decoding steps: sets the calling thread's thread count (see the module
    docstring); returns it, or None where nothing is governed."""
    g = governor()
    return g.follow() if g is not None else None


def pin(threads: int) -> None:
    """A fixed thread count for the rest of this process (a command's --threads), on every thread
    that decodes: following the free cores stops."""
    global _governor, _decided
    if threads < 1:
        raise ConfigError(f"the thread count must be >= 1, got {threads}")
    with _create:
        _decided = True
        _governor = Governor(max(1, threads), threads, lambda: None, fixed=threads)
    torch.set_num_threads(threads)
