"""TokenTree: validation, the ancestor mask, positions, and building from paths (shared prefixes)."""

from __future__ import annotations

import pytest
import torch

from blockspec.dflash.token_tree import TokenTree
from blockspec.errors import ConfigError

#        0:r
#      /     \
#    1:a     2:b
#   /   \      \
#  3:c  4:d    5:e
#  |
#  6:f
TREE = TokenTree((9, 10, 11, 12, 13, 14, 15), (-1, 0, 0, 1, 1, 2, 3))


def test_depths_positions_paths() -> None:
    assert TREE.depths == (0, 1, 1, 2, 2, 2, 3)
    assert TREE.positions(40) == [40, 41, 41, 42, 42, 42, 43]
    assert TREE.path(6) == [0, 1, 3, 6] and TREE.path_tokens(6) == [10, 12, 15]
    assert TREE.children(1) == {12: 3, 13: 4} and TREE.children(6) == {}
    assert TREE.leaves() == [4, 5, 6]
    assert TREE.paths() == [[10, 13], [11, 14], [10, 12, 15]]
    assert TREE.max_depth == 3 and not TREE.is_chain()


def test_ancestor_mask_sees_ancestors_and_self_only() -> None:
    mask = TREE.ancestor_mask()
    want = torch.zeros(7, 7, dtype=torch.bool)
    for i, anc in {0: [0], 1: [0, 1], 2: [0, 2], 3: [0, 1, 3], 4: [0, 1, 4], 5: [0, 2, 5], 6: [0, 1, 3, 6]}.items():
        want[i, anc] = True
    assert torch.equal(mask, want)
    assert not mask[3, 4] and not mask[4, 3] and not mask[5, 3]  # siblings and cousins stay apart


def test_chain_is_the_one_child_tree() -> None:
    chain = TokenTree.chain(5, [6, 7, 8])
    assert chain.is_chain() and chain.parents == (-1, 0, 1, 2) and chain.depths == (0, 1, 2, 3)
    assert torch.equal(chain.ancestor_mask(), torch.ones(4, 4, dtype=torch.bool).tril())
    assert TokenTree.chain(5, []).tokens == (5,)


@pytest.mark.parametrize("tokens, parents, why", [
    ((), (), "at least its root"),
    ((1, 2), (-1,), "parents"),
    ((1, 2), (0, 0), "node 0 is the root"),
    ((1, 2, 3), (-1, 2, 0), "does not precede"),
    ((1, 2, 3, 4), (-1, 0, 1, 0), "not breadth-first"),
    ((1, 2, 2), (-1, 0, 0), "two children with token 2"),
])
def test_bad_trees_are_refused(tokens, parents, why) -> None:
    with pytest.raises(ConfigError, match=why):
        TokenTree(tokens, parents)


def test_from_paths_shares_prefixes_in_breadth_first_order() -> None:
    tree = TokenTree.from_paths(9, [[10, 12, 15], [10, 13], [11, 14], [10, 12]])
    assert tree == TREE  # same nodes, same canonical order
    assert TokenTree.from_paths(9, []) == TokenTree.chain(9, [])


def test_merge_adds_only_the_new_part_of_a_branch() -> None:
    merged = TREE.merge([10, 12, 15, 16, 17])
    assert len(merged) == len(TREE) + 2
    assert merged.tokens[: len(TREE)] == TREE.tokens and merged.parents[: len(TREE)] == TREE.parents
    assert merged.path_tokens(len(merged) - 1) == [10, 12, 15, 16, 17]
    assert TREE.merge([10, 13]) == TREE  # already there
    new = TREE.merge([20, 21])
    assert sorted(new.paths()) == sorted([*TREE.paths(), [20, 21]])
    assert new.children(0) == {10: 1, 11: 2, 20: 3}  # after the root's own children
