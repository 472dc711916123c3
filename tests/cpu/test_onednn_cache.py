"""oneDNN's shape-keyed caches stay bounded (cpu/onednn_cache.py): products of many different row
counts (each prompt length makes one) through cpu/linear.py do not keep memory for every shape."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from blockspec.cpu import linear, onednn_cache

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads RSS from /proc")

# 400 products with row counts beyond the C kernels' (so oneDNN's): RSS after the first 100 row
# counts and after all of them.
SCRIPT = r"""
import json
import torch
from blockspec.cpu import linear

def rss_mb():
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS")) / 1024

w = torch.randn(16, 16)
marks = []
with torch.inference_mode():
    for i, rows in enumerate(range(200, 600)):
        linear.linear(torch.randn(rows, 16), w)
        if i + 1 in (100, 400):
            marks.append(rss_mb())
print(json.dumps({"matmul": linear.CPU_MATMUL, "after_100": marks[0], "after_400": marks[1]}))
"""


def _rss_over_row_counts(env: dict[str, str]) -> dict:
    names = (*onednn_cache.ONEDNN_NAMES, onednn_cache.IDEEP_NAME)
    full = {k: v for k, v in os.environ.items() if k not in names} | env
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=full, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not linear.onednn_available(), reason="this PyTorch build has no oneDNN linear")
def test_products_of_many_row_counts_keep_memory_bounded() -> None:
    bounded = _rss_over_row_counts({})
    assert bounded["matmul"] in ("native", "onednn")
    # The control: oneDNN's and ideep's own default capacity (1024 shapes) keeps ~0.55 MB for
    # each new row count here (~165 MB over the last 300), so the measurement sees the creep.
    unbounded = _rss_over_row_counts({onednn_cache.ONEDNN_NAMES[0]: "1024", onednn_cache.IDEEP_NAME: "1024"})
    assert unbounded["after_400"] - unbounded["after_100"] > 60, unbounded
    assert bounded["after_400"] - bounded["after_100"] < 15, bounded


def test_a_capacity_the_user_set_is_kept() -> None:
    env: dict[str, str] = {}
    onednn_cache.bound_caches(env)
    assert env == {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "64", "LRU_CACHE_CAPACITY": "64"}
    env = {"DNNL_PRIMITIVE_CACHE_CAPACITY": "8", "LRU_CACHE_CAPACITY": "2048"}
    onednn_cache.bound_caches(env)  # oneDNN's older name counts as set too
    assert env == {"DNNL_PRIMITIVE_CACHE_CAPACITY": "8", "LRU_CACHE_CAPACITY": "2048"}
