"""Tree acceptance (dflash/tree_verify.py) on crafted target outputs: partial acceptance at every
depth and branch, equality with the chain rule (dflash/verify.py and the keyed draws DecodeBatch
verifies chains with), and planted bugs that these checks catch."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from blockspec.dflash import tree_verify
from blockspec.dflash.sampling import RowRandom, probabilities
from blockspec.dflash.token_tree import TokenTree
from blockspec.dflash.tree_verify import TreeAcceptance, node_draws, walk, walk_greedy, walk_sampled
from blockspec.dflash.verify import accept_greedy
from blockspec.errors import ConfigError

V = 24
#            0:r(20)
#        /      |      \
#     1:(3)   2:(4)   3:(5)
#     /   \      \
#  4:(6) 5:(7)  6:(6)
#   |             |
#  7:(8)        8:(9)
#   |
#  9:(10)
TREE = TokenTree((20, 3, 4, 5, 6, 7, 6, 8, 9, 10), (-1, 0, 0, 0, 1, 1, 2, 4, 6, 7))

GreedyWalk = Callable[[TokenTree, torch.Tensor], TreeAcceptance]
SampledWalk = Callable[[TokenTree, torch.Tensor, int, int], TreeAcceptance]


def logits_towards(tree: TokenTree, stop: int, bonus: int) -> torch.Tensor:
    """Target logits [n, V] whose argmax leads root -> ... -> stop, then `bonus` at stop; noise
    (and a wrong favourite) at every node off that path."""
    g = torch.Generator().manual_seed(stop * 31 + bonus)
    logits = torch.randn(len(tree), V, generator=g)
    path = tree.path(stop)
    for here, nxt in zip(path, path[1:]):
        logits[here, tree.tokens[nxt]] = 10.0
    logits[stop, bonus] = 10.0
    return logits


def every_partial_acceptance_ok(greedy: GreedyWalk, tree: TokenTree) -> bool:
    """For every node, the walk stops there with each bonus no child of it carries, and goes on
    past it for each token a child carries."""
    for stop in range(len(tree)):
        kids = tree.children(stop)
        for bonus in range(V):
            if bonus in kids:
                continue
            got = greedy(tree, logits_towards(tree, stop, bonus))
            if got.path != tuple(tree.path(stop)) or got.bonus != bonus:
                return False
    return True


def test_greedy_stops_at_every_depth_and_branch() -> None:
    assert every_partial_acceptance_ok(walk_greedy, TREE)
    full = walk_greedy(TREE, logits_towards(TREE, 9, 1))
    assert full.accepted == 4 and full.committed(TREE) == [3, 6, 8, 10, 1]
    side = walk_greedy(TREE, logits_towards(TREE, 8, 0))
    assert side.path == (0, 2, 6, 8) and side.committed(TREE) == [4, 6, 9, 0]


def test_planted_bug_first_branch_only_is_caught() -> None:
    def first_branch_only(tree: TokenTree, logits: torch.Tensor) -> TreeAcceptance:
        best = logits.argmax(-1).tolist()
        path = [0]
        while True:  # the chain rule along each node's first child: misses every other branch
            kids = [i for i in range(len(tree)) if tree.parents[i] == path[-1]]
            if not kids or tree.tokens[kids[0]] != best[path[-1]]:
                return TreeAcceptance(tuple(path), best[path[-1]])
            path.append(kids[0])

    assert not every_partial_acceptance_ok(first_branch_only, TREE)


def chain_rule_greedy(proposals: list[int], logits: torch.Tensor) -> list[int]:
    """What a plain DFlash step commits for a chain: dflash/verify.py's rule."""
    accepted, bonus = accept_greedy(torch.tensor([proposals], dtype=torch.long), logits.argmax(-1)[None])
    return proposals[: int(accepted)] + [int(bonus)]


