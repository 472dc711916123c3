"""Admission: a bounded FIFO of waiting requests in front of the running batch."""

from __future__ import annotations

import threading
from collections import deque

from blockspec.engine.request import Request
from blockspec.errors import BlockspecError


class QueueFullError(BlockspecError):
    """The engine holds max_batch + max_queue requests already; retry later (HTTP 429/503)."""


class Scheduler:
    """Thread-safe waiting queue. The engine thread admits; any thread submits.

    Bound: running + waiting <= max_batch + max_queue, i.e. at most max_queue requests wait
    beyond the free batch slots.
    """

    def __init__(self, max_batch: int, max_queue: int) -> None:
        self.max_batch = max_batch
        self.max_queue = max_queue
        self.waiting: deque[Request] = deque()
        self.running = 0
        self.cond = threading.Condition()

    def submit(self, request: Request) -> None:
        with self.cond:
            if len(self.waiting) + self.running >= self.max_batch + self.max_queue:
                raise QueueFullError(
                    f"the engine is full ({self.running} running, {len(self.waiting)} waiting; "
                    f"max_batch {self.max_batch} + max_queue {self.max_queue}); retry later or "
                    "raise max_queue"
                )
            self.waiting.append(request)
            self.cond.notify_all()

    def admit(self, running: int) -> list[Request]:
        """Pops as many waiting requests as there are free batch slots (FIFO)."""
        with self.cond:
            self.running = running
            free = max(0, self.max_batch - running)
            out = [self.waiting.popleft() for _ in range(min(free, len(self.waiting)))]
            self.running = running + len(out)
            return out

    def set_running(self, running: int) -> None:
        with self.cond:
            self.running = running

    def drain(self) -> list[Request]:
        """Removes and returns every waiting request (engine shutdown)."""
        with self.cond:
            out = list(self.waiting)
            self.waiting.clear()
            return out

    def wait_for_work(self, timeout: float) -> None:
        with self.cond:
            if not self.waiting:
                self.cond.wait(timeout)

    def wake(self) -> None:
        with self.cond:
            self.cond.notify_all()

    @property
    def depth(self) -> int:
        with self.cond:
            return len(self.waiting)
