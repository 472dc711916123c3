"""The host side of a token-tree step (dflash/tree_step.py, proposers/base.py): the batch's trees
packed into one verify pass's tensors, each row's tree built once, and the drafter's top-k read
back for the whole batch at once, each equal to the plain per-row construction it replaces; and
a tree step runs the drafter's head once (no chain proposals beside the tree's top-k)."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_target
from scripted import RankedDrafter
from support import one_thread, ragged_prompts, reference_greedy  # noqa: F401 (fixture)

from blockspec.config import SamplingParams
from blockspec.dflash.batch import DecodeBatch
from blockspec.dflash.trim import Shape
from blockspec.dflash.row import make_row
from blockspec.dflash.drafter import new_drafter_for_target
from blockspec.dflash.drafter_config import DFLASH2
from blockspec.dflash.proposers import BestFirstProposer, Draft, LookupProposer, PositionDistributions
from blockspec.dflash.token_tree import TokenTree
from blockspec.dflash.tree_step import gather_path, pack_trees, propose_tree
from blockspec.targets.hf import HFTarget
from blockspec.targets.slots import EMPTY

pytestmark = pytest.mark.usefixtures("one_thread")

NEG = float("-inf")


def random_dists(seed: int, depth: int = 6, k: int = 4, *, ties: bool = False, dead: bool = False
                 ) -> PositionDistributions:
    """Top-k of random draft distributions; `ties`: log-probabilities from a coarse grid, so
    paths tie; `dead`: some candidates of probability 0 (log-probability -inf)."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(depth, 50, generator=gen) * 3
    if ties:
        logits = (logits * 2).round() / 2
    dists = PositionDistributions.from_logits(logits, k)
    if dead:
        lp = dists.logprobs.clone()
        lp[torch.rand(depth, k, generator=gen) < 0.3] = NEG
        lp[:, 0] = dists.logprobs[:, 0]  # every depth keeps its best candidate
        lp = lp.sort(dim=-1, descending=True).values
        dists = PositionDistributions(dists.ids, lp)
    return dists


def trees_of(seed: int) -> list[TokenTree]:
    trees = [TokenTree.chain(7, []), TokenTree.chain(3, [4, 5, 6]), TokenTree((9, 1, 2, 3, 4, 5), (-1, 0, 0, 0, 1, 2))]
    for budget, ties, dead in ((5, False, False), (11, True, False), (15, False, True)):
        trees.append(BestFirstProposer(budget).propose(Draft(2, random_dists(seed + budget, ties=ties, dead=dead))))
    return trees


@pytest.mark.parametrize("seed", range(4))
def test_packed_trees_hold_each_trees_tokens_positions_and_ancestor_mask(seed: int) -> None:
    trees = trees_of(seed)
    cur = [10 + 3 * r for r in range(len(trees))]
    packed = pack_trees(trees, cur, "cpu")
    n = max(map(len, trees))
    assert packed.ids.shape == packed.positions.shape == packed.padding.shape == (len(trees), n)
    assert packed.ancestors.shape == (len(trees), n, n) and packed.ancestors.dtype == torch.bool
    for r, (tree, c) in enumerate(zip(trees, cur)):
        m = len(tree)
        assert packed.ids[r, :m].tolist() == list(tree.tokens) and packed.ids[r, m:].eq(0).all()
        assert packed.positions[r].tolist() == tree.positions(c) + [EMPTY] * (n - m)
        assert packed.padding[r].tolist() == [False] * m + [True] * (n - m)
        assert torch.equal(packed.ancestors[r, :m, :m], tree.ancestor_mask())
        assert not packed.ancestors[r, m:].any() and not packed.ancestors[r, :, m:].any()


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("dead", [False, True])
def test_a_tree_without_a_lookup_branch_is_the_best_first_tree_built_once(seed: int, ties: bool, dead: bool) -> None:
    dists = random_dists(seed, ties=ties, dead=dead)
    for budget in (0, 1, 3, 7, 15, 40):
        inner = BestFirstProposer(budget, max_depth=dists.max_depth)
        grown_with_the_branch_rule = LookupProposer(inner, 0).propose(Draft(5, dists, []))
        assert propose_tree(5, dists, [], budget) == grown_with_the_branch_rule == inner.propose(Draft(5, dists))


