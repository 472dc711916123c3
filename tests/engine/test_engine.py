"""The continuous-batching engine: joins, leaves, cancel, queue bound, errors, adaptive blocks."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import torch
from conftest import make_tiny_target
from support import OracleDrafter, distinct_prompts, reference_greedy, run_with_joins

from blockspec.config import SamplingParams, SpecConfig
from blockspec.engine import AdaptiveBlock, CostModel, Engine, EngineConfig, QueueFullError
from blockspec.dflash.policy import buckets_up_to, calibration_sizes, expected_tokens
from blockspec.errors import ConfigError, ContextLengthError
from blockspec.dflash.drafter import new_drafter_for_target
from blockspec.targets.native import load_native_target
from blockspec.targets.slots import EMPTY
from blockspec.targets.hf import HFTarget


@pytest.fixture(scope="module")
def setup():
    model = make_tiny_target("llama", seed=21)
    target = load_native_target(model, dtype=None, eos_token_ids=())
    prompts = distinct_prompts(6, seed=3)
    truths = [reference_greedy(model, p, 30) for p in prompts]
    return model, target, prompts, truths


@pytest.mark.parametrize("backend", ["native", "hf"])
def test_requests_joining_mid_flight_get_the_same_output_as_alone(setup, backend) -> None:
    model, native, prompts, truths = setup
    target = native if backend == "native" else HFTarget(model)
    drafter = OracleDrafter(model, native, prompts, truths)
    engine = Engine(target, drafter, EngineConfig(SpecConfig(block_size=6), max_batch=3))
    try:
        outputs = run_with_joins(engine, prompts, SamplingParams(max_new_tokens=30))
        assert outputs == truths
        m = engine.metrics
        assert m.requests_total == 6 and m.requests_running == 0 and m.tokens_generated_total == 180
        assert engine.recorder.row_steps > m.steps_total  # steps really shared rows
        assert 1.5 < m.mean_tau < 6
    finally:
        engine.stop()


def test_engine_with_lookup_is_lossless_for_joining_requests(setup) -> None:
    """n-gram lookup proposals in the continuous-batching engine: rows join mid-flight, each has
    its own token index, and the output is each request's own."""
    from blockspec.dflash.lookup import LookupConfig

    model, target, prompts, truths = setup
    drafter = new_drafter_for_target(model.config, mask_token_id=47, num_layers=1, dtype=torch.float64)
    engine = Engine(target, drafter, EngineConfig(SpecConfig(block_size=6, lookup=LookupConfig(min_ngram=2)), max_batch=3))
    try:
        params = SamplingParams(max_new_tokens=30)
        handles = [engine.submit(p, params) for p in prompts[:2]]
        next(iter(handles[0].events(timeout=60)))
        handles += [engine.submit(p, params) for p in prompts[2:]]
        results = [h.result(timeout=120) for h in handles]
        assert [r.token_ids for r in results] == truths
        assert sum(r.stats.lookup_steps for r in results) > 0
    finally:
        engine.stop()


class _FixedCosts(CostModel):
    """Step costs that real timings do not move, so the test does not depend on machine load:
    a calibration is recorded (its bucket) but its timings are replaced by verify-cost-like ones."""

    def set(self, batch: int, costs: list[float], drafting: list[float] | None = None) -> None:
        super().set(batch, [1.0 + 0.1 * (n - 1) for n in range(1, self.max_block + 1)])

    def observe(self, batch: int, block: int, seconds: float) -> None:
        pass


def test_adaptive_block_size_never_changes_the_output(setup) -> None:
    model, target, prompts, truths = setup
    good = OracleDrafter(model, target, prompts, truths, wrong_every=7)
    bad = new_drafter_for_target(model.config, mask_token_id=47, num_layers=1, dtype=torch.float64)
    for drafter in (good, bad):
        engine = Engine(target, drafter, EngineConfig(SpecConfig(block_size=8, adaptive=True), max_batch=4))
        engine.adaptive.costs = _FixedCosts(max_block=8)  # the choice must not hang on machine load
        try:
            assert run_with_joins(engine, prompts, SamplingParams(max_new_tokens=30)) == truths
            assert sorted(engine.adaptive.costs.calibrated) == [1, 2, 4]  # every bucket, calibrated at start
            used = engine.metrics.block_sizes
            assert len(used) > 1  # it did adapt
            favourite = max(used, key=used.get)
            assert favourite > 2 if drafter is good else favourite == 1, used
        finally:
            engine.stop()


