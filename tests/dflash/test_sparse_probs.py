"""A nucleus as (id, probability) pairs (dflash/sparse_probs.py, cpu/csrc/nucleus.c's
bs_nucleus_pairs): the same probabilities as `sampling.probabilities`, bit for bit, and the same
tokens drawn for a seed by the keyed race and the standard rule as from the vocabulary-wide rows."""

from __future__ import annotations

import math

import pytest
import torch

from blockspec.cpu import kernels
from blockspec.dflash.sampling import RowRandom, probabilities, sample_from
from blockspec.dflash.sparse_probs import (SparseProbs, draw, nucleus_draws, nucleus_pairs, race_on_host,
                                          sample_from_pairs, sample_pairs, shaped)
from blockspec.dflash.tree_verify import keyed_draws
from blockspec.dflash.verify import _inverse_cdf, verify_standard, verify_standard_keyed

pytestmark = pytest.mark.skipif(kernels.kernel() is None, reason="needs the C kernels (a compiler)")


def _logits(b: int, n: int, v: int, seed: int, strong: int = 6, spread: float = 6.0) -> torch.Tensor:
    """Logits like a language model's: `strong` tokens over a noisy floor (lowered by log v, so its
    mass does not grow with the vocabulary), the top one tied with its neighbour."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, n, v, generator=g) - math.log(v)
    ids = torch.randint(0, v, (b, n, strong), generator=g)
    x = x.scatter_add(-1, ids, math.log(v) + 4.0 + spread * torch.rand(b, n, strong, generator=g))
    top = x.argmax(dim=-1, keepdim=True)
    return x.scatter(-1, (top + 1) % v, x.gather(-1, top))


def _settings(b: int, temperature: float, top_p: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch.full((b,), temperature), torch.zeros(b, dtype=torch.long), torch.full((b,), top_p)


@pytest.mark.parametrize("v", [5, 16, 100, 3001, 49152])
@pytest.mark.parametrize("temperature,top_p", [(0.7, 0.9), (1.0, 0.5), (0.3, 0.99), (1.0, 0.95)])
def test_pairs_hold_the_probabilities_bits(v: int, temperature: float, top_p: float) -> None:
    x = _logits(3, 4, v, seed=v)
    settings = _settings(3, temperature, top_p)
    pairs = nucleus_pairs(x, *settings)
    assert pairs is not None
    want = probabilities(x, *settings)
    assert pairs.shape == want.shape
    assert torch.equal(pairs.dense(), want)
    # ids ascending, then padding (id 0, probability 0)
    real = pairs.probs > 0
    assert torch.equal(real.sum(-1), (want > 0).sum(-1))
    gaps = pairs.ids[..., 1:] - pairs.ids[..., :-1]
    assert bool(((gaps > 0) | ~real[..., 1:]).all())
    assert bool((pairs.ids[~real] == 0).all())


def test_requests_the_kernel_does_not_shape_keep_vocabulary_wide_rows() -> None:
    x = _logits(2, 3, 300, seed=1)
    t, k, p = _settings(2, 0.7, 0.9)
    for temperature, top_k, top_p in ((torch.tensor([0.7, 0.0]), k, p),  # a greedy row
                                      (t, torch.tensor([0, 40]), p),  # top-k
                                      (t, k, torch.tensor([0.9, 1.0]))):  # top-p off
        assert nucleus_pairs(x, temperature, top_k, top_p) is None
        got = shaped(x, temperature, top_k, top_p)
        assert isinstance(got, torch.Tensor)
        assert torch.equal(got, probabilities(x, temperature, top_k, top_p))
    flat = torch.zeros(1, 2, 5000)  # a nucleus wider than the kernel's candidates
    settings = _settings(1, 1.0, 0.9)
    assert nucleus_pairs(flat, *settings) is None
    assert torch.equal(shaped(flat, *settings), probabilities(flat, *settings))


def _wide(b: int, n: int, v: int, seed: int) -> torch.Tensor:
    """Nuclei of dozens of tokens (more than the race's head of 32): its tail draws too."""
    return _logits(b, n, v, seed, strong=60, spread=1.0)


@pytest.mark.parametrize("kind", ["peaked", "usual", "wide"])
def test_the_keyed_race_draws_the_same_tokens(kind: str) -> None:
    b, n, v = 4, 3, 2000
    seen_tail = seen_single = 0
    temperature, top_p = {"peaked": (0.3, 0.5), "usual": (0.7, 0.9), "wide": (1.0, 0.97)}[kind]
    for trial in range(60):
        x = (_wide if kind == "wide" else _logits)(b, n, v, seed=100 + trial)
        if kind == "peaked" and trial % 2:  # one token far ahead at every position
            x = x.scatter_add(-1, x.argmax(dim=-1, keepdim=True), torch.full((b, n, 1), 20.0))
        rows = x.shape[0]
        settings = _settings(rows, temperature, top_p)
        pairs = nucleus_pairs(x, *settings)
        assert pairs is not None
        dense = probabilities(x, *settings)
        random = RowRandom([trial * 7 + r for r in range(rows)])
        starts = [trial + 3 * r for r in range(rows)]
        got = draw(random, pairs, starts)
        assert torch.equal(got, random.sample(dense, starts))
        seen_single += pairs.ids.shape[-1] == 1
        if kind == "wide":
            head = dense.topk(32, dim=-1).indices
            seen_tail += int((head != got[..., None]).all(dim=-1).sum())
    if kind == "peaked":
        assert seen_single > 0  # one-token nuclei (drawn without clocks) were compared
    if kind == "wide":
        assert pairs.ids.shape[-1] > 32
        assert seen_tail > 0  # the tail's draw was compared, not only the head's


@pytest.mark.parametrize("kind", ["peaked", "usual", "wide"])
@pytest.mark.parametrize("draft_vocabulary", [True, False])
def test_a_draft_steps_draws_in_one_call_are_the_pairs_draws(kind: str, draft_vocabulary: bool,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """`nucleus_draws` (cpu/csrc/nucleus.c's bs_nucleus_draws): the pairs of a draft vocabulary's
    logits over the target's ids, each position's keyed draw and its peak, as `nucleus_pairs`,
    the ids read through the vocabulary, `sample_pairs` and the pairs' largest probability give
    them; the kernel's own race where every nucleus fits the race's head, the tail's draw else."""
    b, n, m, v = 3, 4, 900, 5000
    temperature, top_p = {"peaked": (0.3, 0.5), "usual": (0.7, 0.9), "wide": (1.0, 0.97)}[kind]
    raced = tails = 0
    real = kernels.nucleus_draws
    results = []
    monkeypatch.setattr(kernels, "nucleus_draws", lambda *a: results.append(real(*a)) or results[-1])
    for trial in range(25):
        x = (_wide if kind == "wide" else _logits)(b, n, m, seed=200 + trial)
        if kind == "peaked" and trial % 2:
            x = x.scatter_add(-1, x.argmax(dim=-1, keepdim=True), torch.full((b, n, 1), 20.0))
        g = torch.Generator().manual_seed(trial)
        support = torch.randperm(v, generator=g)[:m].sort().values if draft_vocabulary else None
        t, _, p = _settings(b, temperature, top_p)
        t[1] = temperature * 1.5  # rows differ in their settings
        random = RowRandom([trial, 2**62 + trial, -trial - 1])
        starts = [trial, 3 * trial + 1, 2**20]
        want = nucleus_pairs(x, t, torch.zeros(b, dtype=torch.long), p)
        assert want is not None
        if support is not None:
            want = SparseProbs(torch.where(want.probs > 0, support[want.ids], torch.zeros_like(want.ids)), want.probs, v)
        out = nucleus_draws(x, support, v if draft_vocabulary else m, t, p, random, starts)
        assert out is not None
        pairs, drawn, peaks = out
        assert torch.equal(pairs.ids, want.ids) and torch.equal(pairs.probs, want.probs)
        assert pairs.vocab == want.vocab
        assert torch.equal(peaks, want.probs.amax(dim=-1))
        assert torch.equal(drawn, sample_pairs(random, want, starts))
        raced += results[-1][2] is not None
        tails += results[-1][2] is None
    assert raced > 0  # the kernel's race was compared
    if kind == "wide":
        assert tails > 0  # and the tail's fallback
    assert nucleus_draws(x, support, v, torch.tensor([0.7, 0.0, 0.7]), p, random, starts) is None  # a greedy row


def test_the_race_kernel_draws_as_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """`sample_pairs` through cpu/csrc/race.c: the tokens of the host's race over the same pairs,
    and the host's race (with its tail) where a nucleus is wider than the race's head."""
    real, used = kernels.pairs_race, []
    monkeypatch.setattr(kernels, "pairs_race", lambda *a: used.append(real(*a) is not None) or real(*a))
    for trial in range(60):
        x = (_wide if trial % 3 == 0 else _logits)(3, 4, 1500, seed=700 + trial)
        pairs = nucleus_pairs(x, *_settings(3, 0.8, 0.95))
        random, starts = RowRandom([trial, -trial, 2**63 + trial]), [trial, 0, 2**25]
        got = sample_pairs(random, pairs, starts)
        with monkeypatch.context() as patch:
            patch.setattr(kernels, "pairs_race", lambda *a: None)
            assert torch.equal(got, sample_pairs(random, pairs, starts))
    assert any(used) and not all(used)  # the kernel drew, and left the wide nuclei to the host


def test_the_host_race_picks_the_tensors_argmin() -> None:
    """race_on_host against the race in tensor operations: arrival -log(u) / p in float64, the
    first least in the head's order (the higher probability first, the lower id on ties)."""
    g = torch.Generator().manual_seed(7)
    for trial in range(200):
        k = int(torch.randint(1, 40, (1,), generator=g))
        probs = torch.rand(3, 2, k, generator=g) ** 4
        probs[probs < 0.05] = 0.0  # zeros: never first
        probs[..., 0] = probs[..., 0].clamp(min=1e-3)  # at least one token of mass > 0
        log_u = torch.log(torch.rand(3, 2, k, generator=g, dtype=torch.float64))
        if trial % 4 == 0 and k > 1:  # a tie in probability and in arrival: the order decides
            probs[..., 1] = probs[..., 0]
            log_u[..., 1] = log_u[..., 0]
        ids = torch.stack([torch.randperm(5000, generator=g)[:k] for _ in range(6)]).reshape(3, 2, k)
        order = torch.tensor([[sorted(range(k), key=lambda i: (-probs[r, j, i].item(), ids[r, j, i].item()))
                               for j in range(2)] for r in range(3)])  # [3, 2, k]: the head's order
        head, head_ids, head_log = probs.gather(-1, order), ids.gather(-1, order), log_u.gather(-1, order)
        arrival = -head_log / head.double()
        want = head_ids.gather(-1, arrival.argmin(dim=-1, keepdim=True))[..., 0]
        assert torch.equal(race_on_host(ids, probs, log_u), want)


def test_tree_draws_read_pairs_as_rows() -> None:
    b, n, v = 2, 5, 700
    x = _logits(b, n, v, seed=3)
    settings = _settings(b, 0.8, 0.9)
    random = RowRandom([11, 12])
    depths, starts = [[0, 1, 1, 2, 3], [0, 1, 2]], [4, 9]
    got = keyed_draws(random, nucleus_pairs(x, *settings), depths, starts)
    assert torch.equal(got, keyed_draws(random, probabilities(x, *settings), depths, starts))


def test_sampling_from_pairs_picks_the_dense_rows_token() -> None:
    g = torch.Generator().manual_seed(0)
    for trial in range(50):
        x = _logits(3, 2, 400, seed=trial)
        pairs = nucleus_pairs(x, *_settings(3, 0.9, 0.95))
        u = torch.rand(3, 2, generator=g, dtype=torch.float64)
        assert torch.equal(sample_from_pairs(pairs.ids, pairs.probs, u), sample_from(pairs.dense(), u))
    # a uniform whose float32 rounds to 1: the last token of mass > 0, never a padding id
    probs = torch.tensor([[0.25, 0.75, 0.0, 0.0]])
    ids = torch.tensor([[3, 8, 0, 0]])
    assert sample_from_pairs(ids, probs, torch.tensor([1.0 - 2.0**-40], dtype=torch.float64)).tolist() == [8]
    # the dense draw likewise stops at the last token of mass > 0, never a zero-probability tail
    dense = torch.zeros(1, 10)
    dense[0, 3], dense[0, 8] = 0.25, 0.75
    for u in (torch.tensor([1.0 - 2.0**-40], dtype=torch.float64), torch.tensor([1.0 - 2.0**-30])):
        assert sample_from(dense, u).tolist() == [8]
    # the standard rule's host draw picks what `sample_from` picks, at the top end too
    w = [0.25, 0.75, 1e-12, 0.0]
    for u in (0.1, 0.25, 0.999, 1.0 - 2.0**-30, 1.0 - 2.0**-40):
        assert _inverse_cdf(w, u) == int(sample_from(torch.tensor([w]), torch.tensor([u], dtype=torch.float64)))


def _draft(b: int, m: int, v: int, seed: int) -> torch.Tensor:
    """Draft distributions [b, m, V] near the target's (so proposals are often kept) and one-hot rows."""
    q = probabilities(_logits(b, m, v, seed=seed), *_settings(b, 0.8, 0.95))
    onehot = torch.zeros_like(q).scatter_(-1, q.argmax(-1, keepdim=True), 1.0)
    return torch.where(torch.arange(b)[:, None, None] == 0, onehot, q)


def _rule_draws(q: torch.Tensor, g: torch.Generator, ragged: bool
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Proposals drawn from q [b, m, V], the standard rule's accept and bonus uniforms, and a
    ragged limit per row (None unless `ragged`), all from g."""
    b, m = q.shape[:2]
    proposals = sample_from(q, torch.rand(b, m, generator=g, dtype=torch.float64))
    accept_u = torch.rand(b, m, generator=g, dtype=torch.float64)
    bonus_u = torch.rand(b, m + 1, generator=g, dtype=torch.float64)
    return proposals, accept_u, bonus_u, torch.randint(0, m + 1, (b,), generator=g) if ragged else None


@pytest.mark.parametrize("ragged", [False, True])
def test_the_standard_rule_decides_the_same(ragged: bool) -> None:
    b, m, v = 5, 4, 600
    outcomes = set()
    for trial in range(80):
        g = torch.Generator().manual_seed(trial)
        x = _logits(b, m + 1, v, seed=1000 + trial, strong=3, spread=3.0)
        settings = _settings(b, 0.8, 0.95)
        pairs = nucleus_pairs(x, *settings)
        p = probabilities(x, *settings)
        q = _draft(b, m, v, seed=1000 + trial)  # target-like but different logits: some kept, some not
        q = 0.5 * q + 0.5 * p[:, :m]
        proposals, accept_u, bonus_u, limit = _rule_draws(q, g, ragged)
        got = verify_standard(proposals, pairs, q, accept_u, bonus_u, limit)
        want = verify_standard(proposals, p, q, accept_u, bonus_u, limit)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        outcomes.update(got[0].tolist())
    assert len(outcomes) >= 3  # rejections at several positions, and acceptances, were compared
    pairs0, p0 = nucleus_pairs(x[:, :1], *settings), probabilities(x[:, :1], *settings)
    empty = torch.zeros(b, 0, dtype=torch.long)
    got = verify_standard(empty, pairs0, q[:, :0], accept_u[:, :0], bonus_u[:, :1])
    want = verify_standard(empty, p0, q[:, :0], accept_u[:, :0], bonus_u[:, :1])
    assert torch.equal(got[1], want[1]) and not bool(got[0].any())


def _target_and_draft(b: int, m: int, v: int, seed: int
                      ) -> tuple[SparseProbs, torch.Tensor, SparseProbs, torch.Tensor]:
    """The target's p at m + 1 positions and a draft's q at m, each as pairs and as rows (T 0.8,
    top-p 0.95): the draft's logits are the target's moved, so its nucleus overlaps p's but is
    not p's."""
    x = _logits(b, m + 1, v, seed=seed, strong=3, spread=3.0)
    settings = _settings(b, 0.8, 0.95)
    y = 0.6 * x[:, :m] + 0.4 * _logits(b, m, v, seed=seed + 1000, strong=3, spread=3.0)
    return nucleus_pairs(x, *settings), probabilities(x, *settings), nucleus_pairs(y, *settings), probabilities(y, *settings)


@pytest.mark.parametrize("ragged", [False, True])
def test_the_standard_rule_decides_the_same_with_the_drafts_q_as_pairs(ragged: bool) -> None:
    """A drafter's q shaped by temperature / top-p as pairs (how a chat request's drafts come,
    dflash/proposers/dflash_block.py): the same accepted and bonus as its vocabulary-wide rows,
    whether the target's p is pairs or rows."""
    b, m, v = 5, 4, 600
    outcomes = set()
    for trial in range(60):
        g = torch.Generator().manual_seed(trial)
        p_pairs, p, q_pairs, q = _target_and_draft(b, m, v, 2000 + trial)
        assert q_pairs is not None and torch.equal(q_pairs.dense(), q)
        proposals, accept_u, bonus_u, limit = _rule_draws(q, g, ragged)
        want = verify_standard(proposals, p, q, accept_u, bonus_u, limit)
        for target in (p_pairs, p):
            got = verify_standard(proposals, target, q_pairs, accept_u, bonus_u, limit)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        outcomes.update(want[0].tolist())
    assert len(outcomes) >= 3  # rejections at several positions, and acceptances, were compared


@pytest.mark.parametrize("ragged", [False, True])
def test_the_standard_rules_kernel_decides_as_the_host(ragged: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """`verify_standard_keyed` over pairs (cpu/csrc/standard_rule.c): the accepted and bonus of
    the host's rule over the same pairs and of the vocabulary-wide rows, with the uniforms of each
    position's key, for drafts from q and for lookup's point masses."""
    from blockspec.dflash.batch import _one_hot_where

    b, m, v = 5, 4, 600
    calls, real = [], kernels.standard_rule
    monkeypatch.setattr(kernels, "standard_rule", lambda *a: calls.append(1) or real(*a))
    outcomes = set()
    for trial in range(80):
        g = torch.Generator().manual_seed(trial)
        p_pairs, p, q_pairs, q = _target_and_draft(b, m, v, 4000 + trial)
        proposals, _, _, limit = _rule_draws(q, g, ragged)
        if trial % 3 == 0:  # lookup proposed some rows' first positions: point masses there
            looked = torch.randint(0, m + 1, (b,), generator=g).tolist()
            proposals = torch.where(torch.arange(m)[None] < torch.tensor(looked)[:, None],
                                    torch.randint(0, v, (b, m), generator=g), proposals)
            q_pairs, q = _one_hot_where(q_pairs, proposals, looked), _one_hot_where(q, proposals, looked)
        keys = RowRandom([trial, -trial, 2**62 + trial, 7, trial * 31]).keys([0, 5, trial, 2**30, 9], m + 1)
        got = verify_standard_keyed(proposals, p_pairs, q_pairs, keys, limit)
        with monkeypatch.context() as patch:
            patch.setattr(kernels, "standard_rule", lambda *a: None)
            host = verify_standard_keyed(proposals, p_pairs, q_pairs, keys, limit)
            rows = verify_standard_keyed(proposals, p, q, keys, limit)
        for want in (host, rows):
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        outcomes.update(got[0].tolist())
    assert len(calls) == 80  # the kernel decided every step
    assert len(outcomes) >= 3  # rejections at several positions, and acceptances, were compared


def test_lookup_proposals_replace_a_pairs_q_by_their_point_masses() -> None:
    """Where n-gram lookup proposed a row's first positions, the standard rule tests them against
    point masses: the pairs say what the vocabulary-wide rows say."""
    from blockspec.dflash.batch import _one_hot_where

    b, n, v = 3, 4, 50
    settings = _settings(b, 0.8, 0.95)
    y = _logits(b, n, v, seed=7)
    pairs, q = nucleus_pairs(y, *settings), probabilities(y, *settings)
    proposals = torch.randint(0, v, (b, n), generator=torch.Generator().manual_seed(1))
    looked = [0, 2, 4]
    got = _one_hot_where(pairs, proposals, looked)
    assert torch.equal(got.dense(), _one_hot_where(q, proposals, looked))
    assert not torch.equal(got.dense(), q)
    # a lookup step's (no draft): the point masses alone, zero past each row's looked-up positions
    alone = _one_hot_where(None, proposals, looked, v)
    kept = (torch.arange(n)[None] < torch.tensor(looked)[:, None])[..., None]
    want = torch.zeros(b, n, v).scatter_(-1, proposals[..., None], 1.0) * kept
    assert isinstance(alone, SparseProbs) and alone.ids.shape == (b, n, 1)
    assert torch.equal(alone.dense(), want)
