"""Batch proposers (dflash/proposers/batched.py) through their one interface: a DFlash block
(greedy, sampled under the keyed or standard rule), a DFlash 2 walk (greedy, sampled) and the
lookup override, each against the per-row construction it stands for; and every configuration
of a drafting step runs the draft head once, whether the step verifies a chain, a tree, or a
chain its trim chose over an offered tree."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from conftest import make_tiny_target
from support import one_thread, ragged_prompts  # noqa: F401 (fixture)
from test_dflash2_decode import random_dflash2

from blockspec.config import LookupConfig, SamplingParams
from blockspec.dflash.batch import DecodeBatch
from blockspec.dflash.trim import Shape
from blockspec.dflash.row import make_row
from blockspec.dflash.drafter import new_drafter_for_target
from blockspec.dflash.proposers import (BatchDraft, DFlash2WalkProposer, DFlashBlockProposer, Draft, LookupOverride,
                                        SelectorDistributions, SelectorWalkProposer)
from blockspec.dflash.sampling import RowRandom, probabilities
from blockspec.dflash.sparse_probs import SparseProbs
from blockspec.errors import ConfigError
from blockspec.targets.hf import HFTarget

pytestmark = pytest.mark.usefixtures("one_thread")

GREEDY = SamplingParams(max_new_tokens=12, ignore_eos=True)
KEYED = SamplingParams(max_new_tokens=12, temperature=0.8, top_p=0.95, seed=3, sampling_rule="keyed", ignore_eos=True)
STANDARD = KEYED.with_(seed=4, sampling_rule="standard")


def _model():
    return make_tiny_target("llama", seed=0)


def _dflash(model):
    return new_drafter_for_target(model.config, mask_token_id=model.config.vocab_size - 1, num_layers=1,
                                  block_size=8, seed=3, dtype=torch.float64)


def _draft(drafter, model, params: list[SamplingParams], *, depth: int = 5, **over) -> BatchDraft:
    """A BatchDraft over random hidden states for rows of `params` (their roots 1, 2, ..)."""
    b = len(params)
    gen = torch.Generator().manual_seed(11)
    hidden = torch.randn(b, depth, model.config.hidden_size, generator=gen, dtype=torch.float64)
    kw = dict(hidden=hidden, head=HFTarget(model).head(), last=torch.arange(1, b + 1),
              starts=[3 + 2 * i for i in range(b)], random=RowRandom([p.seed for p in params]),
              temperature=torch.tensor([p.temperature for p in params], dtype=torch.float32),
              top_k=torch.tensor([p.top_k for p in params]),
              top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32),
              rules=[p.rule for p in params], constraints=[None] * b)
    return BatchDraft(**{**kw, **over})


def test_a_batch_draft_refuses_a_step_that_wants_nothing() -> None:
    model = _model()
    with pytest.raises(ConfigError, match="chain"):
        _draft(_dflash(model), model, [GREEDY], chain=False, tree_top_k=0)
    with pytest.raises(ConfigError, match="tree_top_k"):
        _draft(_dflash(model), model, [GREEDY], tree_top_k=-1)


def test_a_greedy_dflash_block_is_the_draft_argmax_and_its_trees_top_choice() -> None:
    model = _model()
    drafter = _dflash(model)
    draft = _draft(drafter, model, [GREEDY, GREEDY])
    logits = drafter.logits(draft.hidden, draft.head)  # [b, D, V]
    proposer = DFlashBlockProposer(drafter, sampled=False)
    plain = proposer.propose(draft)
    assert torch.equal(plain.ids, logits.argmax(-1)) and plain.confidence is None and plain.distributions is None
    trimmed = proposer.propose(replace(draft, confidence=True))
    assert torch.equal(trimmed.ids, plain.ids)
    assert torch.allclose(trimmed.confidence.double(), logits.softmax(-1).amax(-1), rtol=1e-5)
    offered = proposer.propose(replace(draft, confidence=True, tree_top_k=3))
    assert torch.equal(offered.ids, plain.ids)
    assert torch.allclose(offered.confidence, trimmed.confidence, rtol=1e-5)
    for i, dist in enumerate(offered.distributions):
        for d in range(1, 6):
            ids, logps = dist.children(d, 0)
            assert ids == logits[i, d - 1].topk(3).indices.tolist() and len(logps) == 3
    tree_only = proposer.propose(replace(draft, chain=False, tree_top_k=3))
    assert tree_only.ids is None and len(tree_only.distributions) == 2


@pytest.mark.parametrize("params", [[KEYED, KEYED], [STANDARD, KEYED], [GREEDY, STANDARD]],
                         ids=["keyed", "standard_and_keyed", "greedy_and_standard"])
def test_a_sampled_dflash_block_draws_the_targets_keyed_draws_with_or_without_a_tree(params) -> None:
    """Proposals are the rows' keyed draws from their shaped draft distributions (the draws a
    chain-only step takes), the same where the step is also offered a tree, whose distributions
    come from the same head pass; the standard rule's rows keep the q they were drawn from."""
    model = _model()
    drafter = _dflash(model)
    draft = _draft(drafter, model, params, confidence=True)
    logits = drafter.logits(draft.hidden, draft.head)
    probs = probabilities(logits, draft.temperature, draft.top_k, draft.top_p)  # [b, D, V]
    want = RowRandom([p.seed for p in params]).sample(probs, list(draft.starts))
    proposer = DFlashBlockProposer(drafter, sampled=True)
    chain = proposer.propose(draft)
    offered = proposer.propose(replace(draft, tree_top_k=4))
    for got in (chain, offered):
        assert torch.equal(got.ids, want)
        assert torch.equal(got.confidence, probs.amax(-1))
        if any(p.rule == "standard" for p in params):
            # a batch of temperature / top-p rows keeps its q as its nucleus's pairs
            q = got.draft_q
            assert isinstance(q, SparseProbs) == all(not p.greedy for p in params)
            assert torch.equal(q.dense() if isinstance(q, SparseProbs) else q, probs)
        else:
            assert got.draft_q is None
    logp = torch.log_softmax(logits, -1)
    for i, (p, dist) in enumerate(zip(params, offered.distributions)):
        # a sampled row's tree grows where its draws go (its shaped distribution), a greedy row's
        # from the draft softmax itself
        ref = logp[i] if p.greedy else probs[i].log()
        for d in range(1, 6):
            ids, _ = dist.children(d, 0)
            assert set(ids) <= set(ref[d - 1].topk(4).indices.tolist()) and ids[0] == int(ref[d - 1].argmax())


