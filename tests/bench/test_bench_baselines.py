"""Baselines of the benchmark: transformers generate, prompt lookup, the reference package."""

from __future__ import annotations

import pytest

from blockspec.bench.baselines import (
    HFGenerateRunner,
    ReferenceRunner,
    load_hf_model,
    reference_available,
    reference_drafter_from,
)
from blockspec.bench.runner import Request, EngineRunner
from blockspec.config import SamplingParams

PROMPTS = ["Janet has 16 ducks and sells the eggs.", "def add(a, b):\n    return a + b"]


@pytest.fixture(scope="module")
def pipe(tiny_model_dir, tiny_drafter_dir):
    from blockspec.api import load

    return load(str(tiny_model_dir), str(tiny_drafter_dir))


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir):
    return load_hf_model(tiny_model_dir)


@pytest.fixture(scope="module")
def requests(pipe):
    params = SamplingParams(max_new_tokens=8)
    return [Request(tuple(pipe.encode(p, chat=True)), params) for p in PROMPTS]


@pytest.fixture(scope="module")
def ar_outputs(pipe, requests):
    return EngineRunner(pipe.target, None, 1).run(requests, 1)


def test_hf_generate_baseline_runs_and_matches_our_ar(pipe, hf_model, requests, ar_outputs):
    runner = HFGenerateRunner(hf_model, pipe.target.info.eos_token_ids)
    done = []
    outs = runner.run(requests, 1, progress=done.append)
    assert done == [1, 1] and runner.name == "hf generate" and runner.max_concurrency == 1
    for out, ar in zip(outs, ar_outputs):
        assert out.token_ids == ar.token_ids  # same weights, greedy
        assert out.latency_s > 0 and out.steps == len(out.token_ids) - 1  # one forward per token
        assert out.finish_reason in ("stop", "length")


def test_prompt_lookup_baseline_runs(pipe, hf_model, requests, ar_outputs):
    runner = HFGenerateRunner(hf_model, pipe.target.info.eos_token_ids, prompt_lookup_num_tokens=3)
    assert runner.method == "pld" and runner.name == "pld n3"
    outs = runner.run(requests, 1)
    for out, ar in zip(outs, ar_outputs):
        assert len(out.token_ids) == len(ar.token_ids)
        assert 1 <= out.steps <= len(out.token_ids) - 1


def test_hf_generate_sampled_is_seeded(pipe, hf_model, requests):
    runner = HFGenerateRunner(hf_model, pipe.target.info.eos_token_ids)
    params = SamplingParams(max_new_tokens=8, temperature=0.9, seed=5)
    reqs = [Request(requests[0].prompt_ids, params)] * 2
    a, b = runner.run(reqs, 1)
    assert a.token_ids == b.token_ids and len(a.token_ids) == 8


@pytest.mark.skipif(not reference_available(), reason="the reference package dflash==0.1.0 is not importable")
def test_reference_baseline_runs_on_the_same_weights(pipe, hf_model, requests, ar_outputs):
    ref = reference_drafter_from(pipe.drafter)
    runner = ReferenceRunner(ref, hf_model, pipe.target.info.eos_token_ids, block_size=4)
    assert runner.name == "reference b4"
    outs = runner.run(requests, 1)
    for out, ar in zip(outs, ar_outputs):
        assert out.token_ids == ar.token_ids  # greedy DFlash is lossless in the reference too
        assert 1 <= out.steps <= len(out.token_ids) - 1


def test_reference_is_available_in_the_dev_environment():
    # The project venv installs dflash==0.1.0 (--no-deps); the baseline must be importable there.
    pytest.importorskip("dflash")
    assert reference_available()
