"""The adaptive block policy on a machine with other work: calibration timed in interleaved rounds
survives a burst of outside load, costs priced wrong at calibration or during a burst are found
out online, and each thread count keeps its own measurements. Steps run on a fake clock with
injected costs (no real timing)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from blockspec.config import SamplingParams
from blockspec.dflash.policy import adaptive
from blockspec.dflash.policy import (AdaptiveBlock, CostModel, calibration_sizes, expected_tokens, interpolate,
                                     time_sizes)

RATE = 0.7  # every row's drafts are accepted at this rate per position
ROWS = 2  # a batch of 2: no widening or trimming, so the chosen size is the size run


def true_cost(n: int) -> float:
    """Seconds of a step verifying n tokens a row (a draft pass for n > 1): a CPU's shape."""
    return 1.0 if n == 1 else 1.3 + 0.15 * (n - 1)


def best_block(max_block: int, cost=true_cost) -> int:
    return max(range(1, max_block + 1), key=lambda n: expected_tokens([RATE] * max_block, n, 10**6) / cost(n))


class Machine:
    """A fake clock and a batch whose steps cost `cost(n)` times `load`, plus `catch_up` seconds
    when a draft pass reads more than one plain step's context (and says so, as DecodeBatch does)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, catch_up: float = 0.5) -> None:
        self.t = 0.0
        self.load = 1.0
        self.cost = true_cost
        self.catch_up = catch_up
        self.plain_since = 0
        self.blocks: list[int] = []
        monkeypatch.setattr(adaptive, "time", SimpleNamespace(perf_counter=lambda: self.t))
        rows = [SimpleNamespace(remaining=10**6, acceptance_rates=lambda prior, lookup=False: [RATE] * 15,
                                params=SamplingParams(), stats=SimpleNamespace(accepted_by_position=[0] * 15,
                                                      lookup_accepted_by_position=[0] * 15),
                                tries=[0] * 15, lookup_tries=[0] * 15) for _ in range(ROWS)]
        self.batch = SimpleNamespace(drafter=object(), argmax_only=True, rows=rows, skips_padding=False, verified=0,
                                     lookup_plan=lambda: [[]] * ROWS, step=self.step, caught_up=False)

    def step(self, block: int, trim: object = None) -> int:
        b = self.batch
        b.caught_up = block > 1 and self.plain_since > 1
        self.t += self.cost(block) * self.load + (self.catch_up if b.caught_up else 0.0)
        self.plain_since = self.plain_since + 1 if block == 1 else 0
        b.verified = ROWS * block
        self.blocks.append(block)
        return block

    def run(self, policy: AdaptiveBlock, steps: int) -> list[int]:
        start = len(self.blocks)
        for _ in range(steps):
            policy.step(self.batch)
        return self.blocks[start:]


def test_interleaved_calibration_shrugs_off_a_burst_of_load() -> None:
    """Timings 8-16 run 4x slower (another process woke up): with the sizes taken in turn, the
    burst lands on one or two timings of each, and the fastest is the true cost."""
    sizes = [1, 2, 3, 4, 6, 8]
    calls = []

    def run(n: int) -> tuple[float, float]:
        calls.append(n)
        slow = 4.0 if 8 <= len(calls) <= 16 else 1.0
        return true_cost(n) * slow, (0.3 if n > 1 else 0.0) * slow

    totals, drafts = time_sizes(run, sizes, rounds=3)
    assert totals == {n: true_cost(n) for n in sizes}
    assert drafts == {n: 0.3 if n > 1 else 0.0 for n in sizes}
    assert calls[:6] == sizes and calls[6:12] == sizes[::-1]  # rounds alternate direction
    with pytest.raises(ValueError, match="rounds"):
        time_sizes(run, sizes, rounds=0)


def test_policy_drafts_after_a_calibration_hit_by_load(monkeypatch: pytest.MonkeyPatch) -> None:
    """The calibration's timings are taken during a burst that slowed the drafting sizes' first
    rounds; the policy still drafts at once, at the best block size."""
    machine = Machine(monkeypatch)
    sizes = calibration_sizes(8)
    calls = []

    def run(n: int) -> tuple[float, float]:
        calls.append(n)
        slow = 5.0 if n > 1 and len(calls) <= 2 * len(sizes) else 1.0  # warm-up and round 1
        return true_cost(n) * slow, 0.0

    totals, _ = time_sizes(run, sizes)
    costs = CostModel(max_block=8)
    costs.set(ROWS, interpolate(totals, 8))
    policy = AdaptiveBlock(8, costs=costs)
    blocks = machine.run(policy, 200)
    best = best_block(8)
    assert best > 2
    assert blocks[1] > 1  # after the first plain check, drafting
    tail = blocks[-100:]
    assert tail.count(best) >= 85 and tail.count(1) <= 5, tail


def test_policy_finds_out_drafting_priced_wrong_by_a_busy_calibration(monkeypatch: pytest.MonkeyPatch) -> None:
    """Costs calibrated while the machine was busy say drafting never pays (every drafting size
    4x plain decoding). Probes find the drafts accepted, and the probe's repeat (its own draft
    pass caught up on the plain steps' context, so its time is left out) measures what drafting
    really costs: the policy then drafts at the best size."""
    machine = Machine(monkeypatch)
    costs = CostModel(max_block=8)
    costs.set(ROWS, [1.0] + [4.0] * 7)
    policy = AdaptiveBlock(8, costs=costs)
    blocks = machine.run(policy, 400)
    tail = blocks[-150:]
    assert tail.count(best_block(8)) >= 120 and tail.count(1) <= 10, blocks
    assert blocks.index(best_block(8)) < 120


def test_policy_follows_costs_that_change_online(monkeypatch: pytest.MonkeyPatch) -> None:
    """A burst of load that makes drafting steps dear (a draft pass stalls on a busy core) turns
    the policy to plain decoding; when it passes, the policy drafts at the best size again."""
    machine = Machine(monkeypatch)
    costs = CostModel(max_block=8)
    costs.set(ROWS, [true_cost(n) for n in range(1, 9)])
    policy = AdaptiveBlock(8, costs=costs)
    best = best_block(8)
    assert machine.run(policy, 100)[-50:].count(best) >= 45
    machine.cost = lambda n: true_cost(n) * (4.0 if n > 1 else 1.0)
    during = machine.run(policy, 150)
    assert during[-50:].count(1) >= 45, during  # plain decoding wins while drafting is dear
    machine.cost = true_cost
    after = machine.run(policy, 500)
    assert after[-100:].count(best) >= 85, after
    assert after.index(best) < 350


def test_each_thread_count_keeps_its_own_measurements(monkeypatch: pytest.MonkeyPatch) -> None:
    """One thread costs 1.8x two here: measurements at one count do not move the other's, and a
    change of count re-checks plain decoding at once."""
    machine = Machine(monkeypatch)
    count = [2]
    costs = CostModel(max_block=8)
    costs.set(ROWS, [true_cost(n) for n in range(1, 9)])
    policy = AdaptiveBlock(8, costs=costs, thread_count=lambda: count[0])
    machine.run(policy, 60)
    two = dict(costs.measured[ROWS])
    assert two[1] == pytest.approx(1.0) and two[best_block(8)] == pytest.approx(true_cost(best_block(8)))
    count[0], machine.load = 1, 1.8
    blocks = machine.run(policy, 60)
    assert blocks[0] == 1  # a fresh plain check at the new count
    assert costs.threads == 1 and costs.cost(ROWS, 1) == pytest.approx(1.8)
    assert costs.other_threads[2][ROWS] == two  # untouched by the slower steps
    count[0], machine.load = 2, 1.0
    machine.run(policy, 1)
    assert costs.cost(ROWS, 1) == pytest.approx(1.0) and 1 in costs.other_threads
    costs.set(ROWS, [1.0] * 8)  # a new calibration forgets every count's measurements
    assert ROWS not in costs.measured and ROWS not in costs.other_threads[1]


def test_a_batch_stops_probing_once_drafting_is_measured_far_from_paying(monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch whose drafting steps really cost 2.1x a plain step and more (a CPU at 8 rows):
    drafting commits at most 0.81 of plain decoding's tokens per second at RATE. The first probe
    and its repeat measure that; after them the batch decodes plainly, where it used to go on
    probing (each probe catching up on every row's context)."""
    machine = Machine(monkeypatch)
    machine.cost = lambda n: 1.0 if n == 1 else 2.1 + 0.6 * (n - 2)
    costs = CostModel(max_block=8)
    costs.set(ROWS, [machine.cost(n) for n in range(1, 9)])
    policy = AdaptiveBlock(8, costs=costs)
    blocks = machine.run(policy, 600)
    drafted = [i for i, n in enumerate(blocks) if n > 1]
    assert len(drafted) == 2 and drafted[1] == drafted[0] + 1, drafted  # one probe, one repeat

    monkeypatch.setattr(adaptive, "BATCH_PROBE_MARGIN", 1.0)  # the gate off: the policy before it
    machine = Machine(monkeypatch)
    machine.cost = lambda n: 1.0 if n == 1 else 2.1 + 0.6 * (n - 2)
    costs = CostModel(max_block=8)
    costs.set(ROWS, [machine.cost(n) for n in range(1, 9)])
    assert sum(n > 1 for n in machine.run(AdaptiveBlock(8, costs=costs), 600)) > 6