def test_engine_with_verify_lengths_per_row_is_lossless(setup) -> None:
    """EngineConfig(ragged_verify=True): the adaptive policy gives each row of a batch its own
    verify length from its drafts' confidences; the output stays the target's."""
    model, target, prompts, truths = setup
    good = OracleDrafter(model, target, prompts, truths, wrong_every=3)
    engine = Engine(target, good, EngineConfig(SpecConfig(block_size=8, adaptive=True, ragged_verify=True), max_batch=4))
    engine.adaptive.costs = _FixedCosts(max_block=8)
    steps: list[tuple[int, int, int]] = []  # (rows, tokens verified, longest row's)
    plain = engine.batch.step

    def step(block, trim=None):
        q = plain(block, trim)
        steps.append((len(engine.batch.rows), engine.batch.verified, q))
        return q

    engine.batch.step = step
    try:
        assert run_with_joins(engine, prompts, SamplingParams(max_new_tokens=30)) == truths
    finally:
        engine.stop()
    assert any(rows > 1 and verified < rows * q for rows, verified, q in steps), steps  # ragged steps ran
    with pytest.raises(ConfigError, match="ragged_verify"):
        EngineConfig(SpecConfig(ragged_verify=1))


def test_spec_decoder_adaptive_block_is_lossless_and_adapts(setup) -> None:
    """The Python API's adaptive mode (SpecConfig.adaptive) runs the engine's policy."""
    from blockspec.config import SpecConfig
    from blockspec.engine.decoder import SpecDecoder

    model, target, prompts, truths = setup
    good = OracleDrafter(model, target, prompts, truths, wrong_every=7)
    bad = new_drafter_for_target(model.config, mask_token_id=47, num_layers=1, dtype=torch.float64)
    for drafter in (good, bad):
        decoder = SpecDecoder(target, drafter, SpecConfig(block_size=8, adaptive=True))
        decoder.adaptive_policy.costs = _FixedCosts(max_block=8)
        for prompt, truth in zip(prompts[:3], truths[:3]):
            assert decoder.generate([prompt], SamplingParams(max_new_tokens=30))[0].token_ids == truth
        used = decoder.block_choices
        favourite = max(used, key=used.get)
        assert favourite > 2 if drafter is good else favourite == 1, used
        fixed = decoder.generate(prompts[:2], SamplingParams(max_new_tokens=30), block_size=3)
        assert [r.token_ids for r in fixed] == truths[:2]
        assert decoder.block_choices == used  # an explicit block size bypasses the policy


class _CheapDrafts(_FixedCosts):
    """_FixedCosts whose calibration also timed the draft passes: 0.01 at every width."""

    def set(self, batch: int, costs: list[float], drafting: list[float] | None = None) -> None:
        CostModel.set(self, batch, [1.0 + 0.1 * (n - 1) for n in range(1, self.max_block + 1)],
                      [0.0] + [0.01] * (self.max_block - 1))


def test_adaptive_steps_draft_the_chosen_width_unless_wider_is_cheap(setup) -> None:
    """A short adaptive block costs what a fixed short block costs: the drafter sees exactly the
    chosen width, unless a lone row's step can draft wider for next to nothing; then it drafts
    the whole block and verifies what the drafts' confidences earn. The output is the target's."""
    from blockspec.dflash.batch import DecodeBatch, make_row

    model, target, prompts, truths = setup
    for costs, n in ((_FixedCosts(max_block=8), 3), (_CheapDrafts(max_block=8), 3), (_CheapDrafts(max_block=8), 1)):
        drafter = OracleDrafter(model, target, prompts, truths, wrong_every=3)  # favours small blocks
        batch = DecodeBatch(target, drafter, max_block=8)
        params = SamplingParams(max_new_tokens=30)
        rows = [make_row(i, len(p), params, (), 8) for i, p in enumerate(prompts[:n])]
        batch.join(prompts[:n], rows)
        policy = AdaptiveBlock(8, costs=costs)
        policy.calibrate_all(batch, 4)  # before counting: calibration drafts every width itself
        widths, chosen = [], []
        draft = batch.draft
        batch.draft = lambda f, fp, emb, pos, cache: (widths.append(emb.shape[1]), draft(f, fp, emb, pos, cache))[1]
        while len(batch):
            chosen.append(policy.step(batch))
            batch.retire()
        assert [r.generated for r in rows] == truths[:n]
        drafting = [k for k in chosen if k > 1]
        if n == 1:  # cheap wide drafts for a lone row; the oracle is sure of each: all verified
            assert widths.count(8) > len(widths) // 2, widths
        else:  # no timed draft passes, or a batch of rows: exactly the chosen width
            assert widths == drafting and drafting and max(drafting) < 8, (chosen, widths)


