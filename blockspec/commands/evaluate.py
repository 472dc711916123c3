"""`blockspec evaluate`: held-out acceptance length (tau) of one or more drafters for a target.

The shipping check of the training recipe (docs/TRAINING.md): greedy speculative decoding of
the prompts that `blockspec datagen` holds out of the training data, so a new drafter
is compared with the old one without touching a benchmark's test split.
"""

from __future__ import annotations

import argparse
import json

from blockspec.commands.model_args import add_runtime_arguments, load_kwargs
from blockspec.train.data import HELDOUT_SOURCES

HELP = "held-out acceptance length (tau) of drafters: the training recipe's shipping check"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_runtime_arguments(p, ("target", "dtype", "drafter_dtype", "device"))
    p.add_argument("--drafter", action="append", required=True,
                   help="DFlash drafter directory (repeat to compare several on the same prompts)")
    p.add_argument("--prompts", type=int, default=32,
                   help="the first N held-out prompts; keep N within datagen's --holdout (default 64), "
                        "the prompts it kept out of the training data")
    p.add_argument("--heldout", default="gsm8k_train", choices=list(HELDOUT_SOURCES),
                   help="gsm8k TRAIN questions as maths prompts (default) or as HumanEval-style code stubs "
                        "(gsm8k_code), or standard-library function stubs (py_stubs)")
    p.add_argument("--block-size", type=int, default=None, help="block size (default: each drafter's)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--context", type=int, default=0, metavar="TOKENS",
                   help="put the other held-out prompts in front of each one until it holds at least this many "
                        "tokens: tau over a long context (default 0: off)")
    p.add_argument("--batch-size", type=int, default=16, help="prompts decoded together")
    p.add_argument("--data-dir", default=None, metavar="DIR",
                   help="a folder holding gsm8k_train.jsonl, for the held-out gsm8k prompts; default "
                        "$BLOCKSPEC_DATA, else the Hugging Face Hub (needs `datasets` and a network); "
                        "py_stubs need none")
    p.add_argument("--trees", action="store_true",
                   help="instead of decoding: teacher-forced tau of chains and best-first token trees of "
                        "--budgets proposed nodes per step (python -m blockspec.bench.treetau's measure), every "
                        "drafter on the same greedy continuations; a DFlash 2 drafter's trees grow from its "
                        "selector's conditional scores, its chain is the selector's walk")
    p.add_argument("--budgets", type=int, nargs="+", default=[3, 7, 15], help="--trees: nodes per step")
    p.add_argument("--top-k", type=int, default=8,
                   help="--trees: candidates per block position a DFlash tree chooses from (a DFlash 2 "
                        "drafter's: its selector_top_k)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--json", action="store_true", help="print one JSON object per drafter")


def run(args: argparse.Namespace) -> int:
    from blockspec.errors import ConfigError

    for name in ("prompts", "max_new_tokens", "batch_size"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.context < 0:
        raise ConfigError(f"--context must be >= 0 tokens, got {args.context}")
    from blockspec.api import load
    from blockspec.text import encode_prompt
    from blockspec.train.data import heldout_prompts
    from blockspec.train.evaluate import quick_tau

    if args.threads:
        from blockspec.cpu.threads import pin

        pin(args.threads)  # the user's count, on every decoding thread (cpu/threads.py)
    held = heldout_prompts(args.prompts, data_dir=args.data_dir, source=args.heldout)
    if args.trees:
        return _tree_taus(args, held)
    rows = []
    for drafter in args.drafter:
        pipe = load(**load_kwargs(args), drafter=drafter, block_size=args.block_size)
        prompts = [encode_prompt(pipe.tokenizer, m, chat=True) for m in _with_context(held, args.context, pipe)]
        block = args.block_size or pipe.drafter.block_size
        res = quick_tau(pipe.decoder.target, pipe.drafter, prompts, block_size=block,
                        max_new_tokens=args.max_new_tokens, batch_size=args.batch_size)
        row = {"drafter": str(drafter), "block_size": block, **res,
               "prompt_tokens": round(sum(map(len, prompts)) / len(prompts), 1)}
        rows.append(row)
        if args.json:
            print(json.dumps(row), flush=True)
    if not args.json:
        print(f"held-out {args.heldout} prompts: {len(held)}, greedy, "
              f"{args.max_new_tokens} new tokens" + (f", at least {args.context} tokens of context" if args.context else ""))
        print(f"{'tau':>6} {'steps':>6} {'block':>5}  drafter")
        for r in rows:
            print(f"{r['tau']:6.2f} {r['steps']:6d} {r['block_size']:5d}  {r['drafter']}")
    return 0


def _tree_taus(args: argparse.Namespace, held: list) -> int:
    """`--trees`: chain and tree tau of every drafter on the held-out prompts' greedy continuations."""
    from blockspec.api import load
    from blockspec.bench.treetau import TreeTauConfig, TreeTauResult, measure_drafters
    from blockspec.text import encode_prompt

    cfg = TreeTauConfig(tuple(args.budgets), args.top_k, args.max_new_tokens)
    pipes = [load(**load_kwargs(args), drafter=d) for d in args.drafter]
    prompts = [encode_prompt(pipes[0].tokenizer, m, chat=True) for m in _with_context(held, args.context, pipes[0])]
    totals = [TreeTauResult() for _ in pipes]
    for prompt in prompts:
        for total, res in zip(totals, measure_drafters(pipes[0].target, [p.drafter for p in pipes], prompt, cfg)):
            total.add(res)
    if args.json:
        for drafter, total in zip(args.drafter, totals):
            print(json.dumps({"drafter": str(drafter), "heldout": args.heldout, "prompts": len(prompts),
                              **{name: round(t.tau, 4) for name, t in total.tallies.items()}}), flush=True)
        return 0
    print(f"held-out {args.heldout} prompts: {len(prompts)}, teacher-forced greedy tau, {args.max_new_tokens} new "
          "tokens")
    names = [f"{kind} {n}" for n in cfg.budgets for kind in ("chain", "tree")]
    print(" ".join(f"{n:>8}" for n in names) + "  drafter")
    for drafter, total in zip(args.drafter, totals):
        print(" ".join(f"{total.tallies[n].tau:8.2f}" for n in names) + f"  {drafter}")
    return 0


def _with_context(held: list, tokens: int, pipe: object) -> list[list[dict]]:
    """Each held-out prompt's messages, its last user turn behind the other held-out prompts'
    (`datasets.with_context`) when tokens > 0."""
    from blockspec.datasets import Sample, token_counter, with_context

    messages = [[dict(m) for m in p.messages] for p in held]
    if not tokens:
        return messages
    samples = [Sample(str(p.id), (m[-1]["content"],)) for p, m in zip(held, messages)]
    for m, padded in zip(messages, with_context(samples, samples, tokens, token_counter(pipe.tokenizer))):
        m[-1]["content"] = padded.prompt
    return messages
