"""Proposers (dflash/proposers/): chain, best-first tree, lookup branch and DFlash 2 walk, on
crafted distributions, against exhaustive enumeration and the selector's own walk."""

from __future__ import annotations

import math

import pytest
import torch

from blockspec.dflash.proposers import (
    BestFirstProposer,
    ChainProposer,
    Draft,
    LookupProposer,
    PositionDistributions,
    SelectorDistributions,
    SelectorWalkProposer,
)
from blockspec.dflash.selector import CandidateSelector
from blockspec.dflash.token_tree import TokenTree
from blockspec.errors import ConfigError

ROOT = 99


def position_dists(depth: int, k: int, seed: int) -> PositionDistributions:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(depth, 40, generator=g) * 2.0
    return PositionDistributions.from_logits(logits, k)


class TableDistributions:
    """Conditional distributions: at each depth k candidates whose ids and probabilities depend
    on the token before (a crafted stand-in for a selector)."""

    def __init__(self, depth: int, k: int, seed: int) -> None:
        self.max_depth, self.k, self.seed = depth, k, seed

    def children(self, depth: int, prev: int) -> tuple[list[int], list[float]]:
        g = torch.Generator().manual_seed(self.seed * 100_003 + depth * 1009 + prev)
        ids = torch.randperm(50, generator=g)[: self.k]
        logp, order = torch.log_softmax(torch.randn(self.k, generator=g) * 2.0, dim=-1).sort(descending=True)
        return ids[order].tolist(), logp.tolist()


def all_paths(dists, root: int, depth: int) -> dict[tuple[int, ...], float]:
    """Every root path up to `depth` with its log-probability (the sum along it)."""
    out: dict[tuple[int, ...], float] = {}
    frontier = [((), 0.0, root)]
    for d in range(1, depth + 1):
        nxt = []
        for path, score, prev in frontier:
            for tok, lp in zip(*dists.children(d, prev)):
                out[(*path, tok)] = score + lp
                nxt.append(((*path, tok), score + lp, tok))
        frontier = nxt
    return out


def node_paths(tree: TokenTree) -> set[tuple[int, ...]]:
    return {tuple(tree.path_tokens(i)) for i in range(1, len(tree))}


@pytest.mark.parametrize("kind", ["position", "conditional"])
@pytest.mark.parametrize("seed", range(4))
def test_best_first_takes_the_most_likely_paths(kind: str, seed: int) -> None:
    depth, k = 4, 3
    dists = position_dists(depth, k, seed) if kind == "position" else TableDistributions(depth, k, seed)
    scores = all_paths(dists, ROOT, depth)
    ranked = sorted(scores.values(), reverse=True)
    for budget in (1, 2, 3, 5, 7, 15, 30):
        tree = BestFirstProposer(budget).propose(Draft(ROOT, dists))
        assert len(tree) == budget + 1 and tree.tokens[0] == ROOT
        got = node_paths(tree)
        # the chosen paths are the `budget` best (random scores: no ties at the cut)
        assert sorted((scores[p] for p in got), reverse=True) == pytest.approx(ranked[:budget])
        assert all(p[:-1] in got or len(p) == 1 for p in got)  # closed under ancestors


def test_best_first_respects_max_depth_and_short_distributions() -> None:
    dists = position_dists(6, 1, 0)
    assert BestFirstProposer(10, max_depth=3).propose(Draft(ROOT, dists)).max_depth == 3
    assert len(BestFirstProposer(10).propose(Draft(ROOT, dists))) == 7  # 6 depths of one candidate
    assert BestFirstProposer(0).propose(Draft(ROOT, None)) == TokenTree.chain(ROOT, [])


@pytest.mark.parametrize("seed", range(3))
def test_budget_along_first_choices_is_the_chain(seed: int) -> None:
    wide = position_dists(8, 4, seed)
    top1 = PositionDistributions(wide.ids[:, :1], wide.logprobs[:, :1])
    chain = ChainProposer(5).propose(Draft(ROOT, wide))
    assert chain == TokenTree.chain(ROOT, wide.ids[:5, 0].tolist())
    assert BestFirstProposer(5).propose(Draft(ROOT, top1)) == chain
    # a confident drafter (first choices near certain): the best-first tree is that chain too
    sharp = PositionDistributions(wide.ids, torch.tensor([[-1e-4, -12.0, -13.0, -14.0]] * 8))
    assert BestFirstProposer(5).propose(Draft(ROOT, sharp)) == chain


def test_best_first_branches_where_the_drafter_hesitates() -> None:
    ids = torch.tensor([[1, 2], [3, 4], [5, 6]])
    lp = torch.tensor([[math.log(0.5), math.log(0.45)], [math.log(0.9), math.log(0.1)], [math.log(0.9), math.log(0.1)]])
    tree = BestFirstProposer(4).propose(Draft(ROOT, PositionDistributions(ids, lp)))
    # .5 (1), .45 (2), .45 (1,3), .405 (2,3): both first choices, each continued by its best child
    assert node_paths(tree) == {(1,), (2,), (1, 3), (2, 3)}
    assert tree.tokens == (ROOT, 1, 2, 3, 3) and tree.parents == (-1, 0, 0, 1, 2)


