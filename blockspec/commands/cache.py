"""`blockspec cache`: what blockspec keeps on disk (sizes per part and per model), and removing it.

    blockspec cache                 # = --info
    blockspec cache --clear         # everything blockspec stored
    blockspec cache --clear wheels  # one part (wheels, models, kernels; comma-separated)
"""

from __future__ import annotations

import argparse
import shutil

HELP = "show what blockspec stores on disk (--info, the default) or remove it (--clear)"


def _parts(text: str) -> tuple[str, ...]:
    from blockspec.cache_dir import PARTS

    names = tuple(x.strip() for x in text.split(",") if x.strip())
    if "all" in names:
        return tuple(PARTS)
    bad = [n for n in names if n not in PARTS]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"parts to clear are all or some of: {', '.join(PARTS)}; got {text!r}")
    return names


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--info", action="store_true",
                        help="print the cache directory and the size of each part and each model (the default)")
    parser.add_argument("--clear", nargs="?", type=_parts, const="all", default=None, metavar="PARTS",
                        help="remove what blockspec stored: all of it, or the parts named (comma-separated: wheels, "
                             "models, kernels). Models are pulled and converted again at their next use, "
                             "packed weights and kernels rebuilt; other files in the directory are left alone")
    parser.add_argument("--cache-dir", default=None,
                        help="cache directory (default: $BLOCKSPEC_CACHE or ~/.cache/blockspec)")


def _mb(n: int) -> str:
    return f"{n / 1e6:8.1f} MB"


def info(cache_dir: str | None = None) -> list[str]:
    """The lines of `blockspec cache --info`."""
    from blockspec.cache_dir import CACHE_ENV, PACKED_PREFIX, PARTS, cache_root, tree_size

    root = cache_root(cache_dir)
    lines = [f"blockspec cache: {root}" + ("" if cache_dir else f" (set ${CACHE_ENV} to move it)")]
    if not root.is_dir():
        return lines + ["  empty: nothing stored yet"]
    total = 0
    for part, what in PARTS.items():
        size = tree_size(root / part)
        total += size
        lines.append(f"  {part:<8}{_mb(size)}  {what}")
        if part == "models" and (root / part).is_dir():
            for model in sorted(p for p in (root / part).iterdir() if p.is_dir() and not p.name.startswith(".")):
                packed = sum(f.stat().st_size for f in model.glob(f"{PACKED_PREFIX}*") if f.is_file())
                extra = f" (packed weights {packed / 1e6:.1f} MB)" if packed else ""
                lines.append(f"    {model.name:<30}{_mb(tree_size(model))}{extra}")
    other = tree_size(root) - total
    if other:
        lines.append(f"  {'other':<8}{_mb(other)}  files blockspec does not manage (left alone by --clear)")
    lines.append(f"  {'total':<8}{_mb(total + other)}")
    lines.append("remove it: blockspec cache --clear (or one part: --clear wheels)")
    return lines


def clear(parts: tuple[str, ...], cache_dir: str | None = None) -> list[str]:
    """Removes the named parts of the cache (and the cache directory once nothing is left in it)."""
    from blockspec.cache_dir import cache_root, tree_size

    root = cache_root(cache_dir)
    lines, freed = [], 0
    for part in parts:
        path = root / part
        if not path.exists():
            continue
        size = tree_size(path)
        shutil.rmtree(path)
        freed += size
        lines.append(f"removed {path} ({size / 1e6:.1f} MB)")
    if root.is_dir() and not any(root.iterdir()):
        root.rmdir()
    lines.append(f"freed {freed / 1e6:.1f} MB" if lines else f"nothing to remove in {root}")
    return lines


def run(args: argparse.Namespace) -> int:
    lines = clear(args.clear, args.cache_dir) if args.clear else info(args.cache_dir)
    print("\n".join(lines))
    return 0