def chain_rule_sampled(proposals: list[int], probs: torch.Tensor, seed: int, start: int) -> list[int]:
    """What a plain DFlash step commits when sampling: the target's keyed draws at output positions
    start.. (as DecodeBatch draws them), then the same acceptance."""
    best = RowRandom([seed]).sample(probs[None], [start])  # [1, m+1]
    accepted, bonus = accept_greedy(torch.tensor([proposals], dtype=torch.long), best)
    return proposals[: int(accepted)] + [int(bonus)]


def biased_logits(tree: TokenTree, seed: int, strength: float) -> torch.Tensor:
    """Random target logits that lean towards one random child at each node, so walks end at
    every depth across seeds."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(len(tree), V, generator=g)
    for i in range(len(tree)):
        kids = list(tree.children(i))
        if kids:
            logits[i, kids[int(torch.randint(len(kids), (1,), generator=g))]] += strength
    return logits


def as_good_as_the_best_chain(tree: TokenTree, logits: torch.Tensor, committed: list[int],
                              chain: Callable[[list[int], torch.Tensor], list[int]]) -> bool:
    """The tree commits what the longest-accepting of its root-to-leaf chains commits, each chain
    verified on the logits of its own nodes (which, by the tree mask, are the chain's logits)."""
    outs = [chain(tree.path_tokens(leaf), logits[tree.path(leaf)]) for leaf in tree.leaves()]
    best = max(outs, key=len)
    # every chain follows the same target tokens while it accepts: its accepted part prefixes the best
    return committed == best and all(o[:-1] == best[: len(o) - 1] for o in outs)


def test_a_chain_tree_commits_what_the_chain_rule_does() -> None:
    chain = TokenTree.chain(20, [3, 6, 8, 10])
    for seed in range(40):
        logits = biased_logits(chain, seed, strength=2.5)
        assert walk_greedy(chain, logits).committed(chain) == chain_rule_greedy([3, 6, 8, 10], logits)
        probs = probabilities(logits[None], torch.tensor([0.8]), torch.tensor([0]), torch.tensor([1.0]))[0]
        got = walk_sampled(chain, probs, seed=seed, start=7).committed(chain)
        assert got == chain_rule_sampled([3, 6, 8, 10], probs, seed, 7)


def test_greedy_tree_equals_its_best_chain() -> None:
    depths = set()
    for seed in range(60):
        logits = biased_logits(TREE, seed, strength=3.0)
        got = walk_greedy(TREE, logits)
        depths.add(got.accepted)
        assert as_good_as_the_best_chain(TREE, logits, got.committed(TREE), chain_rule_greedy)
    assert depths == {0, 1, 2, 3, 4}  # partial acceptance at every depth


def sampled_tree_ok(sampled: SampledWalk, tree: TokenTree, seeds: range) -> tuple[bool, set[int]]:
    depths = set()
    temp, top_k, top_p = torch.tensor([0.9]), torch.tensor([0]), torch.tensor([1.0])
    for seed in seeds:
        logits = biased_logits(tree, seed, strength=4.0)
        probs = probabilities(logits[None], temp, top_k, top_p)[0]
        start = seed % 5
        got = sampled(tree, probs, seed, start)
        depths.add(got.accepted)
        if not as_good_as_the_best_chain(tree, probs, got.committed(tree),
                                         lambda p, pr: chain_rule_sampled(p, pr, seed, start)):
            return False, depths
    return True, depths


def test_sampled_tree_equals_plain_decoding_draws() -> None:
    ok, depths = sampled_tree_ok(walk_sampled, TREE, range(80))
    assert ok and depths == {0, 1, 2, 3, 4}


def test_planted_bug_draws_keyed_by_node_index_are_caught(monkeypatch) -> None:
    def by_index(tree: TokenTree, probs: torch.Tensor, seed: int, start: int) -> torch.Tensor:
        # keyed by the node's place in the block, as a chain's positions are: wrong for a tree
        return RowRandom([seed]).sample(probs[None], [start])[0]

    monkeypatch.setattr(tree_verify, "node_draws", by_index)
    ok, _ = sampled_tree_ok(tree_verify.walk_sampled, TREE, range(80))
    assert not ok


def test_node_draws_share_a_position_per_depth() -> None:
    probs = torch.softmax(torch.randn(len(TREE), V, generator=torch.Generator().manual_seed(3)), -1)
    same = probs.clone()
    same[1:4] = probs[1]  # the depth-1 nodes with one distribution: one output position, one draw
    draws = node_draws(TREE, same, seed=11, start=2)
    assert draws[1] == draws[2] == draws[3]
    plain = RowRandom([11]).sample(probs[None, [0, 1]], [2])[0]  # the chain root -> node 1
    assert node_draws(TREE, probs, 11, 2)[[0, 1]].tolist() == plain.tolist()


def test_bad_inputs_are_refused() -> None:
    with pytest.raises(ConfigError, match="target tokens"):
        walk(TREE, [1, 2])
    with pytest.raises(ConfigError, match="nodes=10"):
        node_draws(TREE, torch.ones(3, V), 0, 0)


# ---- chi-square: unseeded requests (a fresh seed each) follow the target's distribution ----------

SMALL_V = 5
SMALL = TokenTree((0, 1, 2, 3, 4, 2, 0), (-1, 0, 0, 0, 1, 1, 2))  # 3 children, then 2 and 1 grandchildren


def toy_probs(prefix: tuple[int, ...]) -> torch.Tensor:
    """A toy target's p(. | prefix) [SMALL_V]: a fixed function of the prefix."""
    g = torch.Generator().manual_seed(hash(prefix) % 2**31)
    return torch.softmax(torch.randn(SMALL_V, generator=g) * 1.5, dim=-1)


def node_probs(tree: TokenTree) -> torch.Tensor:
    """[n, SMALL_V]: the toy target at each node, given the tokens from the root to it."""
    return torch.stack([toy_probs(tuple(tree.tokens[i] for i in tree.path(node))) for node in range(len(tree))])


def first_two_counts(sampled: SampledWalk, draws: int) -> torch.Tensor:
    """Counts [V, V] of the first two output tokens: the tree step's, and where it committed only
    one, the next plain step's draw (what decoding would do next)."""
    probs = node_probs(SMALL)
    counts = torch.zeros(SMALL_V, SMALL_V)
    for seed in range(draws):
        out = sampled(SMALL, probs, seed, 0).committed(SMALL)
        if len(out) < 2:
            nxt = toy_probs((SMALL.tokens[0], out[0]))
            out.append(int(RowRandom([seed]).sample(nxt[None, None], [1])[0, 0]))
        counts[out[0], out[1]] += 1
    return counts


def toy_joint() -> torch.Tensor:
    first = toy_probs((SMALL.tokens[0],))
    return torch.stack([first[a] * toy_probs((SMALL.tokens[0], a)) for a in range(SMALL_V)]).double()


def test_sampled_tree_follows_the_target_distribution() -> None:
    from support import chi2_pvalue

    assert chi2_pvalue(first_two_counts(walk_sampled, 3000), toy_joint()) > 1e-3


def test_chi_square_catches_a_lossy_tree_rule() -> None:
    from support import chi2_pvalue

    def greedy_for_children(tree: TokenTree, probs: torch.Tensor, seed: int, start: int) -> TreeAcceptance:
        got = walk_sampled(tree, probs, seed, start)
        if got.accepted == 0:  # the draw missed every child: take the target's likeliest child anyway
            kids = tree.children(0)
            best = max(kids, key=lambda t: float(probs[0, t]))
            return TreeAcceptance((0, kids[best]), int(node_draws(tree, probs, seed, start)[kids[best]]))
        return got

    assert chi2_pvalue(first_two_counts(greedy_for_children, 3000), toy_joint()) < 1e-3
