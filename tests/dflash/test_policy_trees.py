"""The adaptive policy with token trees (dflash/policy.py, dflash/node_acceptance.py): trees are
priced by the acceptance observed by depth and rank, with their own step costs, and each step
verifies a chain or a tree, whichever is expected to commit more tokens per second. Batches are
stand-ins with the fields the policy reads and costs are scripted, so no result depends on the
machine's load; the end-to-end checks decode with the ranked drafter and stay lossless."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from conftest import make_tiny_target
from scripted import RankedDrafter
from support import one_thread, ragged_prompts, reference_greedy  # noqa: F401 (fixture)

from blockspec.config import SamplingParams, SpecConfig
from blockspec.dflash.trim import Shape, TreeOffer
from blockspec.dflash.node_acceptance import NodeAcceptance, best_tree_expectations
from blockspec.dflash.policy import AdaptiveBlock, CostModel, tree_expected_by_width
from blockspec.engine.decoder import SpecDecoder
from blockspec.targets.hf import HFTarget

# A doubtful first position (two near-equal choices), then confident ones under each: the
# drafter's best-first tree of 5 nodes, best first.
DOUBTFUL = TreeOffer(depths=(1, 1, 2, 2, 3), ranks=(0, 1, 0, 0, 0), parents=(-1, -1, 0, 1, 2),
                     probs=(0.45, 0.45, 0.9, 0.9, 0.9))
CHAIN_CONF = [0.45, 0.9, 0.9, 0.9, 0.9]  # the same draft's first choices


def _row(rate: float = 0.5) -> SimpleNamespace:
    return SimpleNamespace(remaining=100, params=SamplingParams(), constraint=None,
                           acceptance_rates=lambda prior, lookup=False: [rate] * 7)


def _costs(per_token: float, draft: float = 0.2) -> CostModel:
    """Steps of 1 s plus `per_token` per verified token, plus a draft pass of `draft` s."""
    costs = CostModel(max_block=8)
    for rows in (1, 2):
        costs.set(rows, [1.0] + [1.0 + draft + per_token * (n - 1) for n in range(2, 9)], [0.0] + [draft] * 7)
    return costs


def _trained(rank1_rate: float, trials: int = 400) -> NodeAcceptance:
    """Acceptance observed over many steps: first choices as likely as their draft probability,
    second choices of probability 0.45 accepted at `rank1_rate`."""
    nodes = NodeAcceptance()
    for i in range(trials):
        nodes.observe(1, 0, 0.45, i % 20 < 9)
        nodes.observe(1, 1, 0.45, i < rank1_rate * trials)
        nodes.observe(2, 0, 0.9, i % 10 < 9)
    return nodes


def test_node_acceptance_starts_at_the_drafters_word_and_learns_by_rank() -> None:
    nodes = NodeAcceptance()
    assert nodes.rate(1, 0, 0.3) == pytest.approx(0.3) and nodes.rate(2, 1, 0.3) == pytest.approx(0.3)
    assert nodes.rate(1, 0, 0.0) == 0.0 and nodes.rate(1, 0, 1.0) == 1.0
    for i in range(300):  # second choices of probability 0.3 accepted 1 time in 10; first choices as promised
        nodes.observe(1, 1, 0.3, i % 10 == 0)
        nodes.observe(1, 0, 0.3, i % 10 < 3)
    assert nodes.rate(1, 1, 0.3) == pytest.approx(0.1, abs=0.02)
    assert nodes.rate(1, 0, 0.3) == pytest.approx(0.3, abs=0.02)
    assert nodes.rate(3, 1, 0.3) < 0.15  # an unseen depth borrows its rank's ratio over all depths
    assert nodes.rate(1, 2, 0.3) == pytest.approx(0.3)  # an unseen rank keeps the drafter's word
    # mean rates (steps whose probabilities were not read back): observed, shrunk to a prior
    assert nodes.mean_rate(1, 1, first=0.5) == pytest.approx((30 + 8 * 0.5 * 0.2) / (300 + 8))
    assert NodeAcceptance().mean_rate(2, 2, first=0.5) == pytest.approx(0.5 * 0.2 ** 2)
    for _ in range(50):
        nodes.observe(2, 0, None, True)
    assert nodes.rate(2, 0, 0.3) == pytest.approx(0.3, abs=0.02)  # trials without p: mean rates only
    assert nodes.mean_rate(2, 0, first=0.5) > 0.9


def test_best_tree_expectations() -> None:
    chain = best_tree_expectations(lambda d, r: 0.5 if r == 0 else 0.0, 3, 8, 4)
    assert chain == pytest.approx([1.0, 1.5, 1.75, 1.875])  # no second choices: the chain
    tree = best_tree_expectations(lambda d, r: (0.5, 0.4, 0.1, 0.1)[r], 3, 8, 4)
    assert tree == pytest.approx([1.0, 1.5, 1.9, 2.15])  # the second child (0.4) before depth 2 (0.25)
    # rates rising with rank are capped by the rank above: a later sibling is never better
    assert best_tree_expectations(lambda d, r: 0.2 * (r + 1), 2, 2, 3) == pytest.approx([1.0, 1.2, 1.4])
    assert best_tree_expectations(lambda d, r: 0.5, 4, 1, 2) == pytest.approx([1.0, 1.5, 2.0, 2.0, 2.0])


def test_tree_expectations_of_a_row_follow_its_offer_and_lookup() -> None:
    nodes = NodeAcceptance()
    e = tree_expected_by_width(DOUBTFUL, nodes, 6, 100, [])
    assert e == pytest.approx([1.0, 1.45, 1.9, 1.9 + 0.405, 1.9 + 0.81, 1.9 + 0.81 + 0.3645])
    assert tree_expected_by_width(DOUBTFUL, nodes, 6, 2, [])[-1] == 2.0  # capped by the remaining tokens
    # a lookup branch of rates 0.8 takes the first nodes, the drafter's best nodes the rest
    looked = tree_expected_by_width(DOUBTFUL, nodes, 4, 100, [0.8, 0.8])
    assert looked == pytest.approx([1.0, 1.8, 1.8 + 0.64, 1.8 + 0.64 + 0.45])


def test_trim_picks_a_tree_when_it_is_cheap_and_well_accepted() -> None:
    rows = [_row()]
    for rank1, tree_cost, want in ((0.4, 0.05, True),  # second choices pay, trees cost what chains do
                                   (0.4, 0.6, False),  # ...but a tree step costs far more
                                   (0.02, 0.05, False)):  # the drafter's second choices are rarely right
        policy = AdaptiveBlock(8, costs=_costs(0.05), tree_costs=_costs(tree_cost))
        policy.nodes["greedy"] = _trained(rank1)
        policy._tree_model = policy.tree_costs
        chosen = policy.trimmer(SimpleNamespace(rows=rows))(
            [CHAIN_CONF], [0], [DOUBTFUL])
        assert isinstance(chosen, Shape) and chosen.tree is want, (rank1, tree_cost, chosen)
        assert chosen.lengths > 1
    # where no trees are offered (tree_nodes 0, a constrained row) the trim verifies a chain
    plain = AdaptiveBlock(8, costs=_costs(0.05)).trimmer(SimpleNamespace(rows=rows))
    assert plain([CHAIN_CONF], [0]) in range(2, 7)


def test_trim_prices_trees_by_observed_not_drafted_acceptance() -> None:
    """Uncalibrated, the second choice's 0.45 makes the tree look worth its extra cost; observed
    at 0.05, the policy keeps the chain."""
    rows = [_row()]
    fresh = AdaptiveBlock(8, costs=_costs(0.05), tree_costs=_costs(0.06))
    fresh._tree_model = fresh.tree_costs
    assert fresh.trimmer(SimpleNamespace(rows=rows))([CHAIN_CONF], [0], [DOUBTFUL]).tree
    fresh.nodes["greedy"] = _trained(0.05)
    assert not fresh.trimmer(SimpleNamespace(rows=rows))([CHAIN_CONF], [0], [DOUBTFUL]).tree


def _tree_batch(rows: list, tree_nodes: int = 7, trees: bool = True, **fields) -> SimpleNamespace:
    return SimpleNamespace(drafter=object(), argmax_only=True, rows=rows, trees=trees, tree_nodes=tree_nodes,
                           lookup_plan=lambda: [[]] * len(rows), **fields)


def test_a_batch_chooses_trees_by_their_mean_acceptance_and_cost() -> None:
    rows = [_row(0.5), _row(0.5)]
    for rank1, tree_cost, want in ((0.4, 0.05, True), (0.4, 0.6, False), (0.02, 0.05, False)):
        policy = AdaptiveBlock(8, costs=_costs(0.05), tree_costs=_costs(tree_cost), plain_every=1000,
                               challenge_every=1000)
        nodes = policy.node_acceptance("greedy")
        for i in range(400):
            nodes.observe(1, 1, None, i < rank1 * 400)
        assert policy.choose(_tree_batch(rows)) == 1  # a plain step first: its real cost
        assert policy.choose(_tree_batch(rows)) > 1 and policy.tree_choice is want, (rank1, tree_cost)
    policy.choose(_tree_batch(rows, trees=False))
    assert policy.choose(_tree_batch(rows, trees=False)) > 1 and not policy.tree_choice  # chains only


def test_tree_steps_are_timed_apart_from_chain_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    """A tree step's time corrects the tree costs, a chain step's the chain costs. Fake clock:
    chain steps 1 + 0.1 n seconds, tree steps 1 + 0.05 n."""
    from blockspec.dflash.policy import adaptive

    clock = SimpleNamespace(t=0.0)
    monkeypatch.setattr(adaptive, "time", SimpleNamespace(perf_counter=lambda: clock.t))
    rows = [SimpleNamespace(remaining=100, params=SamplingParams(), constraint=None,
                            acceptance_rates=lambda prior, lookup=False: [0.6] * 7,
                            stats=SimpleNamespace(accepted_by_position=[0] * 7, lookup_accepted_by_position=[0] * 7),
                            tries=[0] * 7, lookup_tries=[0] * 7) for _ in range(2)]
    seen = []

    def step(block: int, trim: object = None, tree: bool = True) -> int:
        batch.tree_step = tree and block > 1
        seen.append((block, batch.tree_step))
        clock.t += 1.0 + (0.05 if batch.tree_step else 0.1) * block
        batch.verified = 2 * block
        return block

    batch = _tree_batch(rows, step=step, verified=0, caught_up=False, skips_padding=False, tree_step=False,
                        node_trials=[])
    policy = AdaptiveBlock(8, costs=_costs(0.1, draft=0.0), tree_costs=_costs(0.1, draft=0.0), challenge_every=1000)
    nodes = policy.node_acceptance("greedy")
    for i in range(400):
        nodes.observe(1, 1, None, i < 160)
    for _ in range(6):
        policy.step(batch)
    trees = [n for n, t in seen if t]
    assert trees and policy.tree_steps == len(trees)
    assert set(policy.costs.measured[2]) == {n for n, t in seen if not t}  # the plain check's step
    chain = policy.costs.table(2)
    tree = policy.tree_table(2, chain)
    # calibrated alike, the tree steps ran faster than their estimate: trees now read cheaper
    assert all(tree[n - 1] < chain[n - 1] for n in set(trees)), (tree, chain)


def test_tree_costs_follow_the_chains_and_a_slow_tree_step_moves_them_a_bounded_share() -> None:
    """Tree costs are the chain steps' current costs times the calibrated tree / chain ratio of
    each width, times a factor the tree steps correct: a chain measured faster makes trees read
    faster (they run too rarely to follow longer contexts or outside load by their own steps),
    and one tree step slowed tenfold by a burst of load moves the factor by a bounded share."""
    from blockspec.dflash.policy import adaptive

    policy = AdaptiveBlock(8, costs=_costs(0.1), tree_costs=_costs(0.12), plain_every=1000, challenge_every=1000)
    chain = policy.costs.table(1)
    tree = policy.tree_table(1, chain)
    assert tree == pytest.approx(_costs(0.12).table(1))  # nothing measured: the calibration
    policy.costs.observe(1, 4, 0.5 * chain[3])  # chains at width 4 measured at half their calibration
    faster = policy.costs.table(1)
    assert policy.tree_table(1, faster)[3] == pytest.approx(0.5 * tree[3])
    policy._observe_tree(1, 4, 10 * policy.tree_table(1, faster)[3])
    s, bound = policy.costs.smoothing, adaptive.TREE_FACTOR_BOUND
    assert policy.tree_table(1, faster)[3] == pytest.approx((1 - s + s * bound) * 0.5 * tree[3])
    # calibrated under other load (every size 20% dearer, the plain step too): trees cost what chains do
    slow = CostModel(max_block=8)
    slow.set(1, [1.2 * c for c in _costs(0.1).table(1)], [1.2 * c for c in _costs(0.1).draft_table(1)])
    drifted = AdaptiveBlock(8, costs=_costs(0.1), tree_costs=slow)
    assert drifted.tree_table(1, chain) == pytest.approx(chain)


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("tree_cost", [0.01, 1.0])
def test_the_policy_with_trees_is_lossless_and_follows_tree_costs(tree_cost: float,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """With the ranked drafter (second and third choices often right) the policy verifies trees
    when tree steps are cheap and chains when they are dear; greedy output is plain decoding's.
    The scripted costs stay as they are (real steps are not timed into them)."""
    monkeypatch.setattr(CostModel, "observe", lambda self, batch, block, seconds: None)
    model = make_tiny_target("llama", seed=11)
    prompts = ragged_prompts(1, seed=28, vocab=48)
    truth = [reference_greedy(model, p, 24) for p in prompts]
    drafter = RankedDrafter(model, prompts, truth, seed=11)
    dec = SpecDecoder(HFTarget(model), drafter, SpecConfig(block_size=8, adaptive=True, tree_nodes=5))
    costs, tree_costs = CostModel(max_block=8), CostModel(max_block=8)
    costs.set(1, [1.0 + 0.01 * n for n in range(8)], [0.0] + [0.1] * 7)
    tree_costs.set(1, [1.0] + [1.0 + tree_cost * n for n in range(1, 8)], [0.0] + [0.1] * 7)
    policy = AdaptiveBlock(8, costs=costs, sampled_costs=costs, tree_costs=tree_costs, sampled_tree_costs=tree_costs,
                           thread_count=lambda: 1, plain_every=1000, challenge_every=1000)
    dec.adaptive_policy = policy
    results = dec.generate(prompts, SamplingParams(max_new_tokens=24))
    assert [r.token_ids for r in results] == truth
    tree_steps = sum(r.stats.tree_steps for r in results)
    if tree_cost < 0.1:
        assert tree_steps > 0 and policy.tree_steps == tree_steps
        assert any(k[1] > 0 for k in policy.node_acceptance("greedy").means)  # trials by rank were booked
    else:
        assert tree_steps == 0


def test_a_lone_row_is_offered_trees_while_they_come_close() -> None:
    """A trimmed step reads back and ranks its drafter's top choices only while trees promise
    nearly what chains do, and every TREE_OFFER_EVERY drafting steps regardless."""
    from blockspec.dflash.policy.adaptive import TREE_OFFER_EVERY

    lone = [_row(0.5)]
    close = AdaptiveBlock(8, costs=_costs(0.05), tree_costs=_costs(0.05), plain_every=1000, challenge_every=1000)
    close.choose(_tree_batch(lone))  # the plain check
    assert close.choose(_tree_batch(lone)) > 1 and close.tree_choice  # no second choice seen yet: offered
    dear = AdaptiveBlock(8, costs=_costs(0.05), tree_costs=_costs(2.0), plain_every=1000, challenge_every=1000)
    offered = []
    for _ in range(2 * TREE_OFFER_EVERY + 1):
        dear.choose(_tree_batch(lone))
        offered.append(dear.tree_choice)
    assert offered[0] is False  # the plain check
    assert [i for i, o in enumerate(offered) if o] == [TREE_OFFER_EVERY, 2 * TREE_OFFER_EVERY]


@pytest.mark.usefixtures("one_thread")
def test_tree_steps_are_calibrated_like_chain_steps() -> None:
    """calibrate(tree=True) times what a tree step runs (draft pass, top choices ranked, a tree
    packed, one tree pass walked), greedy and sampled, on the native target."""
    import torch

    from blockspec.dflash.batch import DecodeBatch
    from blockspec.dflash.drafter import new_drafter_for_target
    from blockspec.dflash.policy import calibrate
    from blockspec.targets.native import load_native_target

    model = make_tiny_target("llama", seed=21)
    target = load_native_target(model, dtype=None, eos_token_ids=())
    drafter = new_drafter_for_target(model.config, mask_token_id=47, num_layers=1, dtype=torch.float64)
    batch = DecodeBatch(target, drafter, max_block=6, tree_nodes=3)
    assert batch.trees
    for sampled in (False, True):
        totals, drafting = calibrate(batch, 2, 6, sampled=sampled, tree=True)
        assert len(totals) == len(drafting) == 6 and drafting[0] == 0.0
        assert all(0 < d < t for d, t in zip(drafting[1:], totals[1:]))
    policy = AdaptiveBlock(6)
    policy.calibrate_all(batch, 2)
    assert all(m.known(2) for m in (policy.costs, policy.sampled_costs, policy.tree_costs, policy.sampled_tree_costs))


def test_trees_are_priced_in_the_chains_units() -> None:
    """A chain step chooses with trees on what it chooses without them (its first choices keep
    their draft probabilities), and a lower rank is priced by its acceptance relative to the
    first choices' at the same depth and band."""
    nodes = NodeAcceptance()
    for i in range(400):  # first choices of 0.3 accepted 60%, second choices of 0.3 accepted 30%
        nodes.observe(1, 0, 0.3, i % 10 < 6)
        nodes.observe(1, 1, 0.3, i % 10 < 3)
    assert nodes.relative_rate(1, 0, 0.3) == 0.3 and nodes.rate(1, 0, 0.3) == pytest.approx(0.6, abs=0.02)
    assert nodes.relative_rate(1, 1, 0.3) == pytest.approx(0.15, abs=0.01)  # half a first choice's
    rows = [_row()]
    for tree_cost in (0.6, 2.0):  # trees too dear: the chain, with the length chains pick alone
        policy = AdaptiveBlock(8, costs=_costs(0.05), tree_costs=_costs(tree_cost))
        policy.nodes["greedy"] = nodes
        policy._tree_model = policy.tree_costs
        chosen = policy.trimmer(SimpleNamespace(rows=rows))([CHAIN_CONF], [0], [DOUBTFUL])
        alone = AdaptiveBlock(8, costs=_costs(0.05)).trimmer(SimpleNamespace(rows=rows))([CHAIN_CONF], [0])
        assert chosen == Shape(alone, False)


