"""The compute-quality bench's step costs (blockspec/bench/compute_quality.py): each verify width
timed both ways (every position's id, and until the first rejected proposal), on either clock."""

from __future__ import annotations

import time

import pytest
import torch
from conftest import make_tiny_target

from blockspec.bench.compute_quality import step_costs
from blockspec.cpu import kernels
from blockspec.targets.native import load_native_target


@pytest.mark.skipif(kernels.kernel() is None, reason="needs the C kernels (the int8 mode)")
@pytest.mark.parametrize("clock", [time.perf_counter, time.thread_time])
def test_step_costs_time_a_plain_step_and_each_verify_both_ways(clock) -> None:
    model = make_tiny_target("llama", seed=2, dtype=torch.float32, hidden_size=64, intermediate_size=96,
                             num_attention_heads=4, num_key_value_heads=2)
    targets = {m: load_native_target(model, dtype="float32", compute=m) for m in ("exact", "int8")}
    med = step_costs(targets, [3, 8], context=12, reps=3, clock=clock)
    assert sorted(med) == sorted(f"{m}_{k}" for m in targets for k in ("1", "3", "3r", "8", "8r"))
    assert all(v > 0 for v in med.values())
