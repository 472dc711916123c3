"""`blockspec bench`: DFlash against plain autoregressive decoding (and baselines) on prompt sets.

    blockspec bench                                   # the demo model, as `generate` decodes it
    blockspec bench --target smollm2-135m-instruct --drafter fresh --datasets gsm8k,humaneval \
        --limit gsm8k=16,humaneval=8 --block-sizes 16 --baselines hf,reference --out runs/bench

By default DFlash runs as every verb decodes: the adaptive block policy with n-gram lookup;
`--block-sizes` adds runs at fixed block sizes (the published DFlash), `--no-adaptive` keeps
only those.

Writes report.md (the model-card table: Task | Concurrency | AR | DFlash (speedup) | tau),
results.json (every request's raw statistics) and plot.png into --out. Greedy DFlash output is
checked token for token against plain decoding; a difference is reported loudly and the command
exits with status 1. `--repeat N` runs the whole benchmark N times, each with fresh engines, keeps
each run's report in --out/runK, and writes the spread of each speedup over the runs at the top
(bench/repeats.py).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import os
import shlex
import sys
from pathlib import Path

from blockspec.commands.heap import freeze_loaded
from blockspec.commands.model_args import MODEL, add_runtime_arguments, command_args, load_kwargs

HELP = "benchmark DFlash against autoregressive decoding on standard prompt sets"

BASELINE_NAMES = ("hf", "pld", "reference")


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return values


def _floats(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if not values or any(v < 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected numbers >= 0, got {text!r}")
    return values


def _limits(text: str) -> dict[str, int]:
    """`16` (every set) or `gsm8k=16,humaneval=8` (per set; "*" = the rest); 0 = all prompts."""
    out: dict[str, int] = {}
    for part in (p.strip() for p in text.split(",") if p.strip()):
        name, _, value = part.rpartition("=")
        try:
            n = int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected N or NAME=N[,NAME=N...], got {text!r}") from None
        if n < 0:
            raise argparse.ArgumentTypeError(f"limits must be >= 0 (0 = all), got {part!r}")
        out[name.strip() or "*"] = n
    if not out:
        raise argparse.ArgumentTypeError("empty --limit")
    return out


def _names(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from blockspec.datasets import DATASETS

    # the model flags of every verb that decodes; the decoding ones are sweeps here (--block-sizes,
    # --adaptive, --lookup on|off|both), declared below, but for --tree-nodes N: each DFlash runner
    # then runs as chains and as trees of N ('... treeN'), interleaved; without it as the default
    # trees, --tree-nodes 0 as chains
    add_runtime_arguments(parser, (*MODEL, "tree_nodes"))
    parser.add_argument("--drafter-layers", type=int, default=1, help="layers of a 'fresh' drafter (default 1)")
    parser.add_argument("--datasets", type=_names, default=("gsm8k",),
                        help=f"comma-separated prompt sets from: {', '.join(DATASETS)} (default gsm8k)")
    parser.add_argument("--limit", type=_limits, default={"*": 16},
                        help="prompts per data set: N, or per set NAME=N,NAME=N (default 16; 0 = all)")
    parser.add_argument("--shuffle", action="store_true", help="take a random sample instead of the first N")
    parser.add_argument("--data-dir", default=None, metavar="DIR",
                        help="a folder of data files (gsm8k_test.jsonl, ...) read before $BLOCKSPEC_DATA and the "
                             "copies of the benchmark sets shipped in the package (default: those copies)")
    parser.add_argument("--seed", type=int, default=None,
                        help="seed of the sampled requests (each its own, derived from N): reproducible text, "
                             "verified by the keyed rule. Default: no seed, as chat clients send them (the standard "
                             "rule). Also seeds --shuffle and a fresh drafter (default 0)")
    parser.add_argument("--sampling-rule", choices=("auto", "keyed", "standard", "both"), default="auto",
                        help="how the DFlash runners verify sampled requests: auto (default) = keyed with a seed, "
                             "standard without; keyed or standard = every request so; both = each DFlash runner "
                             "twice, '... keyed' and '... standard', interleaved (dflash/verify.py)")
    parser.add_argument("--block-sizes", type=_ints, default=None,
                        help="comma-separated fixed DFlash block sizes to measure as well, each verifying its whole "
                             "block every step as the published DFlash does, e.g. 16 (default: none; the adaptive "
                             "runner then goes up to the largest of them, else up to the drafter's block size)")
    parser.add_argument("--adaptive", action=argparse.BooleanOptionalAction, default=True,
                        help="run DFlash with the adaptive block policy, as generate/serve/demo decode (each step "
                             "picks its block size; default: on). --no-adaptive measures fixed blocks only "
                             "(--block-sizes, default the drafter's)")
    parser.add_argument("--adaptive-only", action="store_true",
                        help="run plain decoding (AR) and the adaptive runner only, even with --block-sizes")
    parser.add_argument("--lookup", choices=("off", "on", "both"), default="on",
                        help="n-gram lookup proposals (dflash/lookup.py) in the DFlash runners: on (default) = as "
                             "every verb decodes, off = the drafter alone (its own tau), both = each DFlash runner "
                             "twice, without and with ('dflash+lookup')")
    parser.add_argument("--ragged-verify", choices=("off", "on", "both"), default="off",
                        help="in the adaptive runners, let each row of a batch verify its own number of drafted "
                             "tokens (EngineConfig.ragged_verify): off (default), on, or both (each adaptive "
                             "runner twice, the second named '... ragged')")
    parser.add_argument("--concurrency", type=_ints, default=(1,),
                        help="comma-separated numbers of requests decoded together, e.g. 1,4,8 (default 1)")
    parser.add_argument("--temperature", type=_floats, default=(0.0,),
                        help="comma-separated temperatures, 0 = greedy (default 0)")
    parser.add_argument("--top-p", type=float, default=1.0,
                        help="nucleus sampling for the temperatures above 0, every runner alike (default 1: off)")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="tokens to generate per turn (default 128)")
    parser.add_argument("--context", type=int, default=0, metavar="TOKENS",
                        help="put other problems of the same set in front of each prompt until it holds at least "
                             "this many tokens: the same tasks over a long context (default 0: off)")
    parser.add_argument("--thinking", choices=("on", "off", "both"), default="off",
                        help="thinking mode for chat templates that have one (default off)")
    parser.add_argument("--baselines", type=_names, default=(),
                        help="comma-separated: hf (transformers generate), pld (prompt lookup), "
                             "reference (dflash 0.1.0 package); default none")
    parser.add_argument("--pld-tokens", type=int, default=10,
                        help="prompt_lookup_num_tokens for the pld baseline (default 10)")
    parser.add_argument("--out", default=None, help="output directory (default runs/bench-<date>-<time>)")
    parser.add_argument("--endpoint", default=None,
                        help="measure an OpenAI-compatible server at this URL (ours, vLLM, SGLang) instead "
                             "of running models in-process; uses --model, --concurrency, --temperature")
    parser.add_argument("--model", default=None, help="model name to send to --endpoint (default: --target)")
    parser.add_argument("--api-key", default=None, help="API key for --endpoint")
    parser.add_argument("--backend", choices=("auto", "native", "hf"), default="auto",
                        help="target implementation for AR and DFlash: native (own Llama-family code), "
                             "hf (transformers) or auto (default)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads (default: torch's choice; 1 is steadier on a shared machine)")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="time base of tokens/s: wall clock (default) or this process's CPU time "
                             "(for machines shared with other jobs; use with --threads 1)")
    parser.add_argument("--interleave", choices=("steps", "rounds"), default="steps",
                        help="how our engine runners share the machine: 'steps' (default) steps their engines in "
                             "turn, each step timed to its own runner, so a machine whose speed drifts slows all "
                             "alike; 'rounds' runs each one's share of a round of prompts whole, one after the "
                             "other (baselines always run so)")
    parser.add_argument("--repeat", type=int, default=1, metavar="N",
                        help="run the whole benchmark N times, each with fresh engines (so each calibrates its "
                             "adaptive policy anew): every run's report in --out/runK, and a summary of each "
                             "DFlash runner's speedup over AR in every run, with the median and range (default 1)")
    parser.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                        help="one uncounted warm-up generation per runner first (default on)")
    parser.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True,
                        help="show a progress bar (default on)")


def _thinking_modes(mode: str, tokenizer: object, notes: list[str]) -> tuple[bool | None, ...]:
    from blockspec.text import supports_thinking

    if not supports_thinking(tokenizer):
        if mode != "off":
            notes.append(f"--thinking {mode} ignored: this chat template has no thinking switch")
        return (None,)
    return {"on": (True,), "off": (False,), "both": (True, False)}[mode]


def _load_datasets(names: tuple[str, ...], limits: dict[str, int], shuffle: bool, seed: int,
                   data_dir: str | None = None) -> dict[str, list]:
    from blockspec.datasets import load_dataset
    from blockspec.errors import ConfigError

    stray = sorted(set(limits) - set(names) - {"*"})
    if stray:
        raise ConfigError(f"--limit names {stray} that are not in --datasets {','.join(names)}")
    out = {}
    for name in names:
        n = limits.get(name, limits.get("*", 16))
        out[name] = list(load_dataset(name, limit=n or None, shuffle=shuffle, seed=seed, data_dir=data_dir))
    return out


def _with_context(datasets: dict[str, list], tokens: int, tokenizer: object,
                  data_dir: str | None = None) -> dict[str, list]:
    """Each set's prompts with other problems of the whole set in front (`datasets.with_context`)."""
    from blockspec.datasets import load_dataset, token_counter, with_context

    count = token_counter(tokenizer)
    return {name: with_context(samples, load_dataset(name, data_dir=data_dir), tokens, count)
            for name, samples in datasets.items()}


