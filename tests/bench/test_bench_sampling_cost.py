"""`python -m blockspec.bench.sampling_cost`: the share of sampled steps spent sampling, per rule."""

from __future__ import annotations

import torch
from conftest import make_tiny_target

import blockspec.dflash.batch as decode
from blockspec.bench.sampling_cost import SAMPLING, Clocks, measure, table, timing
from blockspec.config import SamplingParams, SpecConfig
from blockspec.dflash.drafter import new_drafter_for_target
from blockspec.engine.decoder import SpecDecoder
from blockspec.targets.native import load_native_target


def test_sampling_time_is_a_part_of_step_time_for_both_rules() -> None:
    model = make_tiny_target("llama", seed=2)
    drafter = new_drafter_for_target(model.config, mask_token_id=47, num_layers=1, dtype=torch.float64)
    dec = SpecDecoder(load_native_target(model, dtype=None, eos_token_ids=()), drafter, SpecConfig(block_size=4))
    params = SamplingParams(max_new_tokens=10, temperature=0.7, top_p=0.9, ignore_eos=True)
    original = decode.verify_standard_keyed
    results = measure(dec, [[5, 6, 7], [1, 2]], params, ("keyed", "standard"))
    assert decode.verify_standard_keyed is original  # the timers are gone
    for rule, r in results.items():
        assert r["tokens"] == 20 and r["steps"] >= 2
        assert 0 < r["sampling_s"] < r["step_s"], (rule, r)
    md = table(results)
    assert md.startswith("| rule | steps |") and "| keyed |" in md and "| standard |" in md


def test_nested_timed_calls_count_once() -> None:
    clocks = Clocks()
    calls = []

    def inner() -> None:
        calls.append("inner")

    timed_inner = clocks.wrap(inner)
    outer = clocks.wrap(lambda: (timed_inner(), calls.append("outer")))
    outer()
    assert calls == ["inner", "outer"] and clocks.calls == 1
    from blockspec.dflash.sampling import probabilities

    with timing(SAMPLING[:1], clocks):
        assert decode.probabilities is not probabilities  # wrapped while inside
        decode.probabilities(torch.zeros(1, 1, 4), torch.ones(1), torch.zeros(1, dtype=torch.long), torch.ones(1))
    assert decode.probabilities is probabilities and clocks.calls == 2