@pytest.mark.parametrize("draft_vocab", [False, True], ids=["", "draft_vocab"])
@pytest.mark.parametrize("rows", ["nucleus", "mixed"])
def test_a_sampled_rows_tree_ranks_the_k_most_likely_tokens_of_its_shaped_distribution(draft_vocab: bool,
                                                                                       rows: str) -> None:
    """The tree's top-k of a sampled row, read off the draft vocabulary's logits (rows of several
    kinds) or its nucleus's pairs (temperature / top-p rows alone), is the top-k of its shaped
    draft distribution over the whole vocabulary (ids in order and the same log-probabilities),
    a nucleus narrower than k leaving the rest out; a greedy row's beside it is what a greedy
    step's tree grows from. The pairs give the same draws, peaks and q as the vocabulary-wide
    rows."""
    model = _model()
    drafter = _dflash(model)
    vocab = model.config.vocab_size
    if draft_vocab:
        drafter.set_draft_vocab(torch.arange(1, vocab, 3), vocab)
    narrow = KEYED.with_(top_p=0.05, temperature=0.2, seed=8)  # a nucleus of a few tokens here
    params = [KEYED, narrow, STANDARD] if rows == "nucleus" else [KEYED, narrow, STANDARD.with_(top_k=3), GREEDY]
    draft = _draft(drafter, model, params, tree_top_k=6, confidence=True)
    proposal = DFlashBlockProposer(drafter, sampled=True).propose(draft)
    got = proposal.distributions
    logits = drafter.logits(draft.hidden, draft.head)  # [b, D, V], -inf outside a draft vocabulary
    probs = probabilities(logits, draft.temperature, draft.top_k, draft.top_p)  # [b, D, V]
    assert isinstance(proposal.draft_q, SparseProbs) == (rows == "nucleus")
    q = proposal.draft_q
    assert torch.equal(q.dense() if isinstance(q, SparseProbs) else q, probs)
    assert torch.equal(proposal.ids, RowRandom([p.seed for p in params]).sample(probs, list(draft.starts)))
    assert torch.equal(proposal.confidence, probs.amax(-1))
    greedy_top, greedy_ids = drafter.top_logprobs(draft.hidden, draft.head, 6)  # [b, D, 6]
    narrower = 0
    for i, p in enumerate(params):
        for d in range(1, draft.hidden.shape[1] + 1):
            ids, lps = got[i].children(d, 0)
            if p.greedy:
                assert ids == greedy_ids[i, d - 1].tolist()
                assert lps == greedy_top[i, d - 1].tolist()
                continue
            row = probs[i, d - 1]
            order = row.sort(descending=True, stable=True).indices[:6]
            want = [t for t in order.tolist() if row[t] > 0]
            narrower += len(want) < 6
            assert ids == want
            assert lps == row[want].log().float().tolist()
    assert narrower  # the narrow nucleus and the top-k row were cut below k