def _hf_model(args: argparse.Namespace, pipe: object) -> object:
    """The target as a `transformers` model (what the baselines call): the pipeline's own when it
    runs on the hf backend, else loaded once more from the same weights."""
    model = getattr(pipe.target, "model", None)
    if model is not None:
        return model
    from blockspec.api import resolve_target_dir
    from blockspec.bench.baselines import load_hf_model

    return load_hf_model(resolve_target_dir(args.target), dtype=pipe.target.dtype, device=args.device)


def _baseline_runners(args: argparse.Namespace, pipe: object, block_sizes: tuple[int, ...], notes: list[str]) -> list:
    from blockspec.bench import baselines as bl
    from blockspec.errors import ConfigError
    from blockspec.targets.base import DTYPES

    unknown = [b for b in args.baselines if b not in BASELINE_NAMES]
    if unknown:
        raise ConfigError(f"unknown baseline(s) {unknown}; choose from {', '.join(BASELINE_NAMES)}")
    if not args.baselines:
        return []
    model = _hf_model(args, pipe)
    eos = pipe.target.info.eos_token_ids
    pad = getattr(pipe.tokenizer, "pad_token_id", None)
    runners: list = []
    if "hf" in args.baselines:
        runners.append(bl.HFGenerateRunner(model, eos, pad_token_id=pad))
    if "pld" in args.baselines:
        if args.pld_tokens < 1:
            raise ConfigError(f"--pld-tokens must be >= 1, got {args.pld_tokens}")
        runners.append(bl.HFGenerateRunner(model, eos, prompt_lookup_num_tokens=args.pld_tokens, pad_token_id=pad))
    if "reference" in args.baselines:
        if not bl.reference_available():
            notes.append("reference baseline skipped: the package `dflash` (0.1.0) is not importable "
                         "(pip install dflash==0.1.0 --no-deps)")
        else:
            dtype = DTYPES.get(args.dtype, pipe.target.dtype)
            source = Path(pipe.drafter_source) if pipe.drafter_source else None
            if source is not None and (source / "config.json").exists():
                ref = bl.load_reference_drafter(source, dtype=dtype, device=args.device)
            else:  # a fresh drafter: hand the reference class the very same weights
                ref = bl.reference_drafter_from(pipe.drafter, dtype=dtype, device=args.device)
            runners += [bl.ReferenceRunner(ref, model, eos, b) for b in block_sizes]
    return runners


