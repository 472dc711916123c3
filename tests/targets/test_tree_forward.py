"""The Hugging Face adapter's tree pass: every node's logits and features are those of its
root-to-node chain run plainly, in a ragged batch; after keeping the accepted path the cache
decodes on as if only that chain had been verified; a planted mask bug (a node that sees a
sibling) is caught; recurrent targets refuse trees."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_target
from support import one_thread  # noqa: F401 (fixture)

from blockspec.dflash.token_tree import TokenTree
from blockspec.errors import ConfigError
from blockspec.targets import tree_mask
from blockspec.targets.hf import HFTarget
from blockspec.targets.slots import EMPTY

VOCAB = 64
LAYERS = (1, 3)
TOL = dict(atol=2e-5, rtol=2e-5)  # fp32: same sums over a different key order and mask
#            0
#        /   |   \
#       1    2    3
#      / \    \
#     4   5    6
#     |        |
#     7        8
#     |
#     9
TREE = TokenTree((20, 3, 4, 5, 6, 7, 6, 8, 9, 10), (-1, 0, 0, 0, 1, 1, 2, 4, 6, 7))
CHAIN = TokenTree.chain(11, [12, 13, 14, 15, 16, 17, 18, 19, 21])
PROMPTS = [list(range(30, 39)), [40, 41, 42, 43, 44]]  # 9 and 5 tokens: row 1 is left-padded

_MODELS: dict[str, object] = {}


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: thread hand-offs cost more than the work


def model_of(family: str):
    if family not in _MODELS:
        _MODELS[family] = make_tiny_target(family, seed=3, dtype=torch.float32, hidden_size=64,
                                           intermediate_size=128, vocab_size=VOCAB)
    return _MODELS[family]


def prefilled(target: HFTarget, prompts: list[list[int]]):
    """A cache holding the prompts, left-padded to one width (empty slots)."""
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    pos = torch.tensor([[EMPTY] * (width - len(p)) + list(range(len(p))) for p in prompts])
    cache = target.new_cache(len(prompts))
    target.forward(ids, pos, cache)
    return cache


def chain_outputs(target: HFTarget, prompt: list[int], tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits [len, V] and features [len, F] of `tokens` decoded as a plain chain after the prompt."""
    cache = prefilled(target, [prompt])
    n = len(prompt)
    logits, feats = target.forward(torch.tensor([tokens]), torch.arange(n, n + len(tokens))[None], cache, LAYERS)
    return logits[0], feats[0]


def chain_reference(target: HFTarget, prompt: list[int], tree: TokenTree) -> tuple[torch.Tensor, torch.Tensor]:
    """Per node [n, V] and [n, F]: the outputs at its last token of its root-to-node chain (one
    chain per leaf serves every node on the way to it)."""
    logits, feats = [None] * len(tree), [None] * len(tree)
    for leaf in tree.leaves():
        path = tree.path(leaf)
        lg, ft = chain_outputs(target, prompt, [tree.tokens[i] for i in path])
        for j, node in enumerate(path):
            logits[node], feats[node] = lg[j], ft[j]
    return torch.stack(logits), torch.stack(feats)


def tree_pass(target: HFTarget, ancestors: torch.Tensor | None = None):
    trees = [TREE, CHAIN]
    cache = prefilled(target, PROMPTS)
    ids = torch.tensor([list(t.tokens) for t in trees])
    pos = torch.tensor([t.positions(len(p)) for t, p in zip(trees, PROMPTS)])
    if ancestors is None:
        ancestors = torch.stack([t.ancestor_mask() for t in trees])
    logits, feats = target.forward_tree(ids, pos, ancestors, cache, LAYERS)
    return trees, cache, logits, feats


def worst_node_error(target: HFTarget, trees, logits: torch.Tensor) -> float:
    return max(float((logits[row, : len(tree)] - chain_reference(target, prompt, tree)[0]).abs().max())
               for row, (tree, prompt) in enumerate(zip(trees, PROMPTS)))


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3", "gpt_oss"])
def test_each_node_is_its_chain(family: str) -> None:
    target = HFTarget(model_of(family))
    trees, _, logits, feats = tree_pass(target)
    for row, (tree, prompt) in enumerate(zip(trees, PROMPTS)):
        want_logits, want_feats = chain_reference(target, prompt, tree)
        torch.testing.assert_close(logits[row], want_logits, **TOL)
        torch.testing.assert_close(feats[row], want_feats, **TOL)
        assert torch.equal(logits[row].argmax(-1), want_logits.argmax(-1))  # greedy picks alike


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_after_the_walk_the_cache_holds_the_accepted_chain(family: str) -> None:
    target = HFTarget(model_of(family))
    trees, cache, _, _ = tree_pass(target)
    paths = [TREE.path(9), CHAIN.path(4)]  # row 0 goes down the first branch to depth 4; row 1 stops at 4
    keep = torch.zeros(2, len(TREE), dtype=torch.bool)
    for row, path in enumerate(paths):
        keep[row, path] = True
    cache.reject(keep)
    nxt = torch.tensor([[50], [51]])
    pos = torch.tensor([[len(PROMPTS[r]) + len(paths[r])] for r in range(2)])
    logits, _ = target.forward(nxt, pos, cache, LAYERS)
    for row, (tree, path) in enumerate(zip(trees, paths)):
        want, _ = chain_outputs(target, PROMPTS[row], [tree.tokens[i] for i in path] + [int(nxt[row, 0])])
        torch.testing.assert_close(logits[row, 0], want[-1], **TOL)


def test_planted_mask_bug_a_node_that_sees_a_sibling_is_caught() -> None:
    target = HFTarget(model_of("llama"))
    trees, _, logits, _ = tree_pass(target)
    assert worst_node_error(target, trees, logits) < 2e-5
    ancestors = torch.stack([t.ancestor_mask() for t in trees])
    ancestors[0, 5, 4] = True  # node 5 also sees its sibling 4
    trees, _, bad, _ = tree_pass(target, ancestors)
    assert worst_node_error(target, trees, bad) > 1e-3


def test_planted_mask_bug_positional_rule_alone_is_caught(monkeypatch) -> None:
    target = HFTarget(model_of("qwen3"))

    def positions_only(slots, positions, ancestors, *, sliding_window=None):
        return slots.attention_mask(positions, causal=True, sliding_window=sliding_window)

    monkeypatch.setattr("blockspec.targets.hf.tree_visibility", positions_only)
    trees, _, bad, _ = tree_pass(target)
    assert worst_node_error(target, trees, bad) > 1e-3


def test_recurrent_targets_refuse_trees() -> None:
    target = HFTarget(make_tiny_target("qwen3_5_text", seed=1, dtype=torch.float32))
    cache = target.new_cache(1)
    with pytest.raises(ConfigError, match="one state per branch"):
        target.forward_tree(torch.tensor([list(TREE.tokens)]), torch.tensor([TREE.positions(0)]),
                            TREE.ancestor_mask(), cache)


def test_bad_tree_shapes_are_refused() -> None:
    target = HFTarget(model_of("llama"))
    cache = prefilled(target, PROMPTS)
    with pytest.raises(ConfigError, match="ancestors"):
        target.forward_tree(torch.zeros(2, 10, dtype=torch.long), torch.zeros(2, 10, dtype=torch.long),
                            torch.ones(9, 9, dtype=torch.bool), cache)
    with pytest.raises(ConfigError, match="fewer than"):
        tree_mask.tree_visibility(cache.slots, torch.zeros(2, 99, dtype=torch.long), torch.ones(99, 99))
