"""What the adaptive policy costs a batch that decodes plainly: its expected tokens are kept
between steps that move no acceptance count, yet always equal a fresh computation; and a batch
whose policy never drafts runs no draft pass (the drafter's catch-up waits for a drafting step)
while its output stays the target's own greedy tokens."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_target

from blockspec.config import LookupConfig, SamplingParams
from blockspec.dflash.batch import DecodeBatch
from blockspec.dflash.row import make_row
from blockspec.dflash.drafter import DFLASH, DFLASH2, new_drafter_for_target
from blockspec.dflash.policy import adaptive as policy_module
from blockspec.dflash.policy import RULES, AdaptiveBlock, CostModel, acceptance_counts, expected_by_block
from blockspec.targets.native import load_native_target


@pytest.fixture(scope="module")
def model():
    return make_tiny_target(seed=3)


def _batch(model, prompts: list[list[int]], max_new: int = 40, architecture: str = DFLASH) -> DecodeBatch:
    target = load_native_target(model, dtype=None, eos_token_ids=())
    dflash2 = dict(conv_group_size=8, selector_rank=8, selector_top_k=4) if architecture == DFLASH2 else None
    drafter = new_drafter_for_target(model.config, mask_token_id=47, num_layers=1, dtype=torch.float64,
                                     block_size=4, architecture=architecture, dflash2=dflash2)
    batch = DecodeBatch(target, drafter, max_block=4, lookup=LookupConfig(min_ngram=1))
    _join(batch, prompts, max_new)
    return batch


def _join(batch: DecodeBatch, prompts: list[list[int]], max_new: int) -> None:
    sp = SamplingParams(max_new_tokens=max_new)
    start = len(batch.rows) + sum(1 for _ in prompts) * 100  # keys only need to be distinct
    batch.join(prompts, [make_row(start + i, len(p), sp, (), 4) for i, p in enumerate(prompts)])


def _fresh(policy: AdaptiveBlock, batch: DecodeBatch) -> list[float]:
    """`AdaptiveBlock.expected` computed from scratch: the batch-wide rates, then every row's."""
    priors = {rule: policy.global_rates(rule=rule) for rule in RULES}
    lookup = {rule: policy.global_rates(lookup=True, rule=rule) for rule in RULES}
    totals = [0.0] * policy.max_block
    for r, cont in zip(batch.rows, batch.lookup_plan()):
        rates = r.acceptance_rates(lookup, lookup=True)[: len(cont)] if cont else r.acceptance_rates(priors)
        totals = [t + e for t, e in zip(totals, expected_by_block(rates, policy.max_block, r.remaining))]
    return totals


def test_kept_expectations_equal_fresh_ones_through_drafting_joins_and_retirement(model) -> None:
    """Plain steps, drafting steps (whose acceptance `record` books), rows retiring and joining
    (a new row may reuse a gone row's id()), a row's counts edited in place and a changed prior:
    after each, the expectation the policy keeps equals one computed from scratch, and it did
    change along the way (so a stale one would have been caught), lookup plans of several
    lengths among them."""
    batch = _batch(model, [[5, 6, 7, 5, 6], [9, 8], [11, 12, 13]], max_new=12)
    policy = AdaptiveBlock(4)
    seen = []
    planned = set()  # lookup plan lengths met: a row's kept looked-up expectation serves them all
    for n, block in enumerate([1, 1, 3, 1, 2, 4, 1, 1, 3, 2, 1, 4, 1, 1, 2, 3, 1, 1, 4, 1]):
        if not batch.rows:
            break
        before = acceptance_counts(batch.rows)
        rows = list(batch.rows)
        batch.step(block)
        if block > 1:
            policy.record(rows, before)
        if n == 6:  # rows' counts edited in place, as a caller may: their tries of either kind
            unedited = policy.expected(batch.rows, batch.lookup_plan())
            for r in batch.rows:
                r.tries[0] += 5
                r.lookup_tries[0] += 5
            assert policy.expected(batch.rows, batch.lookup_plan()) != unedited
        if n == 9:
            policy.prior = 0.2
        batch.retire()
        if n in (5, 11):
            _join(batch, [[7, 7, 7], [3, 4]], max_new=6 + n)
        if batch.rows:
            planned.update(len(cont) for cont in batch.lookup_plan())
            kept = policy.expected(batch.rows, batch.lookup_plan())
            assert kept == _fresh(policy, batch), n  # to the last bit: the same sums in the same order
            assert policy.expected(batch.rows, batch.lookup_plan()) == kept  # asked twice: the same
            seen.append(tuple(kept))
    assert len(set(seen)) > 3 and len(planned - {0}) >= 2
    # rows that left are forgotten once they outnumber the batch's by far
    assert batch.rows
    policy._rows_expected.update({(-i, False): (None, (), [], [], []) for i in range(1, 100)})
    policy.expected(batch.rows, batch.lookup_plan())
    assert {key[0] for key in policy._rows_expected} == {id(r) for r in batch.rows}


