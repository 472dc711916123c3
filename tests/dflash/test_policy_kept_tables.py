"""What the adaptive policy keeps between steps instead of deriving it again (dflash/policy.py):
CostModel's tables, kept until a calibration, a measurement or a thread count changes them, equal
tables derived from scratch to the last bit after every such change (and equal the documented
interpolation, done the long way); `record` moves only the kind of counts a step moved, so
what is kept from the other kind stays; and how ties fall: the best block among equal rates is
the smallest, and equal gains of a ragged split go to the rows in order."""

from __future__ import annotations

import copy
import random
from types import SimpleNamespace

import pytest

from blockspec.config import SamplingParams
from blockspec.dflash.policy import AdaptiveBlock, CostModel, bucket, split_lengths

MAX_BLOCK = 8
BATCHES = range(1, 9)  # buckets 1, 2, 4, 8, and sizes between them (scaled by `row_scale`)


def _fresh(model: CostModel) -> CostModel:
    """A model with `model`'s calibrations and measurements and nothing kept."""
    return CostModel(model.max_block, model.smoothing, copy.deepcopy(model.calibrated), copy.deepcopy(model.measured),
                     copy.deepcopy(model.drafting), model.threads, copy.deepcopy(model.other_threads),
                     copy.deepcopy(model.drafts_seen))


def _long_way(model: CostModel, batch: int) -> list[float]:
    """`CostModel.table` as documented, size by size: a measured size's own measurement, else its
    calibration times the measured/calibrated ratios of the nearest measured sizes, interpolated
    linearly (flat beyond the ends); then scaled to `batch` rows."""
    b = bucket(batch)
    base, seen = model.calibrated[b], model.measured.get(b, {})
    ratios = {n: t / base[n - 1] for n, t in seen.items() if base[n - 1] > 0}
    out = []
    for n in range(1, model.max_block + 1):
        if n in seen:
            out.append(seen[n])
            continue
        if not ratios:
            out.append(base[n - 1])
            continue
        lower, upper = [m for m in ratios if m <= n], [m for m in ratios if m >= n]
        if not lower or not upper:
            ratio = ratios[min(upper)] if not lower else ratios[max(lower)]
        elif max(lower) == min(upper):
            ratio = ratios[n]
        else:
            lo, hi = max(lower), min(upper)
            ratio = ratios[lo] + (n - lo) / (hi - lo) * (ratios[hi] - ratios[lo])
        out.append(base[n - 1] * ratio)
    scale = model.row_scale(batch)
    return out if scale is None else [c * s for c, s in zip(out, scale)]


def _drafts_long_way(model: CostModel, batch: int) -> list[float] | None:
    """`CostModel.draft_table` as documented: each step's estimate at the bucket's row count
    times its draft pass's calibrated share; a width measured by `observe_draft` its
    measurement, the others that estimate times the measured/estimated ratios of the nearest
    measured widths, interpolated linearly (flat beyond the ends); then scaled to `batch` rows."""
    b = bucket(batch)
    cal, base = model.drafting.get(b), model.calibrated[b]
    if cal is None:
        return None
    estimate = [t * (c / k if k > 0 else 0.0) for t, c, k in zip(_long_way(model, b), cal, base)]  # at b's rows
    seen = model.drafts_seen.get((model.threads, b), {})
    ratios = {n: t / estimate[n - 1] for n, t in seen.items() if estimate[n - 1] > 0}
    out = []
    for n in range(1, model.max_block + 1):
        if n in seen or not ratios:
            out.append(seen.get(n, estimate[n - 1]))
            continue
        lower, upper = [m for m in ratios if m <= n], [m for m in ratios if m >= n]
        lo = max(lower) if lower else min(upper)
        hi = min(upper) if upper else max(lower)
        ratio = ratios[lo] if lo == hi else ratios[lo] + (n - lo) / (hi - lo) * (ratios[hi] - ratios[lo])
        out.append(estimate[n - 1] * ratio)
    scale = model.row_scale(batch)
    return out if scale is None else [c * s for c, s in zip(out, scale)]