def test_trimmed_verify_never_changes_the_output(setup) -> None:
    """Steps that draft a block and verify only part of it, down to one token, commit the
    target's own tokens (the native cache must not read the slots past a trimmed block)."""
    import random

    from blockspec.dflash.batch import DecodeBatch, make_row

    model, target, prompts, truths = setup
    rng = random.Random(0)
    bad = new_drafter_for_target(model.config, mask_token_id=47, num_layers=1, dtype=torch.float64)
    oracle = OracleDrafter(model, target, prompts, truths, wrong_every=6)
    # one row alone too: a lone query's forward reads every slot up to the horizon unmasked
    for drafter, n in ((oracle, 3), (bad, 3), (bad, 1)):
        batch = DecodeBatch(target, drafter, max_block=8)
        rows = [make_row(i, len(p), SamplingParams(max_new_tokens=30), (), 8) for i, p in enumerate(prompts[:n])]
        batch.join(prompts[:n], rows)
        lengths: list[int] = []

        def trim(confidence, looked):  # alone: a long verify (stale slots), then one token, often
            width = len(confidence[0]) + 1
            lengths.append(rng.randint(1, width) if n > 1 else (width, 1, 1, 3, 1)[len(lengths) % 5])
            return lengths[-1]

        while len(batch):
            batch.step(8, trim)
            batch.retire()
        assert [r.generated for r in rows] == truths[:n]
        assert 1 in lengths and max(lengths) > 4, lengths


@pytest.mark.parametrize("backend", ["native", "hf"])
def test_verify_lengths_per_row_never_change_the_output(setup, backend) -> None:
    """Ragged steps (each row verifies its own number of drafted tokens, the rest of its block
    is padding) commit the target's own tokens, on the native target (which leaves padding out
    of its matmuls) and through the Hugging Face adapter."""
    import random

    from blockspec.dflash.batch import DecodeBatch, make_row

    model, native_target, prompts, truths = setup
    target = native_target if backend == "native" else HFTarget(model)
    rng = random.Random(1)
    oracle = OracleDrafter(model, target, prompts, truths, wrong_every=4)
    batch = DecodeBatch(target, oracle, max_block=8)
    rows = [make_row(i, len(p), SamplingParams(max_new_tokens=30), (), 8) for i, p in enumerate(prompts)]
    batch.join(prompts, rows)
    verified: list[tuple[list[int], int]] = []

    def trim(confidence, looked):
        lengths = [rng.randint(1, len(c) + 1) for c in confidence]
        verified.append((lengths, 0))
        return lengths

    while len(batch):
        batch.step(8, trim)
        verified[-1] = (verified[-1][0], batch.verified)
        batch.retire()
    assert [r.generated for r in rows] == truths
    assert all(sum(lengths) == n for lengths, n in verified)  # padding is not counted as verified
    assert any(min(lengths) == 1 and max(lengths) > 4 for lengths, _ in verified)


def _confident_row(lookup_rate: float = 0.5) -> SimpleNamespace:
    return SimpleNamespace(remaining=100, acceptance_rates=lambda prior, lookup=False: [lookup_rate] * 7)


def test_adaptive_policy_widens_cheap_drafts_and_trims_by_confidence() -> None:
    costs = CostModel(max_block=8)
    for rows in (1, 2):
        costs.set(rows, [1.0 + 0.05 * (n - 1) for n in range(1, 9)], [0.0] + [0.02] * 7)
    costs.set(16, [1.0 + 0.5 * (n - 1) for n in range(1, 9)], [0.0] + [0.2 * n for n in range(2, 9)])
    policy = AdaptiveBlock(8, costs=costs)
    assert policy.widen(1, 3) == 8  # drafting 8 wide costs what drafting 3 does
    assert policy.widen(16, 3) == 3  # at 16 rows every extra drafted token costs 4% of the step
    assert policy.widen(1, 1) == 1 and AdaptiveBlock(8, costs=_FixedCosts(max_block=8)).widen(1, 3) == 3
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


