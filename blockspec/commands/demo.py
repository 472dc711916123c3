"""`blockspec demo`: a small real model from PyPI plus our drafter, DFlash against plain decoding."""

from __future__ import annotations

import argparse
import sys

from blockspec.commands.heap import freeze_loaded
from blockspec.commands.model_args import add_runtime_arguments, load_kwargs
from blockspec.zoo.registry import DEFAULT_PROMPT

HELP = "run the built-in demo: a small real model with DFlash, showing the speedup"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_runtime_arguments(p)
    p.add_argument("--prompt", default=DEFAULT_PROMPT)
    p.add_argument("--max-new-tokens", type=int, default=160)
    p.add_argument("--busy", type=int, default=0, metavar="N",
                   help="run beside N CPU-bound processes that the demo starts and stops itself (how it "
                        "fares on a machine with other work)")


def run(args: argparse.Namespace) -> int:
    from blockspec.bench.busy import busy_processes
    from blockspec.errors import ConfigError

    if args.busy < 0:
        raise ConfigError(f"--busy must be >= 0 processes, got {args.busy}")
    with busy_processes(args.busy):
        if args.busy:
            print(f"Running beside {args.busy} CPU-bound process{'es' if args.busy > 1 else ''} "
                  "(stopped when the demo ends)", file=sys.stderr)
        return _demo(args)


def _demo(args: argparse.Namespace) -> int:
    from blockspec.api import FRESH, default_drafter_for, load
    from blockspec.commands.generate import block_label, run_one
    from blockspec.config import SamplingParams

    err = sys.stderr
    kwargs = load_kwargs(args)
    if kwargs["drafter"] is None and default_drafter_for(args.target) is None:
        kwargs["drafter"] = FRESH
        print("NOTE: no trained drafter ships for this target yet, so this demo uses a freshly "
              "initialised (untrained) drafter. Output is still exactly the target's own (lossless), "
              "but almost no draft tokens are accepted (tau ~ 1), so expect NO speedup.", file=err)
    print(f"Loading {args.target} (downloaded from PyPI and converted on first use) ...", file=err)
    trained = kwargs["drafter"] != FRESH
    pipe = load(**kwargs)
    freeze_loaded()
    source = pipe.drafter_source or "fresh (untrained)"
    mode = f"adaptive, up to {pipe.block_size}" if pipe.adaptive_block else str(pipe.block_size)
    lookup = "on" if pipe.lookup is not None else "off"
    compute = getattr(pipe.target, "compute_detail", pipe.compute)
    print(f"Drafter: {source}; block size {mode}; n-gram lookup proposals {lookup}; target compute {compute}\n",
          file=err)
    ids = pipe.encode([{"role": "user", "content": args.prompt}])
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    # Warm-up: first-call overheads, and the adaptive policy times the step costs of this machine.
    pipe.generate_ids([ids[:8]], SamplingParams(max_new_tokens=4))
    print(f"User: {args.prompt}\n\nAssistant (DFlash):", file=err)
    before = pipe.decoder.block_choices
    fast = run_one(pipe, ids, params, stream=True)
    steps = {n: c - before.get(n, 0) for n, c in pipe.decoder.block_choices.items() if c > before.get(n, 0)}
    print("\nRunning plain autoregressive decoding on the same prompt for comparison ...", file=err)
    plain = pipe.generate_ids([ids], params, block_size=1)[0]
    same = plain.token_ids == fast.token_ids
    speedup = fast.tokens_per_s / max(plain.tokens_per_s, 1e-9)
    print(f"\nplain decoding : {plain.tokens_per_s:7.1f} tokens/s", file=err)
    print(f"DFlash         : {fast.tokens_per_s:7.1f} tokens/s  (mean acceptance length tau "
          f"{fast.stats.mean_tau:.2f} tokens per step, {block_label(pipe)})", file=err)
    print(f"speedup        : {speedup:.2f}x   output identical to plain decoding: {same}", file=err)
    busy = load_note()
    if speedup < 1.0:
        print(f"NOTE: {why_slower(fast.stats.mean_tau, steps, trained)}{f' ({busy})' if busy else ''}",
              file=err)
    elif busy:
        print(f"load           : {busy}", file=err)
    if not same:  # fp32 kernels for 1 vs 16 tokens may round differently on near-ties
        print("WARNING: outputs differ; this should only happen on a floating-point near-tie. "
              "Please report it with the prompt.", file=err)
    return 0


def why_slower(tau: float, steps: dict[int, int], trained: bool) -> str:
    """One line on why DFlash lost to plain decoding, from the run's steps per block size."""
    total = sum(steps.values())
    plain = steps.get(1, 0) / total if total else 0.0
    if not trained:
        return (f"an untrained drafter's drafts are hardly ever accepted (tau {tau:.2f}), so drafting cannot "
                "pay; train one (docs/TRAINING.md)")
    if plain >= 0.5:
        return (f"DFlash decoded plainly in {plain:.0%} of steps: the drafter's acceptance on this prompt "
                f"(tau {tau:.2f}) does not pay for a draft pass on this machine now")
    return (f"DFlash drafted in {1 - plain:.0%} of steps, but at tau {tau:.2f} the accepted tokens did not pay "
            "for the draft passes on this machine now")


def load_note() -> str:
    """'other processes used ~X of N cores: decoding ran on T thread(s)' where they were busy at the
    last look of the thread governor (cpu/threads.py), else ''."""
    from blockspec.cpu.threads import governor

    g = governor()
    if g is None or g.others is None or g.others < 0.3:
        return ""
    return (f"other processes used ~{g.others:.1f} of {g.cpus} cores: decoding ran on "
            f"{g.threads} thread{'s' if g.threads > 1 else ''}")