def test_a_sampled_rows_chain_takes_the_length_it_takes_without_trees() -> None:
    """A sampled row prices its chain by the acceptance observed at its drafts' peaks, not by
    the peaks themselves (`_chain_rates`): where its trim is offered trees and answers with the
    chain, the chain is as long as without the offer. Observed here above the peaks, so pricing
    by the peaks would verify a shorter chain."""
    nodes = NodeAcceptance()
    for i in range(400):  # first choices accepted far more often than their peaks say
        nodes.observe(1, 0, 0.45, i % 20 < 19)
        for depth in range(2, 6):
            nodes.observe(depth, 0, 0.9, i % 100 < 99)
        nodes.observe(1, 1, 0.45, i % 50 == 0)  # second choices rarely right: trees do not pay
    row = SimpleNamespace(remaining=100, params=SamplingParams(temperature=0.7, top_p=0.9), constraint=None,
                          acceptance_rates=lambda prior, lookup=False: [0.5] * 7)
    assert row.params.rule == "standard"
    for tree_cost in (0.06, 0.6):
        policy = AdaptiveBlock(8, costs=_costs(0.4), tree_costs=_costs(tree_cost))
        policy.nodes["standard"] = nodes
        policy._tree_model = policy.tree_costs
        chosen = policy.trimmer(SimpleNamespace(rows=[row]))([CHAIN_CONF], [0], [DOUBTFUL])
        alone = AdaptiveBlock(8, costs=_costs(0.4))
        alone.nodes["standard"] = nodes
        want = alone.trimmer(SimpleNamespace(rows=[row]))([CHAIN_CONF], [0])
        assert chosen == Shape(want, False), (tree_cost, chosen, want)
        peaks = AdaptiveBlock(8, costs=_costs(0.4)).trimmer(SimpleNamespace(rows=[_row()]))([CHAIN_CONF], [0])
        assert want > peaks  # priced by the peaks it would stop sooner


