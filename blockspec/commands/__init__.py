"""The `blockspec` CLI verbs, one module each; arguments several verbs share live here.

One story for the defaults: every verb that decodes (generate, serve, bench, demo) takes the demo
model, DEFAULT_TARGET, with the drafter shipped for it, the adaptive block policy (each step picks
its block size, up to the drafter's) and n-gram lookup proposals. `bench --block-sizes` adds
runs at fixed block sizes, as the published DFlash decodes.
"""

from __future__ import annotations

import argparse

from blockspec.zoo.registry import DEFAULT_TARGET  # noqa: F401  (the verbs' default --target)


def add_drafter_dtype_argument(parser: argparse.ArgumentParser) -> None:
    """--drafter-dtype, for the verbs that load a pipeline (see `blockspec.api.resolve_drafter_dtype`)."""
    parser.add_argument("--drafter-dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                        help="the drafter's dtype; auto (default): bfloat16 beside a float32 target on a CPU "
                             "with bf16 products, else the target's (the output is the same either way)")


def add_lookup_argument(parser: argparse.ArgumentParser) -> None:
    """--no-lookup, for the verbs that decode with a pipeline (see `blockspec.dflash.lookup`)."""
    parser.add_argument("--no-lookup", action="store_true",
                        help="draft every proposal with the drafter (pure DFlash); by default a sequence whose "
                             "last tokens occurred before proposes what followed them (n-gram lookup; same output)")
