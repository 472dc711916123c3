"""Benchmark runners and the suite that drives them over data sets, settings and concurrency.

A runner turns a list of token-id requests into outputs, `concurrency` requests in flight at a
time. Everything above that (chat templates, multi-turn conversations, warm-up, timing, progress)
lives in `run_suite`, so a new way of serving requests (the continuous batching engine, an HTTP
endpoint: see bench/http.py) only needs a new runner.
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from types import SimpleNamespace
from typing import Protocol

from blockspec.config import SAMPLING_RULES, SamplingParams, SpecConfig
from blockspec.errors import ConfigError
from blockspec.text import encode_prompt

Progress = Callable[[int], None]  # called with the number of requests just finished
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


@dataclass(frozen=True)
class Request:
    """One generation request: a prompt in token ids plus its sampling parameters. `messages` is
    the same prompt as a conversation, for runners that send text (an HTTP endpoint)."""

    prompt_ids: tuple[int, ...]
    params: SamplingParams
    messages: tuple[dict, ...] | None = None
    enable_thinking: bool | None = None


@dataclass
class Output:
    """What a runner returns per request. Acceptance fields are None for non-speculative runners;
    `steps` (target verification passes after prefill) is known even when per-step lengths are not."""

    token_ids: list[int]
    finish_reason: str
    latency_s: float  # end to end for this request, prefill included (wall clock)
    prefill_s: float | None = None
    steps: int | None = None
    acceptance_lengths: list[int] | None = None
    accepted_by_position: list[int] | None = None
    sampling_rule: str | None = None  # how the engine verified it: "greedy", "keyed" or "standard"
    # token trees: steps that verified one, and accepted nodes by rank among their siblings
    tree_steps: int | None = None
    accepted_by_rank: list[int] | None = None


class Runner(Protocol):
    """Generates for requests. `name` is unique in a suite ("ar", "dflash b16", "hf", ...).

    A runner that can tell the time its last `run` spent in prefill passes sets
    `last_prefill_s`, keyed by clock name ("wall", "cpu"): each pass counted once however many
    requests it admitted. The suite then reports decode-only throughput for it (RunRecord)."""

    name: str
    method: str  # "ar" | "dflash" | "hf" | "pld" | "reference"
    block_size: int  # tokens per verification pass (1 for non-speculative runners)
    max_concurrency: int | None  # None: any; 1: batch-1 baselines

    def run(self, requests: Sequence[Request], concurrency: int, progress: Progress | None = None) -> list[Output]: ...


class EngineRunner:
    """The continuous batching engine in process (what `blockspec serve` runs): `concurrency`
    requests in flight, a finished one replaced by the next waiting one at the following step.

    block_size 1 is plain autoregressive decoding on the same target; `adaptive` lets the engine
    pick each step's block size (at most `block_size`); `lookup` adds n-gram lookup proposals
    (runner names then read 'dflash+lookup'). One engine per concurrency level is kept
    for the runner's life, so adaptive calibrations and cache storage are paid once. The engines
    decode on the benchmark's own thread (no engine threads), like every baseline: idle engine
    threads would each keep an OpenMP team, which slows the busy one (cpu/openmp.py).
    """

    max_concurrency = None

    def __init__(self, target: object, drafter: object | None, block_size: int, *, adaptive: bool = False,
                 lookup: object | None = None, ragged: bool = False, sampling_rule: str | None = None,
                 tree_nodes: int = 0) -> None:
        if block_size > 1 and drafter is None:
            raise ConfigError("a DFlash runner needs a drafter; load one or use block_size=1")
        if adaptive and block_size < 2:
            raise ConfigError("adaptive block size needs a drafter block size >= 2")
        if ragged and not adaptive:
            raise ConfigError("ragged verification (a length per row) is chosen by the adaptive policy; "
                              "pass adaptive=True")
        self.ragged = ragged
        self.target, self.drafter = target, drafter if block_size > 1 else None
        self.block_size = block_size
        self.adaptive = adaptive
        self.lookup = lookup if block_size > 1 else None
        self.method = "ar" if block_size == 1 else "dflash"
        kind = "dflash+lookup" if self.lookup is not None else "dflash"
        self.name = "ar" if block_size == 1 else (f"{kind} auto<=b{block_size}" if adaptive else f"{kind} b{block_size}")
        if ragged:
            self.name += " ragged"
        self.tree_nodes = tree_nodes if block_size > 1 else 0
        if self.tree_nodes:
            self.name += f" tree{self.tree_nodes}"
        if sampling_rule is not None and sampling_rule not in SAMPLING_RULES:
            raise ConfigError(f"sampling_rule must be one of {', '.join(SAMPLING_RULES)}, got {sampling_rule!r}")
        # Every sampled request verified by this rule (SamplingParams.sampling_rule) instead of
        # its own; the name says which where forced (e.g. 'dflash auto<=b16 keyed').
        self.sampling_rule = sampling_rule if block_size > 1 else None
        if self.sampling_rule is not None and self.sampling_rule != "auto":
            self.name += f" {self.sampling_rule}"
        self._engines: dict[int, object] = {}
        self.last_block_sizes: dict[int, int] = {}  # steps per block size of the last `run`
        self.last_prefill_s: dict[str, float] = {}  # time in prefill passes of the last `run`, per clock

    def _engine(self, concurrency: int) -> object:
        from blockspec.engine import Engine, EngineConfig

        if concurrency not in self._engines:
            spec = SpecConfig(block_size=self.block_size, adaptive=self.adaptive, lookup=self.lookup,
                              ragged_verify=self.ragged, tree_nodes=self.tree_nodes)
            cfg = EngineConfig(spec, max_batch=concurrency, max_queue=1 << 20, own_thread=False)
            self._engines[concurrency] = Engine(self.target, self.drafter, cfg)
        return self._engines[concurrency]

    def prepare(self, concurrency: int) -> None:
        """Creates this concurrency's engine and runs its start-up (the adaptive cost
        calibration), which would otherwise land inside the first measured round."""
        self._engine(concurrency).wait_ready()

    def close(self) -> None:
        """Drops the engines (and their caches)."""
        for engine in self._engines.values():
            engine.stop()
        self._engines.clear()

    def run(self, requests: Sequence[Request], concurrency: int, progress: Progress | None = None) -> list[Output]:
        started = self.start(requests, concurrency)
        self._engine(concurrency).run_until_idle(progress)
        return self.finish(started)

    def start(self, requests: Sequence[Request], concurrency: int) -> tuple:
        """Submits `requests` to this concurrency's engine without decoding them (`step`, then
        `finish`): what `run` does in parts, so several runners can step in turn."""
        engine = self._engine(concurrency)
        if requests and not engine.pending:
            # the caches this round needs, before its steps are timed: growing them mid-run touches
            # fresh memory (up to ~0.3 s at 16 rows on a VM), whichever runner happens to grow first
            engine.reserve(min(concurrency, len(requests)),
                           max(len(r.prompt_ids) + r.params.max_new_tokens for r in requests))
        rule = self.sampling_rule
        handles = [engine.submit(list(r.prompt_ids), r.params if rule is None else r.params.with_(sampling_rule=rule))
                   for r in requests]
        return engine, engine.metrics, handles

    def step(self, started: tuple) -> tuple[bool, int]:
        """One engine step of a `start`ed run: (requests still left, requests that ended in it)."""
        engine = started[0]
        before = engine.pending
        left = engine.step_once()
        return left, before - engine.pending

    def finish(self, started: tuple) -> list[Output]:
        """The outputs of a `start`ed run once no request is left, and its step and prefill tallies."""
        engine, start, handles = started
        before = start.block_sizes
        end = engine.metrics
        after = end.block_sizes
        self.last_block_sizes = {n: c - before.get(n, 0) for n, c in sorted(after.items()) if c > before.get(n, 0)}
        self.last_prefill_s = {"wall": end.prefill_s_total - start.prefill_s_total,
                               "cpu": end.prefill_cpu_s_total - start.prefill_cpu_s_total}
        outputs: list[Output] = []
        speculative = self.block_size > 1
        for handle in handles:
            res = handle.result()
            st = res.stats
            outputs.append(Output(
                token_ids=list(res.token_ids),
                finish_reason=res.finish_reason,
                latency_s=st.prefill_s + st.decode_s,
                prefill_s=st.prefill_s,
                steps=st.steps,
                acceptance_lengths=list(st.acceptance_lengths) if speculative else None,
                # proposal k accepted, drafted or looked up: the report's share of steps per position
                accepted_by_position=[a + b for a, b in zip(st.accepted_by_position, st.lookup_accepted_by_position)]
                if speculative else None,
                sampling_rule=st.sampling_rule if speculative else None,
                tree_steps=st.tree_steps if speculative else None,
                accepted_by_rank=list(st.accepted_by_rank) if speculative else None,
            ))
        return outputs


# ---- the suite --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Setting:
    """A sampling regime: temperature, and thinking on/off (None: the template has no switch)."""

    temperature: float
    thinking: bool | None

    @property
    def label(self) -> str:
        temp = "Greedy (temperature 0)" if self.temperature == 0 else f"Temperature {self.temperature:g}"
        think = "" if self.thinking is None else (", thinking on" if self.thinking else ", thinking off")
        return temp + think

    @property
    def key(self) -> str:
        think = "na" if self.thinking is None else ("on" if self.thinking else "off")
        return f"t{self.temperature:g}-think-{think}"


@dataclass(frozen=True)
class SuitePlan:
    """What to run: concurrency levels, settings and generation length."""

    concurrency: tuple[int, ...] = (1,)
    settings: tuple[Setting, ...] = (Setting(0.0, None),)
    max_new_tokens: int = 128
    top_p: float = 1.0  # the nucleus of every sampled request (temperature > 0); 1: off
    # Sampled requests carry a seed derived from this one (reproducible, the keyed rule); None:
    # no seed, as chat clients send them (the standard rule, dflash/verify.py).
    seed: int | None = None
    warmup: bool = True
    warmup_tokens: int = 32
    # Every runner takes its turn on each round of prompts (round_batches x concurrency) before
    # the next round, so load from other processes on a shared machine drifts over all runners alike.
    interleave: bool = True
    round_batches: int = 4  # a round is this many times `concurrency` prompts
    # Within a round, the engine runners (ours) step in turn, one engine step each, every step
    # timed to its own runner (`run_task_stepped`); False: each runs its share of the round whole.
    stepped: bool = True
    # "wall": throughput per second of wall-clock time; "cpu": per second of this process's CPU
    # time (steadier on a machine shared with other jobs; pair it with one torch thread).
    clock: str = "wall"

    def __post_init__(self) -> None:
        if self.clock not in CLOCKS:
            raise ConfigError(f"clock must be one of {', '.join(CLOCKS)}, got {self.clock!r}")
        if not self.concurrency or any(not isinstance(c, int) or c < 1 for c in self.concurrency):
            raise ConfigError(f"concurrency must be integers >= 1, e.g. 1,4,8; got {self.concurrency!r}")
        if not isinstance(self.round_batches, int) or self.round_batches < 1:
            raise ConfigError(f"round_batches must be an integer >= 1, got {self.round_batches!r}")
        if not self.settings:
            raise ConfigError("give at least one setting (temperature / thinking)")
        if self.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"top_p must be in (0, 1] (1 = off), got {self.top_p!r}")


@dataclass
class RequestRecord:
    """One request of one run, with everything the report needs (serialised to results.json)."""

    runner: str
    method: str
    block_size: int
    task: str
    concurrency: int
    temperature: float
    thinking: bool | None
    sample_id: str
    turn: int
    prompt_tokens: int
    generated_tokens: int
    finish_reason: str
    latency_s: float
    prefill_s: float | None
    tokens_per_s: float
    steps: int | None
    mean_tau: float | None
    acceptance_lengths: list[int] | None
    accepted_by_position: list[int] | None
    token_ids: list[int]
    text: str
    sampling_rule: str | None = None  # DFlash runners: how the request was verified (Output)
    tree_steps: int | None = None  # DFlash runners with token trees (Output)
    accepted_by_rank: list[int] | None = None

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class RunRecord:
    """One runner over one task at one concurrency and setting: the time of the whole run (all
    turns; wall clock, or CPU time with SuitePlan.clock "cpu") is what throughput is computed from.

    Decode-only throughput is the tokens after each request's first (the first comes from its
    prefill) over the run's time less the time of its prefill passes, on the same clock. At
    concurrency > 1 a prefill pass stalls every row in flight, so it is taken out once, however
    many requests it admitted; what is left is the time of the decode steps. None where the
    runner cannot tell its prefill time (Runner.last_prefill_s)."""

    runner: str
    method: str
    block_size: int
    task: str
    concurrency: int
    temperature: float
    thinking: bool | None
    requests: int = 0
    generated_tokens: int = 0
    wall_s: float = 0.0
    prefill_s: float | None = 0.0  # time in prefill passes, clock of wall_s; None: not known
    block_sizes: dict[int, int] = field(default_factory=dict)  # engine steps per block size used
    records: list[RequestRecord] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def decode_tokens(self) -> int:
        """Generated tokens after each request's first."""
        return sum(max(0, r.generated_tokens - 1) for r in self.records)

    @property
    def decode_s(self) -> float | None:
        """The run's time less its prefill passes (None where those are not known)."""
        return None if self.prefill_s is None else max(0.0, self.wall_s - self.prefill_s)

    @property
    def decode_tokens_per_s(self) -> float | None:
        """Decode-only throughput (see the class docstring); None where the prefill time is unknown."""
        decode_s = self.decode_s
        if decode_s is None:
            return None
        return self.decode_tokens / decode_s if decode_s > 0 else 0.0

    def as_dict(self) -> dict:
        d = {k: v for k, v in asdict(self).items() if k != "records"}
        d["tokens_per_s"] = round(self.tokens_per_s, 3)
        d["decode_tokens"] = self.decode_tokens
        d["decode_s"] = None if self.decode_s is None else round(self.decode_s, 6)
        rate = self.decode_tokens_per_s
        d["decode_tokens_per_s"] = None if rate is None else round(rate, 3)
        return d


