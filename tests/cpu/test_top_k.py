"""The draft top-k (`cpu/csrc/topk.c`, `cpu/top_k.py`): the kernel and the PyTorch path give the
same ids in the same defined order (larger logit first, the lower id first on ties), whose first
column is the greedy argmax, and the log-softmax of each."""

from __future__ import annotations

import pytest
import torch

from blockspec.cpu import kernels
from blockspec.cpu.argmax import argmax_and_peak, greedy_ids
from blockspec.cpu.top_k import reference_top_logprobs, top_logprobs

needs_kernel = pytest.mark.skipif(kernels.kernel() is None, reason="no native CPU kernel on this machine")


def _tied_logits(rows: int, n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random logits with many exact ties (a coarse grid), the maximum tied in some rows, and a
    stretch of -inf (a draft vocabulary's outside)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-40, 8, (rows, n), generator=g).float() / 4  # ties everywhere
    x[0, 5] = x[0, n - 3] = x[0].max() + 1  # the maximum tied, far apart (vector and tail)
    x[1, n // 2:] = float("-inf")
    return x.to(dtype)


def _expected_order(x: torch.Tensor, k: int) -> torch.Tensor:
    """The defined order by brute force: sort (-logit, id) pairs."""
    out = []
    for row in x.float().tolist():
        out.append(sorted(range(len(row)), key=lambda j: (-row[j], j))[:k])
    return torch.tensor(out)


@pytest.mark.parametrize("n", [7, 16, 37, 1000, 4099])
@pytest.mark.parametrize("k", [1, 3, 8])
def test_reference_orders_ties_lower_id_first(n: int, k: int) -> None:
    x = _tied_logits(3, n, torch.float32, seed=n + k)
    logp, ids = reference_top_logprobs(x, min(k, n))
    assert torch.equal(ids, _expected_order(x, min(k, n)))
    want = torch.log_softmax(x.double(), -1).gather(-1, ids).float()
    assert torch.allclose(logp, want, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [7, 16, 37, 1000, 4099])
@pytest.mark.parametrize("k", [1, 3, 8, 64])
def test_kernel_equals_its_reference_ties_included(dtype: torch.dtype, n: int, k: int) -> None:
    k = min(k, n)
    for x in (_tied_logits(4, n, dtype, seed=n * k), torch.randn(5, 2, n).to(dtype)):
        fast = kernels.top_k(x, k)
        assert fast is not None
        logp, ids = fast
        ref_logp, ref_ids = reference_top_logprobs(x, k)
        assert ids.shape == logp.shape == (*x.shape[:-1], k) and logp.dtype == torch.float32
        assert torch.equal(ids, ref_ids)
        finite = ref_logp.isfinite()
        assert torch.equal(finite, logp.isfinite())
        assert torch.allclose(logp[finite], ref_logp[finite], atol=2e-5)


@pytest.mark.parametrize("kernel", [True, False])
def test_first_column_is_the_greedy_argmax_and_its_peak(monkeypatch: pytest.MonkeyPatch, kernel: bool) -> None:
    """What lets a step read its chain from the tree's top-k: the same id as the argmax, ties
    included, and the probability the argmax kernel gives it."""
    if kernel and kernels.kernel() is None:
        pytest.skip("no native CPU kernel on this machine")
    if not kernel:
        monkeypatch.setattr(kernels, "top_k", lambda logits, k: None)
        monkeypatch.setattr(kernels, "argmax", lambda logits: None)
        monkeypatch.setattr(kernels, "argmax_peak", lambda logits: None)
    x = torch.cat([_tied_logits(4, 3001, torch.float32, seed=1), torch.randn(4, 3001)])
    logp, ids = top_logprobs(x, 4)
    best, peak = argmax_and_peak(x)
    assert torch.equal(ids[:, 0], best) and torch.equal(ids[:, 0], greedy_ids(x))
    assert torch.allclose(logp[:, 0].exp(), peak, rtol=1e-5)


def test_bad_k_is_refused_clearly() -> None:
    with pytest.raises(ValueError, match="1 <= k <= 5"):
        top_logprobs(torch.zeros(2, 5), 6)
    with pytest.raises(ValueError, match="1 <= k"):
        top_logprobs(torch.zeros(2, 5), 0)


@needs_kernel
@pytest.mark.parametrize("n", [1, 5, 31, 32, 33, 100, 3001, 49152])
@pytest.mark.parametrize("k", [1, 8, 32])
def test_top_values_give_torch_topks_values_ties_by_lower_index(n: int, k: int) -> None:
    """`kernels.top_values` (the keyed race's head, dflash/sampling.py): torch.topk's values in descending order, every
    index pointing at its value, ties by the lower index; sparse rows (a nucleus) as dense ones."""
    if k > n:
        assert kernels.top_values(torch.zeros(2, n), k) is None
        return
    g = torch.Generator().manual_seed(n * 100 + k)
    dense = torch.rand(3, n, generator=g)
    sparse = torch.zeros(3, n).scatter_(-1, torch.randint(0, n, (3, 4), generator=g), 0.25)  # <= 4 tokens, ties
    ties = torch.randint(0, 3, (3, n), generator=g).float()  # many equal values
    for x in (dense, sparse, ties):
        vals, idx = kernels.top_values(x, k)
        want = x.topk(k, dim=-1).values
        assert torch.equal(vals, want)
        assert torch.equal(x.gather(-1, idx), vals)
        for r in range(3):
            assert len(set(idx[r].tolist())) == k
            for j in range(1, k):  # equal values: the lower index first
                if vals[r, j] == vals[r, j - 1]:
                    assert idx[r, j] > idx[r, j - 1]
            # a tie at the boundary keeps the lowest indices of that value
            last = vals[r, -1]
            held = set(idx[r][vals[r] == last].tolist())
            lowest = (x[r] == last).nonzero()[:, 0].tolist()[: len(held)]
            assert held == set(lowest)