def test_a_step_drafts_where_its_chain_would_and_a_trimmed_one_as_wide() -> None:
    """Trees priced before the drafts exist never make a step draft where the chain would decode
    plainly (a lone row or a batch), and a lone row's trim may answer with a chain, so its draft
    is never narrower than the chain's best width."""
    nodes = _trained(0.9)  # second choices very often right: trees promise much

    def policy(costs: CostModel, tree_costs: CostModel) -> AdaptiveBlock:
        p = AdaptiveBlock(8, costs=costs, tree_costs=tree_costs, plain_every=1000, challenge_every=1000)
        p.nodes["greedy"] = nodes
        return p

    cheap_trees = CostModel(max_block=8)
    for rows in (1, 2):
        cheap_trees.set(rows, [1.0] * 8, [0.0] * 8)  # a tree of any width costs a plain step
    for weak in ([_row(0.02)], [_row(0.02), _row(0.02)]):  # chains rarely accepted: plain pays best
        p = policy(_costs(0.3, draft=0.5), cheap_trees)
        assert [p.choose(_tree_batch(weak)) for _ in range(3)] == [1, 1, 1]
    narrow_trees = CostModel(max_block=8)
    narrow_trees.set(1, [1.0, 1.0, 1.0] + [9.0] * 5, [0.0] * 8)  # trees pay at widths 2-3 only
    strong = [_row(0.9)]
    chains = policy(_costs(0.3), narrow_trees)  # verified tokens dear: the chain's best is 6-7 wide
    chains.choose(_tree_batch(strong, trees=False))  # the plain check
    chain_width = chains.choose(_tree_batch(strong, trees=False))
    p = policy(_costs(0.3), narrow_trees)
    p.choose(_tree_batch(strong))
    assert chain_width > 3 and p.choose(_tree_batch(strong)) >= chain_width


