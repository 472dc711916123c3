"""The top-p nucleus kernel (cpu/csrc/nucleus.c via cpu/kernels.py, used by
dflash/sampling.probabilities): the tokens of the full sort's nucleus, their renormalised
softmax probabilities, and the positions it leaves to the general path."""

from __future__ import annotations

import pytest
import torch

from blockspec.cpu import kernels
from blockspec.dflash import sampling
from blockspec.dflash.sampling import probabilities


def _nucleus_by_full_sort(logits: torch.Tensor, inv_t: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """The reference: softmax in float64, every probability sorted, the prefix before top_p kept."""
    probs = torch.softmax(logits.double() * inv_t.double()[:, None], dim=-1)
    sorted_p, order = probs.sort(dim=-1, descending=True, stable=True)
    before = sorted_p.cumsum(dim=-1) - sorted_p
    out = torch.zeros_like(probs).scatter(-1, order, sorted_p * (before < top_p.double()[:, None]))
    return out / out.sum(dim=-1, keepdim=True)


def _peaked(rows: int, v: int, seed: int) -> torch.Tensor:
    """Logits like a language model's: a few strong tokens over a noisy floor."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, v, generator=g)
    strong = torch.randint(0, v, (rows, 6), generator=g)
    return x.scatter_add(-1, strong, 4.0 + 6.0 * torch.rand(rows, 6, generator=g))


@pytest.mark.parametrize("v", [7, 16, 100, 3001, 49152])  # below, at and off the 16-lane vector width
def test_the_kernel_keeps_the_full_sorts_nucleus(v: int) -> None:
    x = _peaked(12, v, seed=v)
    inv_t = torch.tensor([1 / 0.7, 1.0, 2.0, 1 / 0.3] * 3)
    top_p = torch.tensor([0.9, 0.5, 0.99, 0.8, 0.95, 0.1] * 2)
    probs, done = kernels.nucleus(x, inv_t, top_p)
    want = _nucleus_by_full_sort(x, inv_t, top_p)
    assert bool(done.any())
    for r in range(12):
        if done[r]:
            assert torch.equal(probs[r] > 0, want[r] > 0), r
            assert torch.allclose(probs[r].double(), want[r], rtol=1e-5, atol=1e-7), r
        else:  # left to the general path, untouched
            assert bool((probs[r] == 0).all())


def test_flat_rows_are_left_to_the_general_path_and_probabilities_still_filter_them() -> None:
    """A nearly flat row's nucleus reaches past the kernel's candidates: the kernel says so, and
    `probabilities` filters that row the general way, beside rows the kernel did."""
    v = 5000
    g = torch.Generator().manual_seed(4)
    x = torch.randn(4, v, generator=g)
    x[:2, :3] += torch.tensor([16.0, 15.0, 14.5])  # peaked: the nucleus is three tokens
    x[2:] *= 0.01
    top_p = torch.full((4,), 0.9)
    _, done = kernels.nucleus(x, torch.ones(4), top_p)
    assert done.tolist() == [True, True, False, False]
    got = probabilities(x[:, None], torch.ones(4), torch.zeros(4, dtype=torch.long), top_p)[:, 0]
    want = _nucleus_by_full_sort(x, torch.ones(4), top_p)
    assert torch.equal(got > 0, want > 0)
    assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-7)
    assert 4000 < int((got[2] > 0).sum()) < v  # the flat rows kept most tokens, not all


def test_rows_with_nan_or_no_finite_logit_are_left_to_the_general_path() -> None:
    x = torch.randn(3, 50)
    x[0, 7] = float("nan")
    x[1] = float("-inf")
    probs, done = kernels.nucleus(x, torch.ones(3), torch.full((3,), 0.9))
    assert done.tolist() == [False, False, True] and bool((probs[:2] == 0).all())


def test_ties_keep_the_lower_ids_first() -> None:
    """Tokens of equal probability enter the nucleus in id order (the stable full sort's)."""
    x = torch.full((1, 40), -30.0)
    x[0, [3, 9, 17, 25]] = 5.0  # four equal tokens, each a quarter of the mass
    probs, done = kernels.nucleus(x, torch.ones(1), torch.tensor([0.6]))
    assert bool(done[0])
    assert (probs[0] > 0).nonzero()[:, 0].tolist() == [3, 9, 17]  # mass before 17: 0.5 < 0.6


def test_a_wide_nucleus_of_tied_tokens_is_cut_in_the_full_sorts_order() -> None:
    """Hundreds of candidates in three tiers of equal weight, shuffled over the ids: the kernel
    takes the heaviest in turn until the mass reaches top_p, and where that stops inside a tier it
    keeps that tier's lower ids, as the stable full sort does (the first 109 of the middle tier)."""
    v = 3000
    g = torch.Generator().manual_seed(11)
    order = torch.randperm(v, generator=g)
    tiers = {1.0: order[:100], 0.5: order[100:300], 0.0: order[300:600]}
    x = torch.full((1, v), -30.0)
    for value, ids in tiers.items():
        x[0, ids] = value
    probs, done = kernels.nucleus(x, torch.ones(1), torch.tensor([0.5]))
    assert bool(done[0])
    kept = set((probs[0] > 0).nonzero()[:, 0].tolist())
    assert kept == set(tiers[1.0].tolist()) | set(sorted(tiers[0.5].tolist())[:109])
    want = _nucleus_by_full_sort(x, torch.ones(1), torch.tensor([0.5]))
    assert torch.equal(probs[0] > 0, want[0] > 0)
    assert torch.allclose(probs[0].double(), want[0], rtol=1e-5, atol=1e-7)


def test_probabilities_takes_the_kernel_only_where_it_applies(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel serves temperature + top-p requests; top-k, top_p 1 and greedy rows keep the
    general path, and the results are the general path's (same tokens, close probabilities)."""
    calls = []
    real = kernels.nucleus
    monkeypatch.setattr(kernels, "nucleus", lambda *a: (calls.append(1), real(*a))[1])
    x = _peaked(6, 300, seed=9).reshape(2, 3, 300)
    t, p = torch.tensor([0.7, 1.3]), torch.tensor([0.9, 0.8])
    fast = probabilities(x, t, torch.zeros(2, dtype=torch.long), p)
    assert calls == [1]
    monkeypatch.setattr(sampling, "_nucleus_kernel", lambda *a: None)  # the general path alone
    slow = probabilities(x, t, torch.zeros(2, dtype=torch.long), p)
    assert torch.equal(fast > 0, slow > 0) and torch.allclose(fast, slow, rtol=1e-5, atol=1e-7)
    monkeypatch.undo()
    monkeypatch.setattr(kernels, "nucleus", lambda *a: (calls.append(1), real(*a))[1])
    probabilities(x, t, torch.tensor([0, 5]), p)  # a top-k row
    probabilities(x, t, torch.zeros(2, dtype=torch.long), torch.tensor([0.9, 1.0]))  # a top_p 1 row
    assert calls == [1]


@pytest.mark.parametrize("v", [16, 3001, 49152])
def test_a_draft_vocabularys_logits_give_the_bits_of_the_spread_row(v: int) -> None:
    """Logits of some tokens alone (a draft vocabulary; -inf elsewhere) through the kernel and
    through `probabilities` give exactly the probabilities of the row spread over the
    vocabulary, the rows the kernel leaves to the general path included."""
    g = torch.Generator().manual_seed(v)
    support = torch.randperm(v, generator=g)[: max(1, v * 2 // 5)].sort().values
    sub = _peaked(12, support.numel(), seed=v + 1)
    sub[9:] *= 0.01  # flat rows: the general path
    full = sampling.spread(sub, support, v)
    inv_t = torch.tensor([1 / 0.7, 1.0, 2.0, 1 / 0.3] * 3)
    top_p = torch.tensor([0.9, 0.5, 0.99, 0.8, 0.95, 0.1] * 2)
    probs, done = kernels.nucleus(sub, inv_t, top_p, support, v)
    want, want_done = kernels.nucleus(full, inv_t, top_p)
    assert torch.equal(done, want_done) and torch.equal(probs, want)
    assert bool(done.any()) and (v < 1000 or not bool(done.all()))
    temp, top_k = torch.tensor([0.7, 1.3, 0.5]), torch.zeros(3, dtype=torch.long)
    for p in (torch.tensor([0.9, 0.8, 0.95]), torch.tensor([0.9, 1.0, 0.95])):  # a top_p 1 row: spread first
        got = probabilities(sub.view(3, 4, -1), temp, top_k, p, support, v)
        assert torch.equal(got, probabilities(full.view(3, 4, -1), temp, top_k, p))
    for temp_, top_k_ in ((torch.tensor([0.7, 0.0, 0.5]), top_k), (temp, torch.tensor([0, 3, 0]))):  # greedy, top-k
        got = probabilities(sub.view(3, 4, -1), temp_, top_k_, p, support, v)
        assert torch.equal(got, probabilities(full.view(3, 4, -1), temp_, top_k_, p))
