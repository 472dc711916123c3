"""Server counters and the Prometheus text exposition of GET /metrics.

The server counts what it sees at the HTTP edge (requests by route and status, tokens, latency,
time to first token, per-request tau); the engine's own gauges (queue depth, running requests,
steps) are read from `engine.metrics` when scraped, so the two never drift apart.
"""

from __future__ import annotations

import math
import threading
from collections import defaultdict
from collections.abc import Sequence

from blockspec.engine.metrics import Histogram

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
TAU_BUCKETS = (1.0, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 8.0, 10.0, 16.0)

# Engine fields exported as gauges or counters when the engine has them: (attribute, type, help).
ENGINE_FIELDS = (
    ("requests_total", "counter", "Requests admitted by the engine."),
    ("requests_running", "gauge", "Requests being decoded now."),
    ("queue_depth", "gauge", "Requests waiting for a batch slot."),
    ("tokens_generated_total", "counter", "Tokens committed by the engine."),
    ("steps_total", "counter", "Decode steps run by the engine."),
    ("mean_tau", "gauge", "Mean acceptance length (committed tokens per step) over the engine's life."),
    ("errors_total", "counter", "Requests that failed inside the engine."),
    ("cancelled_total", "counter", "Requests cancelled (client gone or shutdown)."),
)


def _histogram_lines(name: str, hist: Histogram) -> list[str]:
    out = [f'{name}_bucket{{le="{_num(b)}"}} {c}' for b, c in zip(hist.bounds, hist.counts)]
    out.append(f'{name}_bucket{{le="+Inf"}} {hist.count}')
    out += [f"{name}_sum {_num(hist.sum)}", f"{name}_count {hist.count}"]
    return out


