"""Token-tree decoding (docs/DESIGN.md section 5.3) is lossless: greedy tree decoding equals plain
greedy decoding token for token, seeded sampled tree decoding equals seeded plain decoding, in
ragged batches with rows joining and leaving, with a drafter whose second and third choices are
the right ones (acceptance through non-first children, stopping at every depth). What follows a
step follows its accepted path: the drafter's context features, logprobs, stop tokens and
strings, statistics by depth and rank. Hybrid (Gated DeltaNet) targets keep chains. Planted bugs
(a walk along first children, the block prefix's features) fail these checks."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_target
from scripted import RankedDrafter
from support import one_thread, ragged_prompts, reference_greedy  # noqa: F401 (fixture)

from blockspec.config import SamplingParams, SpecConfig
from blockspec.dflash import batch as batch_module
from blockspec.dflash.batch import DecodeBatch
from blockspec.dflash.row import Row, make_row
from blockspec.dflash.drafter import DFLASH2, new_drafter_for_target
from blockspec.dflash.lookup import LookupConfig
from blockspec.dflash.tree_verify import TreeAcceptance
from blockspec.engine import Engine, EngineConfig
from blockspec.engine.decoder import SpecDecoder
from blockspec.errors import ConfigError
from blockspec.targets.hf import HFTarget
from blockspec.targets.slots import EMPTY

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: thread hand-offs cost more than the work

MAX_NEW = 24


def _setup(family: str, batch: int, seed: int):
    model = make_tiny_target(family, seed=seed)
    prompts = ragged_prompts(batch, seed=seed + 17, vocab=48)
    truth = [reference_greedy(model, p, MAX_NEW) for p in prompts]
    return model, prompts, truth


def _ranked_run(family: str, tree_nodes: int, *, batch: int = 3, seed: int = 0, block: int = 8):
    model, prompts, truth = _setup(family, batch, seed)
    drafter = RankedDrafter(model, prompts, truth, seed=seed)
    dec = SpecDecoder(HFTarget(model), drafter, SpecConfig(block_size=block, tree_nodes=tree_nodes))
    return model, prompts, truth, drafter, dec.generate(prompts, SamplingParams(max_new_tokens=MAX_NEW))


def _decode(target, drafter, prompts, params, *, block: int, tree_nodes: int) -> list[Row]:
    """Rows decoded by DecodeBatch steps of `block` (1: plain decoding), all joined at once."""
    batch = DecodeBatch(target, drafter, max_block=8, tree_nodes=tree_nodes)
    rows = [make_row(i, len(p), sp, (), 8) for i, (p, sp) in enumerate(zip(prompts, params))]
    batch.join(prompts, rows)
    while batch.rows:
        batch.retire()
        if batch.rows:
            batch.step(block)
    return rows


def check_ranked_trees(family: str, seed: int) -> None:
    """Greedy trees with the ranked drafter: lossless, and acceptance goes through second and
    third children at several depths, so trees accept far more than chains of first choices."""
    _, _, truth, _, trees = _ranked_run(family, tree_nodes=12, seed=seed)
    _, _, _, _, chains = _ranked_run(family, tree_nodes=0, seed=seed)
    for t, r, c in zip(truth, trees, chains):
        assert r.token_ids == t
        assert c.token_ids == t
        assert r.stats.tree_steps >= r.stats.steps - 2 and c.stats.tree_steps == 0  # a last token: a plain step
        assert sum(r.stats.acceptance_lengths) + 1 == len(t)
    ranks = [sum(col) for col in zip(*[r.stats.accepted_by_rank + [0] * 3 for r in trees])]
    assert ranks[1] > 0 and ranks[2] > 0, f"no acceptance through non-first children: ranks {ranks}"
    # accepted_by_position counts the first-choice spine in tree steps; the path itself goes deeper
    deepest = max(max(r.stats.acceptance_lengths) for r in trees)
    assert deepest >= 3, f"acceptance should reach depth 2: longest step {deepest}"
    tree_tau = sum(r.stats.mean_tau for r in trees) / len(trees)
    chain_tau = sum(c.stats.mean_tau for c in chains) / len(chains)
    assert tree_tau > chain_tau + 0.4, f"tree tau {tree_tau:.2f} vs chain tau {chain_tau:.2f}"


@pytest.mark.parametrize("family,seed", [("llama", 0), ("qwen3", 1)])
def test_greedy_tree_equals_plain_and_accepts_through_siblings(family: str, seed: int) -> None:
    check_ranked_trees(family, seed)


def test_a_walk_along_first_children_fails_the_check(monkeypatch: pytest.MonkeyPatch) -> None:
    """Planted bug: the walk descends only into first children (still lossless, but it throws the
    tree away); the rank and tau checks above must catch it."""
    def first_children(tree, tokens):
        path = [0]
        while True:
            kids = list(tree.children(path[-1]).items())
            if not kids or kids[0][0] != int(tokens[path[-1]]):
                return TreeAcceptance(tuple(path), int(tokens[path[-1]]))
            path.append(kids[0][1])

    monkeypatch.setattr(batch_module, "walk", first_children)
    with pytest.raises(AssertionError):
        check_ranked_trees("llama", 0)


def _check_features(model, drafter: RankedDrafter, prompts, outputs) -> None:
    """Every context feature the drafter was fed (a non-EMPTY position) is the target's feature of
    the committed sequence at that position: rows are told apart by the features themselves."""
    target = HFTarget(model)
    true = []
    for p, out in zip(prompts, outputs):
        seq = p + out
        _, f = target.forward(torch.tensor([seq]), torch.arange(len(seq))[None], target.new_cache(1),
                              drafter.target_layer_ids)
        true.append(f[0].double())
    fed = 0
    for feats, positions in drafter.received:
        for row_feats, row_pos in zip(feats, positions):
            for f, pos in zip(row_feats, row_pos.tolist()):
                if pos == EMPTY:
                    continue
                fed += 1
                best = min(float((t[pos] - f).abs().max()) for t in true if pos < len(t) - 1)
                assert best < 1e-6, f"the drafter read a feature at position {pos} of no committed sequence"
    assert fed >= sum(len(p) for p in prompts)


def test_the_drafter_reads_the_accepted_path_features() -> None:
    model, prompts, truth, drafter, results = _ranked_run("llama", tree_nodes=12, seed=2)
    assert [r.token_ids for r in results] == truth
    _check_features(model, drafter, prompts, truth)


def test_block_prefix_features_fail_the_feature_check(monkeypatch: pytest.MonkeyPatch) -> None:
    """Planted bug: the queue gets the features of the first nodes of the block (node order), not
    of the accepted path's nodes."""
    monkeypatch.setattr(batch_module, "gather_path", lambda values, path: values[:, : path.shape[1]])
    model, prompts, truth, drafter, results = _ranked_run("llama", tree_nodes=12, seed=2)
    monkeypatch.undo()
    with pytest.raises(AssertionError):
        _check_features(model, drafter, prompts, [r.token_ids for r in results])


