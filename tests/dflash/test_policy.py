"""The adaptive block size (dflash/policy.py): the cost model, calibration, the choice of a
step's block size, widening and trimming, probes and lookup steps. Batches are stand-ins with
the fields the policy reads; clocks are fake, so no result depends on the machine's load."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from conftest import make_tiny_target

from blockspec.config import SamplingParams
from blockspec.dflash.drafter import new_drafter_for_target
from blockspec.dflash.policy import AdaptiveBlock, CostModel, buckets_up_to, calibration_sizes, expected_tokens
from blockspec.targets.native import load_native_target


def _confident_row(lookup_rate: float = 0.5) -> SimpleNamespace:
    return SimpleNamespace(remaining=100, params=SamplingParams(), acceptance_rates=lambda prior, lookup=False: [lookup_rate] * 7)


def test_adaptive_policy_widens_cheap_drafts_and_trims_by_confidence() -> None:
    costs = CostModel(max_block=8)
    for rows in (1, 2):
        costs.set(rows, [1.0 + 0.05 * (n - 1) for n in range(1, 9)], [0.0] + [0.02] * 7)
    costs.set(16, [1.0 + 0.5 * (n - 1) for n in range(1, 9)], [0.0] + [0.2 * n for n in range(2, 9)])
    policy = AdaptiveBlock(8, costs=costs)
    assert policy.widen(1, 3) == 8  # drafting 8 wide costs what drafting 3 does
    assert policy.widen(16, 3) == 3  # at 16 rows every extra drafted token costs 4% of the step
    untimed = CostModel(max_block=8)  # calibrated without timing the draft passes
    untimed.set(1, [1.0 + 0.1 * (n - 1) for n in range(1, 9)])
    assert policy.widen(1, 1) == 1 and AdaptiveBlock(8, costs=untimed).widen(1, 3) == 3
    trim = policy.trimmer(SimpleNamespace(rows=[_confident_row()]))
    assert trim([[0.97] * 7], [0]) == 8  # confident drafts: verify them all
    assert trim([[0.9, 0.9, 0.02, 0.9, 0.9, 0.9, 0.9]], [0]) == 3  # up to the unlikely one
    assert trim([[0.0] * 7], [0]) == 1  # hopeless drafts: a plain step (the draft is paid anyway)
    looked = policy.trimmer(SimpleNamespace(rows=[_confident_row(lookup_rate=0.8)]))
    assert looked([[0.0] * 7], [7]) == 8  # lookup proposals: lookup's rates (0.8), not the drafter's
    assert trim([[0.97] * 3], [0]) == 4  # a draft clipped by the rows' limits
    two = policy.trimmer(SimpleNamespace(rows=[_confident_row(), _confident_row()], skips_padding=True))
    assert two([[0.97] * 7, [0.0] * 7], [0, 0]) == 8  # one length for the batch: the sum decides
    # ragged: a length per row where the target skips padding; a step of T tokens costs what a
    # uniform block of T / rows does
    ragged = AdaptiveBlock(8, costs=costs, ragged=True)
    per_row = ragged.trimmer(SimpleNamespace(rows=[_confident_row(), _confident_row()], skips_padding=True))
    assert per_row([[0.97] * 7, [0.0] * 7], [0, 0]) == [8, 1]
    assert per_row([[0.97] * 7, [0.9, 0.9, 0.02, 0.9, 0.9, 0.9, 0.9]], [0, 0]) == [8, 3]
    assert per_row([[0.0] * 7, [0.0] * 7], [0, 0]) == [1, 1]
    unpacked = ragged.trimmer(SimpleNamespace(rows=[_confident_row(), _confident_row()], skips_padding=False))
    assert unpacked([[0.97] * 7, [0.0] * 7], [0, 0]) == 8  # padding would cost full rows: one length


def test_calibration_times_the_draft_pass_apart() -> None:
    from blockspec.dflash.policy import calibrate
    from blockspec.dflash.batch import DecodeBatch

    model = make_tiny_target("llama", seed=21)
    target = load_native_target(model, dtype=None, eos_token_ids=())
    drafter = new_drafter_for_target(model.config, mask_token_id=47, num_layers=1, dtype=torch.float64)
    totals, drafting = calibrate(DecodeBatch(target, drafter, max_block=4), 2, 4)
    assert len(totals) == len(drafting) == 4 and drafting[0] == 0.0
    assert all(0 < d < t for d, t in zip(drafting[1:], totals[1:]))


def test_cost_model_measures_the_draft_pass_apart() -> None:
    """`observe_draft`: a width whose draft passes real steps timed keeps its own measurement in
    `draft_table` (a first one capped at FIRST_TIMING_CAP times its estimate, a faster one
    believed, a slower one averaged in); the others take their calibrated share of the step
    times the measured/estimated ratio of the nearest measured widths, interpolated. Per thread
    count; a calibration forgets them; nothing without timed draft passes."""
    from blockspec.dflash.policy.costs import FIRST_TIMING_CAP

    costs = CostModel(max_block=6, smoothing=0.5)
    costs.set(1, [1.0, 2.0, 2.0, 2.0, 3.0, 3.0], [0.0, 1.0, 1.0, 1.0, 1.5, 1.5])  # the draft: half of each step
    costs.use_threads(2)
    assert costs.draft_table(1) == [0.0, 1.0, 1.0, 1.0, 1.5, 1.5]
    costs.observe_draft(1, 3, 0.25)
    # width 3 measured at a quarter of its estimate: every width follows that ratio
    assert costs.draft_table(1) == pytest.approx([0.0, 0.25, 0.25, 0.25, 0.375, 0.375])
    assert costs.table(1) == [1.0, 2.0, 2.0, 2.0, 3.0, 3.0]  # the steps' own costs do not move
    costs.observe_draft(1, 5, 1.5 * 0.5)  # width 5 at half: widths between interpolate the two ratios
    assert costs.draft_table(1) == pytest.approx([0.0, 0.25, 0.25, 0.375 * 1.0, 0.75, 0.75])
    costs.observe_draft(1, 3, 0.5)  # slower: averaged in
    costs.observe_draft(1, 5, 0.5)  # faster: believed at once
    assert costs.draft_table(1)[2] == pytest.approx(0.375) and costs.draft_table(1)[4] == pytest.approx(0.5)
    costs.observe_draft(1, 2, 100.0)  # a first timing far above its estimate (width 3's ratio: 0.375) is capped
    assert costs.draft_table(1)[1] == pytest.approx(FIRST_TIMING_CAP * 0.375)
    costs.observe_draft(1, 1, 5.0)  # a plain step drafts nothing: ignored
    assert costs.draft_table(1)[0] == 0.0
    costs.use_threads(1)  # another thread count: its own measurements (none yet)
    assert costs.draft_table(1) == [0.0, 1.0, 1.0, 1.0, 1.5, 1.5]
    costs.use_threads(2)
    assert costs.draft_table(1)[4] == pytest.approx(0.5)
    costs.set(1, [1.0, 2.0, 2.0, 2.0, 3.0, 3.0], [0.0, 1.0, 1.0, 1.0, 1.5, 1.5])
    assert costs.draft_table(1) == [0.0, 1.0, 1.0, 1.0, 1.5, 1.5]  # a calibration starts afresh
    untimed = CostModel(max_block=3)
    untimed.set(1, [1.0, 2.0, 3.0])
    untimed.observe_draft(1, 2, 0.5)
    assert untimed.draft_table(1) is None


def test_adaptive_policy_measures_draft_passes_that_do_not_catch_up(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each drafting step's draft pass (`DecodeBatch.draft_timing`) goes to the cost model at its
    drafted width, except one that caught up on a backlog; the lookup steps then price the
    drafting sizes by their own time plus the measured draft, not the calibration's share of the
    step. Fake clock: a step verifying n tokens costs 1 + 0.1 n seconds, its draft pass 0.1 more
    (the calibration said 1.0)."""
    from blockspec.dflash.policy import adaptive

    clock = SimpleNamespace(t=0.0)
    monkeypatch.setattr(adaptive, "time", SimpleNamespace(perf_counter=lambda: clock.t))
    row = SimpleNamespace(remaining=1000, acceptance_rates=lambda prior, lookup=False: [0.7] * 3,
                          params=SamplingParams(),
                          stats=SimpleNamespace(accepted_by_position=[0] * 3, lookup_accepted_by_position=[0] * 3),
                          tries=[0] * 3, lookup_tries=[0] * 3)
    drafted: list[tuple[int, bool]] = []

    def step(block: int, trim: object = None) -> int:
        batch.caught_up = block > 1 and len(drafted) % 3 == 0  # every third draft pass catches up
        drafted.extend([(block, batch.caught_up)] * (block > 1))
        batch.draft_timing = (block, 5.0 if batch.caught_up else 0.1) if block > 1 else None
        clock.t += 1.0 + 0.1 * block + (batch.draft_timing[1] if block > 1 else 0.0)
        batch.verified = block
        return block

    batch = SimpleNamespace(drafter=object(), argmax_only=True, rows=[row], skips_padding=False, verified=0,
                            lookup_plan=lambda: [[]], step=step, caught_up=False, draft_timing=None)
    costs = CostModel(max_block=4)
    costs.set(1, [1.1, 2.2, 2.3, 2.4], [0.0, 1.0, 1.0, 1.0])
    policy = AdaptiveBlock(4, costs=costs, plain_every=1000, challenge_every=1000)
    policy.widen = lambda b, block: block  # drafts the chosen width, untrimmed
    policy.trimmer = lambda batch: None
    for _ in range(9):
        policy.step(batch)
    widths = {w for w, caught in drafted if not caught}
    assert widths and any(caught for _, caught in drafted)
    assert costs.drafts_seen[(costs.threads, 1)] == {w: pytest.approx(0.1) for w in widths}
    drafts = costs.draft_table(1)
    assert all(drafts[w - 1] == pytest.approx(0.1) for w in widths)
    assert max(drafts) < 0.5  # the widths not measured follow the measured ones, not the calibration's 1.0


