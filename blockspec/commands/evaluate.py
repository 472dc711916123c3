"""`blockspec evaluate`: held-out acceptance length (tau) of one or more drafters for a target.

The shipping check of the training recipe (docs/TRAINING.md): greedy speculative decoding of
the prompts that `blockspec datagen` holds out of the training data, so a new drafter
is compared with the old one without touching a benchmark's test split.
"""

from __future__ import annotations

import argparse
import json

from blockspec.commands import add_drafter_dtype_argument
from blockspec.train.data import HELDOUT_SOURCES

HELP = "held-out acceptance length (tau) of drafters: the training recipe's shipping check"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default="smollm2-135m-instruct",
                   help="zoo name (see `blockspec pull --list`), local HF directory or Hub id")
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
    p.add_argument("--batch-size", type=int, default=16, help="prompts decoded together")
    p.add_argument("--data-dir", default=None, help="where the data sets live (default: ../shared/data)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16", "float64"])
    add_drafter_dtype_argument(p)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--json", action="store_true", help="print one JSON object per drafter")


def run(args: argparse.Namespace) -> int:
    from blockspec.errors import ConfigError

    for name in ("prompts", "max_new_tokens", "batch_size"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    import torch

    import blockspec
    from blockspec.text import encode_prompt
    from blockspec.train.data import heldout_prompts
    from blockspec.train.evaluate import quick_tau

    if args.threads:
        torch.set_num_threads(args.threads)
    held = heldout_prompts(args.prompts, data_dir=args.data_dir, source=args.heldout)
    rows = []
    for drafter in args.drafter:
        pipe = blockspec.load(args.target, drafter, dtype=args.dtype, device=args.device,
                              block_size=args.block_size, drafter_dtype=args.drafter_dtype)
        prompts = [encode_prompt(pipe.tokenizer, list(p.messages), chat=True) for p in held]
        block = args.block_size or pipe.drafter.block_size
        res = quick_tau(pipe.decoder.target, pipe.drafter, prompts, block_size=block,
                        max_new_tokens=args.max_new_tokens, batch_size=args.batch_size)
        row = {"drafter": str(drafter), "block_size": block, **res}
        rows.append(row)
        if args.json:
            print(json.dumps(row), flush=True)
    if not args.json:
        print(f"held-out {args.heldout} prompts: {len(held)}, greedy, "
              f"{args.max_new_tokens} new tokens")
        print(f"{'tau':>6} {'steps':>6} {'block':>5}  drafter")
        for r in rows:
            print(f"{r['tau']:6.2f} {r['steps']:6d} {r['block_size']:5d}  {r['drafter']}")
    return 0
