"""Where a decoding tick's time goes: this library's C kernels against the host work around them.

    python -m blockspec.bench.tickparts --dataset gsm8k --limit 16 --max-new-tokens 128 --threads 2

Decodes the first prompts of a set one request at a time (or `--concurrency N` in flight) with
plain decoding (AR) and the default DFlash runner (adaptive blocks, n-gram lookup, token trees)
stepping in turn, tick by tick, so the machine's drift hits both alike, and books every decoding tick (ticks that prefill a joining
request are left out) to its parts: the policy's choice, the draft pass, the proposals, the
target's pass, a sampled step's acceptance, verification and commit, the engine's report. Each part's wall time splits into
the time spent inside the C library's entry points (cpu/csrc/: the layer programs, the integer
products, norms, heads and sampling kernels) and the rest, the host work: Python, PyTorch's
dispatch and its small tensor operations. Parts nest (the target's pass lies inside
verification), so they do not sum to the tick. Prints a Markdown table per runner, then JSON.

What it is for: on a CPU the host work around the kernels is a fixed cost per tick, paid once a
token by plain decoding and once per 2-3 tokens by DFlash, and it runs cold (each target pass
streams the weights through every cache). Its share, and where it sits, says what a leaner step
could still gain (BENCHMARKS.md, "Where the int8 mode's time goes").
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from blockspec.bench.sampling_cost import dataset_prompts, load_pinned, patched, run_arguments
from blockspec.cpu import kernels

# (module, attribute, part): the timed parts of a tick; class methods as "Class.method"
PARTS = (
    ("blockspec.engine.engine", "Engine._tick", "tick"),
    ("blockspec.dflash.policy.adaptive", "AdaptiveBlock.choose", "policy: choice"),
    ("blockspec.dflash.policy.adaptive", "AdaptiveBlock.record", "policy: acceptance bookkeeping"),
    ("blockspec.dflash.batch", "DecodeBatch._draft_hidden", "draft pass"),
    ("blockspec.dflash.batch", "DecodeBatch._propose", "proposals (draft head)"),
    ("blockspec.dflash.batch", "DecodeBatch._verify_and_commit", "verify and commit (chain)"),
    ("blockspec.dflash.batch", "DecodeBatch._verify_tree", "verify and commit (tree)"),
    ("blockspec.targets.native.llama", "NativeLlama.forward", "target pass"),
    ("blockspec.dflash.batch", "DecodeBatch._accept_sampled", "sampled acceptance (draws, rules)"),
    ("blockspec.engine.engine", "Engine._report", "engine: report and retire"),
)


class Book:
    """Seconds per (runner, part): wall and inside the C kernels, and calls, for the tick being
    stepped (`scratch`) and for the ticks kept (`kept`)."""

    def __init__(self) -> None:
        self.kernel_s = 0.0  # a running total of time inside the C library
        self.scratch: Counter = Counter()
        self.kept: Counter = Counter()

    def keep(self, runner: str) -> None:
        """Adds the tick just stepped to `runner`'s totals."""
        for (part, what), v in self.scratch.items():
            self.kept[runner, part, what] += v
        self.scratch.clear()

    def part(self, fn: Callable, name: str) -> Callable:
        def timed(*args, **kwargs):
            k0, t0 = self.kernel_s, time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                wall = time.perf_counter() - t0
                self.scratch[name, "wall"] += wall
                self.scratch[name, "kernel"] += self.kernel_s - k0
                self.scratch[name, "calls"] += 1
        return timed

    def kernel(self, fn: Callable) -> Callable:
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.kernel_s += time.perf_counter() - t0
        return timed


class TimedLibrary:
    """The C library (`kernels.kernel()`) with every entry point timed into a Book: the library
    itself is callable (the fp32 / bf16 products) and holds the others as attributes, some of
    them per dtype or per bit width in dicts."""

    def __init__(self, lib: object, book: Book) -> None:
        self._lib, self._book = lib, book
        self._call = book.kernel(lib)
        self._attrs: dict[str, object] = {}

    def __call__(self, *args):
        return self._call(*args)

    def __getattr__(self, name: str) -> object:
        if name.startswith("_"):
            raise AttributeError(name)
        if name not in self._attrs:
            value = getattr(self._lib, name)
            if isinstance(value, dict):
                value = {k: self._book.kernel(v) if callable(v) else v for k, v in value.items()}
            elif callable(value):
                value = self._book.kernel(value)
            self._attrs[name] = value
        return self._attrs[name]