def test_adaptive_choice_follows_acceptance_and_cost() -> None:
    costs = CostModel(max_block=16)
    costs.set(1, [1.0 + 0.07 * (n - 1) for n in range(1, 17)])  # 16 tokens cost ~2x one
    assert expected_tokens([0.0] * 15, 16, 100) == 1.0
    assert expected_tokens([1.0] * 15, 16, 5) == 5.0  # capped by the remaining tokens
    rates = {n: (1.0 + sum(0.9 ** k for k in range(1, n))) / costs.cost(1, n) for n in range(1, 17)}
    assert max(rates, key=rates.get) > 8  # with a good drafter large blocks win...
    poor = {n: expected_tokens([0.05] * 15, n, 100) / costs.cost(1, n) for n in range(1, 17)}
    assert max(poor, key=poor.get) == 1  # ...with a poor one plain decoding does
    costs.observe(1, 1, 2.0)
    assert costs.cost(1, 1) > 1.0 and costs.cost(1, 16) > 2.05  # measurements move all sizes


def test_cost_model_learns_real_step_costs_without_leaking_them() -> None:
    costs = CostModel(max_block=8)
    costs.set(1, [1.0, 1.05, 1.1, 1.15, 1.2, 1.3, 1.4, 1.5])  # calibrated on a short context
    for _ in range(3):
        costs.observe(1, 2, 1.6)  # at serving time block 2 really costs 1.6
    assert costs.cost(1, 2) == pytest.approx(1.6)
    assert costs.cost(1, 1) == pytest.approx(1.6 / 1.05)  # not yet run: calibration x nearest ratio
    costs.observe(1, 1, 1.0)
    assert costs.cost(1, 1) == pytest.approx(1.0) and costs.cost(1, 2) == pytest.approx(1.6)
    costs.observe(1, 8, 3.0)
    ratio_4 = (1.6 / 1.05) + (4 - 2) / (8 - 2) * (3.0 / 1.5 - 1.6 / 1.05)
    assert costs.cost(1, 4) == pytest.approx(1.15 * ratio_4)  # between measured sizes: interpolated
    assert costs.table(1) == sorted(costs.table(1))
    for _ in range(20):
        costs.observe(1, 2, 3.2)  # the machine got twice as slow: everything moves, block 2 most
    assert costs.cost(1, 2) == pytest.approx(3.2, rel=0.05) and costs.cost(1, 1) > 1.15  # damped share
    costs.set(1, [1.0] * 8)  # a new calibration drops what was measured against the old one
    assert costs.table(1) == [1.0] * 8
    with pytest.raises(ValueError, match="max_block"):
        CostModel(max_block=0)