def test_a_greedy_dflash2_walk_is_the_selectors_walk_per_row() -> None:
    model = _model()
    drafter = random_dflash2(model, seed=2, top_k=4)
    draft = _draft(drafter, model, [GREEDY, GREEDY, GREEDY])
    proposer = DFlash2WalkProposer(drafter, sampled=False)
    plain = proposer.propose(draft)
    offered = proposer.propose(replace(draft, confidence=True, tree_top_k=4))
    cands = drafter.candidates(draft.hidden, draft.head, normaliser=True)
    for i in range(3):
        root = int(draft.last[i])
        dists = SelectorDistributions(drafter.candidate_selector, draft.hidden[i], cands.ids[i], cands.logits[i],
                                      cands.logsumexp[i])  # trees on the unary scale
        walked = SelectorWalkProposer(5).propose(Draft(root, dists))
        assert plain.ids[i].tolist() == offered.ids[i].tolist() == list(walked.tokens[1:])
        assert offered.distributions[i].children(2, 7) == dists.children(2, 7)
    assert offered.confidence.shape == (3, 5) and bool(((offered.confidence > 0) & (offered.confidence <= 1)).all())


@pytest.mark.parametrize("rule", ["keyed", "standard"])
def test_a_sampled_dflash2_walk_draws_the_same_with_or_without_a_tree(rule: str) -> None:
    model = _model()
    drafter = random_dflash2(model, seed=2, top_k=4)
    params = [KEYED.with_(sampling_rule=rule, seed=s) for s in (5, 6)] + [GREEDY]
    draft = _draft(drafter, model, params, confidence=True)
    proposer = DFlash2WalkProposer(drafter, sampled=True)
    chain = proposer.propose(draft)
    offered = proposer.propose(replace(draft, tree_top_k=4))
    assert torch.equal(chain.ids, offered.ids) and torch.equal(chain.confidence, offered.confidence)
    cands = drafter.candidates(draft.hidden, draft.head)
    assert bool((chain.ids[..., None] == cands.ids).any(-1).all())  # every proposal is a candidate
    if rule == "standard":
        assert torch.equal(chain.draft_q, offered.draft_q)
        assert torch.allclose(chain.draft_q.sum(-1), torch.ones(3, 5, dtype=chain.draft_q.dtype))
        outside = torch.ones_like(chain.draft_q, dtype=torch.bool).scatter_(-1, cands.ids, False)
        assert not chain.draft_q[outside].any()  # q_t is zero outside the candidates
    else:
        assert chain.draft_q is None
    # other seeds draw other proposals: the draws are the rows' own
    others = [proposer.propose(replace(draft, random=RowRandom([s, s + 1, None]))).ids for s in range(100, 110, 2)]
    assert any(not torch.equal(other[:2], chain.ids[:2]) for other in others)
    assert all(torch.equal(other[2], chain.ids[2]) for other in others)  # the greedy row's walk is its best