def test_a_batch_whose_policy_never_drafts_runs_no_draft_pass(model, monkeypatch: pytest.MonkeyPatch) -> None:
    """Drafting measured far dearer than plain decoding (so no probe may pay): every step of a
    4-row batch is plain, the drafter never runs, the queued context features wait (the next
    draft pass would read them all), and each row's tokens equal plain decoding's."""
    prompts = [[5, 6, 7], [9, 8, 7, 6], [11], [12, 13]]
    batch = _batch(model, prompts, max_new=30)
    plain = DecodeBatch(batch.target, None, max_block=1)
    plain.join(prompts, [make_row(i, len(p), SamplingParams(max_new_tokens=30), (), 1) for i, p in enumerate(prompts)])
    passes: list[int] = []

    def counted(batch: DecodeBatch) -> None:
        draft = batch.draft
        monkeypatch.setattr(batch, "draft", lambda *a, **k: (passes.append(1), draft(*a, **k))[1])

    counted(batch)
    costs = CostModel(max_block=4)
    costs.set(4, [1e-4, 1.0, 1.0, 1.0])
    costs.observe(4, 2, 1.0)  # a real drafting step measured it: the batch probes only where it may pay
    policy = AdaptiveBlock(4, costs=costs, probe_every=2, plain_every=1000, challenge_every=1000)
    out: dict[object, list[int]] = {}
    while batch.rows:
        assert policy.step(batch) == 1
        for r in batch.retire():
            out[r.key] = r.generated
    assert passes == [] and policy.used == {1: 29}
    while plain.rows:
        plain.step(1)
        for r in plain.retire():
            out[("plain", r.key)] = r.generated
    keys = sorted(k for k in out if not isinstance(k, tuple))
    assert [out[k] for k in keys] == [out[("plain", i)] for i in range(4)]
    # the check can fail: a probe that drafts would have run the drafter
    batch = _batch(model, prompts, max_new=30)
    counted(batch)
    probing = AdaptiveBlock(4, costs=CostModel(max_block=4), probe_every=2)
    probing.costs.set(4, [1e-4, 1.0, 1.0, 1.0])
    # calibrated only, and counted as a batch of too few rows to go by its calibration: it probes regardless
    monkeypatch.setattr(policy_module, "MARGIN_ROWS", 5)
    for _ in range(6):
        probing.step(batch)
    assert passes


@pytest.mark.parametrize("architecture", [DFLASH, DFLASH2])
def test_a_long_plain_run_folds_its_queue_into_the_draft_cache(model, architecture: str,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Past FOLD_BYTES of queued features `retire` folds the queue into the draft cache, so a
    batch that keeps decoding plainly keeps a bounded queue (and backlog), and its next drafting
    step drafts what it would have after reading the whole backlog at once: the same draft hidden
    states, the same acceptance, the same tokens (DFlash 2's convolutions see a one-token block)."""
    import blockspec.dflash.batch as batch_module

    blocks = [1] * 12 + [3] + [1] * 5 + [4] + [1] * 3 + [2]

    def run(fold_columns: int) -> tuple[DecodeBatch, list[torch.Tensor], list[int]]:
        batch = _batch(model, [[5, 6, 7, 8, 9], [9, 8], [11, 12, 13]], max_new=40, architecture=architecture)
        column = batch.queue.pieces[0].feats[:, :1].nbytes  # one column of every row
        monkeypatch.setattr(batch_module, "FOLD_BYTES", fold_columns * column)
        passes: list[torch.Tensor] = []
        draft = batch.draft
        monkeypatch.setattr(batch, "draft", lambda *a, **k: (h := draft(*a, **k), passes.append(h))[0])
        widths = []
        for block in blocks:
            batch.step(block)
            batch.retire()
            widths.append(batch.queue.nbytes // column)
        return batch, passes, widths

    eager, eager_passes, eager_widths = run(10_000)
    # 4: folds between plain steps; 0: a fold after every step, so every drafting step comes right
    # after one and finds nothing queued (only the block's own tokens are new to the drafter)
    for fold_columns in (4, 0):
        folded, folded_passes, folded_widths = run(fold_columns)
        assert max(eager_widths) > 12 and max(folded_widths) <= fold_columns
        drafting = [h for h in folded_passes if h.shape[1] > 1]  # the folds' blocks are one token
        assert len(eager_passes) == len(drafting) == 3 < len(folded_passes)
        for a, b in zip(eager_passes, drafting):
            torch.testing.assert_close(b, a, rtol=1e-9, atol=1e-9)
        assert [r.generated for r in folded.rows] == [r.generated for r in eager.rows]
        assert [r.tries for r in folded.rows] == [r.tries for r in eager.rows]
        assert ([r.stats.accepted_by_position for r in folded.rows]
                == [r.stats.accepted_by_position for r in eager.rows])
    assert folded.draft_backlog == 0 or folded.draft_backlog <= len(folded.rows) * 4
    # a fold with nothing queued does nothing
    if folded.queue:
        folded.queue.take()
    assert not folded.fold_queue()