@contextmanager
def instrumented(book: Book) -> Iterator[None]:
    """Times the tick's parts and the C library's entry points into `book` while inside; puts
    everything back after."""
    names = {attr: name for _, attr, name in PARTS}
    lib = kernels.kernel()
    with patched(tuple((module, attr) for module, attr, _ in PARTS), lambda fn, attr: book.part(fn, names[attr])):
        if lib is not None:
            kernels._kernel = TimedLibrary(lib, book)
        try:
            yield
        finally:
            if lib is not None:
                kernels._kernel = lib


def measure(runners: dict[str, object], requests: list[object], concurrency: int = 1) -> dict[str, dict]:
    """Steps `runners` (bench EngineRunners, prepared) in turn over `requests`, their ticks
    alternating, and books their decoding ticks. At concurrency 1 the requests go one at a time,
    the runners' order alternating with them; at more, each runner serves them all with that many
    in flight. Per runner: the tokens its decoding ticks committed, their seconds and count, and
    per part the calls, wall and kernel seconds; and its outputs, in the requests' order."""
    book = Book()
    tokens, outputs = Counter(), {name: [] for name in runners}
    rounds = [[r] for r in requests] if concurrency == 1 else [list(requests)]
    with instrumented(book):
        for i, batch in enumerate(rounds):
            order = list(runners) if i % 2 == 0 else list(runners)[::-1]
            started = {name: runners[name].start(batch, concurrency) for name in order}
            busy = list(order)
            while busy:
                for name in list(busy):
                    engine = started[name][0]
                    before = engine.metrics
                    left, _ = runners[name].step(started[name])
                    after = engine.metrics
                    if after.prefill_s_total == before.prefill_s_total:
                        book.keep(name)
                        tokens[name] += after.tokens_generated_total - before.tokens_generated_total
                    else:  # a tick that prefilled a join is not a decoding tick
                        book.scratch.clear()
                    if not left:
                        busy.remove(name)
            for name in runners:
                outputs[name].extend(out.token_ids for out in runners[name].finish(started[name]))
    results = {}
    for name in runners:
        parts = {part: {what: book.kept[name, part, what] for what in ("calls", "wall", "kernel")}
                 for _, _, part in PARTS if book.kept[name, part, "calls"]}
        tick = parts.get("tick", {"calls": 0, "wall": 0.0})
        results[name] = {"tokens": tokens[name], "ticks": tick["calls"], "seconds": tick["wall"], "parts": parts,
                         "outputs": outputs[name]}
    return results


def table(name: str, result: dict) -> str:
    """A runner's parts as a Markdown table, per decoding tick."""
    ticks = max(1, result["ticks"])
    rate = result["tokens"] / max(result["seconds"], 1e-12)
    lines = [f"{name}: {result['ticks']} decoding ticks, {result['tokens'] / ticks:.2f} tokens a tick, "
             f"{rate:.1f} tokens/s",
             "",
             "| part | calls a tick | us a tick | in the C kernels | host work | host share |",
             "| --- | --- | --- | --- | --- | --- |"]
    for part, p in result["parts"].items():
        host = p["wall"] - p["kernel"]
        lines.append(f"| {part} | {p['calls'] / ticks:.2f} | {1e6 * p['wall'] / ticks:.0f} | "
                     f"{1e6 * p['kernel'] / ticks:.0f} | {1e6 * host / ticks:.0f} | "
                     f"{100 * host / max(p['wall'], 1e-12):.0f}% |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from blockspec.bench.runner import EngineRunner, Request
    from blockspec.config import DEFAULT_TREE_NODES, LookupConfig, SamplingParams

    ap = run_arguments(__doc__.splitlines()[0], limit=16, max_new_tokens=128, temperature=0.0, top_p=1.0)
    ap.add_argument("--tree-nodes", type=int, default=DEFAULT_TREE_NODES)
    ap.add_argument("--concurrency", type=int, default=1, help="requests in flight (default 1)")
    args = ap.parse_args(argv)
    pipe = load_pinned(args)
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                            seed=args.seed)
    requests = [Request(tuple(ids), params) for ids in dataset_prompts(pipe.tokenizer, args.dataset, args.limit)]
    runners = {"ar": EngineRunner(pipe.target, None, 1),
               "dflash": EngineRunner(pipe.target, pipe.drafter, 16, adaptive=True, lookup=LookupConfig(),
                                      tree_nodes=args.tree_nodes)}
    for runner in runners.values():
        runner.prepare(args.concurrency)  # calibration, outside the timed ticks
    results = measure(runners, requests, args.concurrency)
    for name, result in results.items():
        print(table(name, result) + "\n")
    print(json.dumps({"threads": torch.get_num_threads(),
                      **{name: {k: v for k, v in r.items() if k != "outputs"} for name, r in results.items()}}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