def test_calibration_times_the_draft_pass_apart(setup) -> None:
    from blockspec.dflash.policy import calibrate
    from blockspec.dflash.batch import DecodeBatch

    model, target, _, _ = setup
    drafter = new_drafter_for_target(model.config, mask_token_id=47, num_layers=1, dtype=torch.float64)
    totals, drafting = calibrate(DecodeBatch(target, drafter, max_block=4), 2, 4)
    assert len(totals) == len(drafting) == 4 and drafting[0] == 0.0
    assert all(0 < d < t for d, t in zip(drafting[1:], totals[1:]))


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
    rows = [SimpleNamespace(remaining=100, acceptance_rates=lambda prior, lookup=False: [0.0] * 7)] * 16
    batch = SimpleNamespace(drafter=object(), argmax_only=True, rows=rows, lookup_plan=lambda: [[]] * 16)
    costs.set(16, [1.0] + [10.0] * 7)
    policy = AdaptiveBlock(8, costs=costs, probe_block=3, probe_every=4)
    assert [policy.choose(batch) for _ in range(4)] == [1, 1, 1, 2]  # a batch probes with 2 tokens a row


def test_adaptive_probes_cost_at_most_their_share_of_plain_decoding(monkeypatch: pytest.MonkeyPatch) -> None:
    """A probe that costs much more than a plain step (the drafter catching up on a large batch's
    context) waits until the plain steps since the last probe took 1 / PROBE_SHARE times its extra
    cost; a cheap one keeps the step back-off alone. Steps run on a fake clock: plain 1 s, probes
    1.2 s or 5 s."""
    from blockspec.dflash import policy as adaptive

    clock = SimpleNamespace(t=0.0)
    monkeypatch.setattr(adaptive, "time", SimpleNamespace(perf_counter=lambda: clock.t))
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
    from blockspec.dflash import policy as adaptive

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


def test_decode_batch_reports_draft_passes_that_catch_up(setup) -> None:
    """`caught_up` after a step: its draft pass read rows that joined since the last one, or the
    context of more than one plain step; not after a plain step or a steady drafting step."""
    from blockspec.dflash.batch import DecodeBatch, make_row

    model, target, prompts, _ = setup
    drafter = new_drafter_for_target(model.config, mask_token_id=47, num_layers=1, dtype=torch.float64)
    batch = DecodeBatch(target, drafter, max_block=4)
    rows = [make_row(i, len(p), SamplingParams(max_new_tokens=40), (), 4) for i, p in enumerate(prompts[:3])]
    batch.join(prompts[:2], rows[:2])
    seen = []
    for block in (2, 3, 1, 2, 1, 1, 2, 2):
        batch.step(block)
        seen.append(batch.caught_up)
    assert seen == [True, False, False, False, False, False, True, False]
    batch.join(prompts[2:3], rows[2:3])
    batch.step(1)
    assert not batch.caught_up
    batch.step(2)
    assert batch.caught_up


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


def test_cancel_frees_the_slot(setup) -> None:
    _, target, prompts, truths = setup
    engine = Engine(target, None, EngineConfig(SpecConfig(block_size=1), max_batch=1))
    try:
        long = engine.submit(prompts[0], SamplingParams(max_new_tokens=400, ignore_eos=True))
        waiting = engine.submit(prompts[1], SamplingParams(max_new_tokens=30))
        next(long.events(timeout=60))
        long.cancel()
        events = list(long.events(timeout=60))
        assert events[-1].finished and events[-1].finish_reason == "cancelled"
        assert waiting.result(timeout=60).token_ids == truths[1]
        assert engine.metrics.requests_running == 0 and engine.metrics.cancelled_total == 1
        queued = engine.submit(prompts[2], SamplingParams(max_new_tokens=5))
        queued.cancel()  # cancelled before or right after admission
        assert queued.result(timeout=60).finish_reason in ("cancelled", "length")
    finally:
        engine.stop()