def _messages_for(turns: Sequence[str], answers: Sequence[str], turn: int) -> list[dict]:
    messages: list[dict] = []
    for i in range(turn):
        messages += [{"role": "user", "content": turns[i]}, {"role": "assistant", "content": answers[i]}]
    return messages + [{"role": "user", "content": turns[turn]}]


def encode_turn(tokenizer: object, turns: Sequence[str], answers: Sequence[str], turn: int,
                thinking: bool | None) -> list[int]:
    """Prompt ids for `turn` of a conversation whose earlier turns were answered with `answers`
    (the model's own replies). Without a chat template, the raw text is concatenated."""
    if getattr(tokenizer, "chat_template", None):
        kwargs = {"enable_thinking": thinking} if thinking is not None else None
        return encode_prompt(tokenizer, _messages_for(turns, answers, turn), chat=True, chat_template_kwargs=kwargs)
    parts = [p for i in range(turn) for p in (turns[i], answers[i])] + [turns[turn]]
    return encode_prompt(tokenizer, "\n\n".join(parts), chat=False)


def _visible(tokenizer: object, ids: Sequence[int]) -> str:
    return tokenizer.decode(list(ids), skip_special_tokens=True)


def _request_seed(seed: int | None, sample_id: str, turn: int) -> int | None:
    """Per-request sampling seed: the same for every runner and independent of batching (None
    without a suite seed)."""
    if seed is None:
        return None
    return (seed * 1_000_003 + zlib.crc32(sample_id.encode()) * 16 + turn) % 2**63


