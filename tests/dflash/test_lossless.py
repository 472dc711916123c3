"""Greedy DFlash output must equal plain autoregressive output token for token."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_target
from support import reference_greedy, ragged_prompts
from scripted import ScriptedDrafter

from blockspec.config import SamplingParams, SpecConfig
from blockspec.dflash.drafter import new_drafter_for_target
from blockspec.targets.hf import HFTarget
from blockspec.engine.decoder import SpecDecoder


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "gemma3"])
@pytest.mark.parametrize("block_size,batch", [(2, 1), (5, 3), (16, 4)])
def test_real_drafter_greedy_equals_plain(family: str, block_size: int, batch: int) -> None:
    model = make_tiny_target(family, seed=block_size)
    drafter = new_drafter_for_target(model.config, mask_token_id=47, num_layers=2, block_size=16,
                                     dtype=torch.float64, seed=batch)
    dec = SpecDecoder(HFTarget(model), drafter, SpecConfig(block_size=block_size))
    prompts = ragged_prompts(batch, seed=block_size * 10 + batch, vocab=48)
    results = dec.generate(prompts, SamplingParams(max_new_tokens=21))
    for p, r in zip(prompts, results):
        assert r.token_ids == reference_greedy(model, p, 21)
        assert r.finish_reason == "length"
        assert sum(r.stats.acceptance_lengths) + 1 == len(r.token_ids)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("block_size", [2, 3, 4, 7, 8, 11, 16])
def test_scripted_drafter_greedy_equals_plain(seed: int, block_size: int) -> None:
    """High acceptance: whole blocks accepted, rejections at every position, ragged batches."""
    model = make_tiny_target("llama", seed=seed)
    batch = 1 + (seed + block_size) % 4
    prompts = ragged_prompts(batch, seed=seed + 100 * block_size, vocab=48)
    max_new = 9 + 5 * seed + block_size  # ends mid-block for most block sizes
    truth = [reference_greedy(model, p, max_new) for p in prompts]
    drafter = ScriptedDrafter(model, prompts, truth, error_rate=0.15, seed=seed)
    dec = SpecDecoder(HFTarget(model), drafter, SpecConfig(block_size=block_size))
    results = dec.generate(prompts, SamplingParams(max_new_tokens=max_new))
    for t, r in zip(truth, results):
        assert r.token_ids == t
        assert len(r.token_ids) == max_new
    taus = [r.stats.mean_tau for r in results]
    assert max(taus) > 1.5, "the scripted drafter should get blocks accepted"
    for r in results:
        assert r.stats.accepted_by_position == sorted(r.stats.accepted_by_position, reverse=True)


@pytest.mark.parametrize("block_size", [4, 16])
def test_stop_token_inside_block(block_size: int) -> None:
    model = make_tiny_target("qwen3", seed=3)
    prompts = ragged_prompts(4, seed=7, vocab=48)
    long = [reference_greedy(model, p, 40) for p in prompts]
    # Stop on a token each row produces somewhere after its start: it falls inside a block.
    stop = {long[0][5], long[1][9]}
    truth = [reference_greedy(model, p, 40, stop) for p in prompts]
    drafter = ScriptedDrafter(model, prompts, long, error_rate=0.0)
    dec = SpecDecoder(HFTarget(model), drafter, SpecConfig(block_size=block_size))
    results = dec.generate(prompts, SamplingParams(max_new_tokens=40, stop_token_ids=tuple(stop)))
    for t, r in zip(truth, results):
        assert r.token_ids == t
        if t[-1] in stop:
            assert r.finish_reason == "stop"
    assert results[0].finish_reason == "stop"
    assert len(results[0].token_ids) <= 6


def test_eos_from_target_info_stops_unless_ignored() -> None:
    model = make_tiny_target("llama", seed=4)
    prompt = [3, 4, 5]
    cont = reference_greedy(model, prompt, 20)
    eos = cont[6]
    target = HFTarget(model, eos_token_ids=(eos,))
    dec = SpecDecoder(target, ScriptedDrafter(model, [prompt], [cont], error_rate=0.0),
                      SpecConfig(block_size=8))
    stopped = dec.generate([prompt], SamplingParams(max_new_tokens=20))[0]
    assert stopped.token_ids == cont[: cont.index(eos) + 1]
    dec = SpecDecoder(target, ScriptedDrafter(model, [prompt], [cont], error_rate=0.0),
                      SpecConfig(block_size=8))
    ignored = dec.generate([prompt], SamplingParams(max_new_tokens=20, ignore_eos=True))[0]
    assert ignored.token_ids == cont


def test_block_size_one_is_plain_decoding_without_drafter() -> None:
    model = make_tiny_target("llama", seed=5)
    prompts = ragged_prompts(3, seed=11, vocab=48)
    dec = SpecDecoder(HFTarget(model), None, SpecConfig(block_size=1))
    for p, r in zip(prompts, dec.generate(prompts, SamplingParams(max_new_tokens=12))):
        assert r.token_ids == reference_greedy(model, p, 12)
        assert r.stats.acceptance_lengths == [1] * 11


def test_runtime_block_size_smaller_than_drafter_block() -> None:
    model = make_tiny_target("llama", seed=6)
    prompts = ragged_prompts(2, seed=12, vocab=48)
    truth = [reference_greedy(model, p, 30) for p in prompts]
    drafter = ScriptedDrafter(model, prompts, truth, error_rate=0.0, block_size=16)
    dec = SpecDecoder(HFTarget(model), drafter, SpecConfig(block_size=16))
    results = dec.generate(prompts, SamplingParams(max_new_tokens=30), block_size=8)
    assert [r.token_ids for r in results] == truth
    assert all(max(r.stats.acceptance_lengths) <= 8 for r in results)
    assert all(r.stats.block_size == 8 for r in results)
