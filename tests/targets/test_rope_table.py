"""Rotary.below (targets/rope.py): cos/sin read from a table of positions, the numbers `forward`
computes, across growth of the table, dtypes, scaling and a changed inv_freq."""

from __future__ import annotations

import pytest
import torch

from blockspec.targets.rope import TABLE_MIN, Rotary, rope_inv_freq


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scaling", [1.0, 0.7])
def test_table_reads_are_the_computed_numbers(dtype: torch.dtype, scaling: float) -> None:
    inv_freq, _ = rope_inv_freq(64, 100000.0, None)
    rotary = Rotary(inv_freq, scaling)
    g = torch.Generator().manual_seed(0)
    for bound in (5, TABLE_MIN, TABLE_MIN + 1, 3 * TABLE_MIN):  # the last two grow the table
        for n in (1, 3, 16, 17, 129):
            positions = torch.randint(-1, bound, (2, n), generator=g)  # -1: EMPTY, rope of position 0
            want, got = rotary(positions, dtype), rotary.below(positions, dtype, bound)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
            assert got[0].dtype == dtype and got[0].shape == (2, n, 64)
    assert rotary._tables[dtype][1].shape[0] == 4 * TABLE_MIN


def test_a_changed_inv_freq_builds_a_new_table() -> None:
    rotary = Rotary(rope_inv_freq(32, 10000.0, None)[0])
    positions = torch.arange(40)[None]
    before = rotary.below(positions, torch.float32, 40)[0]
    with torch.no_grad():
        rotary.inv_freq.mul_(0.5)  # in place: a new version
    after = rotary.below(positions, torch.float32, 40)[0]
    assert not torch.equal(before, after)
    assert torch.equal(after, rotary(positions, torch.float32)[0])
    with pytest.raises(IndexError):  # a position at or past the bound is a caller's error, never a wrong number
        rotary.below(torch.tensor([[5000]]), torch.float32, 40)
