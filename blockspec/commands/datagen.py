"""`blockspec datagen`: regenerate training responses with the target model itself."""

from __future__ import annotations

import argparse
import json

from blockspec.commands.model_args import add_runtime_arguments

HELP = "regenerate training responses with the target model itself (resumable JSONL shards)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_runtime_arguments(p, ("target", "dtype", "device"))
    p.add_argument("--out", required=True, help="output directory for shard-NNNNN.jsonl files")
    p.add_argument("--sources", default="gsm8k_train,mbpp_train,sharegpt,alpaca",
                   help="comma list of gsm8k_train, gsm8k_code, mbpp_train, sharegpt, sharegpt_code, alpaca, py_stubs or .jsonl paths "
                        "(ShareGPT-style messages/conversations, or prompt/instruction/question)")
    p.add_argument("--limit", action="append", default=[], metavar="SOURCE=N",
                   help="at most N prompts from SOURCE (repeatable), e.g. --limit sharegpt=500")
    p.add_argument("--data-dir", default=None, metavar="DIR",
                   help="a folder holding the sources' files (gsm8k_train.jsonl, mbpp_sanitized.json, "
                        "sharegpt_first_turns.jsonl, alpaca_seed_tasks.jsonl); default $BLOCKSPEC_DATA, else "
                        "the Hugging Face Hub (needs `datasets` and a network; alpaca: a folder only)")
    p.add_argument("--holdout", type=int, default=64,
                   help="first N prompts of each held-out source (gsm8k_train, gsm8k_code, py_stubs) kept out of the data (the quick-eval set)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--max-prompt-tokens", type=int, default=512)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (matches greedy serving)")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--shard-size", type=int, default=500)
    p.add_argument("--drafter", default=None, help="optional drafter dir to speed generation up (same output)")
    p.add_argument("--block-size", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--backend", default="spec", choices=["spec", "hf"],
                   help="spec: our SpecDecoder; hf: transformers generate (reference path)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--features-for", default=None, metavar="IDS",
                   help="comma list of target layer ids (the drafter's target_layer_ids, e.g. 1,14,27): keep "
                        "their features while generating, so `blockspec train` skips its feature pass")


def run(args: argparse.Namespace) -> int:
    from blockspec.api import resolve_target_dir
    from blockspec.errors import ConfigError
    from blockspec.dflash.drafter import load_drafter
    from blockspec.targets.native.load import load_target
    from blockspec.train.data import load_prompts
    from blockspec.train.datagen import regenerate

    if args.threads:
        from blockspec.cpu.threads import pin

        pin(args.threads)  # the user's count, on every decoding thread (cpu/threads.py)
    limits = {}
    for item in args.limit:
        name, _, n = item.partition("=")
        if not n.isdigit():
            raise ConfigError(f"--limit wants SOURCE=N, got {item!r}")
        limits[name] = int(n)
    layer_ids: tuple[int, ...] = ()
    if args.features_for:
        try:
            layer_ids = tuple(int(x) for x in args.features_for.split(","))
        except ValueError:
            raise ConfigError(f"--features-for wants comma-separated layer ids, e.g. 1,14,27; got {args.features_for!r}") from None
    prompts = load_prompts(args.sources.split(","), data_dir=args.data_dir, limits=limits,
                           holdout=args.holdout, seed=args.seed)
    # "spec" runs on the native Llama-family code where it applies (static KV, no padding work),
    # which generates faster than the HF adapter (docs/DESIGN.md section 12); "hf" needs the
    # transformers model.
    target, tokenizer = load_target(resolve_target_dir(args.target), backend="hf" if args.backend == "hf" else "auto",
                                    dtype=args.dtype, device=args.device)
    drafter = None
    if args.drafter:
        drafter = load_drafter(args.drafter, dtype=target.dtype, device=args.device)
    summary = regenerate(
        target, tokenizer, prompts, args.out, drafter=drafter,
        block_size=args.block_size or (drafter.block_size if drafter is not None else 1),
        batch_size=args.batch_size, max_new_tokens=args.max_new_tokens,
        max_prompt_tokens=args.max_prompt_tokens, temperature=args.temperature, seed=args.seed,
        shard_size=args.shard_size, backend=args.backend, feature_layer_ids=layer_ids,
    )
    print(json.dumps({"prompts": len(prompts), **summary}))
    return 0