def test_a_batch_that_decodes_plainly_prices_no_trees(monkeypatch: pytest.MonkeyPatch) -> None:
    """Trees are priced only in steps whose chain drafts: a batch whose chains do not pay (most
    steps of a busy batch) computes no tree expectations, and one whose chains pay does."""
    priced = []
    tree_expected = AdaptiveBlock.tree_expected
    monkeypatch.setattr(AdaptiveBlock, "tree_expected",
                        lambda self, *a: priced.append(1) or tree_expected(self, *a))
    cheap_trees = CostModel(max_block=8)
    for rows in (1, 2):
        cheap_trees.set(rows, [1.0] * 8, [0.0] * 8)  # trees as cheap as can be: they would win if priced
    weak = AdaptiveBlock(8, costs=_costs(0.3, draft=0.5), tree_costs=cheap_trees, plain_every=1000,
                         challenge_every=1000, probe_every=1000)
    weak.nodes["greedy"] = _trained(0.9)
    assert [weak.choose(_tree_batch([_row(0.02), _row(0.02)])) for _ in range(20)] == [1] * 20
    assert priced == []
    strong = AdaptiveBlock(8, costs=_costs(0.05), tree_costs=cheap_trees, plain_every=1000, challenge_every=1000)
    strong.nodes["greedy"] = _trained(0.9)
    strong.choose(_tree_batch([_row(0.9), _row(0.9)]))  # the plain check
    assert strong.choose(_tree_batch([_row(0.9), _row(0.9)])) > 1 and strong.tree_choice and priced