def test_rows_joining_and_leaving_keep_their_own_output() -> None:
    """max_batch 3 over 6 requests of different lengths: rows leave mid-flight and queued ones
    join, every step a ragged batch of trees of different sizes."""
    model, prompts, _ = _setup("llama", 6, seed=4)
    lengths = [7, 19, 11, 24, 5, 16]
    truth = [reference_greedy(model, p, n) for p, n in zip(prompts, lengths)]
    drafter = RankedDrafter(model, prompts, [reference_greedy(model, p, MAX_NEW) for p in prompts], seed=4)
    engine = Engine(HFTarget(model), drafter, EngineConfig(SpecConfig(block_size=6, tree_nodes=9), max_batch=3,
                                                          own_thread=False))
    handles = [engine.submit(p, SamplingParams(max_new_tokens=n)) for p, n in zip(prompts, lengths)]
    engine.run_until_idle()
    results = [h.result() for h in handles]
    assert [r.token_ids for r in results] == truth
    assert all(r.stats.tree_steps > 0 for r in results)
    assert sum(r.stats.mean_tau for r in results) / 6 > 1.5


def test_seeded_sampled_trees_equal_seeded_plain_decoding() -> None:
    """A node's draw is the target's keyed draw at its output position, so a seed fixes the text
    whatever the tree; the logprobs along the accepted path are plain decoding's."""
    model, prompts, truth = _setup("qwen3", 3, seed=5)
    drafter = RankedDrafter(model, prompts, truth, seed=5)
    params = [SamplingParams(max_new_tokens=MAX_NEW, temperature=t, top_p=p, seed=s, logprobs=2)
              for t, p, s in ((0.7, 1.0, 11), (1.0, 0.9, 12), (0.0, 1.0, None))]
    target = HFTarget(model)
    trees = _decode(target, drafter, prompts, params, block=8, tree_nodes=10)
    plain = _decode(target, drafter, prompts, params, block=1, tree_nodes=10)
    for t, p in zip(trees, plain):
        assert t.generated == p.generated
        assert t.stats.tree_steps > 0
        assert len(t.logprobs) == len(p.logprobs) == len(t.generated)
        for a, b in zip(t.logprobs, p.logprobs):
            assert a.logprob == pytest.approx(b.logprob, abs=1e-6)
            assert [i for i, _ in a.top] == [i for i, _ in b.top]
    assert trees[2].generated == truth[2]  # the greedy row of the mixed batch