def test_a_batch_of_position_distributions_equals_one_per_row() -> None:
    gen = torch.Generator().manual_seed(0)
    logp = torch.log_softmax(torch.randn(3, 5, 30, generator=gen), dim=-1)
    top, ids = logp.topk(4, dim=-1)
    top[1, 2, 1:] = NEG  # a position where the drafter rules out all but one candidate
    top[2, 0, 3] = NEG
    batch = PositionDistributions.batch(ids, top)
    assert len(batch) == 3
    for i, dist in enumerate(batch):
        one = PositionDistributions(ids[i], top[i])
        assert dist.max_depth == one.max_depth == 5
        for depth in range(1, 6):
            assert dist.children(depth, 0) == one.children(depth, 0)
    assert batch[1].children(3, 0)[0] == [int(ids[1, 2, 0])]
    assert len(batch[2].children(1, 0)[0]) == 3


def test_a_tree_step_runs_the_drafters_head_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A greedy tree step reads its tree from the drafter's top-k alone: no chain proposals (and
    no second pass over the draft head) beside it; the output stays plain greedy decoding."""
    model = make_tiny_target("llama", seed=0)
    prompts = ragged_prompts(2, seed=17, vocab=48)
    truth = [reference_greedy(model, p, 12) for p in prompts]
    drafter = RankedDrafter(model, prompts, truth, seed=0)
    calls: list[str] = []
    for name in ("greedy_tokens", "greedy_with_confidence", "logits", "top_logprobs"):
        method = getattr(drafter, name)
        monkeypatch.setattr(drafter, name, lambda *a, _n=name, _m=method, **k: calls.append(_n) or _m(*a, **k))
    batch = DecodeBatch(HFTarget(model), drafter, max_block=8, tree_nodes=7)
    rows = [make_row(i, len(p), SamplingParams(max_new_tokens=12), (), 8) for i, p in enumerate(prompts)]
    batch.join(prompts, rows)
    tree_steps = 0
    while batch.rows:
        batch.retire()
        if batch.rows:
            calls.clear()
            before = sum(r.stats.tree_steps for r in rows)
            drafts = max(r.remaining for r in batch.rows) > 1  # the last steps are plain (one token left)
            batch.step(8)
            tree_steps += sum(r.stats.tree_steps for r in rows) > before  # a tree that is a chain verifies as one
            assert calls.count("top_logprobs") == int(drafts), calls
            assert "greedy_tokens" not in calls and "greedy_with_confidence" not in calls, calls
    assert tree_steps > 1 and [r.generated for r in rows] == truth


@pytest.mark.parametrize("dflash2", [False, True])
def test_a_step_offered_trees_reads_its_chain_from_the_same_head_pass(monkeypatch: pytest.MonkeyPatch,
                                                                       dflash2: bool) -> None:
    """A trimmed greedy step offered trees runs the drafter's head once and, where its trim
    answers with a chain, verifies the chain a chains-only batch verifies (DFlash: the top-k's
    first column; DFlash 2: the selector's walk over the candidates its trees grow from), trimmed
    by the same confidences; the output stays plain greedy decoding's."""
    model = make_tiny_target("llama", seed=0)
    prompts = ragged_prompts(2, seed=17, vocab=48)
    truth = [reference_greedy(model, p, 12) for p in prompts]
    runs = []
    for tree_nodes in (0, 7):
        if dflash2:
            drafter = new_drafter_for_target(model.config, mask_token_id=model.config.vocab_size - 1, num_layers=1,
                                             block_size=8, architecture=DFLASH2, seed=9, dtype=torch.float64,
                                             dflash2=dict(conv_group_size=8, selector_rank=8, selector_top_k=4))
        else:
            drafter = RankedDrafter(model, prompts, truth, seed=0)
        calls: list[str] = []
        for name in ("greedy_tokens", "greedy_with_confidence", "logits", "top_logprobs", "candidates"):
            method = getattr(drafter, name)
            monkeypatch.setattr(drafter, name, lambda *a, _n=name, _m=method, **k: calls.append(_n) or _m(*a, **k))
        batch = DecodeBatch(HFTarget(model), drafter, max_block=8, tree_nodes=tree_nodes)
        verified: list[list[list[int]]] = []
        confidences: list[list[list[float]]] = []
        verify = batch._verify_and_commit
        monkeypatch.setattr(batch, "_verify_and_commit",
                            lambda ids, *a, **k: verified.append(ids.tolist()) or verify(ids, *a, **k))

        def trim(conf, from_lookup, offers=None):
            confidences.append(conf)
            # a chain of 5 where trees are offered (a plain length would verify trees)
            return 5 if offers is None else Shape(5, tree=False)

        rows = [make_row(i, len(p), SamplingParams(max_new_tokens=12), (), 8) for i, p in enumerate(prompts)]
        batch.join(prompts, rows)
        while batch.rows:
            batch.retire()
            if batch.rows:
                calls.clear()
                drafted = len(confidences)
                batch.step(8, trim)
                if len(confidences) > drafted:  # a drafting step (the last ones are plain: one token left)
                    assert calls.count("logits") == 1, calls  # one pass over the draft head
                    if dflash2:
                        assert calls.count("candidates") == 1, calls
                    else:
                        head = "top_logprobs" if tree_nodes else "greedy_with_confidence"
                        assert [c for c in calls if c != "logits"] == [head], calls
        assert [r.generated for r in rows] == truth and all(r.stats.tree_steps == 0 for r in rows)
        runs.append((verified, confidences))
    (chain_ids, chain_conf), (offered_ids, offered_conf) = runs
    assert len(chain_conf) > 2 and offered_ids == chain_ids
    assert len(offered_conf) == len(chain_conf)
    for a, b in zip(offered_conf, chain_conf):
        assert torch.allclose(torch.tensor(a), torch.tensor(b), rtol=1e-5)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("ties", [False, True])
def test_a_ranking_reused_from_the_same_distributions_equals_a_fresh_one(seed: int, ties: bool) -> None:
    """A step ranks its rows' nodes to price the tree, then builds it: the second ranking is the
    first one's prefix, equal to ranking afresh, for budgets in any order, depths cut or not, the
    distributions exhausted or not, ties and zero-probability candidates included."""
    shared = random_dists(seed, depth=4, k=3, ties=ties, dead=True)
    gen = torch.Generator().manual_seed(seed)
    for budget in torch.randint(0, 90, (12,), generator=gen).tolist() + [200, 3]:
        for depth in (None, 2):
            fresh = PositionDistributions(shared.ids, shared.logprobs)  # nothing ranked from it yet
            want = BestFirstProposer(budget, max_depth=depth).ranked(Draft(5, fresh))
            assert BestFirstProposer(budget, max_depth=depth).ranked(Draft(5, shared)) == want
            assert BestFirstProposer(budget, max_depth=depth).propose(Draft(5, shared)) == \
                BestFirstProposer(budget, max_depth=depth).propose(Draft(5, fresh))
    assert len(BestFirstProposer(200).ranked(Draft(5, shared))) < 200  # exhausted: every node ranked


@pytest.mark.parametrize("nodes", [62, 63, 70])
def test_packed_ancestors_of_trees_wider_than_an_int64s_bits(nodes: int) -> None:
    """A node's ancestors are packed as the bits of one integer: trees of more nodes than an
    int64 holds bits for take the other path, with the same masks."""
    gen = torch.Generator().manual_seed(nodes)
    parents = [-1] + [int(torch.randint(max(0, i - 3), i, (1,), generator=gen)) for i in range(1, nodes)]
    depths = [0]
    for p in parents[1:]:
        depths.append(depths[p] + 1)
    order = sorted(range(nodes), key=lambda i: (depths[i], i))  # breadth-first, parents first
    where = {old: new for new, old in enumerate(order)}
    tree = TokenTree(tuple(range(1000, 1000 + nodes)), tuple(-1 if i == 0 else where[parents[i]] for i in order))
    packed = pack_trees([tree, TokenTree.chain(3, [4, 5])], [5, 9], "cpu")
    assert torch.equal(packed.ancestors[0], tree.ancestor_mask())
    assert torch.equal(packed.ancestors[1, :3, :3], TokenTree.chain(3, [4, 5]).ancestor_mask())
    assert not packed.ancestors[1, 3:].any() and not packed.ancestors[1, :, 3:].any()


def test_gather_path_reads_each_rows_path_nodes() -> None:
    values = torch.randn(3, 6, 5)  # [b, n, F]
    path = torch.tensor([[0, 2, 5], [0, 1, 1], [0, 4, 0]])  # [b, m]; repeats stand for padding
    out = gather_path(values, path)
    assert out.shape == (3, 3, 5)
    assert all(torch.equal(out[r, k], values[r, path[r, k]]) for r in range(3) for k in range(3))