def test_calibration_covers_every_bucket_and_block_end() -> None:
    assert buckets_up_to(1) == [1] and buckets_up_to(5) == [1, 2, 4, 8] and buckets_up_to(32)[-1] == 32
    assert calibration_sizes(16) == [1, 2, 3, 4, 6, 8, 12, 16] and calibration_sizes(10) == [1, 2, 3, 4, 6, 8, 10]


def test_adaptive_policy_probes_while_plain_decoding_wins() -> None:
    class Batch:
        drafter = object()
        argmax_only = True
        rows = []

        @staticmethod
        def lookup_plan() -> list[list[int]]:
            return []

    costs = CostModel(max_block=8)
    costs.set(1, [1.0] + [10.0] * 7)  # drafting never pays
    policy = AdaptiveBlock(8, costs=costs, probe_block=3, probe_every=4)
    choices = [policy.choose(Batch) for _ in range(12)]
    assert choices == [1, 1, 1, 3, 1, 1, 1, 1, 1, 1, 1, 3]  # probes back off: after 4, then 8
    def batch_of(rate: float) -> SimpleNamespace:
        rows = [SimpleNamespace(remaining=100, acceptance_rates=lambda prior, lookup=False: [rate] * 7)] * 16
        return SimpleNamespace(drafter=object(), argmax_only=True, rows=rows, lookup_plan=lambda: [[]] * 16)

    # block 2 commits 1.75 tokens a row for 1.6x a plain step: 1.09x plain decoding, short of the
    # batch's drafting margin (1.1x) but within its probes' margin, so the batch probes, with 2
    # tokens a row; at 1.5 tokens a row (0.94x) its calibration keeps it from probing at all
    costs.set(16, [1.0, 1.6] + [10.0] * 6)
    policy = AdaptiveBlock(8, costs=costs, probe_block=3, probe_every=4)
    assert [policy.choose(batch_of(0.75)) for _ in range(4)] == [1, 1, 1, 2]
    policy = AdaptiveBlock(8, costs=costs, probe_block=3, probe_every=4)
    assert [policy.choose(batch_of(0.5)) for _ in range(12)] == [1] * 12


