"""`python -m blockspec.bench.sampletau`: the expected tau of lossless sampled rules.

The anchor weighting is checked by hand; end to end on a tiny model, the standard rule's
expected tau equals the mean acceptance length that unseeded sampled decodes reach with the same
drafter at the same fixed width, and the exact expectations (argmax chain, tree walk) keep
their orderings."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_target

from blockspec.bench import sampletau
from blockspec.bench.sampletau import SampleTauConfig, SampleTauResult, Walk, measure_prompt
from blockspec.config import SamplingParams, SpecConfig
from blockspec.dflash import sampling
from blockspec.dflash.drafter import new_drafter_for_target
from blockspec.engine.decoder import SpecDecoder
from blockspec.errors import ConfigError
from blockspec.targets.hf import HFTarget

V = 48
PROMPT = [5, 9, 13, 2, 7]


def test_anchor_weights_by_hand() -> None:
    w = Walk(weight={0: 1.0})
    w.visit(0, [1.0, 0.0])  # commits 2 for sure: the next step is at 2
    w.visit(1, [0.9])  # never stepped on: adds nothing
    w.visit(2, [0.5], mean=[0.7])  # 1 or 2 tokens, half and half; counted by the lower-variance mean
    w.visit(3, [])  # half the decodes; the continuation ends: 1 token
    w.visit(4, [1.0, 1.0])  # every decode
    assert (w.tokens, w.steps) == pytest.approx((2 + 1.7 + 0.5 + 3, 3.5))
    assert w.first == pytest.approx(1 + 0.7 + 1)


def tiny():
    model = make_tiny_target("llama", seed=5, vocab_size=V)
    torch.manual_seed(3)
    drafter = new_drafter_for_target(model.config, mask_token_id=V - 1, num_layers=1, block_size=8,
                                     dtype=torch.float64)
    return HFTarget(model), drafter


def test_standard_rule_tau_is_what_unseeded_decodes_reach() -> None:
    target, drafter = tiny()
    f = sampling.STANDARD_DRAFT_FACTOR  # what the decoder's standard-rule rows draw with
    cfg = SampleTauConfig(temperature=1.0, top_p=1.0, widths=(3,), factors=(f,), max_new_tokens=16)
    total = SampleTauResult()
    g = torch.Generator().manual_seed(0)
    for _ in range(16):
        total.add(measure_prompt(target, drafter, PROMPT, cfg, g))
    expected = total.tallies[f"standard f={f:g}"][3].tau
    dec = SpecDecoder(target, drafter, SpecConfig(block_size=3))
    torch.manual_seed(1)
    outs = dec.generate([PROMPT] * 160, SamplingParams(max_new_tokens=16, temperature=1.0, ignore_eos=True))
    lengths = [n for r in outs for n in r.stats.acceptance_lengths]
    assert {r.stats.sampling_rule for r in outs} == {"standard"}
    measured = sum(lengths) / len(lengths)
    assert 1.1 < measured  # proposals were kept: the comparison says something
    assert expected == pytest.approx(measured, abs=0.04)


def test_exact_expectations_keep_their_orderings() -> None:
    target, drafter = tiny()
    cfg = SampleTauConfig(temperature=0.8, top_p=0.9, widths=(2, 4, 8), factors=(1.0, 0.5), max_new_tokens=12)
    res = measure_prompt(target, drafter, PROMPT, cfg, torch.Generator().manual_seed(0))
    assert res.anchors == 11
    for name, by_w in res.tallies.items():
        taus = [by_w[w].tau for w in cfg.widths]
        assert all(1.0 <= t <= w for t, w in zip(taus, cfg.widths)), name
    chain, tree = res.tallies["argmax chain"], res.tallies["keyed tree"]
    # one node: the tree is the argmax chain; more nodes: each width's tree holds the narrower one's
    assert tree[2].tau == pytest.approx(chain[2].tau)
    assert chain[2].tau <= chain[4].tau <= chain[8].tau
    assert tree[2].tau <= tree[4].tau <= tree[8].tau
    for k in sampletau.SIBLINGS:  # every anchor's first proposal: a probability
        top, bound = res.siblings[k]
        assert 0 < top <= res.anchors and 0 < bound <= res.anchors


def test_bad_settings_are_refused(capsys) -> None:
    for kw in (dict(temperature=0.0), dict(top_p=0.0), dict(widths=(1,)), dict(factors=(0.0,)), dict(top_k=0),
               dict(max_new_tokens=1), dict(chain_depth=0)):
        with pytest.raises(ConfigError):
            SampleTauConfig(**kw)
    assert sampletau.main(["--limit", "0"]) == 2
    assert "--limit" in capsys.readouterr().err