def _tau(out: Output) -> float | None:
    if out.acceptance_lengths:
        return sum(out.acceptance_lengths) / len(out.acceptance_lengths)
    if out.steps:  # runners that only count verification passes; the first token comes from prefill
        return max(0, len(out.token_ids) - 1) / out.steps
    return None


def _turn_requests(samples: Sequence[object], answers: list[list[str]], turn: int, tokenizer: object,
                   setting: Setting, plan: SuitePlan) -> tuple[list[int], list[Request]]:
    """The samples that have a turn `turn` and their requests, each after its runner's own
    earlier answers."""
    active = [i for i, s in enumerate(samples) if turn < len(s.turns)]
    prompts = [encode_turn(tokenizer, samples[i].turns, answers[i], turn, setting.thinking) for i in active]
    requests = [
        Request(tuple(p), SamplingParams(max_new_tokens=plan.max_new_tokens, temperature=setting.temperature,
                                         top_p=plan.top_p if setting.temperature > 0 else 1.0,
                                         seed=_request_seed(plan.seed, str(samples[i].id), turn)),
                messages=tuple(_messages_for(samples[i].turns, answers[i], turn)),
                enable_thinking=setting.thinking)
        for i, p in zip(active, prompts)
    ]
    return active, requests


def _book(run: RunRecord, runner: Runner, task: str, samples: Sequence[object], tokenizer: object,
          setting: Setting, concurrency: int, turn: int, active: list[int], requests: list[Request],
          outputs: list[Output], answers: list[list[str]], seconds: float, plan: SuitePlan) -> None:
    """Adds one turn's outputs (and `seconds` of the plan's clock) to `run`."""
    run.wall_s += seconds
    prefill = getattr(runner, "last_prefill_s", {}).get(plan.clock)
    run.prefill_s = None if prefill is None or run.prefill_s is None else run.prefill_s + prefill
    for n, steps in getattr(runner, "last_block_sizes", {}).items():
        run.block_sizes[n] = run.block_sizes.get(n, 0) + steps
    for i, req, out in zip(active, requests, outputs):
        text = _visible(tokenizer, out.token_ids)
        answers[i].append(text)
        n = len(out.token_ids)
        tau = _tau(out)
        run.records.append(RequestRecord(
            runner=runner.name, method=runner.method, block_size=runner.block_size, task=task,
            concurrency=concurrency, temperature=setting.temperature, thinking=setting.thinking,
            sample_id=str(samples[i].id), turn=turn, prompt_tokens=len(req.prompt_ids), generated_tokens=n,
            finish_reason=out.finish_reason, latency_s=round(out.latency_s, 6),
            prefill_s=None if out.prefill_s is None else round(out.prefill_s, 6),
            tokens_per_s=round(n / out.latency_s, 3) if out.latency_s > 0 else 0.0,
            steps=out.steps, mean_tau=None if tau is None else round(tau, 4),
            acceptance_lengths=out.acceptance_lengths, accepted_by_position=out.accepted_by_position,
            token_ids=list(out.token_ids), text=text, sampling_rule=out.sampling_rule,
            tree_steps=out.tree_steps, accepted_by_rank=out.accepted_by_rank,
        ))
        run.requests += 1
        run.generated_tokens += n