def test_a_batch_probes_only_while_drafting_comes_close_to_plain_decoding() -> None:
    """A batch of several rows whose best drafting size is expected far below what drafting has
    to beat (BATCH_DRAFT_MARGIN above plain decoding; here 1 + a tokens a row for 2x a plain
    step) never probes; one within BATCH_PROBE_MARGIN of it does, and so does a lone row however
    far drafting is."""
    from blockspec.dflash.policy import adaptive

    def probes(rows: int, rate: float) -> list[int]:
        costs = CostModel(max_block=8)
        costs.set(rows, [1.0, 2.0] + [10.0] * 6)
        row = SimpleNamespace(remaining=100, acceptance_rates=lambda prior, lookup=False: [rate] * 7)
        batch = SimpleNamespace(drafter=object(), argmax_only=True, rows=[row] * rows, lookup_plan=lambda: [[]] * rows)
        costs.observe(rows, 2, 2.0)  # a real drafting step confirmed the calibration
        policy = AdaptiveBlock(8, costs=costs, probe_every=4)
        return [i for i in range(1, 41) if policy.choose(batch) > 1]

    assert adaptive.BATCH_PROBE_MARGIN == 0.1 and adaptive.BATCH_DRAFT_MARGIN == 0.1
    assert probes(8, 0.6) == []  # 1.6 / 2 = 0.8 of plain decoding
    assert probes(8, 0.85) == []  # 0.925 of it: outside the margin of the 1.1 drafting has to beat
    assert probes(8, 0.99) == [4, 12, 28]  # 0.995 of it: within the margin, the usual back-off
    assert probes(1, 0.0) == [4, 12, 28]  # a lone row probes whatever the estimate
    assert AdaptiveBlock.probe_may_pay(8, [1.0, 0.995, 0.5]) and not AdaptiveBlock.probe_may_pay(8, [1.0, 0.985, 0.5])
    costs = CostModel(max_block=8)
    costs.set(8, [1.0, 2.0] + [10.0] * 6)
    costs.use_threads(2)
    assert not costs.drafting_measured(8)
    costs.observe(8, 1, 1.0)
    assert not costs.drafting_measured(8)  # plain steps say nothing of drafting's cost
    costs.observe(5, 2, 2.0)
    assert costs.drafting_measured(8) and not costs.drafting_measured(16)  # per bucket
    costs.use_threads(3)
    assert not costs.drafting_measured(8)  # and per thread count
    costs.use_threads(2)
    assert costs.drafting_measured(8)
    # drafting costs never measured by a real step (a calibration under outside load may have
    # priced them wrong): two rows probe, and the probe's repeat measures them; from MARGIN_ROWS
    # rows on the calibration decides, as a measurement would
    def unmeasured(rows: int) -> list[int]:
        busy = CostModel(max_block=8)
        busy.set(rows, [1.0] + [10.0] * 7)
        row = SimpleNamespace(remaining=100, acceptance_rates=lambda prior, lookup=False: [0.6] * 7)
        batch = SimpleNamespace(drafter=object(), argmax_only=True, rows=[row] * rows, lookup_plan=lambda: [[]] * rows)
        policy = AdaptiveBlock(8, costs=busy, probe_every=4)
        return [i for i in range(1, 41) if policy.choose(batch) > 1]

    assert adaptive.MARGIN_ROWS == 3
    assert unmeasured(2) == [4, 12, 28] and unmeasured(3) == [] and unmeasured(8) == []
    # drafting measured dear (a burst of load) is priced at the least of its measurement and its
    # calibration scaled like plain decoding's cost (which a burst slows alike)
    costs = CostModel(max_block=8)
    costs.set(8, [1.0, 1.2] + [10.0] * 6)
    costs.observe(8, 1, 1.0)
    costs.observe(8, 2, 2.4)  # a drafting step during a burst
    assert costs.cost(8, 2) == pytest.approx(2.4) and costs.least_table(8)[:2] == pytest.approx([1.0, 1.2])
    costs.observe(8, 1, 3.0)  # plain decoding slowed too: the whole machine did
    assert costs.cost(8, 1) > 1.0 and costs.least_table(8)[1] == pytest.approx(1.2 * costs.cost(8, 1))


def test_a_batch_drafts_only_where_drafting_beats_plain_decoding_by_the_margin() -> None:
    """A batch of MARGIN_ROWS rows or more drafts where its best drafting size is expected to
    commit at least (1 + BATCH_DRAFT_MARGIN) times plain decoding's tokens per second; a lone row
    and two rows wherever drafting wins at all. Block 2 costs 1.6 plain steps and commits 1 + a tokens a row."""
    from blockspec.dflash.policy import adaptive

    def choice(rows: int, rate: float) -> int:
        costs = CostModel(max_block=8)
        costs.set(rows, [1.0, 1.6] + [10.0] * 6)
        costs.observe(rows, 2, 1.6)
        row = SimpleNamespace(remaining=100, acceptance_rates=lambda prior, lookup=False: [rate] * 7)
        batch = SimpleNamespace(drafter=object(), argmax_only=True, rows=[row] * rows, lookup_plan=lambda: [[]] * rows)
        policy = AdaptiveBlock(8, costs=costs, probe_every=1000)
        return max(policy.choose(batch) for _ in range(3))  # where drafting wins, a plain check runs first

    assert adaptive.BATCH_DRAFT_MARGIN == 0.1 and adaptive.MARGIN_ROWS == 3
    assert choice(8, 0.68) == 1 and choice(3, 0.68) == 1  # 1.05x plain decoding: not for a batch
    assert choice(1, 0.68) == 2 and choice(2, 0.68) == 2  # but for a lone row, and two rows
    assert choice(8, 0.78) == 2 and choice(1, 0.78) == 2  # 1.11x: a batch drafts too
    assert choice(8, 0.5) == 1 and choice(1, 0.5) == 1  # 0.94x: neither


