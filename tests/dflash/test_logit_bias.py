"""logit_bias stays lossless: speculative output equals plain decoding with the same bias (greedy
token for token, sampled for the same seed), on the HF adapter and the native target, with
biased and unbiased rows in one batch."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_target
from scripted import ScriptedDrafter
from support import native, ragged_prompts, reference_biased_greedy, reference_greedy

from blockspec.config import SamplingParams, SpecConfig
from blockspec.dflash.logit_bias import apply_logit_bias
from blockspec.engine.decoder import SpecDecoder
from blockspec.errors import ConfigError
from blockspec.targets.hf import HFTarget


@pytest.fixture(scope="module")
def model():
    return make_tiny_target("llama", seed=5)


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("kind", ["hf", "native"])
def test_greedy_with_a_bias_equals_plain_biased_decoding(model, block_size, kind):
    prompts = ragged_prompts(3, seed=11, vocab=48)
    max_new = 18
    plain = [reference_greedy(model, p, max_new) for p in prompts]
    # ban each row's most frequent unbiased token and push another one up: the output changes
    bias = {max(set(plain[0]), key=plain[0].count): -100.0, 7: 4.0}
    biased = [reference_biased_greedy(model, p, max_new, bias) for p in prompts]
    assert all(b != u for b, u in zip(biased, plain)), "the bias must change every row's output"
    # the drafter proposes the unbiased text (which the bias breaks) with errors
    drafter = ScriptedDrafter(model, prompts + prompts, plain + plain, error_rate=0.1, block_size=16)
    target = HFTarget(model) if kind == "hf" else native(model)
    dec = SpecDecoder(target, drafter, SpecConfig(block_size=block_size))
    params = SamplingParams(max_new_tokens=max_new, logit_bias=bias)
    # biased rows beside unbiased ones: those keep their own (argmax) output
    results = dec.generate(prompts + prompts, [params] * 3 + [params.with_(logit_bias=())] * 3)
    assert [r.token_ids for r in results[:3]] == biased
    assert [r.token_ids for r in results[3:]] == plain
    assert all(list(bias)[0] not in r.token_ids for r in results[:3])


def test_sampled_with_a_bias_follows_its_seed_whatever_the_block(model):
    prompts = ragged_prompts(2, seed=3, vocab=48)
    bias = {5: -100.0, 9: 3.0, 11: -2.5}
    params = SamplingParams(max_new_tokens=20, temperature=1.0, top_p=0.95, seed=21, logit_bias=bias)
    target = HFTarget(model)
    plain = SpecDecoder(target, None, SpecConfig(block_size=1)).generate(prompts, params)
    unbiased = SpecDecoder(target, None, SpecConfig(block_size=1)).generate(prompts, params.with_(logit_bias=()))
    assert [r.token_ids for r in plain] != [r.token_ids for r in unbiased]
    truth = [r.token_ids for r in plain]
    drafter = ScriptedDrafter(model, prompts, truth, error_rate=0.25, block_size=16)
    spec = SpecDecoder(target, drafter, SpecConfig(block_size=8)).generate(prompts, params)
    assert [r.token_ids for r in spec] == truth
    assert max(r.stats.mean_tau for r in spec) > 1.5, "the scripted drafter should get blocks accepted"
    assert all(5 not in t for t in truth)


def test_apply_logit_bias_adds_per_row_and_leaves_unbiased_batches_alone():
    logits = torch.zeros(2, 3, 6)
    assert apply_logit_bias(logits, [(), ()]) is logits
    out = apply_logit_bias(logits, [((1, 2.0), (4, -100.0)), ()])
    assert out[0, :, 1].eq(2.0).all() and out[0, :, 4].eq(-100.0).all()
    assert out[0].sum() == 3 * (2.0 - 100.0) and out[1].abs().sum() == 0


@pytest.mark.parametrize("bias,message", [
    ({1: 101}, "logit_bias values"),
    ({1: float("nan")}, "logit_bias values"),
    ({-1: 1.0}, "logit_bias keys"),
    ({"1": 1.0}, "logit_bias keys"),
    (5, "logit_bias must map"),
])
def test_bad_bias_is_refused_where_it_is_written(bias, message):
    with pytest.raises(ConfigError, match=message):
        SamplingParams(logit_bias=bias)


def test_bias_outside_the_vocabulary_is_refused_at_submit(model):
    dec = SpecDecoder(HFTarget(model), None, SpecConfig(block_size=1))
    with pytest.raises(ConfigError, match="logit_bias token ids must be in"):
        dec.generate([[1, 2]], SamplingParams(max_new_tokens=2, logit_bias={48: 1.0}))
