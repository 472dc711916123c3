"""Engine counters and latency histograms, for the server's /metrics."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

# Upper bounds (seconds) of the latency histogram buckets; the last bucket is +inf.
LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


@dataclass
class Histogram:
    """Cumulative-friendly histogram: counts[i] requests took <= bounds[i] (last: the rest)."""

    bounds: tuple[float, ...] = LATENCY_BUCKETS
    counts: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS) + 1))
    total: float = 0.0
    n: int = 0

    def add(self, seconds: float) -> None:
        i = next((k for k, b in enumerate(self.bounds) if seconds <= b), len(self.bounds))
        self.counts[i] += 1
        self.total += seconds
        self.n += 1

    def copy(self) -> Histogram:
        return Histogram(self.bounds, list(self.counts), self.total, self.n)


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
    latency: Histogram  # submit -> final event
    time_to_first_token: Histogram
    block_sizes: dict[int, int]  # steps per block size used


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
        self.latency = Histogram()
        self.ttft = Histogram()
        self.block_sizes: dict[int, int] = {}

    def submitted(self) -> None:
        with self._lock:
            self.requests_total += 1

    def step(self, block: int, rows: int, committed: int) -> None:
        with self._lock:
            self.steps_total += 1
            self.row_steps += rows
            self.committed_in_steps += committed
            self.block_sizes[block] = self.block_sizes.get(block, 0) + 1

    def tokens(self, n: int) -> None:
        with self._lock:
            self.tokens_generated_total += n

    def first_token(self, seconds: float) -> None:
        with self._lock:
            self.ttft.add(seconds)

    def finished(self, reason: str, seconds: float) -> None:
        with self._lock:
            self.latency.add(seconds)
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
                latency=self.latency.copy(),
                time_to_first_token=self.ttft.copy(),
                block_sizes=dict(self.block_sizes),
            )
