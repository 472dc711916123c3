"""Engine counters, for the server's /metrics, and the one histogram type.

Latency and time to first token are measured where a user sees them, at the HTTP edge
(server/metrics.py), from a request's arrival; the engine counts steps, tokens and outcomes.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field



@dataclass
class Histogram:
    """A histogram as Prometheus defines it: counts[i] observations were <= bounds[i]
    (cumulative), `count` all of them."""

    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    sum: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * len(self.bounds)

    def observe(self, value: float) -> None:
        self.sum += value
        self.count += 1
        for i, b in enumerate(self.bounds):
            if value <= b:
                self.counts[i] += 1

    def copy(self) -> Histogram:
        out = Histogram(self.bounds)
        out.counts, out.sum, out.count = list(self.counts), self.sum, self.count
        return out


@dataclass(frozen=True)
class EngineMetrics:
    """A consistent snapshot of the engine's counters."""

    requests_total: int
    requests_running: int
    queue_depth: int
    tokens_generated_total: int
    steps_total: int
    mean_tau: float
    errors_total: int
    cancelled_total: int
    block_sizes: dict[int, int]  # steps per block size used
    # prefill passes (requests joining the batch; no row decodes during one), each counted once
    # however many requests it admitted: wall-clock seconds and process CPU seconds
    prefill_s_total: float = 0.0
    prefill_cpu_s_total: float = 0.0


class MetricsRecorder:
    """Thread-safe accumulation; `snapshot()` is what `Engine.metrics` returns."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests_total = 0
        self.tokens_generated_total = 0
        self.steps_total = 0
        self.row_steps = 0  # sum over steps of rows in the step (tau denominator)
        self.committed_in_steps = 0
        self.errors_total = 0
        self.cancelled_total = 0
        self.block_sizes: dict[int, int] = {}
        self.prefill_s_total = 0.0
        self.prefill_cpu_s_total = 0.0

    def submitted(self) -> None:
        with self._lock:
            self.requests_total += 1

    def step(self, block: int, rows: int, committed: int) -> None:
        with self._lock:
            self.steps_total += 1
            self.row_steps += rows
            self.committed_in_steps += committed
            self.block_sizes[block] = self.block_sizes.get(block, 0) + 1

    def prefill(self, wall_s: float, cpu_s: float) -> None:
        """One prefill pass took `wall_s` seconds of wall clock and `cpu_s` of process CPU time."""
        with self._lock:
            self.prefill_s_total += wall_s
            self.prefill_cpu_s_total += cpu_s

    def tokens(self, n: int) -> None:
        with self._lock:
            self.tokens_generated_total += n

    def finished(self, reason: str) -> None:
        with self._lock:
            if reason == "error":
                self.errors_total += 1
            elif reason == "cancelled":
                self.cancelled_total += 1

    def snapshot(self, running: int, queued: int) -> EngineMetrics:
        with self._lock:
            return EngineMetrics(
                requests_total=self.requests_total,
                requests_running=running,
                queue_depth=queued,
                tokens_generated_total=self.tokens_generated_total,
                steps_total=self.steps_total,
                mean_tau=self.committed_in_steps / self.row_steps if self.row_steps else 0.0,
                errors_total=self.errors_total,
                cancelled_total=self.cancelled_total,
                block_sizes=dict(self.block_sizes),
                prefill_s_total=self.prefill_s_total,
                prefill_cpu_s_total=self.prefill_cpu_s_total,
            )