def test_greedy_logprobs_follow_the_accepted_path() -> None:
    model, prompts, truth = _setup("llama", 2, seed=6)
    drafter = RankedDrafter(model, prompts, truth, seed=6)
    target = HFTarget(model)
    params = [SamplingParams(max_new_tokens=MAX_NEW, logprobs=3)] * 2
    trees = _decode(target, drafter, prompts, params, block=8, tree_nodes=12)
    plain = _decode(target, drafter, prompts, params, block=1, tree_nodes=12)
    for t, p, want in zip(trees, plain, truth):
        assert t.generated == want
        assert max(t.stats.acceptance_lengths) > 2  # several tokens of one path per step
        for a, b in zip(t.logprobs, p.logprobs):
            assert a.logprob == pytest.approx(b.logprob, abs=1e-8)
            assert [i for i, _ in a.top] == [i for i, _ in b.top]
            assert [v for _, v in a.top] == pytest.approx([v for _, v in b.top], abs=1e-8)


def test_stop_tokens_and_strings_inside_an_accepted_path() -> None:
    model, prompts, truth = _setup("llama", 3, seed=7)
    drafter = RankedDrafter(model, prompts, truth, seed=7)
    dec = SpecDecoder(HFTarget(model), drafter, SpecConfig(block_size=8, tree_nodes=12))
    stop = truth[0][9]
    want0 = truth[0][: truth[0].index(stop) + 1]
    got = dec.generate(prompts[:1], SamplingParams(max_new_tokens=MAX_NEW, stop_token_ids=(stop,)))[0]
    assert got.token_ids == want0 and got.finish_reason == "stop"

    # a stop "string": the pair of tokens at output positions 6, 7 of row 1; keep up to its start
    pair = truth[1][6:8]

    def stop_check(i: int, ids: list[int]) -> int | None:
        if i != 1:
            return None
        for j in range(len(ids) - 1):
            if ids[j: j + 2] == pair:
                return j
        return None

    results = dec.generate(prompts, SamplingParams(max_new_tokens=MAX_NEW), stop_check=stop_check)
    first = next(j for j in range(len(truth[1]) - 1) if truth[1][j: j + 2] == pair)
    assert results[1].token_ids == truth[1][:first] and results[1].finish_reason == "stop"
    assert results[0].token_ids == truth[0] and results[2].token_ids == truth[2]


def test_lookup_branch_merges_into_the_tree_and_stays_lossless() -> None:
    model = make_tiny_target("llama", seed=8)
    base = [5, 9, 13, 7, 22, 31]
    prompts = [base * 3, [3, 4] + base * 2]  # repetitive: lookup finds continuations
    truth = [reference_greedy(model, p, MAX_NEW) for p in prompts]
    drafter = RankedDrafter(model, prompts, truth, seed=8, absent_share=6)
    dec = SpecDecoder(HFTarget(model), drafter,
                      SpecConfig(block_size=8, tree_nodes=10, lookup=LookupConfig(min_ngram=2)))
    results = dec.generate(prompts, SamplingParams(max_new_tokens=MAX_NEW))
    assert [r.token_ids for r in results] == truth
    assert all(r.stats.tree_steps > 0 for r in results)
    assert sum(r.stats.lookup_steps for r in results) > 0
    assert sum(sum(r.stats.lookup_accepted_by_position) for r in results) > 0


