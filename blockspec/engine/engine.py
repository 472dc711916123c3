"""The continuous-batching engine: one thread stepping one DecodeBatch.

Between steps, finished and cancelled requests leave and waiting ones join (prefilled into free
rows of the running batch's caches), so requests of any length share the target's forward
passes. Each request keeps its own sampling parameters, seed, stop conditions and statistics,
and streams its committed tokens as TokenEvents. Greedy output of a request does not depend on
its batch mates: rows never see each other's cache entries and verification is exact.

    engine = Engine(target, drafter, EngineConfig(SpecConfig(block_size=16, adaptive=True), max_batch=8))
    handle = engine.submit(prompt_ids, SamplingParams(max_new_tokens=64))  # any thread
    for event in handle.events(): ...   # or handle.result(), or `async for` handle.aevents()
    engine.stop()

By default the engine decodes on a thread of its own, started by the first submit (a server). With
EngineConfig(own_thread=False) nothing decodes until the owner calls run_until_idle() on its own
thread (a benchmark; the Python API through engine/decoder.py). Either way one thread does all the
torch work, which on CPU is what keeps its small matrix products fast (cpu/openmp.py).
"""

from __future__ import annotations

import itertools
import threading
import time
import traceback
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from blockspec.config import SamplingParams, SpecConfig
from blockspec.cpu.openmp import release_thread_pool
from blockspec.cpu.threads import follow_free_cores
from blockspec.dflash.batch import DecodeBatch, captured_features
from blockspec.dflash.results import GenerationResult, RequestStats
from blockspec.dflash.row import Row, make_row
from blockspec.dflash.constraint import TokenConstraint
from blockspec.dflash.drafter import DFlashDrafter, check_compatible
from blockspec.dflash.policy import AdaptiveBlock
from blockspec.engine.memory import trim_heap
from blockspec.engine.metrics import EngineMetrics, MetricsRecorder
from blockspec.engine.request import OnTokens, Request, RequestHandle, StopCheck, TokenEvent, check_prompt
from blockspec.engine.scoring import prompt_logprobs
from blockspec.engine.scheduler import Scheduler
from blockspec.errors import ConfigError
from blockspec.targets.base import Target