def test_the_lookup_override_proposes_each_rows_continuation_first() -> None:
    model = _model()
    drafter = _dflash(model)
    plan = [[9, 8], [], [7, 6, 5, 4, 3, 2, 1]]
    draft = _draft(drafter, model, [GREEDY] * 3, lookup=plan)
    inner = DFlashBlockProposer(drafter, sampled=False)
    drafted = inner.propose(draft).ids
    got = LookupOverride(inner).propose(draft)
    assert got.looked == (2, 0, 5)
    want = drafted.clone()
    want[0, :2] = torch.tensor([9, 8])
    want[2] = torch.tensor([7, 6, 5, 4, 3])
    assert torch.equal(got.ids, want)
    assert LookupOverride(inner).propose(replace(draft, lookup=[[], [], []])).looked == ()


def test_a_dflash2_walk_under_the_lookup_override_walks_on_from_the_continuation() -> None:
    model = _model()
    drafter = random_dflash2(model, seed=2, top_k=4)
    draft = _draft(drafter, model, [GREEDY, GREEDY], lookup=[[9, 8], []])
    inner = DFlash2WalkProposer(drafter, sampled=False)
    got = LookupOverride(inner, walks=True).propose(draft)
    forced = torch.tensor([[9, 8, -1, -1, -1], [-1] * 5])
    assert torch.equal(got.ids, inner.propose(replace(draft, forced=forced)).ids)
    assert got.ids[0, :2].tolist() == [9, 8] and got.looked == (2, 0)
    cands = drafter.candidates(draft.hidden, draft.head)
    dists = SelectorDistributions(drafter.candidate_selector, draft.hidden[0], cands.ids[0], cands.logits[0])
    # the proposal after the continuation is the selector's best after its last token
    assert int(got.ids[0, 2]) == dists.children(3, 8)[0][0]


CONFIGS = {"greedy": [GREEDY, GREEDY], "keyed": [KEYED, KEYED.with_(seed=8)], "standard": [STANDARD, STANDARD],
           "mixed": [GREEDY, KEYED, STANDARD]}


@pytest.mark.parametrize("dflash2", [False, True], ids=["dflash", "dflash2"])
@pytest.mark.parametrize("rows", list(CONFIGS))
@pytest.mark.parametrize("shape", ["chain", "trimmed_chain", "tree", "offered_tree_chosen", "offered_chain_chosen"])
@pytest.mark.parametrize("lookup", [False, True], ids=["", "lookup"])
def test_every_drafting_step_runs_the_draft_head_once(monkeypatch: pytest.MonkeyPatch, dflash2: bool, rows: str,
                                                      shape: str, lookup: bool) -> None:
    """Counted where every head pass goes through (`_shape_logits`: the full or draft-vocabulary
    head's logits), over a whole decode of ragged rows that join and leave."""
    model = _model()
    drafter = random_dflash2(model, seed=2, top_k=4) if dflash2 else _dflash(model)
    passes: list[int] = []
    shape_logits = drafter._shape_logits
    monkeypatch.setattr(drafter, "_shape_logits", lambda x: passes.append(1) or shape_logits(x))
    tree_nodes = 0 if "chain" == shape or shape == "trimmed_chain" else 6
    batch = DecodeBatch(HFTarget(model), drafter, max_block=6, tree_nodes=tree_nodes,
                        lookup=LookupConfig(min_ngram=1, max_ngram=2) if lookup else None)
    tree_steps: list[int] = []  # steps that took the tree's shape (a tree that is a chain then verifies as one)
    verify_tree = batch._verify_tree
    monkeypatch.setattr(batch, "_verify_tree", lambda *a: tree_steps.append(1) or verify_tree(*a))

    def trim(conf, from_lookup, offers=None):
        if shape == "offered_chain_chosen":
            return Shape(4, tree=False)
        return 4

    params = CONFIGS[rows]
    prompts = [[3, 4, 5, 3, 4], [7, 8, 9], [5, 6, 7, 5]][: len(params)]
    batch.join(prompts[:1], [make_row(0, len(prompts[0]), params[0], (), 6)])
    drafting = 0
    pending = list(range(1, len(params)))
    while batch.rows or pending:
        batch.retire()
        if pending:  # a row joins after every step, so the proposer is chosen again
            i = pending.pop(0)
            batch.join([prompts[i]], [make_row(i, len(prompts[i]), params[i].with_(max_new_tokens=8 + i), (), 6)])
        if not batch.rows:
            continue
        passes.clear()
        block = 6 if max(r.remaining for r in batch.rows) > 1 else 1
        batch.step(block, trim if shape not in ("chain", "tree") else None)
        assert len(passes) == (block > 1), (shape, passes)
        drafting += block > 1
    assert drafting > 2
    assert (len(tree_steps) > 0) == (shape in ("tree", "offered_tree_chosen"))