def _new_run(runner: Runner, task: str, setting: Setting, concurrency: int) -> RunRecord:
    return RunRecord(runner.name, runner.method, runner.block_size, task, concurrency, setting.temperature,
                     setting.thinking)


def run_task(
    runner: Runner,
    task: str,
    samples: Sequence[object],
    tokenizer: object,
    setting: Setting,
    concurrency: int,
    plan: SuitePlan,
    progress: Progress | None = None,
    into: RunRecord | None = None,
) -> RunRecord:
    """Runs every turn of every sample through one runner (adding to `into` when given). Turn k+1
    of a conversation is asked after the runner's own turn-k answer (mt-bench), so all turn-k
    requests go first."""
    run = into or _new_run(runner, task, setting, concurrency)
    answers: list[list[str]] = [[] for _ in samples]
    clock = CLOCKS[plan.clock]
    for turn in range(max(len(s.turns) for s in samples)):
        active, requests = _turn_requests(samples, answers, turn, tokenizer, setting, plan)
        t0 = clock()
        outputs = runner.run(requests, concurrency, progress)
        _book(run, runner, task, samples, tokenizer, setting, concurrency, turn, active, requests, outputs, answers,
              clock() - t0, plan)
    return run


def run_task_stepped(
    runners: Sequence[EngineRunner],
    task: str,
    samples: Sequence[object],
    tokenizer: object,
    setting: Setting,
    concurrency: int,
    plan: SuitePlan,
    progress: Progress | None = None,
    into: dict[str, RunRecord] | None = None,
) -> dict[str, RunRecord]:
    """`run_task` for several engine runners at once, their engines stepping in turn, one step
    each, every step timed on the plan's clock to its own runner: a machine whose speed drifts
    (a VM, other jobs) slows all of them alike, where runs one after the other would each get
    different minutes of it. Each runner's turn k+1 follows its own turn-k answers."""
    runs = into if into is not None else {r.name: _new_run(r, task, setting, concurrency) for r in runners}
    answers = {r.name: [[] for _ in samples] for r in runners}
    clock = CLOCKS[plan.clock]
    for turn in range(max(len(s.turns) for s in samples)):
        turns = {r.name: _turn_requests(samples, answers[r.name], turn, tokenizer, setting, plan) for r in runners}
        started = {r.name: r.start(turns[r.name][1], concurrency) for r in runners}
        seconds = dict.fromkeys(started, 0.0)
        busy = list(runners)
        while busy:
            for r in list(busy):
                t0 = clock()
                left, ended = r.step(started[r.name])
                seconds[r.name] += clock() - t0
                if progress is not None and ended:
                    progress(ended)
                if not left:
                    busy.remove(r)
        for r in runners:
            active, requests = turns[r.name]
            outputs = r.finish(started[r.name])
            _book(runs[r.name], r, task, samples, tokenizer, setting, concurrency, turn, active, requests, outputs,
                  answers[r.name], seconds[r.name], plan)
    return runs