def _tables(model: CostModel) -> list:
    return [(model.table(b), model.draft_table(b), model.least_table(b), model.row_scale(b)) for b in BATCHES]


def test_kept_cost_tables_equal_fresh_ones_after_every_change() -> None:
    """Random calibrations, measurements of every batch size and block size, and thread count
    switches; every table is read before each change (so a kept one could go stale) and after
    it equals, to the last bit, a fresh model's and the long way's. The tables did change."""
    rng = random.Random(7)
    model = CostModel(MAX_BLOCK)

    def calibration() -> tuple[list[float], list[float] | None]:
        costs = [1.0 + rng.uniform(0.02, 0.3) * (n - 1) for n in range(1, MAX_BLOCK + 1)]
        drafting = [0.0] + [rng.uniform(0.01, 0.2) * c for c in costs[1:]] if rng.random() < 0.7 else None
        return costs, drafting

    for b in (1, 2, 4, 8):
        model.set(b, *calibration())
    model.use_threads(2)
    seen = set()
    for step in range(400):
        _tables(model)  # kept now: the change below must not leave them stale
        op = rng.random()
        if op < 0.7:
            model.observe(rng.choice(BATCHES), rng.randint(1, MAX_BLOCK), rng.uniform(0.5, 4.0))
        elif op < 0.85:
            model.observe_draft(rng.choice(BATCHES), rng.randint(1, MAX_BLOCK), rng.uniform(0.01, 0.5))
        elif op < 0.95:
            model.use_threads(rng.choice((1, 2)))
        else:
            model.set(rng.choice((1, 2, 4, 8)), *calibration())
        kept = _tables(model)
        assert kept == _tables(_fresh(model)), step
        for b, (table, drafts, *_) in zip(BATCHES, kept):
            assert table == _long_way(model, b), (step, b)
            long_way = _drafts_long_way(model, b)
            assert drafts == long_way if long_way is None else drafts == pytest.approx(long_way, rel=1e-12), (step, b)
            assert [model.cost(b, n) for n in range(1, MAX_BLOCK + 1)] == table
        seen.add(repr(kept))
    assert len(seen) > 300
    assert any(model.drafts_seen.values())  # the draft passes' measurements were among the changes
    # callers get copies: editing one leaves the model's tables as they were
    table = model.table(3)
    table[0] = -1.0
    drafts = model.draft_table(3) or [0.0]
    drafts[0] = -1.0
    assert model.table(3) == _fresh(model).table(3) and model.draft_table(3) == _fresh(model).draft_table(3)


def _batch(rate: float) -> SimpleNamespace:
    row = SimpleNamespace(remaining=100, params=SamplingParams(),
                          acceptance_rates=lambda prior, lookup=False: [rate] * (MAX_BLOCK - 1))
    return SimpleNamespace(drafter=object(), argmax_only=True, rows=[row], lookup_plan=lambda: [[]])


def test_the_best_block_among_equal_rates_is_the_smallest() -> None:
    """Rates 0.5 give E = 1, 1.5, 1.75, ...: costs making blocks 2 and 3 commit exactly as many
    tokens per second choose 2; costs making block 2 tie plain decoding choose 1 (no draft pass)."""
    tie = CostModel(MAX_BLOCK)
    tie.set(1, [1.0, 0.75, 0.875] + [10.0] * (MAX_BLOCK - 3))  # 1, 2, 2, ... tokens per second
    policy = AdaptiveBlock(MAX_BLOCK, costs=tie, probe_every=1000)
    policy.choose(_batch(0.5))  # the first drafting choice of a bucket checks plain decoding
    assert policy.choose(_batch(0.5)) == 2 and not policy.forced
    plain = CostModel(MAX_BLOCK)
    plain.set(1, [1.0, 1.5] + [10.0] * (MAX_BLOCK - 2))  # 1, 1, ... tokens per second
    policy = AdaptiveBlock(MAX_BLOCK, costs=plain, probe_every=1000)
    assert [policy.choose(_batch(0.5)) for _ in range(3)] == [1, 1, 1] and not policy.forced
    # the check can fail: block 2 a little cheaper wins
    cheaper = CostModel(MAX_BLOCK)
    cheaper.set(1, [1.0, 1.49] + [10.0] * (MAX_BLOCK - 2))
    policy = AdaptiveBlock(MAX_BLOCK, costs=cheaper, probe_every=1000)
    policy.choose(_batch(0.5))
    assert policy.choose(_batch(0.5)) == 2


