"""Where blockspec keeps what it downloads and builds: models, wheels, compiled kernels."""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "BLOCKSPEC_CACHE"


def cache_root(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """The cache directory: argument, else $BLOCKSPEC_CACHE, else ~/.cache/blockspec."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    return Path.home() / ".cache" / "blockspec"