def command_line(args: argparse.Namespace) -> str:
    """The full command with every option spelled out (defaults included), to rerun it exactly."""
    joined = lambda xs: ",".join(f"{x:g}" if isinstance(x, float) else str(x) for x in xs)  # noqa: E731
    parts = ["blockspec", "bench", *command_args(args)]  # no --drafter: the drafter shipped for the target
    if args.drafter == "fresh":
        parts += ["--drafter-layers", str(args.drafter_layers)]
    limit = ",".join(str(n) if k == "*" else f"{k}={n}" for k, n in args.limit.items())
    parts += ["--datasets", joined(args.datasets), "--limit", limit]
    if args.shuffle:
        parts.append("--shuffle")
    if args.data_dir is not None:
        parts += ["--data-dir", str(args.data_dir)]
    if args.seed is not None:
        parts += ["--seed", str(args.seed)]
    if args.sampling_rule != "auto":
        parts += ["--sampling-rule", args.sampling_rule]
    if args.block_sizes:
        parts += ["--block-sizes", joined(args.block_sizes)]
    parts += ["--concurrency", joined(args.concurrency), "--temperature", joined(args.temperature)]
    if args.top_p != 1.0:
        parts += ["--top-p", f"{args.top_p:g}"]
    parts += ["--max-new-tokens", str(args.max_new_tokens), "--thinking", args.thinking]
    if args.context:
        parts += ["--context", str(args.context)]
    if args.adaptive_only:
        parts.append("--adaptive-only")
    else:
        parts.append("--adaptive" if args.adaptive else "--no-adaptive")
    parts += ["--lookup", args.lookup]
    if args.ragged_verify != "off":
        parts += ["--ragged-verify", args.ragged_verify]
    if args.baselines:
        parts += ["--baselines", joined(args.baselines)]
        if "pld" in args.baselines:
            parts += ["--pld-tokens", str(args.pld_tokens)]
    if args.threads is not None:
        parts += ["--threads", str(args.threads)]
    parts += ["--clock", args.clock, "--interleave", args.interleave, "--backend", args.backend,
              "--warmup" if args.warmup else "--no-warmup"]
    if args.repeat != 1:
        parts += ["--repeat", str(args.repeat)]
    if args.out:
        parts += ["--out", str(args.out)]
    return shlex.join(parts)