def test_lookup_branch_is_merged_with_dedup() -> None:
    dists = position_dists(4, 2, 1)
    inner = BestFirstProposer(3)
    base = inner.propose(Draft(ROOT, dists))
    first = base.path_tokens(1)
    merged = LookupProposer(inner, 4).propose(Draft(ROOT, dists, lookup=[*first, 7, 8, 9, 10]))
    assert len(merged) == len(base) + 3  # the shared first token once; 4 tokens at most
    assert tuple([*first, 7, 8, 9]) in node_paths(merged) and node_paths(base) <= node_paths(merged)
    assert LookupProposer(inner, 4).propose(Draft(ROOT, dists)) == base  # no continuation: the tree
    assert LookupProposer(None, 2).propose(Draft(ROOT, None, lookup=[5, 6, 7])) == TokenTree.chain(ROOT, [5, 6])


def tiny_selector(seed: int, vocab: int = 30, hidden: int = 8, k: int = 4, depth: int = 5):
    g = torch.Generator().manual_seed(seed)
    sel = CandidateSelector(hidden, vocab, rank=6, top_k=k)
    with torch.no_grad():
        sel.hidden_projection.weight.copy_(torch.randn(6, hidden, generator=g))
        sel.predecessor_codebook.copy_(torch.randn(vocab, 6, generator=g))
        sel.successor_codebook.copy_(torch.randn(vocab, 6, generator=g))
    h = torch.randn(depth, hidden, generator=g)
    logits = torch.randn(depth, vocab, generator=g) * 2
    top, ids = logits.topk(k, dim=-1)
    return SelectorDistributions(sel, h, ids, top)


@pytest.mark.parametrize("seed", range(5))
def test_dflash2_walk_is_the_chain_over_conditional_scores(seed: int) -> None:
    dists = tiny_selector(seed)
    root = seed + 1
    walk = SelectorWalkProposer(5).propose(Draft(root, dists))
    assert walk.is_chain() and len(walk) == 6
    assert walk == ChainProposer(5).propose(Draft(root, dists))
    # the walk depends on the root (the predecessor of its first step), unlike a DFlash chain
    assert any(SelectorWalkProposer(5).propose(Draft(r, dists)).tokens[1:] != walk.tokens[1:] for r in range(10, 20))


@pytest.mark.parametrize("seed", range(3))
def test_dflash2_tree_follows_conditional_path_scores(seed: int) -> None:
    dists = tiny_selector(seed, depth=3)
    scores = all_paths(dists, 3, 3)
    ranked = sorted(scores.values(), reverse=True)
    tree = BestFirstProposer(9).propose(Draft(3, dists))
    assert sorted((scores[p] for p in node_paths(tree)), reverse=True) == pytest.approx(ranked[:9])
    # the conditional scores matter: a child of a different parent gets another distribution
    a, b = dists.children(2, tree.tokens[1]), dists.children(2, tree.tokens[1] + 1)
    assert a != b


def test_dflash2_tree_on_the_unary_scale() -> None:
    """With the unary normaliser a node's probability is its score's share of the unary
    distribution (the rest of the vocabulary keeping its mass): a selector whose transitions are
    0 scores every node as the DFlash tree over the same logits, and grows the same tree; without
    it, the softmax over the K candidates alone overrates each node."""
    dists = tiny_selector(0, depth=4)
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 30, generator=g) * 2
    top, ids = logits.topk(4, dim=-1)
    with torch.no_grad():
        dists.selector.hidden_projection.weight.zero_()
    silent = SelectorDistributions(dists.selector, dists.hidden, ids, top, logits.logsumexp(-1))
    plain = PositionDistributions.from_logits(logits, 4)
    for depth in (1, 3):
        kids, logp = silent.children(depth, 7)
        want_kids, want_logp = plain.children(depth, 7)
        assert kids == want_kids and logp == pytest.approx(want_logp, abs=1e-5)
        assert sum(math.exp(x) for x in logp) < 1.0  # the top K hold part of the mass only
    assert BestFirstProposer(9).propose(Draft(3, silent)) == BestFirstProposer(9).propose(Draft(3, plain))
    renormalised = SelectorDistributions(dists.selector, dists.hidden, ids, top)
    assert sum(math.exp(x) for x in renormalised.children(1, 7)[1]) == pytest.approx(1.0)
    trained = SelectorDistributions(tiny_selector(0, depth=4).selector, dists.hidden, ids, top, logits.logsumexp(-1))
    assert trained.children(2, 7) != silent.children(2, 7)  # transitions re-rank and re-weigh


def test_bad_settings_are_refused() -> None:
    for make in (lambda: ChainProposer(-1), lambda: BestFirstProposer(-1), lambda: BestFirstProposer(3, max_depth=0),
                 lambda: LookupProposer(None, -1), lambda: SelectorWalkProposer(-1)):
        with pytest.raises(ConfigError):
            make()
    with pytest.raises(ConfigError, match="distributions"):
        ChainProposer(3).propose(Draft(ROOT, None))
    with pytest.raises(ConfigError, match="selector"):
        SelectorWalkProposer(3).propose(Draft(ROOT, position_dists(3, 2, 0)))
    with pytest.raises(ConfigError, match="depth, k"):
        PositionDistributions(torch.zeros(3, 2, dtype=torch.long), torch.zeros(3))