def test_the_proposer_is_chosen_again_when_rows_join_or_leave() -> None:
    model = _model()
    batch = DecodeBatch(HFTarget(model), _dflash(model), max_block=6, lookup=LookupConfig(min_ngram=1, max_ngram=2))
    batch.join([[3, 4, 5]], [make_row(0, 3, GREEDY, (), 6)])
    first = batch._proposer()
    assert isinstance(first, LookupOverride) and not first.inner.sampled and batch._proposer() is first
    batch.join([[7, 8]], [make_row(1, 2, KEYED, (), 6)])
    assert batch._proposer().inner.sampled
    batch.rows[1].finish_reason = "stop"
    batch.retire()
    assert not batch._proposer().inner.sampled


@pytest.mark.parametrize("dflash2", [False, True], ids=["dflash", "dflash2"])
@pytest.mark.parametrize("rows", ["keyed", "standard", "mixed"])
def test_a_sampled_step_offered_trees_verifies_the_chain_a_chains_only_batch_draws(
        monkeypatch: pytest.MonkeyPatch, dflash2: bool, rows: str) -> None:
    """Where the trim answers with chains, a batch offered trees verifies the very proposals (and
    the standard rule's q) of a batch without trees, drawn with the same keyed randomness from the
    one head pass its trees' top-k came from: seeded output does not change."""
    model = _model()
    drafter = random_dflash2(model, seed=2, top_k=4) if dflash2 else _dflash(model)
    params = [p.with_(max_new_tokens=24, **({} if p.greedy else {"seed": 20 + i})) for i, p in enumerate(CONFIGS[rows])]
    prompts = ragged_prompts(len(params), seed=5, vocab=48)
    runs = []
    for tree_nodes in (0, 6):
        batch = DecodeBatch(HFTarget(model), drafter, max_block=6, tree_nodes=tree_nodes)
        seen: list = []
        verify = batch._verify_and_commit

        def spy(ids, *a, _verify=verify, _batch=batch, **k):
            q = _batch._draft_q
            seen.append((ids.tolist(), None if q is None else q.dense() if isinstance(q, SparseProbs) else q.clone()))
            return _verify(ids, *a, **k)

        monkeypatch.setattr(batch, "_verify_and_commit", spy)
        decoded = [make_row(i, len(p), sp, (), 6) for i, (p, sp) in enumerate(zip(prompts, params))]
        batch.join(prompts, decoded)
        while batch.rows:
            batch.step(6, lambda conf, looked, offers=None: Shape(4, tree=False) if offers is not None else 4)
            batch.retire()
        runs.append((seen, [r.generated for r in decoded]))
    (chain_seen, chain_out), (offered_seen, offered_out) = runs
    assert offered_out == chain_out and all(len(g) == 24 for g in chain_out)
    assert len(chain_seen) > 3 and [ids for ids, _ in offered_seen] == [ids for ids, _ in chain_seen]
    for (_, a), (_, b) in zip(chain_seen, offered_seen):
        assert (a is None and b is None) or torch.equal(a, b)