def _num(x: float) -> str:
    if isinstance(x, bool):
        return str(int(x))
    if isinstance(x, int):
        return str(x)
    if math.isnan(x):
        return "NaN"
    if math.isinf(x):
        return "+Inf" if x > 0 else "-Inf"
    return repr(float(x))


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class ServerMetrics:
    """Thread-safe counters; `render` gives the exposition text."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: dict[tuple[str, int], int] = defaultdict(int)
        self.finished: dict[str, int] = defaultdict(int)  # by finish_reason
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.spec_steps = 0
        self.spec_tokens = 0  # tokens committed by decode steps (the first token comes from prefill)
        self.in_flight = 0
        self.latency = Histogram(LATENCY_BUCKETS)
        self.ttft = Histogram(LATENCY_BUCKETS)
        self.tau = Histogram(TAU_BUCKETS)
        self.accepted_by_depth: list[int] = []  # drafted proposals accepted at depth d (trees: by their first-choice chain)
        self.accepted_by_rank: list[int] = []  # token trees: accepted nodes by rank among their siblings
        self.tree_steps = 0

    def request_done(self, route: str, status: int) -> None:
        with self._lock:
            self.requests[(route, status)] += 1

    def generation_started(self) -> None:
        with self._lock:
            self.in_flight += 1

    def generation_ended(self) -> None:
        with self._lock:
            self.in_flight -= 1

    def generation_done(
        self, finish_reason: str, prompt_tokens: int, completion_tokens: int, latency_s: float,
        ttft_s: float | None, acceptance_lengths: list[int], *, accepted_by_depth: Sequence[int] = (),
        accepted_by_rank: Sequence[int] = (), tree_steps: int = 0,
    ) -> None:
        """Books a finished generation; the acceptance counts are its requests' sums (RequestStats)."""
        with self._lock:
            self.finished[finish_reason] += 1
            self.prompt_tokens += prompt_tokens
            self.completion_tokens += completion_tokens
            self.latency.observe(latency_s)
            if ttft_s is not None:
                self.ttft.observe(ttft_s)
            if acceptance_lengths:
                self.spec_steps += len(acceptance_lengths)
                self.spec_tokens += sum(acceptance_lengths)
                self.tau.observe(sum(acceptance_lengths) / len(acceptance_lengths))
            for counts, into in ((accepted_by_depth, self.accepted_by_depth), (accepted_by_rank, self.accepted_by_rank)):
                into.extend([0] * (len(counts) - len(into)))
                for k, n in enumerate(counts):
                    into[k] += n
            self.tree_steps += tree_steps

    def render(self, engine_metrics: object | None = None) -> str:
        out: list[str] = []

        def head(name: str, kind: str, text: str) -> None:
            out.append(f"# HELP {name} {text}")
            out.append(f"# TYPE {name} {kind}")

        with self._lock:
            head("blockspec_http_requests_total", "counter", "HTTP requests answered, by route and status code.")
            for (route, status), n in sorted(self.requests.items()):
                out.append(f'blockspec_http_requests_total{{route="{_label(route)}",status="{status}"}} {n}')
            head("blockspec_requests_in_flight", "gauge", "Generation requests being answered now.")
            out.append(f"blockspec_requests_in_flight {self.in_flight}")
            head("blockspec_requests_finished_total", "counter", "Generation requests finished, by finish reason.")
            for reason, n in sorted(self.finished.items()):
                out.append(f'blockspec_requests_finished_total{{finish_reason="{_label(reason)}"}} {n}')
            head("blockspec_prompt_tokens_total", "counter", "Prompt tokens of finished requests.")
            out.append(f"blockspec_prompt_tokens_total {self.prompt_tokens}")
            head("blockspec_generation_tokens_total", "counter", "Generated tokens of finished requests.")
            out.append(f"blockspec_generation_tokens_total {self.completion_tokens}")
            head("blockspec_spec_steps_total", "counter", "Decode steps of finished requests.")
            out.append(f"blockspec_spec_steps_total {self.spec_steps}")
            head("blockspec_spec_tokens_total", "counter", "Tokens committed by those steps (tau = tokens / steps).")
            out.append(f"blockspec_spec_tokens_total {self.spec_tokens}")
            head("blockspec_tau", "gauge", "Mean acceptance length (tokens per decode step) over finished requests.")
            tau = self.spec_tokens / self.spec_steps if self.spec_steps else 0.0
            out.append(f"blockspec_tau {_num(tau)}")
            head("blockspec_spec_accepted_by_depth_total", "counter",
                 "Drafted tokens accepted at each position of a step's chain (in a tree step, of the "
                 "drafter's first-choice chain) by finished requests.")
            for k, n in enumerate(self.accepted_by_depth):
                out.append(f'blockspec_spec_accepted_by_depth_total{{depth="{k + 1}"}} {n}')
            head("blockspec_spec_tree_steps_total", "counter", "Decode steps that verified a token tree.")
            out.append(f"blockspec_spec_tree_steps_total {self.tree_steps}")
            head("blockspec_spec_accepted_by_rank_total", "counter",
                 "Token-tree nodes accepted, by rank among their siblings (1: the drafter's first choice).")
            for k, n in enumerate(self.accepted_by_rank):
                out.append(f'blockspec_spec_accepted_by_rank_total{{rank="{k + 1}"}} {n}')
            head("blockspec_request_tau", "histogram", "Acceptance length per finished request.")
            out += _histogram_lines("blockspec_request_tau", self.tau)
            head("blockspec_request_latency_seconds", "histogram", "End-to-end latency of generation requests.")
            out += _histogram_lines("blockspec_request_latency_seconds", self.latency)
            head("blockspec_time_to_first_token_seconds", "histogram", "Time from arrival to the first token.")
            out += _histogram_lines("blockspec_time_to_first_token_seconds", self.ttft)
        if engine_metrics is not None:
            for attr, kind, text in ENGINE_FIELDS:
                value = getattr(engine_metrics, attr, None)
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    head(f"blockspec_engine_{attr}", kind, text)
                    out.append(f"blockspec_engine_{attr} {_num(value)}")
            blocks = getattr(engine_metrics, "block_sizes", None)
            if isinstance(blocks, dict):
                head("blockspec_engine_steps_by_block_size_total", "counter", "Decode steps per block size used.")
                for size, n in sorted(blocks.items()):
                    out.append(f'blockspec_engine_steps_by_block_size_total{{block_size="{size}"}} {n}')
        return "\n".join(out) + "\n"