def test_a_batch_priced_far_from_drafting_holds_plain_steps_without_working_the_choice_out() -> None:
    """Where a batch of several rows neither drafts nor may probe, its next PLAIN_HOLD - 1 choices
    are plain without the rows' expectations being worked out again, and each hold after the last
    is twice as long (up to MAX_PLAIN_HOLD); rows replaced at the same size keep the hold, a change
    of size ends it and starts again from PLAIN_HOLD, and a lone row never holds."""
    from blockspec.dflash.policy import adaptive

    def run(rows: int, steps: int, change_at: int | None = None, new_rows: int | None = None
            ) -> tuple[list[int], list[int]]:
        costs = CostModel(max_block=8)
        for n in {rows, new_rows or rows}:
            costs.set(n, [1.0, 2.0] + [10.0] * 6)
            costs.observe(n, 2, 2.0)  # drafting measured: the probe gate applies
        row = SimpleNamespace(remaining=100, acceptance_rates=lambda prior, lookup=False: [0.3] * 7)
        batch = SimpleNamespace(drafter=object(), argmax_only=True, rows=[row] * rows,
                                lookup_plan=lambda: [[]] * len(batch.rows))
        policy = AdaptiveBlock(8, costs=costs, probe_every=4)
        worked: list[int] = []
        expected = policy.expected
        policy.expected = lambda *a: worked.append(i) or expected(*a)
        out = []
        for i in range(steps):
            if i == change_at:  # rows left and joined
                batch.rows = [SimpleNamespace(**vars(row)) for _ in range(new_rows or rows)]
            out.append(policy.choose(batch))
        return out, worked

    assert adaptive.PLAIN_HOLD == 8 and adaptive.MAX_PLAIN_HOLD == 64
    assert run(8, 200) == ([1] * 200, [0, 8, 24, 56, 120, 184])  # holds of 8, 16, 32, 64, 64
    assert run(8, 30, change_at=2) == ([1] * 30, [0, 8, 24])  # the same number of rows, new ones
    assert run(8, 30, change_at=2, new_rows=6) == ([1] * 30, [0, 2, 10, 26])  # fewer: held afresh
    choices, worked = run(1, 20)
    assert len(worked) == 20 and choices.count(1) < 20  # a lone row works every step out, and probes



def test_a_held_plain_step_is_stepped_without_a_choice_or_a_measurement(monkeypatch: pytest.MonkeyPatch) -> None:
    """A hold's plain steps but its last run without the choice and without the cost model's
    update; the last one is chosen (held) and measured as every other step; every step's time
    still counts towards the probes' budget. Fake clock: a plain step costs 1 s."""
    from blockspec.dflash.policy import adaptive

    clock = SimpleNamespace(t=0.0)
    monkeypatch.setattr(adaptive, "time", SimpleNamespace(perf_counter=lambda: clock.t))
    row = SimpleNamespace(remaining=100, acceptance_rates=lambda prior, lookup=False: [0.3] * 7)
    stepped = []

    def step(block: int, trim: object = None) -> int:
        clock.t += 1.0
        stepped.append(block)
        batch.verified = 8 * block
        return block

    batch = SimpleNamespace(drafter=object(), argmax_only=True, rows=[row] * 8, skips_padding=False, verified=0,
                            caught_up=False, lookup_plan=lambda: [[]] * 8, step=step)
    costs = CostModel(max_block=8)
    costs.set(8, [1.0, 2.0] + [10.0] * 6)
    costs.observe(8, 2, 2.0)  # drafting measured: the probe gate applies
    policy = AdaptiveBlock(8, costs=costs, probe_every=4)
    chosen, measured = [], []
    choose, observe = policy.choose, costs.observe
    policy.choose = lambda b: chosen.append(len(stepped)) or choose(b)
    costs.observe = lambda *a: measured.append(len(stepped) - 1) or observe(*a)
    assert [policy.step(batch) for _ in range(60)] == [1] * 60 and stepped == [1] * 60
    # holds of 8, 16 and 32 steps: the choice works out steps 0, 8, 24 and 56, and holds the last of each
    assert adaptive.PLAIN_HOLD == 8 and chosen == [0, 7, 8, 23, 24, 55, 56]
    assert measured == chosen  # the steps that were chosen are the steps that were measured
    assert policy.used[1] == 60 and policy.plain_spent == 60.0