def count_requests(datasets: dict[str, Sequence[object]]) -> int:
    """Requests per (runner, task set, concurrency, setting) pass: every turn of every sample."""
    return sum(len(s.turns) for samples in datasets.values() for s in samples)


def run_suite(
    runners: Sequence[Runner],
    datasets: dict[str, Sequence[object]],
    tokenizer: object,
    plan: SuitePlan,
    *,
    progress: bool = True,
    log: Callable[[str], None] | None = None,
) -> list[RunRecord]:
    """Every runner over every task, setting and concurrency level. Runners are interleaved per
    round of prompts (see SuitePlan.interleave), the first of each round rotating, so drift of
    the machine and what one runner leaves behind for the next hit all alike; within a round
    the engine runners step in turn (SuitePlan.stepped). Batch-1 baselines
    run once per task and setting, reported at concurrency 1."""
    from tqdm.auto import tqdm

    datasets = {k: list(v) for k, v in datasets.items() if len(v)}
    if not datasets:
        raise ConfigError("no prompts to run: every data set is empty (check --datasets and --limit)")
    names = [r.name for r in runners]
    if len(set(names)) != len(names):
        raise ConfigError(f"runner names must be unique, got {names}")
    first_conc = min(plan.concurrency)
    passes = 0
    for r in runners:
        passes += 1 if r.max_concurrency == 1 else len(plan.concurrency)
    total = passes * len(plan.settings) * count_requests(datasets)
    bar = tqdm(total=total, desc="bench", unit="req", disable=not progress, dynamic_ncols=True)
    runs: list[RunRecord] = []
    try:
        if plan.warmup:  # first calls pay for lazy initialisation; keep that out of the numbers
            task, samples = next(iter(datasets.items()))
            first = SimpleNamespace(id=samples[0].id, turns=list(samples[0].turns[:1]))
            warm_plan = SuitePlan(settings=plan.settings[:1], seed=plan.seed,
                                  max_new_tokens=min(plan.warmup_tokens, plan.max_new_tokens))
            for r in runners:
                bar.set_postfix_str(f"warm-up {r.name}")
                run_task(r, task, [first], tokenizer, plan.settings[0], 1, warm_plan)
        for setting in plan.settings:
            for task, samples in datasets.items():
                for conc in plan.concurrency:
                    active = [r for r in runners if r.max_concurrency != 1 or conc == first_conc]
                    level = {r.name: 1 if r.max_concurrency == 1 else conc for r in active}
                    here = {r.name: RunRecord(r.name, r.method, r.block_size, task, level[r.name],
                                              setting.temperature, setting.thinking) for r in active}
                    if plan.warmup:  # start-up of this concurrency's engines stays out of the timings
                        for r in active:
                            if hasattr(r, "prepare"):
                                r.prepare(level[r.name])
                    # Rounds of several batches' worth, so the engine can refill freed slots.
                    step = conc * plan.round_batches if plan.interleave else len(samples)
                    for turn, start in enumerate(range(0, len(samples), step)):
                        # each round starts with the next runner, so none always follows the
                        # same others (their freed memory, their caches' state)
                        order = active[turn % len(active):] + active[:turn % len(active)]
                        stepped = [r for r in order if isinstance(r, EngineRunner)] if plan.stepped else []
                        if len(stepped) > 1:
                            bar.set_postfix_str(f"{task} c{conc} {len(stepped)} engines in turn {setting.key}")
                            run_task_stepped(stepped, task, samples[start:start + step], tokenizer, setting, conc,
                                             plan, bar.update, into={r.name: here[r.name] for r in stepped})
                        for r in order:
                            if len(stepped) > 1 and r in stepped:
                                continue
                            bar.set_postfix_str(f"{task} c{level[r.name]} {r.name} {setting.key}")
                            run_task(r, task, samples[start:start + step], tokenizer, setting, level[r.name],
                                     plan, bar.update, into=here[r.name])
                    runs += here.values()
                    if log is not None:
                        for run in here.values():
                            decode = run.decode_tokens_per_s
                            log(f"{task:>10} c{run.concurrency} {run.runner:<16} {setting.key}: "
                                f"{run.tokens_per_s:8.2f} tok/s ({run.generated_tokens} tokens, {run.wall_s:.1f} s)"
                                + ("" if decode is None else f", decode-only {decode:.2f} tok/s"))
    finally:
        bar.close()
    return runs