@dataclass(frozen=True)
class EngineConfig:
    """Engine knobs: how requests are decoded (`spec`) and how many share a batch. spec.block_size
    is the upper bound; 1 means plain decoding."""

    spec: SpecConfig = field(default_factory=SpecConfig)
    max_batch: int = 16  # requests decoded together per step
    max_queue: int = 64  # waiting requests beyond max_batch; more -> QueueFullError
    idle_wait_s: float = 0.05  # how long the idle thread sleeps between checks
    # True: decode on the engine's own thread, started by the first submit (a server). False: the
    # owner decodes on its own thread with run_until_idle() (a benchmark, the Python API: no
    # second OpenMP team).
    own_thread: bool = True
    # True: the adaptive policy measures every batch size up to max_batch before the first
    # request (no calibration pass inside a served step). False: each batch size at its first step.
    calibrate_first: bool = True
    # An engine with a thread of its own that has had nothing to do for this long frees its
    # caches (sized for the largest batch and longest sequence seen) and trims the heap, so a
    # burst of long requests does not keep its memory; None keeps everything.
    release_idle_s: float | None = 2.0

    def __post_init__(self) -> None:
        if not isinstance(self.spec, SpecConfig):
            raise ConfigError(f"spec must be a SpecConfig, got {type(self.spec).__name__}")
        if not isinstance(self.max_batch, int) or self.max_batch < 1:
            raise ConfigError(f"max_batch must be an integer >= 1, got {self.max_batch!r}")
        if not isinstance(self.max_queue, int) or self.max_queue < 0:
            raise ConfigError(f"max_queue must be an integer >= 0, got {self.max_queue!r}")
        for name in ("own_thread", "calibrate_first"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.release_idle_s is not None and not (isinstance(self.release_idle_s, (int, float))
                                                    and self.release_idle_s >= 0):
            raise ConfigError(f"release_idle_s must be None or seconds >= 0, got {self.release_idle_s!r}")


class Engine:
    """Serves token-id requests, decoding them together (see the module docstring)."""

    def __init__(self, target: Target, drafter: DFlashDrafter | None, config: EngineConfig | None = None, *,
                 tokenizer: object = None, capture_layer_ids: tuple[int, ...] = ()) -> None:
        """capture_layer_ids: every request's result also carries the target features of these
        layers at every position (what drafter training reads), from the passes decoding makes."""
        self.config = config or EngineConfig()
        spec = self.config.spec
        if drafter is not None:
            info = target.info
            check_compatible(drafter.cfg, hidden_size=info.hidden_size, vocab_size=info.vocab_size,
                             num_layers=info.num_layers)
        elif spec.block_size > 1:
            raise ConfigError("block_size > 1 needs a drafter; pass one, or use block_size=1 for plain decoding")
        self.target = target
        self.drafter = drafter
        self.tokenizer = tokenizer
        self.block = block = spec.block_size
        self.batch = DecodeBatch(target, drafter if block > 1 else None, max_block=block,
                                 compact_ratio=spec.compact_ratio, lookup=spec.lookup,
                                 capture_layer_ids=capture_layer_ids, tree_nodes=spec.tree_nodes)
        self.adaptive = AdaptiveBlock(block, ragged=spec.ragged_verify) if spec.adaptive and block > 1 else None
        self.scheduler = Scheduler(self.config.max_batch, self.config.max_queue)
        self.recorder = MetricsRecorder()
        self._requests: dict[str, Request] = {}  # running, by id (engine thread only)
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._ready = threading.Event()  # set once the loop has calibrated and takes requests
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self.last_error: str | None = None
        self.last_exception: BaseException | None = None

    # ---- public API ------------------------------------------------------------------------------
    def start(self) -> None:
        """Starts the decode thread (idempotent; not with EngineConfig(own_thread=False))."""
        if not self.config.own_thread:
            raise ConfigError("this engine has no thread of its own (EngineConfig(own_thread=False)): "
                              "decode the submitted requests with engine.run_until_idle()")
        with self._lock:
            if self._thread is not None and self._thread.is_alive():
                return
            self._stopping.clear()
            # The thread that hands over (it loaded the models) keeps an idle OpenMP team that
            # would slow the decode thread's parallel regions down (cpu/openmp.py).
            release_thread_pool()
            self._thread = threading.Thread(target=self._loop, name="blockspec-engine", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """Cancels everything still queued or running and joins the thread."""
        with self._lock:
            thread = self._thread
            self._stopping.set()
            self.scheduler.wake()
        if thread is not None:
            thread.join()
        else:  # own_thread=False: an interrupted run_until_idle left its rows in the batch
            self._drop_all("cancelled")
        for request in self.scheduler.drain():
            self._finish_unstarted(request, "cancelled")

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Starts the decode thread and waits until it takes requests (adaptive block size:
        every batch-size bucket calibrated). Benchmarks call it to keep start-up out of timings.
        Without a thread of its own, the engine calibrates on the calling thread."""
        if not self.config.own_thread:
            if not self._ready.is_set():
                self._calibrate()
            return True
        self.start()
        return self._ready.wait(timeout)

    @property
    def ready(self) -> bool:
        """Whether the decode loop has calibrated (adaptive block size) and takes requests."""
        return self._ready.is_set()

    @torch.inference_mode()
    def run_until_idle(self, on_finished: Callable[[int], None] | None = None) -> None:
        """Decodes on the calling thread until nothing is waiting or running, for an engine made
        with EngineConfig(own_thread=False); the submitted requests' handles then hold results.
        on_finished(n) hears after each step how many requests ended in it (progress bars); what
        it submits runs before this returns."""
        if self.config.own_thread:
            raise ConfigError("run_until_idle() is for engines made with EngineConfig(own_thread=False); "
                              "this one decodes on its own thread: wait on the request handles")
        self.wait_ready()
        left = self.pending
        while left:
            self._tick()
            now = self.pending
            if on_finished is not None and now < left:
                on_finished(left - now)
                # it may have submitted work (a request replacing the one that ended)
                now = self.pending
            left = now

    def step_once(self) -> bool:
        """One engine step on the calling thread (an engine made with EngineConfig(own_thread=False)):
        admits waiting requests and decodes one step; True while requests are left waiting or
        running. Several engines stepped in turn see the same machine, step by step."""
        if self.config.own_thread:
            raise ConfigError("step_once() is for engines made with EngineConfig(own_thread=False)")
        self.wait_ready()
        if self.pending:
            self._tick()
        return bool(self.pending)

    @property
    def pending(self) -> int:
        """Requests waiting or running."""
        return self.scheduler.depth + len(self._requests)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def submit(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None,
               stop_check: StopCheck | None = None, on_tokens: OnTokens | None = None,
               constraint: TokenConstraint | None = None) -> RequestHandle:
        """Queues a request; validates it now (ContextLengthError, ConfigError) and raises
        QueueFullError when the queue is full. Never waits for the decode loop (own_thread=False:
        nothing decodes until the owner calls run_until_idle()). on_tokens(ids) hears each
        commit on the decoding thread, before the event is queued. `constraint`: a fresh matcher
        (engine/grammar.py) the output must match; it masks every token the request commits."""
        if not isinstance(params, SamplingParams):
            raise ConfigError(f"params must be a SamplingParams, got {type(params).__name__}")
        prompt_ids = check_prompt(self.target.info, prompt_ids, params)
        if stop_check is None and params.stop and self.tokenizer is not None:
            from blockspec.text import StopStrings

            stop_check = StopStrings(self.tokenizer, params.stop).watch()
        rid = request_id or f"req-{uuid.uuid4().hex[:12]}-{next(self._ids)}"
        request = Request(rid, prompt_ids, params, stop_check, on_tokens=on_tokens, constraint=constraint)
        self.scheduler.submit(request)
        self.recorder.submitted()
        if self.config.own_thread:
            self.start()
        return RequestHandle(request)

    def generate(self, prompt_ids: list[int], params: SamplingParams, timeout: float | None = None) -> GenerationResult:
        """Submits one request and waits for its result (own_thread=False: decodes it here)."""
        handle = self.submit(prompt_ids, params)
        if not self.config.own_thread:
            self.run_until_idle()
        return handle.result(timeout)

    @property
    def metrics(self) -> EngineMetrics:
        return self.recorder.snapshot(len(self._requests), self.scheduler.depth)

    # ---- the loop ------------------------------------------------------------------------------------
    def _calibrate(self) -> None:
        if self.adaptive is not None and self.config.calibrate_first:
            if self.batch.device.type == "cpu":
                follow_free_cores()  # calibrated at the thread count the first steps will run
            try:  # before the first request, so no calibration pass lands inside a measured step
                self.adaptive.calibrate_all(self.batch, self.config.max_batch)
            except Exception as e:  # the costs are then calibrated lazily per batch size
                self._note_error(e)
        self._ready.set()

    @torch.inference_mode()
    def _loop(self) -> None:
        self._calibrate()
        idle_released = False
        idle_since: float | None = None
        while not self._stopping.is_set():
            if self._tick():
                idle_released = False
                idle_since = None
                continue
            if not idle_released:  # an idle engine's team would slow a busy one down (openmp.py)
                release_thread_pool()
                idle_released = True
            now = time.monotonic()
            idle_since = now if idle_since is None else idle_since
            keep = self.config.release_idle_s
            if keep is not None and now - idle_since >= keep and not self.released:
                self.release_memory()
            self.scheduler.wait_for_work(self.config.idle_wait_s)
        self._drop_all("cancelled")

    @property
    def released(self) -> bool:
        """Whether the engine holds no cache storage (released while idle, or never used)."""
        return self.batch.tcache is None and self.batch.dcache is None

    def release_memory(self) -> None:
        """Frees the caches' storage and trims the heap; only while nothing runs (engine thread)."""
        if self.batch.rows:
            return
        self.batch.release()
        trim_heap()

    def reserve(self, rows: int, tokens: int) -> None:
        """Sizes the caches, before requests arrive, for `rows` requests of up to `tokens` tokens
        each (prompt and output; `DecodeBatch.reserve`), so none of their steps grows them. Only
        while nothing runs, on the thread that decodes (own_thread=False: the caller's). An idle
        engine with its own thread gives the storage back after `release_idle_s`."""
        if self.batch.rows:
            raise ConfigError("reserve() sizes an idle engine's caches; call it before submitting")
        self.batch.reserve(min(rows, self.config.max_batch), tokens)

    def _tick(self) -> bool:
        """Admits waiting requests and runs one step; False when there was nothing to run."""
        try:
            if self.batch.device.type == "cpu":
                follow_free_cores()  # threads where cores are free (cpu/threads.py); the output is the same
            self._admit()
            if not self.batch.rows:
                return False
            self._drop_cancelled()
            if self.batch.rows:
                self._step()
        except Exception as e:  # a bug outside the model calls: fail the batch, keep serving
            self._fail_all(e)
        return True

    def _admit(self) -> None:
        joining = [r for r in self.scheduler.admit(len(self.batch.rows))
                   if not self._skip_cancelled(r) and not self._score(r)]
        if not joining:
            self.scheduler.set_running(len(self.batch.rows))
            return
        eos = self.target.info.eos_token_ids
        rows = [make_row(r.request_id, len(r.prompt_ids), r.params, eos, self.block, r.stop_check, r.constraint)
                for r in joining]
        for r in joining:
            self._requests[r.request_id] = r
        before = len(self.batch.rows)
        t0, c0 = time.perf_counter(), time.process_time()
        try:
            self.batch.join([r.prompt_ids for r in joining], rows)
        except Exception as e:
            self._note_error(e)
            for r, row in zip(joining, rows):
                row.finish_reason = "error"
                self._emit(r, row, error=f"{type(e).__name__}: {e}")
                self._requests.pop(r.request_id, None)
            if len(self.batch.rows) != before or self.batch.cur.shape[0] != before:
                self._fail_all(e)  # the batch changed half-way: it cannot be trusted
            self.scheduler.set_running(len(self.batch.rows))
            return
        prefill_s = time.perf_counter() - t0
        self.recorder.prefill(prefill_s, time.process_time() - c0)
        for row in rows:
            row.stats.prefill_s = prefill_s
        self._report()

    def _score(self, request: Request) -> bool:
        """Sends the prompt's logprobs of a request that asked for them (engine/scoring.py);
        True when that ended the request (scoring only, max_new_tokens 0, or a failure)."""
        k = request.params.prompt_logprobs
        if k is None:
            return False
        t0 = time.perf_counter()
        try:
            scores = prompt_logprobs(self.target, request.prompt_ids, k, device=self.batch.device)
        except Exception as e:
            self._note_error(e)
            self._finish_unstarted(request, "error", f"{type(e).__name__}: {e}")
            return True
        if request.params.max_new_tokens > 0:
            request.emit(TokenEvent(request.request_id, [], False, None, None, prompt_logprobs=scores))
            return False
        stats = RequestStats(prompt_tokens=len(request.prompt_ids), block_size=self.block,
                             prefill_s=time.perf_counter() - t0)
        request.emit(TokenEvent(request.request_id, [], True, "length", stats, prompt_logprobs=scores))
        self.recorder.finished("length")
        return True

    def _skip_cancelled(self, request: Request) -> bool:
        if request.cancelled.is_set():
            self._finish_unstarted(request, "cancelled")
            return True
        return False

    def _finish_unstarted(self, request: Request, reason: str, error: str | None = None) -> None:
        request.emit(TokenEvent(request.request_id, [], True, reason, None, error))
        self.recorder.finished(reason)

    def _drop_cancelled(self) -> None:
        changed = False
        for row in self.batch.rows:
            if row.finish_reason is None and self._requests[row.key].cancelled.is_set():
                row.finish_reason = "cancelled"
                row.new_tokens = []
                changed = True
        if changed:
            self._report()

    def _step(self) -> None:
        rows = list(self.batch.rows)
        try:
            if self.adaptive is not None:
                block = self.adaptive.step(self.batch)
            else:
                block = self.batch.step(self.block)
        except Exception as e:
            self._fail_all(e)
            return
        now = time.perf_counter()
        committed = 0
        for row in rows:
            row.stats.decode_s = now - row.decode_t0
            committed += row.stats.acceptance_lengths[-1] if row.stats.acceptance_lengths else 0
        self.recorder.step(block, len(rows), committed)
        self._report()

    def _report(self) -> None:
        """Streams new tokens, sends final events and retires finished rows."""
        for row in self.batch.rows:
            request = self._requests[row.key]
            if row.finish_reason is None and row.new_tokens:
                self.recorder.tokens(len(row.new_tokens))
                new = list(row.new_tokens)
                if request.on_tokens is not None:
                    request.on_tokens(new)
                request.emit(TokenEvent(row.key, new, False, None, None, logprobs=_take_logprobs(row)))
                row.new_tokens = []
        for row in self.batch.retire():
            request = self._requests.pop(row.key)
            self._emit(request, row)
        self.scheduler.set_running(len(self.batch.rows))

    def _emit(self, request: Request, row: Row, error: str | None = None) -> None:
        """The final event of a row (its last tokens included)."""
        reason = row.finish_reason or "error"
        ended = reason not in ("cancelled", "error")
        tokens = list(row.new_tokens) if ended else []
        logprobs = _take_logprobs(row) if ended else None
        self.recorder.tokens(len(tokens))
        if tokens and request.on_tokens is not None:
            request.on_tokens(tokens)
        features = captured_features(row) if ended else None
        request.emit(TokenEvent(row.key, tokens, True, reason, row.stats, error, features, logprobs=logprobs))
        row.new_tokens = []
        self.recorder.finished(reason)

    def _note_error(self, e: BaseException) -> None:
        self.last_error = "".join(traceback.format_exception(e))
        self.last_exception = e

    def _fail_all(self, e: BaseException) -> None:
        """Fails every running request with finish_reason "error" and starts a clean batch."""
        self._note_error(e)
        message = f"{type(e).__name__}: {e}"
        for row in list(self.batch.rows):
            request = self._requests.pop(row.key, None)
            row.finish_reason = "error"
            if request is not None:
                self._emit(request, row, error=message)
        for request in list(self._requests.values()):
            self._finish_unstarted(request, "error", message)
        self._requests.clear()
        self.batch.clear()
        self.scheduler.set_running(0)

    def _drop_all(self, reason: str) -> None:
        for row in list(self.batch.rows):
            request = self._requests.pop(row.key, None)
            row.finish_reason = reason
            if request is not None:
                self._emit(request, row)
        self.batch.clear()
        self.scheduler.set_running(0)


def _take_logprobs(row: Row) -> list | None:
    """The logprobs of the row's new tokens (None when the request did not ask for them)."""
    if row.logprobs is None:
        return None
    out = list(row.new_logprobs)
    row.new_logprobs = []
    return out
