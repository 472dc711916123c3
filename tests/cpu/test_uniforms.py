"""The keyed uniforms' kernel (cpu/csrc/uniforms.c via cpu/kernels.py, used by
dflash/sampling.slot_uniforms and `RowRandom.keys`): the bits of the PyTorch arithmetic and the
Python keys it replaces, for slots shared by every key and slots of each key, extreme keys, slots
and seeds included."""

from __future__ import annotations

import pytest
import torch

from blockspec.cpu import kernels
from blockspec.dflash import sampling
from blockspec.dflash.sampling import ACCEPT_SLOT, BONUS_SLOT, RowRandom, keyed, slot_uniforms

needs_kernel = pytest.mark.skipif(kernels.kernel() is None, reason="the native CPU kernel did not build here")


def _pytorch(keys: torch.Tensor, slots: torch.Tensor, monkeypatch: pytest.MonkeyPatch) -> torch.Tensor:
    with monkeypatch.context() as patch:
        patch.setattr(kernels, "slot_uniforms", lambda *a: None)
        return slot_uniforms(keys, slots)


@needs_kernel
def test_the_kernel_has_the_pytorch_arithmetics_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    g = torch.Generator().manual_seed(0)
    keys = torch.randint(-2**63, 2**63 - 1, (4, 7), dtype=torch.int64, generator=g)
    keys[0, 0], keys[0, 1], keys[0, 2] = -2**63, 2**63 - 1, 0
    cases = [
        torch.randint(0, 49152, (4, 7, 32), generator=g),  # a race's token ids, per key
        torch.randint(-2**63, 2**63 - 1, (4, 7, 5), dtype=torch.int64, generator=g),
        torch.tensor([ACCEPT_SLOT, BONUS_SLOT, 0, 49152, 49153, 2**63 - 1, -2**63]),  # shared
    ]
    for slots in cases:
        got = slot_uniforms(keys, slots)
        want = _pytorch(keys, slots, monkeypatch)
        assert got.dtype == torch.float64 and got.shape == want.shape == (4, 7, slots.shape[-1])
        assert torch.equal(got, want)
        assert bool((got > 0).all()) and bool((got < 1).all())
    calls = []
    real = kernels.slot_uniforms
    monkeypatch.setattr(kernels, "slot_uniforms", lambda *a: calls.append(1) or real(*a))
    slot_uniforms(keys[:, :1], cases[0][:, :3])  # shapes that broadcast: the PyTorch path
    assert calls == []


@needs_kernel
def test_keyed_draws_are_unchanged_by_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """`RowRandom.sample` and `uniforms` give the same ids and uniforms with and without it."""
    g = torch.Generator().manual_seed(1)
    probs = torch.softmax(torch.randn(3, 4, 500, generator=g) * 3, dim=-1)
    random = RowRandom([11, 2**40 + 3, keyed(5, 9) >> 2])
    starts = [0, 17, 300]
    ids, u = random.sample(probs, starts), random.uniforms(starts, 4, (ACCEPT_SLOT, BONUS_SLOT))
    with monkeypatch.context() as patch:
        patch.setattr(kernels, "slot_uniforms", lambda *a: None)
        assert torch.equal(random.sample(probs, starts), ids)
        assert torch.equal(random.uniforms(starts, 4, (ACCEPT_SLOT, BONUS_SLOT)), u)
    assert sampling.RACE_HEAD < 500  # the tail's clocks (shared slots) took part too


@needs_kernel
def test_position_keys_are_the_python_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    """`RowRandom.keys` through the kernel: `keyed`'s bits for any seed a request can carry
    (negative, past 64 bits, the random ones) at any position."""
    seeds = [0, 5, 2**62 - 1, -5, 2**70 + 1, -2**63, None]
    random = RowRandom(seeds)
    starts = [0, 7, 100, 3, 2**31, 9, 0]
    got = random.keys(starts, 6)
    want = torch.tensor([[sampling._signed(keyed(s, p + j)) for j in range(6)] for s, p in zip(random.seeds, starts)])
    assert torch.equal(got, want)
    with monkeypatch.context() as patch:
        patch.setattr(kernels, "position_keys", lambda *a: None)
        assert torch.equal(random.keys(starts, 6), want)
    assert random.keys([1, 2, 3, 4, 5, 6, 7], 0).shape == (7, 0)