def test_adaptive_probes_cost_at_most_their_share_of_plain_decoding(monkeypatch: pytest.MonkeyPatch) -> None:
    """A probe that costs much more than a plain step (the drafter catching up on a large batch's
    context) waits until the plain steps since the last probe took 1 / PROBE_SHARE times its extra
    cost; a cheap one keeps the step back-off alone. Steps run on a fake clock: plain 1 s, probes
    1.2 s or 5 s."""
    from blockspec.dflash.policy import adaptive

    clock = SimpleNamespace(t=0.0)
    monkeypatch.setattr(adaptive, "time", SimpleNamespace(perf_counter=lambda: clock.t))
    monkeypatch.setattr(adaptive, "BATCH_PROBE_MARGIN", 1.0)  # this batch probes however far drafting is
    rows = [SimpleNamespace(remaining=100, acceptance_rates=lambda prior, lookup=False: [0.0] * 7,
                            params=SamplingParams(),
                            stats=SimpleNamespace(accepted_by_position=[0] * 7, lookup_accepted_by_position=[0] * 7),
                            tries=[0] * 7, lookup_tries=[0] * 7) for _ in range(16)]

    def probes(probe_seconds: float) -> list[int]:
        def step(block: int, trim: object = None) -> int:
            clock.t += 1.0 if block == 1 else probe_seconds
            batch.verified = 16 * block
            return block

        batch = SimpleNamespace(drafter=object(), argmax_only=True, rows=rows, skips_padding=True, verified=0,
                                caught_up=False,
                                lookup_plan=lambda: [[]] * 16, step=step)
        costs = CostModel(max_block=8)
        costs.set(16, [1.0] + [10.0] * 7)  # drafting never pays
        policy = AdaptiveBlock(8, costs=costs, probe_every=4)
        return [i for i in range(1, 201) if policy.step(batch) > 1]

    assert probes(1.2) == [4, 12, 28, 60, 124]  # 0.2 s extra: the back-off of 4, 8, 16, 32... steps
    # 4 s extra: the next probe waits for 4 / PROBE_SHARE = 80 s of plain steps
    assert adaptive.PROBE_SHARE == 0.05 and probes(5.0) == [4, 85, 166]


def test_adaptive_cost_model_leaves_out_draft_passes_that_catch_up(monkeypatch: pytest.MonkeyPatch) -> None:
    """A step whose draft pass also read joined prompts or a run of plain steps' context
    (`DecodeBatch.caught_up`) costs more than its block size does: its time stays out of the cost
    model (believed, it had priced drafting out for the rest of a run). Fake clock: a step costs
    1 + 0.1 block seconds, 50 when it catches up."""
    from blockspec.dflash.policy import adaptive

    clock = SimpleNamespace(t=0.0)
    monkeypatch.setattr(adaptive, "time", SimpleNamespace(perf_counter=lambda: clock.t))
    rows = [SimpleNamespace(remaining=100, acceptance_rates=lambda prior, lookup=False: [0.9] * 3,
                            params=SamplingParams(),
                            stats=SimpleNamespace(accepted_by_position=[0] * 3, lookup_accepted_by_position=[0] * 3),
                            tries=[0] * 3, lookup_tries=[0] * 3) for _ in range(2)]

    def step(block: int, trim: object = None) -> int:
        batch.caught_up = block > 1 and len(drafted) % 2 == 0  # every other draft pass catches up
        drafted.extend([block] * (block > 1))
        clock.t += 50.0 if batch.caught_up else 1.0 + 0.1 * block
        batch.verified = 2 * block
        return block

    drafted: list[int] = []
    batch = SimpleNamespace(drafter=object(), argmax_only=True, rows=rows, skips_padding=False, verified=0,
                            lookup_plan=lambda: [[]] * 2, step=step, caught_up=False)
    costs = CostModel(max_block=4)
    costs.set(2, [1.0, 1.1, 1.2, 1.3])
    policy = AdaptiveBlock(4, costs=costs, plain_every=1000, challenge_every=1000)
    for _ in range(12):
        policy.step(batch)
    assert len(drafted) >= 8  # drafting kept winning
    assert costs.measured[2] and all(t < 2.0 for t in costs.measured[2].values())


def _lookup_row(rate: float, drafted: float = 0.0) -> SimpleNamespace:
    """A row whose lookup proposals are accepted at `rate` and its drafts at `drafted`."""
    return SimpleNamespace(remaining=100,
                           acceptance_rates=lambda prior, lookup=False: [rate if lookup else drafted] * 7)


def test_adaptive_policy_verifies_lookup_continuations_without_drafting() -> None:
    """A row with a lookup continuation can verify it with no draft pass (DecodeBatch.step_lookup):
    chosen when it beats every drafting size, priced as the verify part of a drafting step."""
    costs = CostModel(max_block=8)
    for rows in (1, 2):  # a draft pass costs 0.3 of a 1.0 step; each verified token 0.05 more
        costs.set(rows, [1.0] + [1.3 + 0.05 * (n - 1) for n in range(2, 9)], [0.0] + [0.3] * 7)
    policy = AdaptiveBlock(8, costs=costs, plain_every=1000, challenge_every=1000)
    lone = SimpleNamespace(drafter=object(), argmax_only=True, rows=[_lookup_row(0.9)],
                           lookup_plan=lambda: [[5, 6, 7, 8]])
    assert policy.choose(lone) == 1 and policy.lookup_step == [5]  # the whole continuation, no draft
    bad = SimpleNamespace(drafter=object(), argmax_only=True, rows=[_lookup_row(0.02, drafted=0.9)],
                          lookup_plan=lambda: [[5, 6]])
    assert policy.choose(bad) == 1 and policy.lookup_step is None  # a hopeless continuation: a plain step
    none = SimpleNamespace(drafter=object(), argmax_only=True, rows=[_lookup_row(0.9)], lookup_plan=lambda: [[]])
    policy.choose(none)
    assert policy.lookup_step is None
    pair = dict(drafter=object(), argmax_only=True, rows=[_lookup_row(0.9), _lookup_row(0.9)],
                lookup_plan=lambda: [[5, 6, 7], []])
    assert policy.choose(SimpleNamespace(**pair, skips_padding=True)) == 1 and policy.lookup_step is None  # batch: opt-in
    ragged = AdaptiveBlock(8, costs=costs, plain_every=1000, challenge_every=1000, ragged=True)
    assert ragged.choose(SimpleNamespace(**pair, skips_padding=True)) == 1 and ragged.lookup_step == [4, 1]
    ragged.choose(SimpleNamespace(**pair, skips_padding=False))  # padding would cost full rows
    assert ragged.lookup_step is None


