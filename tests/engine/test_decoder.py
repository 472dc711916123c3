"""SpecDecoder: the engine's loop on the calling thread (the Python API, CLI, datagen, evaluation)."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_target
from support import OracleDrafter, distinct_prompts, reference_greedy

from blockspec.api import Pipeline
from blockspec.config import SamplingParams, SpecConfig
from blockspec.engine import Engine, SpecDecoder
from blockspec.errors import ConfigError
from blockspec.targets.native import load_native_target


class _Letters:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + t % 26) for t in ids)


@pytest.fixture(scope="module")
def setup():
    model = make_tiny_target("llama", seed=21)
    target = load_native_target(model, dtype=None, eos_token_ids=())
    prompts = distinct_prompts(4, seed=5)
    truths = [reference_greedy(model, p, 20) for p in prompts]
    drafter = OracleDrafter(model, target, prompts, truths, wrong_every=4)
    return model, target, drafter, prompts, truths


def test_pipeline_and_decoder_run_the_engines_loop(setup, monkeypatch) -> None:
    """Pipeline.generate_ids decodes through Engine._tick, the server's loop, and gets greedy output."""
    model, target, drafter, prompts, truths = setup
    ticks = []
    real = Engine._tick
    monkeypatch.setattr(Engine, "_tick", lambda self: ticks.append(1) or real(self))
    pipe = Pipeline(target, _Letters(), drafter, block_size=6, adaptive_block=False)
    done = pipe.generate_ids(prompts, SamplingParams(max_new_tokens=20))
    assert [c.token_ids for c in done] == truths
    assert len(ticks) >= 20 / 6  # several tokens per step, every step through the engine
    engine, = pipe.decoder._engines.values()
    assert engine.batch.rows == [] and engine.metrics.requests_total == len(prompts)


def test_a_failing_step_raises_as_raised_and_the_next_call_is_clean(setup) -> None:
    model, target, drafter, prompts, truths = setup
    dec = SpecDecoder(target, drafter, SpecConfig(block_size=6))

    def broken(_row: int, ids: list[int]) -> None:
        raise ValueError("a listener failed")

    with pytest.raises(ValueError, match="a listener failed"):
        dec.generate(prompts, SamplingParams(max_new_tokens=20), on_tokens=broken)
    assert [r.token_ids for r in dec.generate(prompts, SamplingParams(max_new_tokens=20))] == truths


def test_an_interrupt_leaves_nothing_running_for_the_next_call(setup) -> None:
    model, target, drafter, prompts, truths = setup
    dec = SpecDecoder(target, drafter, SpecConfig(block_size=6))
    heard = []

    def interrupt(row: int, ids: list[int]) -> None:
        heard.append(row)
        if len(heard) == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        dec.generate(prompts, SamplingParams(max_new_tokens=20), on_tokens=interrupt)
    steps = {}
    got = dec.generate(prompts[:1], SamplingParams(max_new_tokens=20),
                       on_tokens=lambda row, ids: steps.__setitem__(row, steps.get(row, 0) + 1))
    assert got[0].token_ids == truths[0]
    assert set(steps) == {0}  # only this call's prompt was decoded
    assert all(e.batch.rows == [] and e.scheduler.depth == 0 for e in dec._engines.values())


def test_a_refused_prompt_queues_nothing_of_its_call(setup) -> None:
    model, target, drafter, prompts, truths = setup
    dec = SpecDecoder(target, drafter, SpecConfig(block_size=6))
    with pytest.raises(ConfigError, match="token ids must be in"):
        dec.generate([prompts[0], [10**6]], SamplingParams(max_new_tokens=20))
    steps = {}
    got = dec.generate(prompts[1:2], SamplingParams(max_new_tokens=20),
                       on_tokens=lambda row, ids: steps.__setitem__(row, steps.get(row, 0) + 1))
    assert got[0].token_ids == truths[1] and set(steps) == {0}


def test_fixed_block_calls_and_captured_features_keep_their_own_engines(setup) -> None:
    model, target, drafter, prompts, truths = setup
    dec = SpecDecoder(target, drafter, SpecConfig(block_size=6, adaptive=True))
    for block in (1, 3, 6):
        assert [r.token_ids for r in dec.generate(prompts, SamplingParams(max_new_tokens=20),
                                                  block_size=block)] == truths
    assert dec.block_choices == {}  # explicit block sizes never ran the adaptive policy
    captured = dec.generate(prompts[:2], SamplingParams(max_new_tokens=20), block_size=1,
                            capture_layer_ids=drafter.target_layer_ids)
    for r, p in zip(captured, prompts):
        assert r.features is not None and r.features.shape[0] == len(p) + len(r.token_ids)
        assert torch.all(r.features[-1] == 0)  # the last token was never fed