def test_equal_gains_of_a_split_go_to_the_rows_in_order() -> None:
    """Three extra tokens of equal gain (row 0's two, row 1's one) where only one pays (padding
    costs whole rows): the first row's first, then a tie broken the other way round would
    give [1, 2]."""
    lengths, rate = split_lengths([[1.0, 1.5, 2.0], [1.0, 1.5]], 0.0, [1.0, 1.2, 5.0], 1.0)
    assert lengths == [2, 1] and rate == 2.5 / 1.2
    # the rows the other way round: row 1's second token would pad, so both first tokens pay
    assert split_lengths([[1.0, 1.5], [1.0, 1.5, 2.0]], 0.0, [1.0, 1.2, 5.0], 1.0)[0] == [2, 2]


def _row(rule_params: SamplingParams, positions: int) -> SimpleNamespace:
    stats = SimpleNamespace(accepted_by_position=[0] * positions, lookup_accepted_by_position=[0] * positions)
    return SimpleNamespace(params=rule_params, stats=stats, tries=[0] * positions, lookup_tries=[0] * positions)


def test_recorded_counts_add_up_and_move_only_their_kind() -> None:
    """Rows of two rules grow their counts step by step (drafted ones, looked-up ones, both or
    neither): the batch-wide counts of each rule are the sums of its rows' growth, each
    drafted trial is booked by depth, and only a kind whose counts moved renews what is kept
    from them (`priors`, and through `_recorded` each row's expectations)."""
    rng = random.Random(3)
    positions = MAX_BLOCK - 1
    greedy, sampled = SamplingParams(), SamplingParams(temperature=0.8, seed=1)
    rows = [_row(greedy, positions), _row(greedy, positions), _row(sampled, positions)]
    policy = AdaptiveBlock(MAX_BLOCK)
    sums = {rule: [[0] * positions for _ in range(4)] for rule in ("greedy", "keyed")}
    trials = {rule: [0] * positions for rule in sums}  # drafted (row, position) trials booked
    for step in range(60):
        before = [(list(r.stats.accepted_by_position), list(r.tries), list(r.stats.lookup_accepted_by_position),
                   list(r.lookup_tries)) for r in rows]
        kinds = step % 4  # bit 0: drafted proposals verified, bit 1: looked-up ones
        moved = [False, False]
        for r in rows:
            for k in range(positions):
                for looked, (acc, tries) in enumerate(((r.stats.accepted_by_position, r.tries),
                                                       (r.stats.lookup_accepted_by_position, r.lookup_tries))):
                    if kinds & (1 << looked) and rng.random() < 0.5:
                        tried = rng.randint(1, 3)
                        accepted = rng.randint(0, tried)
                        tries[k] += tried
                        acc[k] += accepted
                        sums[r.params.rule][2 * looked][k] += accepted
                        sums[r.params.rule][2 * looked + 1][k] += tried
                        trials[r.params.rule][k] += looked == 0
                        moved[looked] = True
        priors = (policy.priors(), policy.priors(lookup=True))
        recorded = list(policy._recorded)
        policy.record(rows, before)
        assert policy._recorded == [n + m for n, m in zip(recorded, moved)], step
        for lookup in (False, True):
            assert (policy.priors(lookup=lookup) is priors[lookup]) == (not moved[lookup]), step
    for rule, (acc, tries, lacc, ltries) in sums.items():
        counts = policy.acceptance[rule]
        assert (counts.accepted, counts.tries, counts.lookup_accepted, counts.lookup_tries) == (acc, tries, lacc, ltries)
        means = policy.node_acceptance(rule).means
        assert [means[(k + 1, 0)].tries if (k + 1, 0) in means else 0 for k in range(positions)] == trials[rule]
    assert min(policy._recorded) > 10 and min(min(t) for t in trials.values()) > 5