def test_dflash2_trees_are_lossless() -> None:
    """A DFlash 2 drafter's tree grows from its selector's conditional scores."""
    model = make_tiny_target("llama", seed=9)
    drafter = new_drafter_for_target(model.config, mask_token_id=model.config.vocab_size - 1, num_layers=1,
                                     block_size=8, architecture=DFLASH2, seed=9, dtype=torch.float64,
                                     dflash2=dict(conv_group_size=8, selector_rank=8, selector_top_k=4))
    prompts = ragged_prompts(3, seed=19, vocab=48)
    dec = SpecDecoder(HFTarget(model), drafter, SpecConfig(block_size=6, tree_nodes=6))
    results = dec.generate(prompts, SamplingParams(max_new_tokens=12))
    for p, r in zip(prompts, results):
        assert r.token_ids == reference_greedy(model, p, 12)
        assert r.stats.tree_steps > 0


def test_hybrid_target_keeps_chains_and_stays_lossless() -> None:
    """Gated DeltaNet layers hold one branch's state: the step verifies chains there."""
    model = make_tiny_target("qwen3_5_text", seed=10)
    prompts = ragged_prompts(2, seed=20, vocab=48)
    truth = [reference_greedy(model, p, 14) for p in prompts]
    drafter = RankedDrafter(model, prompts, truth, seed=10)
    target = HFTarget(model)
    assert not target.supports_trees
    dec = SpecDecoder(target, drafter, SpecConfig(block_size=6, tree_nodes=8))
    results = dec.generate(prompts, SamplingParams(max_new_tokens=14))
    assert [r.token_ids for r in results] == truth
    assert all(r.stats.tree_steps == 0 for r in results)


def test_tree_nodes_is_validated() -> None:
    for bad in (-1, 1.5, True, 10_000):
        with pytest.raises(ConfigError, match="tree_nodes"):
            SpecConfig(tree_nodes=bad)
    assert SpecConfig(tree_nodes=0).tree_nodes == 0


