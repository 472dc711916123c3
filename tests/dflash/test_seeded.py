"""A seed fixes the sampled text: the same request with the same seed gives the same tokens whatever
the block size, the adaptive policy, n-gram lookup, the drafter or the batch mates (each draw is
keyed by the request's seed and the output position, dflash/sampling.py)."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_target
from scripted import ScriptedDrafter

from blockspec.config import SamplingParams, SpecConfig
from blockspec.engine.decoder import SpecDecoder
from blockspec.dflash.drafter import new_drafter_for_target
from blockspec.dflash.lookup import LookupConfig
from blockspec.engine import Engine, EngineConfig
from blockspec.targets.hf import HFTarget
from blockspec.targets.native import load_native_target

PROMPT = [5, 6, 7, 8, 5, 6]
MATES = [[1, 2], [9, 3, 3, 9, 3, 3, 9], [4] * 11]
SAMPLED = SamplingParams(max_new_tokens=28, temperature=1.0, top_p=0.95, top_k=30, seed=1234, ignore_eos=True)
LOOKUP = LookupConfig(min_ngram=1, max_ngram=2)


@pytest.fixture(scope="module")
def model():
    return make_tiny_target("llama", seed=2)  # float64, vocabulary 48


@pytest.fixture(scope="module")
def reference(model) -> list[int]:
    """The target decoding alone, one token per step."""
    return SpecDecoder(HFTarget(model), None, SpecConfig(block_size=1)).generate([PROMPT], SAMPLED)[0].token_ids


def test_reference_is_a_sample_of_its_seed(model, reference):
    target = HFTarget(model)
    again = SpecDecoder(target, None, SpecConfig(block_size=1)).generate([PROMPT], SAMPLED)[0].token_ids
    other = SpecDecoder(target, None, SpecConfig(block_size=1)).generate([PROMPT], SAMPLED.with_(seed=99))[0]
    assert again == reference and other.token_ids != reference and len(set(reference)) > 5


@pytest.mark.parametrize("block", [4, 16])
@pytest.mark.parametrize("lookup", [None, LOOKUP], ids=["drafts", "lookup"])
def test_speculative_steps_commit_the_targets_own_draws(model, reference, block, lookup):
    """A drafter that proposes the reference text with errors (many acceptances and rejections at
    every position) commits exactly the reference, alone and between batch mates of any kind."""
    prompts = [MATES[0], PROMPT, MATES[1], MATES[2]]
    params = [SAMPLED.with_(seed=1), SAMPLED, SAMPLED.with_(temperature=0.0), SAMPLED.with_(seed=7, top_p=0.5)]
    drafter = ScriptedDrafter(model, [PROMPT], [reference], error_rate=0.3, block_size=16)
    dec = SpecDecoder(HFTarget(model), drafter, SpecConfig(block_size=block, lookup=lookup))
    alone = dec.generate([PROMPT], SAMPLED)[0]
    drafter = ScriptedDrafter(model, prompts, [reference] * 4, error_rate=0.3, block_size=16, seed=5)
    dec = SpecDecoder(HFTarget(model), drafter, SpecConfig(block_size=block, lookup=lookup))
    batched = dec.generate(prompts, params)
    assert alone.token_ids == reference
    assert batched[1].token_ids == reference
    assert alone.stats.mean_tau > 1.5  # proposals were accepted, so both paths committed tokens
    if lookup is None:
        assert sum(alone.stats.accepted_by_position) < sum(alone.stats.acceptance_lengths)  # and some rejected


@pytest.mark.parametrize("adaptive", [False, True], ids=["fixed", "adaptive"])
@pytest.mark.parametrize("block,lookup", [(1, None), (4, None), (4, LOOKUP), (16, LOOKUP)])
def test_the_engine_reproduces_a_seed_with_requests_coming_and_going(model, reference, adaptive, block, lookup):
    """Continuous batching: mates join while the request runs and leave before it ends."""
    target = load_native_target(model, dtype=None, eos_token_ids=())
    drafter = new_drafter_for_target(model.config, mask_token_id=47, num_layers=1, dtype=torch.float64)
    config = EngineConfig(SpecConfig(block_size=block, adaptive=adaptive and block > 1, lookup=lookup), max_batch=3, own_thread=False)
    engine = Engine(target, drafter, config)
    mates = [engine.submit(MATES[0], SAMPLED.with_(seed=3, max_new_tokens=5))]
    handle = engine.submit(PROMPT, SAMPLED)
    waiting = [(m, SAMPLED.with_(seed=10 + i, max_new_tokens=4 + 3 * i)) for i, m in enumerate(MATES)]

    def more(_finished: int) -> None:  # a mate leaves: another one joins mid-request
        if waiting:
            prompt, params = waiting.pop(0)
            mates.append(engine.submit(prompt, params))

    engine.run_until_idle(more)  # every request has ended when it returns: no result waits
    assert handle.result(timeout=0).token_ids == reference
    assert len(mates) > 2 and all(m.result(timeout=0).finish_reason == "length" for m in mates)