def test_queue_full_raises(setup) -> None:
    _, target, prompts, _ = setup
    engine = Engine(target, None, EngineConfig(SpecConfig(block_size=1), max_batch=1, max_queue=1))
    params = SamplingParams(max_new_tokens=400, ignore_eos=True)
    try:
        handles = [engine.submit(prompts[0], params), engine.submit(prompts[1], params)]
        with pytest.raises(QueueFullError, match="max_queue"):
            engine.submit(prompts[2], params)
        for h in handles:
            h.cancel()
        for h in handles:
            assert h.result(timeout=60).finish_reason == "cancelled"
        assert engine.submit(prompts[2], SamplingParams(max_new_tokens=3)).result(timeout=60).finish_reason == "length"
    finally:
        engine.stop()


def test_invalid_requests_fail_at_submit(setup) -> None:
    _, target, prompts, _ = setup
    engine = Engine(target, None, EngineConfig(SpecConfig(block_size=1)))
    with pytest.raises(ContextLengthError):
        engine.submit(prompts[0], SamplingParams(max_new_tokens=10_000))
    assert not engine.running  # nothing was queued, the thread never started


class FlakyTarget:
    """Delegates to a target but raises on chosen forward calls."""

    def __init__(self, target, fail_on: set[int]) -> None:
        self.inner = target
        self.info = target.info
        self.calls = 0
        self.fail_on = fail_on

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def forward(self, *args, **kwargs):
        self.calls += 1
        if self.calls in self.fail_on:
            raise RuntimeError("injected failure")
        return self.inner.forward(*args, **kwargs)


def test_exception_in_a_step_fails_that_step_only(setup) -> None:
    model, target, prompts, truths = setup
    flaky = FlakyTarget(target, fail_on={4})  # call 1 = prefill, 2.. = steps
    drafter = new_drafter_for_target(model.config, mask_token_id=47, num_layers=1, dtype=torch.float64)
    engine = Engine(flaky, drafter, EngineConfig(SpecConfig(block_size=4), max_batch=2))
    try:
        failed = engine.submit(prompts[0], SamplingParams(max_new_tokens=30))
        events = list(failed.events(timeout=60))
        assert events[-1].finish_reason == "error" and "injected failure" in events[-1].error
        with pytest.raises(RuntimeError, match="injected failure"):
            failed.result()
        assert engine.running
        assert engine.generate(prompts[1], SamplingParams(max_new_tokens=30), timeout=60).token_ids == truths[1]
        assert engine.metrics.errors_total == 1
    finally:
        engine.stop()
    assert not engine.running


def test_streaming_events_per_request_params_and_aevents(setup) -> None:
    model, target, prompts, truths = setup
    drafter = OracleDrafter(model, target, prompts, truths)
    engine = Engine(target, drafter, EngineConfig(SpecConfig(block_size=5), max_batch=4))
    try:
        greedy = engine.submit(prompts[0], SamplingParams(max_new_tokens=30))
        sampled = engine.submit(prompts[1], SamplingParams(max_new_tokens=20, temperature=1.0, top_k=5, seed=3))
        stop_at = truths[2][6]
        stopped = engine.submit(prompts[2], SamplingParams(max_new_tokens=30, stop_token_ids=(stop_at,)))
        cut = engine.submit(prompts[3], SamplingParams(max_new_tokens=30),
                            stop_check=lambda ids: 4 if len(ids) >= 4 else None)
        streamed = []
        for event in greedy.events(timeout=60):
            streamed += event.token_ids
        assert streamed == truths[0] and event.finished and event.stats.mean_tau > 1.5

        async def collect(handle):
            return [e async for e in handle.aevents()]

        events = asyncio.run(collect(sampled))
        tokens = [t for e in events for t in e.token_ids]
        assert len(tokens) == 20 and events[-1].finish_reason == "length"
        assert sampled.result().token_ids == tokens
        result = stopped.result(timeout=60)
        assert result.token_ids == truths[2][: truths[2].index(stop_at) + 1] and result.finish_reason == "stop"
        assert cut.result(timeout=60).token_ids == truths[3][:4]
    finally:
        engine.stop()


def test_stop_cancels_queued_and_running(setup) -> None:
    _, target, prompts, _ = setup
    engine = Engine(target, None, EngineConfig(SpecConfig(block_size=1), max_batch=1))
    params = SamplingParams(max_new_tokens=400, ignore_eos=True)
    running = engine.submit(prompts[0], params)
    queued = engine.submit(prompts[1], params)
    next(running.events(timeout=60))
    engine.stop()
    assert running.result(timeout=10).finish_reason == "cancelled"
    assert queued.result(timeout=10).finish_reason == "cancelled"