@pytest.mark.parametrize("batch", [1, 3])
def test_the_adaptive_policy_spends_its_verify_width_on_trees(batch: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """With the adaptive policy (trimmed lone rows, whole-batch widths) and tree steps that cost
    what chain steps do, every drafting step's width goes to a tree of at most tree_nodes (the
    drafter's second and third choices are right as often as its first), the output stays plain
    greedy decoding's, the trees accept through non-first choices, and the acceptance the policy
    prices steps by is counted by depth. The scripted costs stay as they are."""
    from blockspec.dflash.policy import AdaptiveBlock, CostModel

    monkeypatch.setattr(CostModel, "observe", lambda self, batch, block, seconds: None)
    model, prompts, truth = _setup("llama", batch, seed=11)
    drafter = RankedDrafter(model, prompts, truth, seed=11)
    dec = SpecDecoder(HFTarget(model), drafter, SpecConfig(block_size=8, adaptive=True, tree_nodes=5))
    costs = CostModel(max_block=8)
    for size in (1, 2, 4):
        costs.set(size, [1.0 + 0.01 * n for n in range(8)], [0.0] + [0.1] * 7)  # verified tokens nearly free
    policy = AdaptiveBlock(8, costs=costs, sampled_costs=costs, tree_costs=costs, sampled_tree_costs=costs,
                           thread_count=lambda: 1)
    dec.adaptive_policy = policy
    results = dec.generate(prompts, SamplingParams(max_new_tokens=MAX_NEW))
    assert [r.token_ids for r in results] == truth
    assert sum(r.stats.tree_steps for r in results) > 0
    assert max(policy.used) <= 6  # the root and at most tree_nodes proposed nodes
    assert sum(sum(r.stats.accepted_by_rank[1:]) for r in results) > 0  # through second and third choices
    counts = policy.acceptance["greedy"]  # by depth, from the tree steps
    assert 0 < counts.accepted[0] <= counts.tries[0]


def test_captured_features_follow_the_accepted_path() -> None:
    """Capture mode (what data generation reads): the features of prompt + output are those of a
    plain forward over them, though steps verified trees."""
    model, prompts, truth = _setup("llama", 2, seed=12)
    drafter = RankedDrafter(model, prompts, truth, seed=12)
    dec = SpecDecoder(HFTarget(model), drafter, SpecConfig(block_size=8, tree_nodes=10))
    results = dec.generate(prompts, SamplingParams(max_new_tokens=MAX_NEW), capture_layer_ids=drafter.target_layer_ids)
    target = HFTarget(model)
    for p, r in zip(prompts, results):
        assert r.token_ids == reference_greedy(model, p, MAX_NEW) and r.stats.tree_steps > 0
        seq = p + r.token_ids
        _, want = target.forward(torch.tensor([seq]), torch.arange(len(seq))[None], target.new_cache(1),
                                 drafter.target_layer_ids)
        assert r.features.shape == want[0].shape
        assert torch.allclose(r.features[:-1], want[0, :-1].float(), atol=1e-5)


def test_path_stats_count_depths_tried_and_sibling_ranks() -> None:
    from blockspec.dflash.token_tree import TokenTree
    from blockspec.dflash.tree_step import path_stats, propose_tree
    from blockspec.dflash.proposers import PositionDistributions

    #        0
    #      / | \
    #     1  2  3
    #     |  |
    #     4  5
    tree = TokenTree((9, 1, 2, 3, 4, 5), (-1, 0, 0, 0, 1, 2))
    through_third = path_stats(tree, TreeAcceptance((0, 3), 7), 2)  # node 3 has no children: nothing more tried
    assert (through_third.tried, through_third.accepted, through_third.ranks) == (1, 1, (2,))
    second_then_stop = path_stats(tree, TreeAcceptance((0, 2), 7), 2)  # node 2's child was tried, rejected
    assert (second_then_stop.tried, second_then_stop.accepted, second_then_stop.ranks) == (2, 1, (1,))
    deep = path_stats(tree, TreeAcceptance((0, 2, 5), 7), 3)
    assert (deep.tried, deep.accepted, deep.ranks) == (2, 2, (1, 0))
    cut = path_stats(tree, TreeAcceptance((0, 2, 5), 7), 2)  # a length limit commits node 2 only
    assert (cut.tried, cut.accepted, cut.ranks) == (1, 1, (1,))
    # a lookup branch takes its share of the budget; zero-probability candidates take none
    dists = PositionDistributions(torch.tensor([[5, 6, 7], [8, 9, 10]]),
                                  torch.tensor([[-0.1, -2.5, float("-inf")], [-0.2, -3.0, float("-inf")]]))
    grown = propose_tree(4, dists, [6, 11], 5)
    assert len(grown) == 6 and grown.children(0).keys() >= {5, 6} and 7 not in grown.tokens
    assert [6, 11] in grown.paths() or any(p[:2] == [6, 11] for p in grown.paths())


@pytest.mark.parametrize("seed", range(6))
def test_a_tree_step_books_what_its_first_choice_chain_would_have_accepted(seed: int) -> None:
    """The per-depth counts the policy prices chains by (accepted_by_position, tries) are, in a
    tree step, those of the drafter's first-choice chain (the tree's spine) walked against the
    same target tokens: a tree's siblings must not inflate the chain's rates (the policy adds
    the tree's gain over the chain from its node trials). The tree's own path still sets tau and
    the accepted ranks."""
    from blockspec.dflash.proposers import BestFirstProposer, Draft, PositionDistributions
    from blockspec.dflash.token_tree import TokenTree
    from blockspec.dflash.tree_step import path_stats
    from blockspec.dflash.tree_verify import walk

    gen = torch.Generator().manual_seed(seed)
    deviated = 0
    for trial in range(40):
        dists = PositionDistributions.from_logits(torch.randn(5, 6, generator=gen), 3)
        tree = BestFirstProposer(9).propose(Draft(0, dists))
        # target tokens: mostly one of each node's children (first or other), sometimes none
        targets = []
        for node in range(len(tree)):
            kids = list(tree.children(node))
            pick = int(torch.randint(0, len(kids) + 1, (1,), generator=gen)) if kids else 0
            targets.append(kids[pick] if pick < len(kids) else 99)
        spine = [0]
        while tree.children(spine[-1]):
            spine.append(next(iter(tree.children(spine[-1]).values())))
        chain = TokenTree.chain(0, [tree.tokens[i] for i in spine[1:]])
        chain_walk = walk(chain, [targets[i] for i in spine])
        want = path_stats(chain, chain_walk, chain_walk.accepted + 1)
        acceptance = walk(tree, targets)
        row = make_row(trial, 3, SamplingParams(max_new_tokens=20), (), 8)
        committed = acceptance.committed(tree)
        DecodeBatch._record_tree(row, tree, acceptance, len(committed), committed, [])
        assert row.stats.acceptance_lengths == [acceptance.accepted + 1]
        assert row.stats.accepted_by_position[: want.accepted] == [1] * want.accepted
        assert sum(row.stats.accepted_by_position) == want.accepted
        assert row.tries[: want.tried] == [1] * want.tried and sum(row.tries) == want.tried
        deviated += acceptance.accepted > want.accepted
    assert deviated > 0  # some paths went through a sibling


def _unseeded_counts(lossy: bool, monkeypatch: pytest.MonkeyPatch):
    """Counts of the first 3 tokens of 4000 unseeded sampled tree decodes (vocabulary 10) and the
    target's exact joint distribution of them."""
    from support import PROMPT, VOCAB, exact_joint

    if lossy:  # planted: the drafter's first choice at every node is kept, whatever the target draws
        def first_children(tree, tokens):
            path = [0]
            while tree.children(path[-1]):
                path.append(next(iter(tree.children(path[-1]).values())))
            return TreeAcceptance(tuple(path), int(tokens[path[-1]]))

        monkeypatch.setattr(batch_module, "walk", first_children)
    model = make_tiny_target("llama", vocab_size=VOCAB, seed=1)
    sp = SamplingParams(max_new_tokens=3, ignore_eos=True, temperature=1.0)
    drafter = new_drafter_for_target(model.config, mask_token_id=VOCAB - 1, num_layers=1, block_size=8,
                                     dtype=torch.float64, seed=3)
    dec = SpecDecoder(HFTarget(model), drafter, SpecConfig(block_size=8, tree_nodes=6))
    longer = sp.with_(max_new_tokens=8)  # the first step's tree: 6 nodes over 7 depths
    counts = torch.zeros(VOCAB, VOCAB, VOCAB)
    accepted = 0
    for _ in range(10):
        for r in dec.generate([PROMPT] * 400, longer):  # no seed: each row draws its own
            a, b, c = r.token_ids[:3]
            counts[a, b, c] += 1
            accepted += sum(r.stats.accepted_by_position)
    return counts, exact_joint(model, sp), accepted


def test_unseeded_sampled_trees_follow_the_target_distribution(monkeypatch: pytest.MonkeyPatch) -> None:
    from support import chi2_pvalue

    counts, joint, accepted = _unseeded_counts(False, monkeypatch)
    assert accepted > 400  # the trees' proposals were accepted often: the test exercises them
    assert chi2_pvalue(counts.sum((1, 2)), joint.sum((1, 2))) > 1e-3
    assert chi2_pvalue(counts.sum(0), joint.sum(0)) > 1e-3  # (x2, x3): from the trees
    assert chi2_pvalue(counts, joint) > 1e-3


def test_chi_square_detects_a_lossy_tree_walk(monkeypatch: pytest.MonkeyPatch) -> None:
    from support import chi2_pvalue

    counts, joint, _ = _unseeded_counts(True, monkeypatch)
    assert chi2_pvalue(counts.sum(0), joint.sum(0)) < 1e-6


def test_a_lookup_step_after_a_tree_step_reports_a_chain() -> None:
    """`step_lookup` verifies a chain: what the policy books a step by (`tree_step`, `node_trials`)
    must not be the tree step's before it."""
    model = make_tiny_target("llama", seed=8)
    base = [5, 9, 13, 7, 22, 31]
    prompts = [base * 3]
    truth = [reference_greedy(model, p, MAX_NEW) for p in prompts]
    drafter = RankedDrafter(model, prompts, truth, seed=8, absent_share=6)
    batch = DecodeBatch(HFTarget(model), drafter, max_block=8, tree_nodes=10, lookup=LookupConfig(min_ngram=2))
    rows = [make_row(0, len(prompts[0]), SamplingParams(max_new_tokens=MAX_NEW), (), 8)]
    batch.join(prompts, rows)
    seen = 0
    while batch.rows:
        batch.step(8, tree=True)
        tree = batch.tree_step
        batch.retire()
        if tree and batch.rows and batch.lookup_plan()[0]:
            assert batch.step_lookup([8]) > 1
            assert not batch.tree_step and batch.node_trials == []
            seen += 1
            batch.retire()
    assert rows[0].generated == truth[0] and seen > 0


def test_a_greedy_step_whose_trees_are_chains_verifies_them_as_chains(monkeypatch: pytest.MonkeyPatch) -> None:
    """Trees of one proposed node are chains: such a step takes the chain's verify (no packed
    tree, no node trials, booked as a chain) and decodes what plain decoding does; wider trees
    of the same batch still go through the tree pass."""
    model, prompts, truth = _setup("llama", 3, 5)
    drafter = RankedDrafter(model, prompts, truth, seed=5)
    packed = []
    real_pack = batch_module.pack_trees
    monkeypatch.setattr(batch_module, "pack_trees", lambda *a, **k: packed.append(1) or real_pack(*a, **k))
    batch = DecodeBatch(HFTarget(model), drafter, max_block=8, tree_nodes=10)
    rows = [make_row(i, len(p), SamplingParams(max_new_tokens=MAX_NEW), (), 8) for i, p in enumerate(prompts)]
    batch.join(prompts, rows)
    narrow = wide = 0
    while batch.rows:
        batch.retire()
        if not batch.rows:
            break
        block = 2 if (narrow + wide) % 2 == 0 else 6
        before = len(packed)
        batch.step(block, tree=True)
        if block == 2:
            assert len(packed) == before and not batch.tree_step and batch.node_trials == []
            narrow += 1
        else:
            wide += batch.tree_step and len(packed) == before + 1
    assert narrow > 2 and wide > 2
    assert [r.generated for r in rows] == truth


def test_seeded_sampled_trees_that_are_chains_equal_seeded_plain_decoding(monkeypatch: pytest.MonkeyPatch) -> None:
    """A sampled step whose trees are chains verifies them as chains with each row's keyed draws,
    as the walk would: a seed still fixes the text, and no row takes the standard rule."""
    model, prompts, truth = _setup("qwen3", 3, seed=6)
    drafter = RankedDrafter(model, prompts, truth, seed=6)
    params = [SamplingParams(max_new_tokens=MAX_NEW, temperature=t, top_p=p, seed=s, logprobs=1)
              for t, p, s in ((0.7, 1.0, 21), (1.0, 0.9, 22), (0.9, 1.0, 23))]
    packed = []
    real_pack = batch_module.pack_trees
    monkeypatch.setattr(batch_module, "pack_trees", lambda *a, **k: packed.append(1) or real_pack(*a, **k))
    target = HFTarget(model)
    narrow = _decode(target, drafter, prompts, params, block=2, tree_nodes=10)
    plain = _decode(target, drafter, prompts, params, block=1, tree_nodes=10)
    assert packed == [] and all(r.stats.tree_steps == 0 for r in narrow)
    for n, p in zip(narrow, plain):
        assert n.generated == p.generated
        assert [a.logprob for a in n.logprobs] == pytest.approx([b.logprob for b in p.logprobs], abs=1e-6)
    assert sum(sum(r.stats.accepted_by_position) for r in narrow) > 0  # some proposals were kept