def test_a_tree_step_is_never_priced_below_the_chain_step_of_its_width() -> None:
    """Tree costs calibrated apart from the chains' can come out cheaper than the chain of the
    same width (a calibration under other load), yet a tree step runs the chain's draft and a
    verify pass of as many tokens. A tree that adds no accepted tokens (one node: the chain's
    own; a lone row's second choice never right) is not chosen for its table alone, in a batch
    or in a trim, while a tree that adds tokens still is."""
    chain_costs = _costs(0.05, draft=0.1)
    cheap = CostModel(max_block=8)
    for rows in (1, 2):
        cheap.set(rows, [1.0] + [0.6] * 7, [0.0] + [0.1] * 7)  # trees: below even a plain step
    for tree_nodes, want in ((1, False), (7, True)):
        policy = AdaptiveBlock(8, costs=chain_costs, tree_costs=cheap, plain_every=1000, challenge_every=1000)
        nodes = policy.node_acceptance("greedy")
        for i in range(400):
            nodes.observe(1, 1, None, i < 240)  # second choices often right
        batch = _tree_batch([_row(0.5), _row(0.5)], tree_nodes=tree_nodes)
        assert policy.choose(batch) == 1  # the plain check
        assert policy.choose(batch) > 1 and policy.tree_choice is want, tree_nodes
    policy = AdaptiveBlock(8, costs=chain_costs, tree_costs=cheap)
    policy.nodes["greedy"] = _trained(0.0)
    policy._tree_model = policy.tree_costs
    rows = [SimpleNamespace(remaining=100, params=SamplingParams())]
    assert policy.trimmer(SimpleNamespace(rows=rows))([CHAIN_CONF], [0], [DOUBTFUL]).tree is False