def run(args: argparse.Namespace) -> int:
    from blockspec.api import load
    from blockspec.bench.report import write_report
    from blockspec.bench.runner import EngineRunner, Setting, SuitePlan, count_requests, run_suite
    from blockspec.errors import ConfigError
    from blockspec.dflash.lookup import LookupConfig

    if args.drafter == "none":
        raise ConfigError("bench compares DFlash with plain decoding, so it needs a drafter: pass a "
                          "drafter directory or --drafter fresh")
    if args.max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.repeat < 1:
        raise ConfigError(f"--repeat must be >= 1 (the number of runs), got {args.repeat}")
    if args.repeat > 1 and args.endpoint:
        raise ConfigError("--repeat reruns the in-process runners; measure an --endpoint once per command")
    if args.adaptive_only and not args.adaptive:
        raise ConfigError("--adaptive-only runs the adaptive runner, which --no-adaptive turns off: drop one of them")
    if args.ragged_verify != "off" and not args.adaptive:
        raise ConfigError("--ragged-verify applies to the adaptive runners; drop --no-adaptive")
    if args.threads is not None:
        if args.threads < 1:
            raise ConfigError(f"--threads must be >= 1, got {args.threads}")
        from blockspec.cpu.threads import pin

        pin(args.threads)  # the user's count, on every decoding thread (cpu/threads.py)
    if args.context < 0:
        raise ConfigError(f"--context must be >= 0 tokens, got {args.context}")
    if args.context and args.endpoint:
        raise ConfigError("--context counts tokens with the target's tokenizer, which --endpoint does not load; "
                          "run in-process (drop --endpoint) or leave --context at 0")
    notes: list[str] = []
    seed = 0 if args.seed is None else args.seed  # of --shuffle and a fresh drafter
    datasets = _load_datasets(args.datasets, args.limit, args.shuffle, seed, args.data_dir)
    if args.endpoint:
        from blockspec.bench.endpoint import run_endpoint

        out = Path(args.out or f"runs/bench-endpoint-{_dt.datetime.now():%Y%m%d-%H%M%S}")
        table = run_endpoint(args.endpoint, args.model or str(args.target), datasets, tuple(args.concurrency),
                             args.max_new_tokens, args.temperature[0], args.api_key, out, top_p=args.top_p)
        print(table)
        print(f"wrote {out / 'report.md'} and {out / 'results.json'}", file=sys.stderr)
        return 0
    pipe = load(**load_kwargs(args), drafter_layers=args.drafter_layers, seed=seed, backend=args.backend)
    if args.context:
        datasets = _with_context(datasets, args.context, pipe.tokenizer, args.data_dir)
    freeze_loaded()
    block_sizes = args.block_sizes or (pipe.drafter.block_size,)
    if 1 in block_sizes:
        raise ConfigError("--block-sizes lists DFlash block sizes (>= 2); plain decoding always runs as AR")
    # Fixed blocks where asked for (or where the adaptive runner is off); the adaptive runner by default.
    fixed = () if args.adaptive_only or (args.adaptive and not args.block_sizes) else block_sizes
    runners = [EngineRunner(pipe.target, None, 1)]
    lookups = {"off": (None,), "on": (LookupConfig(),), "both": (None, LookupConfig())}[args.lookup]
    rules = ("keyed", "standard") if args.sampling_rule == "both" else (args.sampling_rule,)
    if args.sampling_rule != "auto" and all(t == 0 for t in args.temperature):
        notes.append(f"--sampling-rule {args.sampling_rule} has no effect on greedy requests (--temperature 0)")
    # --tree-nodes N: chains and trees of N, interleaved; without it the default
    # (DEFAULT_TREE_NODES) alone; --tree-nodes 0: chains
    trees = (0, pipe.tree_nodes) if args.tree_nodes else (pipe.tree_nodes,)
    for lookup in lookups:
        for rule in rules:
            for tree in trees:
                runners += [EngineRunner(pipe.target, pipe.drafter, b, lookup=lookup, sampling_rule=rule,
                                         tree_nodes=tree) for b in fixed]
                if args.adaptive:
                    raggeds = {"off": (False,), "on": (True,), "both": (False, True)}[args.ragged_verify]
                    runners += [EngineRunner(pipe.target, pipe.drafter, max(block_sizes), adaptive=True, lookup=lookup,
                                             ragged=ragged, sampling_rule=rule, tree_nodes=tree) for ragged in raggeds]
    runners += _baseline_runners(args, pipe, block_sizes, notes)
    thinking = _thinking_modes(args.thinking, pipe.tokenizer, notes)
    settings = tuple(Setting(t, th) for t in args.temperature for th in thinking)
    plan = SuitePlan(concurrency=tuple(args.concurrency), settings=settings, max_new_tokens=args.max_new_tokens,
                     top_p=args.top_p, seed=args.seed, warmup=args.warmup, clock=args.clock,
                     stepped=args.interleave == "steps")
    if args.seed is None and any(t > 0 for t in args.temperature):
        notes.append("sampled requests carry no seed (as chat clients send them): their text varies from run to "
                      "run; --seed N makes it reproducible")
    if args.drafter == "fresh":
        notes.append("the drafter is freshly initialised (untrained): expect tau ~ 1 and DFlash slower than AR")
    for n in notes:
        print(f"blockspec bench: {n}", file=sys.stderr)

    load_at_start = round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None
    log = (lambda line: print(line, file=sys.stderr)) if not args.progress else None
    every_run = []
    for k in range(args.repeat):
        if args.repeat > 1:
            print(f"blockspec bench: run {k + 1} of {args.repeat}", file=sys.stderr)
        try:
            every_run.append(run_suite(runners, datasets, pipe.tokenizer, plan, progress=args.progress, log=log))
        finally:  # the next run builds its engines, and calibrates them, afresh
            for r in runners:
                if isinstance(r, EngineRunner):
                    r.close()

    out = Path(args.out or f"runs/bench-{_dt.datetime.now():%Y%m%d-%H%M%S}")
    meta = {
        "command": command_line(args),
        "target": str(args.target),
        "drafter": (f"fresh (untrained, {pipe.drafter.cfg.num_hidden_layers} layer(s), seed {seed})"
                    if args.drafter == "fresh" else pipe.drafter_source),
        "drafter_block_size": pipe.drafter.block_size,
        "backend": f"{args.backend} ({type(pipe.target).__name__})",
        "packed_weights": _packed(pipe.target),
        "compute": getattr(pipe.target, "compute_detail", pipe.compute),
        "dtype": args.dtype,
        "drafter_dtype": str(next(pipe.drafter.parameters()).dtype).removeprefix("torch."),
        "drafter_compute": _drafter_compute(pipe.drafter),
        "device": args.device,
        "clock": args.clock,
        "max_new_tokens": args.max_new_tokens,
        "context_tokens": args.context,
        "block_sizes": list(block_sizes),
        "concurrency": list(args.concurrency),
        "temperatures": list(args.temperature),
        "top_p": args.top_p,
        "seed": args.seed,
        "sampling_rule": args.sampling_rule,
        "thinking": args.thinking,
        "baselines": list(args.baselines),
        "prompts": ", ".join(f"{k} {len(v)}" for k, v in datasets.items())
                   + f" ({count_requests(datasets)} requests per pass"
                   + (f", shuffled with seed {seed})" if args.shuffle else ", first N)"),
        "notes": notes,
        "load_average_at_start": load_at_start,
    }
    if args.repeat == 1:
        reports = [write_report(every_run[0], out, meta)]
        print(reports[0].markdown)
        paths = reports[0].paths
    else:
        from blockspec.bench.repeats import write_repeats

        reports = [write_report(runs, out / f"run{k + 1}", meta) for k, runs in enumerate(every_run)]
        paths = write_repeats(reports, out, meta)
        print(paths["markdown"].read_text())
    print(f"wrote {paths['markdown']}, {paths['json']}, {paths['plot']}", file=sys.stderr)
    if not all(r.lossless_ok for r in reports):
        print("blockspec bench: LOSSLESS CHECK FAILED: greedy DFlash output differs from AR (see report.md)",
              file=sys.stderr)
        return 1
    return 0


def _drafter_compute(drafter: object) -> str:
    """How the drafter computed its proposals (set from the target's mode by the engine), for the
    report: "exact", or the int8 mode with its weights' bits."""
    from blockspec.dflash.drafter import INT8_BITS_ENV

    if getattr(drafter, "compute", "exact") != "int8":
        return "exact"
    return f"int8, {drafter.int8_bits}-bit weights ({INT8_BITS_ENV}=4 or 8 picks them)"


def _packed(target: object) -> str | None:
    """The target's packed weights (cpu/packed_weights.py) for the report, or None."""
    net = getattr(target, "net", None)
    summary = net.packed_summary() if hasattr(net, "packed_summary") else None
    compute = getattr(target, "compute", "exact")
    return None if summary is None else f"{summary} ({compute}; BLOCKSPEC_PACK_WEIGHTS=0 turns them off)"