def _one_row_batch(rate: float) -> object:
    """What AdaptiveBlock.choose reads of a batch: one row whose drafts are accepted at `rate`."""
    row = SimpleNamespace(remaining=100, acceptance_rates=lambda prior: [rate] * 7)
    return SimpleNamespace(drafter=object(), argmax_only=True, rows=[row],
                           lookup_plan=lambda: [[]])  # no lookup proposals


def test_adaptive_policy_measures_plain_decoding_while_drafting_wins() -> None:
    Batch = _one_row_batch(0.9)
    costs = CostModel(max_block=8)
    costs.set(1, [1.0] + [1.1] * 7)  # drafting pays on the calibration's word
    policy = AdaptiveBlock(8, costs=costs, plain_every=3)
    choices = [policy.choose(Batch) for _ in range(12)]
    # a plain step first, then after 2 and 5 drafting steps: the check backs off
    assert choices == [1, 8, 8, 1, 8, 8, 8, 8, 8, 1, 8, 8]
    costs.observe(1, 8, 8.0)  # a first timing this far above the estimate counts as at most 2x it
    assert costs.cost(1, 8) == pytest.approx(2.2)
    for _ in range(9):  # repeated, it is believed: long contexts make wide blocks cost far more...
        costs.observe(1, 8, 8.0)
    assert costs.cost(1, 8) > 7.0
    assert policy.choose(Batch) > 1  # ...but unmeasured plain decoding is assumed to scale alike
    costs.observe(1, 1, 1.0)  # what the plain check measures: plain decoding did not get dearer
    assert policy.choose(Batch) == 1


def test_a_larger_block_that_costs_less_keeps_its_own_cost() -> None:
    # SmolLM2 on 2 cores: a 3-token verify misses the fast kernel that 2 and 4 tokens take.
    true = [1.0, 1.0, 1.6, 1.05, 1.7, 1.75, 1.8, 1.85]
    costs = CostModel(max_block=8)
    costs.set(1, true)
    assert costs.table(1) == true  # block 4 is not raised to block 3's cost
    costs.observe(1, 3, 1.65)
    assert costs.cost(1, 4) == pytest.approx(1.05 * 1.65 / 1.6)  # moved alike, still below block 3
    policy = AdaptiveBlock(8, costs=CostModel(max_block=8), plain_every=1000, challenge_every=1000)
    policy.costs.set(1, true)
    choices = [policy.choose(_one_row_batch(0.6)) for _ in range(3)]
    # the first plain check, then block 4 at its own cost (raised to block 3's, block 2 would win)
    assert choices == [1, 4, 4]


def test_adaptive_policy_remeasures_the_sizes_next_to_its_choice() -> None:
    Batch = _one_row_batch(0.6)
    true = [1.0, 1.05, 1.1, 1.15, 2.0, 2.1, 2.2, 2.3]  # block 4 is the best buy
    costs = CostModel(max_block=8)
    costs.set(1, true)
    policy = AdaptiveBlock(8, costs=costs, plain_every=1000, challenge_every=3)
    for n, t in ((1, 1.0), (2, 1.05), (4, 2.0)):  # block 4's first step ran while the machine was busy
        costs.observe(1, n, t)
    choices = []
    for _ in range(60):
        n = policy.choose(Batch)
        choices.append(n)
        if n > 1:
            costs.observe(1, n, true[n - 1])  # what the runs measure
    assert choices[0] == 1 and choices[1] == 2  # the plain check, then block 2 on the costs as known
    assert 3 in choices[:5]  # its neighbour gets measured, wins, and in turn its neighbour 4...
    assert choices.index(4) < 15, choices  # ...which wins once its cost is known...
    tail = choices[-20:]
    assert tail.count(4) >= 18 and set(tail) <= {3, 4, 5}, choices  # ...save the backed-off re-checks


def test_cost_model_caps_an_outlying_first_timing() -> None:
    costs = CostModel(max_block=4)
    costs.set(16, [0.07, 0.09, 0.11, 0.12])
    costs.observe(16, 2, 0.47)  # one step slowed 5x by outside load
    assert costs.cost(16, 2) == pytest.approx(0.18)  # at most twice the estimate
    assert costs.cost(16, 4) < 0.47
    costs.observe(16, 3, 0.15)  # within twice the estimate: believed
    assert costs.cost(16, 3) == pytest.approx(0.15)  # a larger block may cost less (CPU kernels)


def test_cost_model_trusts_faster_measurements_more() -> None:
    costs = CostModel(max_block=2, smoothing=0.2)
    costs.set(1, [1.0, 1.0])
    costs.observe(1, 2, 2.0)
    costs.observe(1, 2, 1.0)
    assert costs.cost(1, 2) == pytest.approx(1.0)  # faster: believed at once
    costs.observe(1, 2, 2.0)
    assert costs.cost(1, 2) == pytest.approx(1.2)  # slower: averaged in with weight 0.2