def test_offers_back_off_while_answered_with_chains_and_return_when_a_tree_wins(monkeypatch: pytest.MonkeyPatch
                                                                                ) -> None:
    """Each offer a lone row's trim answers with a chain doubles the drafting steps until the next
    (OFFER_BACKOFF at most); one whose tree wins brings the next drafting step's offer back; and
    after TREE_CHECK_EVERY trimmed drafting steps without a tree, one is offered whatever the
    back-off."""
    from blockspec.dflash.policy import adaptive

    wins = {7}  # the offers (counted from 0) whose tree wins
    offers = []

    def trimmer(self: AdaptiveBlock, batch: object):
        def trim(confidence: list, looked: list, offered: list | None = None) -> int | Shape:
            if offered is None:
                return 4
            self._tree_won = len(offers) in wins
            offers.append(drafting[0])
            return Shape(4, self._tree_won)
        return trim

    monkeypatch.setattr(AdaptiveBlock, "trimmer", trimmer)
    rows = [SimpleNamespace(remaining=10_000, params=SamplingParams(), constraint=None,
                            acceptance_rates=lambda prior, lookup=False: [0.9] * 7,
                            stats=SimpleNamespace(accepted_by_position=[0] * 7, lookup_accepted_by_position=[0] * 7),
                            tries=[0] * 7, lookup_tries=[0] * 7)]
    drafting = [0]

    def step(block: int, trim: object = None, tree: bool = False) -> int:
        if block > 1 and trim is not None:
            chosen = trim([[0.9] * (block - 1)], [0], [DOUBTFUL] if tree else None)
            batch.tree_step = isinstance(chosen, Shape) and chosen.tree
            drafting[0] += 1
        else:
            batch.tree_step = False
        batch.verified = block
        return block

    batch = _tree_batch(rows, step=step, verified=0, caught_up=True, skips_padding=False, tree_step=False,
                        node_trials=[])
    policy = AdaptiveBlock(8, costs=_costs(0.05), tree_costs=_costs(0.05), plain_every=10_000,
                           challenge_every=10_000)
    while drafting[0] < 200:
        policy.step(batch)
    gaps = [b - a for a, b in zip(offers, offers[1:])]
    assert gaps[:4] == [2, 4, 8, 16], gaps  # doubling while the trees lose
    # the 32nd drafting step without a tree is a check, offered once (its trim kept the chain)
    assert offers[5] == adaptive.TREE_CHECK_EVERY - 1 and gaps[5] == adaptive.TREE_CHECK_EVERY, offers
    assert offers[8] == offers[7] + 1 and gaps[8:12] == [2, 4, 8, 16], offers  # a tree won: back to every step
    assert max(gaps) == adaptive.OFFER_BACKOFF == adaptive.TREE_CHECK_EVERY, gaps