def test_engine_without_own_thread_decodes_on_the_callers_thread(setup) -> None:
    model, target, prompts, truths = setup
    drafter = OracleDrafter(model, target, prompts, truths, wrong_every=5)
    engine = Engine(target, drafter, EngineConfig(SpecConfig(block_size=6, adaptive=True), max_batch=2, own_thread=False))
    engine.adaptive.costs = _FixedCosts(max_block=6)
    assert engine.wait_ready()  # calibrates here, on this thread
    assert sorted(engine.adaptive.costs.calibrated) == [1, 2]
    handles = [engine.submit(p, SamplingParams(max_new_tokens=30)) for p in prompts]
    assert not engine.running and not any(h.done for h in handles)  # nothing decodes on its own
    finished: list[int] = []
    engine.run_until_idle(finished.append)
    assert not engine.running
    assert sum(finished) == len(prompts) and len(finished) > 1  # progress came step by step
    assert [h.result(timeout=0).token_ids for h in handles] == truths
    assert engine.metrics.requests_running == 0 and engine.metrics.queue_depth == 0
    engine.run_until_idle()  # nothing left: returns at once
    assert engine.generate(prompts[0], SamplingParams(max_new_tokens=30)).token_ids == truths[0]
    with pytest.raises(ConfigError, match="run_until_idle"):
        engine.start()
    with pytest.raises(ConfigError, match="own_thread must be True or False"):
        EngineConfig(own_thread="no")
    threaded = Engine(target, drafter, EngineConfig(SpecConfig(block_size=6), max_batch=2))
    with pytest.raises(ConfigError, match="own_thread=False"):
        threaded.run_until_idle()


def test_plain_steps_queue_every_committed_tokens_features_for_the_next_draft(setup) -> None:
    """Between draft passes the features of committed tokens wait for the drafter (kept as parts,
    so plain steps copy nothing): whatever plain steps, retirements and joins happen meanwhile,
    the next draft pass gets each row's features of exactly the tokens it has not seen, in
    order, equal to a full forward's."""
    from blockspec.dflash.batch import DecodeBatch, make_row
    from blockspec.train.features import target_features

    model, target, prompts, truths = setup
    drafter = new_drafter_for_target(model.config, mask_token_id=47, num_layers=1, dtype=torch.float64)
    batch = DecodeBatch(target, drafter, max_block=4)
    rows = [make_row(i, len(p), SamplingParams(max_new_tokens=30), (), 4) for i, p in enumerate(prompts[:3])]
    batch.join(prompts[:3], rows[:3])
    batch.step(4)  # a draft pass: the prompts' features are in the draft cache now
    seen = {r.key: len(prompts[r.key]) for r in batch.rows}  # that pass gave the drafter the prompts
    for _ in range(3):
        batch.step(1)
    assert len(batch._parts) == 3  # appended to the draft step's own, not yet joined into one tensor
    rows[1].finish_reason = "cancelled"
    batch.retire()
    batch.step(1)
    late = make_row(3, len(prompts[3]), SamplingParams(max_new_tokens=30), (), 4)
    batch.join([prompts[3]], [late])
    seen[3] = 0
    batch.step(1)
    batch._flush_pending()
    feats, pos = batch.pending_feats, batch.pending_pos  # [b, c, L*H], [b, c] (EMPTY left padding)
    assert [r.key for r in batch.rows] == [0, 2, 3]
    layer_ids = drafter.target_layer_ids
    for i, r in enumerate(batch.rows):
        ids = prompts[r.key] + r.generated[:-1]  # every token fed to the target so far
        keep = pos[i] != EMPTY
        want = torch.arange(seen[r.key], len(ids))
        assert torch.equal(pos[i][keep].cpu(), want), (r.key, pos[i])
        full = target_features(target, [ids], layer_ids)[0]  # [S, L*H]
        torch.testing.assert_close(feats[i][keep].float(), full[want], rtol=1e-6, atol=1e-6)
    for r, truth in ((rows[0], truths[0]), (rows[2], truths[2])):  # and the output is the target's
        while r.finish_reason is None:
            batch.step(4)
            batch.retire()
        assert r.generated == truth
