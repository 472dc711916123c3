"""Bounds on the shape-keyed caches of oneDNN's linear, which cpu/linear.py sends wide products to.

oneDNN keeps each primitive it builds in an LRU cache keyed by shape (`ONEDNN_PRIMITIVE_CACHE_CAPACITY`,
1024 entries by default) and PyTorch's ideep layer above it keeps one of its own
(`LRU_CACHE_CAPACITY`, 1024). A prefill's row count is the number of tokens joining, so nearly
every join adds new entries in both caches for every weight shape, whatever the weight's size. A
server's memory then crept up round after round of load, towards 1024 entries per weight shape
that its idle release cannot free (sizes measured: docs/DESIGN.md section 12). `CAPACITY`
entries keep the few shapes of one forward (a model has 4-8 weight shapes, each reused by every
layer) and of the last several steps; a miss costs one primitive build, which a new prompt
length pays at any capacity.

Both are read once, when the process first uses oneDNN, so `bound_caches` must run before that
(cpu/linear.py calls it on import, before its own first product). A capacity the user set, under
either of oneDNN's names, is kept.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

CAPACITY = 64
ONEDNN_NAMES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "DNNL_PRIMITIVE_CACHE_CAPACITY")
IDEEP_NAME = "LRU_CACHE_CAPACITY"


def bound_caches(env: MutableMapping[str, str] | None = None) -> None:
    """Sets both caches' capacity to CAPACITY in `env` (default os.environ) unless already set."""
    env = os.environ if env is None else env
    if not any(name in env for name in ONEDNN_NAMES):
        env[ONEDNN_NAMES[0]] = str(CAPACITY)
    env.setdefault(IDEEP_NAME, str(CAPACITY))