def test_a_bucket_prices_each_batch_size_at_its_own_row_count() -> None:
    """Batch sizes share a bucket's calibration and measurements, kept at the bucket's own row
    count and scaled to each size by the calibrations of the bucket and the one below: a block-2
    step measured while a batch of 8 shrank to 5 rows does not price block 2 at 8 rows as 5 rows'
    (pooled, it had: drafting then looked 1.3x a plain step where it costs 1.8x, and ran)."""
    def true_cost(rows: int, block: int) -> float:  # a fixed part, and the rest by verified tokens
        return 0.2 + 0.1 * rows * block

    costs = CostModel(max_block=8)
    for rows in (4, 8):
        costs.set(rows, [true_cost(rows, n) for n in range(1, 9)])
    costs.observe(8, 1, true_cost(8, 1))
    costs.observe(8, 2, true_cost(8, 2))
    costs.observe(5, 2, true_cost(5, 2))  # the batch shrank: steps of 5 rows, cheaper
    costs.observe(5, 1, true_cost(5, 1))
    for rows in (5, 6, 7, 8):
        assert costs.table(rows)[:3] == pytest.approx([true_cost(rows, n) for n in (1, 2, 3)])
    assert costs.row_scale(8) is None and costs.row_scale(1) is None  # a bucket's own size: as measured
    row = SimpleNamespace(remaining=100, acceptance_rates=lambda prior, lookup=False: [0.65] * 7)
    batch = SimpleNamespace(drafter=object(), argmax_only=True, rows=[row] * 8, lookup_plan=lambda: [[]] * 8)
    assert AdaptiveBlock(8, costs=costs).choose(batch) == 1  # 1.65 tokens a row for 1.8x a plain step
    # a lower bucket's calibration slowed by outside load never prices fewer rows above more
    noisy = CostModel(max_block=8)
    noisy.set(4, [5.0] * 8)
    noisy.set(8, [true_cost(8, n) for n in range(1, 9)])
    assert all(few <= more for few, more in zip(noisy.table(5), noisy.table(8)))
    assert noisy.table(5)[0] == pytest.approx(noisy.table(8)[0])  # 4 rows calibrated at 5x 8 rows' cost


def test_a_batch_prices_its_drafters_catch_up(monkeypatch: pytest.MonkeyPatch) -> None:
    """A drafting step whose draft pass catches up on a backlog (DecodeBatch.draft_backlog: rows
    that joined, a run of plain steps) costs more the longer the backlog. The policy learns what
    a backlog token costs from such steps, and a batch of several rows prices it into drafting
    while its drafter is behind. Fake clock: plain 1 s, block 2 1.5 s, plus 0.01 s a backlog token."""
    from blockspec.dflash.policy import adaptive

    clock = SimpleNamespace(t=0.0)
    monkeypatch.setattr(adaptive, "time", SimpleNamespace(perf_counter=lambda: clock.t))

    def row() -> SimpleNamespace:
        return SimpleNamespace(remaining=100, acceptance_rates=lambda prior, lookup=False: [0.65] * 3,
                               params=SamplingParams(),
                               stats=SimpleNamespace(accepted_by_position=[0] * 3, lookup_accepted_by_position=[0] * 3),
                               tries=[0] * 3, lookup_tries=[0] * 3)

    def step(block: int, trim: object = None) -> int:
        batch.caught_up = block > 1 and batch.draft_backlog > 0
        clock.t += (1.0 if block == 1 else 1.5) + (0.01 * batch.draft_backlog if batch.caught_up else 0.0)
        batch.draft_backlog = 0 if block > 1 else batch.draft_backlog + len(batch.rows)
        batch.verified = len(batch.rows) * block
        return block

    batch = SimpleNamespace(drafter=object(), argmax_only=True, rows=[row() for _ in range(8)], skips_padding=False,
                            verified=0, lookup_plan=lambda: [[]] * 8, step=step, caught_up=False, draft_backlog=0)
    costs = CostModel(max_block=4)
    costs.set(8, [1.0, 1.5, 3.0, 4.0])
    policy = AdaptiveBlock(4, costs=costs, probe_every=1000, plain_every=1000, challenge_every=1000)
    assert policy.step(batch) == 1  # the bucket's first plain check
    batch.draft_backlog = 160  # rows joined
    assert policy.choose(batch) == 2  # 1.65 tokens a row for 1.5x: nothing learned of catching up yet
    assert policy.step(batch) == 2 and policy.catch_up == pytest.approx(0.01)
    assert costs.cost(8, 2) == pytest.approx(1.5)  # the caught-up step stays out of the cost model
    assert policy.choose(batch) == 2  # caught up: drafting pays
    batch.draft_backlog = 160
    assert policy.choose(batch) == 1  # 1.5 + 1.6 s for 1.65 tokens a row: plain
    batch.rows = batch.rows[:1]
    costs.set(1, [1.0, 1.5, 3.0, 4.0])
    policy.plain_checks[1] = (0, 1000)
    assert policy.choose(batch) == 2  # a lone row's choices leave it out
