"""The adaptive policy and sampled steps: sampled batches are priced from a calibration of what a
sampled step runs (the target's whole logits, shaped and drawn from), greedy ones from the greedy
calibration; acceptance priors are kept per verification rule, since rows of different rules
share a batch; and adaptive steps keep unseeded (standard-rule) sampling exact."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_target
from scripted import ScriptedDrafter
from support import PROMPT, VOCAB, chi2_pvalue, exact_joint
from test_standard_rule import sample_unseeded

from blockspec.dflash.policy import calibration as calibration_module
from blockspec.config import SamplingParams, SpecConfig
from blockspec.dflash.batch import DecodeBatch
from blockspec.dflash.row import make_row
from blockspec.dflash.drafter import new_drafter_for_target
from blockspec.dflash.policy import AdaptiveBlock, CostModel, calibrate
from blockspec.dflash.proposers import BatchDraft, DFlashBlockProposer
from blockspec.engine import Engine, EngineConfig
from blockspec.engine.decoder import SpecDecoder
from blockspec.targets.native import load_native_target

SAMPLED = SamplingParams(max_new_tokens=12, temperature=0.8, top_p=0.9, ignore_eos=True)


class _CheapTokens(CostModel):
    """Steps of n tokens per row cost 1 + 0.01 (n - 1), whatever is measured."""

    def set(self, batch: int, costs: list[float], drafting: list[float] | None = None) -> None:
        super().set(batch, [1.0 + 0.01 * (n - 1) for n in range(1, self.max_block + 1)], [0.0] * self.max_block)

    def observe(self, batch: int, block: int, seconds: float) -> None:
        pass


@pytest.fixture(scope="module")
def model():
    return make_tiny_target("llama", seed=2)


def _batch(model, params: list[SamplingParams]) -> DecodeBatch:
    target = load_native_target(model, dtype=None, eos_token_ids=())
    drafter = new_drafter_for_target(model.config, mask_token_id=47, num_layers=1, dtype=torch.float64)
    batch = DecodeBatch(target, drafter, max_block=4)
    prompts = [[5, 6, 7][: 1 + i % 3] for i in range(len(params))]
    batch.join(prompts, [make_row(i, len(p), sp, (), 4) for i, (p, sp) in enumerate(zip(prompts, params))])
    return batch


def test_sampled_calibration_times_what_sampled_steps_run(model, monkeypatch: pytest.MonkeyPatch) -> None:
    """A sampled calibration shapes and draws from the target's whole logits at every size, and at
    the drafting sizes makes the proposals sampled steps make (the DFlash block proposer, the
    standard rule's rows, their confidences where trimmed) shaped at CALIBRATION_DRAFT_TEMPERATURE:
    the dummy context's flat draft distributions keep a real text's handful of tokens in their
    nucleus there, not hundreds. A greedy calibration does neither."""
    shaped: list[tuple[int, ...]] = []
    monkeypatch.setattr(calibration_module, "shaped", lambda logits, *a, f=calibration_module.shaped:
                        (shaped.append(tuple(logits.shape)), f(logits, *a))[-1])
    drafts = []
    propose = DFlashBlockProposer.propose

    def spy(self: DFlashBlockProposer, draft: BatchDraft) -> object:
        drafts.append((self.sampled, draft.temperature.tolist(), draft.top_p.tolist(), list(draft.rules),
                       draft.confidence, draft.hidden.shape[1]))
        return propose(self, draft)

    monkeypatch.setattr(DFlashBlockProposer, "propose", spy)
    batch = _batch(model, [SAMPLED])
    greedy = calibrate(batch, 2, 4, rounds=1)
    assert shaped == [] and drafts == []
    totals, drafting = calibrate(batch, 2, 4, rounds=1, sampled=True, confidence=True)
    assert len(totals) == len(drafting) == 4 and drafting[0] == 0.0 and all(t > 0 for t in totals)
    assert all(0 < d < t for d, t in zip(drafting[1:], totals[1:]))
    assert sorted(s[1] for s in shaped if s[0] == 2) == sorted([1, 2, 3, 4] * 2)  # (warm-up + 1 round) x 4 verifies
    assert sorted(d[-1] for d in drafts) == sorted([1, 2, 3] * 2)  # and the drafts of 1..3 proposals
    t, p = calibration_module.CALIBRATION_DRAFT_TEMPERATURE, calibration_module.CALIBRATION_TOP_P
    assert t < calibration_module.CALIBRATION_TEMPERATURE
    assert all(sampled and temps == [pytest.approx(t)] * 2 and tops == [pytest.approx(p)] * 2
               and rules == ["standard"] * 2 and conf for sampled, temps, tops, rules, conf, _ in drafts)
    assert len(greedy[0]) == 4


def test_sampled_batches_are_priced_from_sampled_costs(model) -> None:
    """`choose` calibrates (lazily) and reads the cost model of the batch's kind: greedy batches
    the greedy one, batches with a sampled row the sampled one."""
    policy = AdaptiveBlock(4)
    sampled = _batch(model, [SAMPLED, SamplingParams(max_new_tokens=12)])
    policy.choose(sampled)
    assert policy.sampled_costs.known(2) and not policy.costs.known(2)
    assert policy.costs_for(sampled) is policy.sampled_costs
    greedy = _batch(model, [SamplingParams(max_new_tokens=12)])
    policy.choose(greedy)
    assert policy.costs.known(1) and not policy.sampled_costs.known(1)
    with_logprobs = _batch(model, [SamplingParams(max_new_tokens=12, logprobs=2)])  # whole logits, like sampling
    assert policy.costs_for(with_logprobs) is policy.sampled_costs


def test_the_engine_calibrates_both_kinds_before_serving(model) -> None:
    target = load_native_target(model, dtype=None, eos_token_ids=())
    drafter = new_drafter_for_target(model.config, mask_token_id=47, num_layers=1, dtype=torch.float64)
    engine = Engine(target, drafter, EngineConfig(SpecConfig(block_size=4, adaptive=True), max_batch=2,
                                                  own_thread=False))
    assert engine.wait_ready()
    assert sorted(engine.adaptive.costs.calibrated) == sorted(engine.adaptive.sampled_costs.calibrated) == [1, 2]
    out = engine.generate([5, 6, 7], SAMPLED)
    assert len(out.token_ids) == 12 and out.stats.sampling_rule == "standard"


def test_acceptance_priors_are_kept_per_rule(model) -> None:
    """Rows of the keyed and the standard rule in one batch: each rule's counts go to its own
    batch-wide rates, and a fresh row of either rule expects from its own rule's rates."""
    policy = AdaptiveBlock(4)
    keyed, standard = SAMPLED.with_(seed=1), SAMPLED
    rows = [make_row(0, 3, keyed, (), 4), make_row(1, 3, standard, (), 4)]
    before = [([0] * 3, [0] * 3, [0] * 3, [0] * 3)] * 2
    rows[0].stats.accepted_by_position[:] = [10, 2, 0]
    rows[0].tries[:] = [100, 10, 2]
    rows[1].stats.accepted_by_position[:] = [80, 60, 40]
    rows[1].tries[:] = [100, 80, 60]
    policy.record(rows, before)
    keyed_rates, standard_rates = policy.global_rates(rule="keyed"), policy.global_rates(rule="standard")
    assert keyed_rates[0] == pytest.approx((10 + 8 * 0.5) / 108) and standard_rates[0] == pytest.approx((80 + 4) / 108)
    assert policy.global_rates(rule="greedy") == [0.5] * 3  # nothing recorded for greedy rows
    fresh = [make_row(2, 3, keyed, (), 4), make_row(3, 3, standard, (), 4)]
    assert fresh[0].acceptance_rates(policy.priors()) == keyed_rates
    assert fresh[1].acceptance_rates(policy.priors()) == standard_rates
    mixed = policy.expected(fresh)
    alone = [policy.expected([r]) for r in fresh]
    assert mixed == pytest.approx([a + b for a, b in zip(*alone)])
    assert alone[1][3] > alone[0][3] + 1.0  # the standard row expects far more from a wide block


def test_adaptive_steps_keep_unseeded_sampling_exact() -> None:
    """The adaptive policy (sampled costs, per-rule priors, a verify length per row chosen from
    the drafts' confidences on a target that skips padding) under the standard rule: the output
    follows the target's distribution."""
    model = make_tiny_target("llama", vocab_size=VOCAB, seed=1)
    sp = SamplingParams(max_new_tokens=3, ignore_eos=True, temperature=1.0)
    joint = exact_joint(model, sp)
    greedy = [[int(joint.sum((1, 2)).argmax()), 0, 0]]
    drafter = ScriptedDrafter(model, [PROMPT] * 256, greedy * 256, error_rate=0.3)  # rows of the bucket
    target = load_native_target(model, dtype=None, eos_token_ids=())
    dec = SpecDecoder(target, drafter, SpecConfig(block_size=4, adaptive=True, ragged_verify=True))
    # a tiny model's real costs make plain steps win: steps that cost next to nothing per token draft
    dec.adaptive_policy = AdaptiveBlock(4, ragged=True, sampled_costs=_CheapTokens(4))
    (counts,) = sample_unseeded(dec, [sp] * 200, n=4000)
    assert chi2_pvalue(counts.sum((1, 2)), joint.sum((1, 2))) > 1e-3
    assert chi2_pvalue(counts.sum(0), joint.sum(0)) > 1e-3
    assert chi2_pvalue(counts, joint) > 1e-3
    assert sum(n for k, n in dec.block_choices.items() if k > 1) > 0  # it drafted


class _Fixed(CostModel):
    """Steps verifying n tokens per row cost 1 + 0.3 (n - 1), drafts nothing, whatever is measured."""

    def set(self, batch: int, costs: list[float], drafting: list[float] | None = None) -> None:
        super().set(batch, [1.0 + 0.3 * (n - 1) for n in range(1, self.max_block + 1)], [0.0] * self.max_block)

    def observe(self, batch: int, block: int, seconds: float) -> None:
        pass


def _trim_policy(batch: DecodeBatch) -> AdaptiveBlock:
    policy = AdaptiveBlock(4, costs=_Fixed(4), sampled_costs=_Fixed(4))
    for model in (policy.costs, policy.sampled_costs):
        model.set(len(batch.rows), [])
    policy._model = policy.costs_for(batch)
    return policy


def test_a_sampled_trim_prices_its_peaks_by_the_acceptance_seen_at_such_peaks(model) -> None:
    """A sampled row's draft peaks are not its proposals' chance of acceptance (that is the overlap
    of p and q): its trim maps them through the acceptance observed at such peaks, by depth and
    band, and books its own peaks for that. A greedy row's trim reads its drafts' probabilities as
    they are, whatever was observed."""
    peaks = [[0.6, 0.6, 0.6]]
    sampled = _batch(model, [SAMPLED])
    policy = _trim_policy(sampled)
    trim = policy.trimmer(sampled)
    assert trim(peaks, [0]) == 2  # taken at their word: E = 1, 1.6, 1.96, 2.18 against 1, 1.3, 1.6, 1.9
    assert policy._trial_conf == peaks  # booked by (depth, band) when the step is recorded
    for _ in range(200):  # such peaks were never accepted at the first proposal
        policy.node_acceptance("standard").observe(1, 0, 0.6, False)
    assert policy.trimmer(sampled)(peaks, [0]) == 1
    for _ in range(200):  # ... and always at every depth
        for depth in (1, 2, 3):
            policy.node_acceptance("standard").observe(depth, 0, 0.6, True)
    assert policy.trimmer(sampled)(peaks, [0]) == 4
    greedy = _batch(model, [SamplingParams(max_new_tokens=12)])
    policy = _trim_policy(greedy)
    for _ in range(200):
        policy.node_acceptance("greedy").observe(1, 0, 0.6, False)
    assert policy.trimmer(greedy)(peaks, [0]) == 2
    assert policy._trial_conf is None  # greedy chains book no peaks (their trees' pricing is as before)


def test_sampled_steps_are_calibrated_at_chat_shaping(model, monkeypatch: pytest.MonkeyPatch) -> None:
    """The sampled calibration shapes the target's logits at CALIBRATION_TEMPERATURE and
    CALIBRATION_TOP_P: at temperature 1 a dummy context's nucleus spans far more tokens than real
    text's does, which priced every sampled position, and so the drafting sizes, too high (the
    drafts' own shaping: `test_sampled_calibration_times_what_sampled_steps_run`)."""
    seen: list[tuple[float, float]] = []
    shaped = calibration_module.shaped
    monkeypatch.setattr(calibration_module, "shaped", lambda logits, t, k, p: (
        seen.append((float(t[0]), float(p[0]))), shaped(logits, t, k, p))[1])
    calibrate(_batch(model, [SAMPLED]), 1, 4, rounds=1, sampled=True)
    assert seen and all(t == pytest.approx(calibration_module.CALIBRATION_TEMPERATURE) and p == pytest.approx(0.9)
                        for t, p in seen)
    assert calibration_module.CALIBRATION_TEMPERATURE < 1