class _EveryThird:
    """A grammar that allows the token ids t with t % 3 == `r` and is complete after `length`
    tokens (then anything may follow, as dflash/constraint.py fills it)."""

    def __init__(self, r: int, vocab: int, length: int = 3) -> None:
        self.r, self.vocab, self.length, self.accepted = r, vocab, length, 0

    def fill_mask(self, out: torch.Tensor) -> None:
        allowed = torch.zeros(out.numel() * 32, dtype=torch.bool)
        allowed[self.r:self.vocab:3] = True
        words = (allowed.view(-1, 32).long() << torch.arange(32)).sum(-1)  # bit j of word w: token 32w + j
        out.copy_(torch.where(words >= 2**31, words - 2**32, words).to(torch.int32))

    def accept(self, token: int) -> bool:
        if token % 3 != self.r:
            return False
        self.accepted += 1
        return True

    def rollback(self, n: int) -> None:
        self.accepted -= n

    def is_terminated(self) -> bool:
        return self.accepted >= self.length


def _old_greedy(drafter, draft: BatchDraft) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The greedy proposals as the block proposer made them when it ran the head twice for
    constrained rows: the greedy kernel over every row, then the constrained rows' full logits
    masked by their grammar."""
    from blockspec.dflash.constraint import argmax_masked

    if draft.confidence:
        ids, conf = drafter.greedy_with_confidence(draft.hidden, draft.head, draft.last)
    else:
        ids, conf = drafter.greedy_tokens(draft.hidden, draft.head, draft.last), None
    rows = [i for i, c in enumerate(draft.constraints) if c is not None]
    logits = drafter.logits(draft.hidden[torch.tensor(rows)], draft.head)  # [m, D, V]
    ids[torch.tensor(rows)] = argmax_masked(logits, rows, list(draft.constraints))
    return ids, conf


@pytest.mark.parametrize("confidence", [False, True], ids=["plain", "confidence"])
@pytest.mark.parametrize("draft_vocab", [False, True], ids=["", "draft_vocab"])
@pytest.mark.parametrize("layout", ["CFC", "FC", "CC"])
def test_constrained_greedy_rows_run_the_head_once_and_propose_what_two_passes_did(
        monkeypatch: pytest.MonkeyPatch, confidence: bool, draft_vocab: bool, layout: str) -> None:
    """A batch mixing rows under a grammar (C) and free rows (F): the proposals (and
    confidences) are those of the old kernel-then-mask path, each row's head runs once, the
    constrained rows' proposals keep to their grammar up to its end and free rows get the plain
    argmax."""
    model = _model()
    drafter = _dflash(model)
    vocab = model.config.vocab_size
    if draft_vocab:
        drafter.set_draft_vocab(torch.arange(0, vocab, 2), vocab)

    def draft() -> BatchDraft:  # fresh matchers: the old and new paths each walk their own
        constraints = [_EveryThird(i % 3, vocab) if k == "C" else None for i, k in enumerate(layout)]
        return _draft(drafter, model, [GREEDY] * len(layout), confidence=confidence, constraints=constraints)

    want_ids, want_conf = _old_greedy(drafter, draft())
    rows_seen: list[int] = []
    shape_logits = drafter._shape_logits  # every head pass, full or draft vocabulary, goes through it
    monkeypatch.setattr(drafter, "_shape_logits", lambda x: rows_seen.append(x.shape[0]) or shape_logits(x))
    this = draft()
    got = DFlashBlockProposer(drafter, sampled=False).propose(this)
    assert sum(rows_seen) == len(layout) and len(rows_seen) == len(set(layout))  # one pass per row
    assert torch.equal(got.ids, want_ids)
    if confidence:
        assert got.confidence.dtype == want_conf.dtype and torch.allclose(got.confidence, want_conf, rtol=1e-6)
    else:
        assert got.confidence is None
    assert all(c is None or c.accepted == 0 for c in this.constraints)  # matchers rolled back
    plain = drafter.logits(this.hidden, this.head).argmax(-1)  # [b, D]
    for i, kind in enumerate(layout):
        if kind == "F":
            assert torch.equal(got.ids[i], plain[i])
        else:  # up to the grammar's end (3 tokens) every proposal is one it allows
            assert all(int(t) % 3 == i % 3 for t in got.ids[i, :3]), (i, got.ids[i])
    assert not torch.equal(got.ids, plain)  # the grammar bit somewhere: the test sees masking
