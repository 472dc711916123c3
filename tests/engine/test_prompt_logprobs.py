"""Prompt logprobs (what `echo` + `logprobs` scores): each prompt token's log-probability under the
target given the tokens before it, computed in chunks (never [prompt, vocabulary] logits at once)
and equal to one full forward of the Hugging Face model; max_new_tokens 0 scores alone."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_target
from support import native

from blockspec.config import SamplingParams, SpecConfig
from blockspec.engine import Engine, EngineConfig
from blockspec.engine.scoring import prompt_logprobs
from blockspec.errors import ConfigError
from blockspec.targets.hf import HFTarget

PROMPT = [5, 17, 3, 40, 22, 9, 31, 2, 44, 12, 8, 19, 27]


@pytest.fixture(scope="module")
def model():
    return make_tiny_target("llama", seed=8)


def reference(model, ids: list[int]) -> torch.Tensor:
    """[n - 1, V]: log-softmax of one full forward, position t predicting token t + 1."""
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0, :-1].double(), dim=-1)


class CountingTarget:
    """A target that records the widest logits any forward returned."""

    def __init__(self, target) -> None:
        self.target = target
        self.widest = 0

    def __getattr__(self, name):
        return getattr(self.target, name)

    def forward(self, ids, positions, cache, layer_ids=(), last_logits_only=False):
        logits, feats = self.target.forward(ids, positions, cache, layer_ids, last_logits_only)
        self.widest = max(self.widest, logits.shape[1])
        return logits, feats


@pytest.mark.parametrize("kind", ["hf", "native"])
@pytest.mark.parametrize("chunk", [1, 4, 128])
def test_prompt_logprobs_equal_one_full_forward(model, kind, chunk):
    target = CountingTarget(HFTarget(model) if kind == "hf" else native(model))
    got = prompt_logprobs(target, PROMPT, 3, chunk=chunk)
    want = reference(model, PROMPT)
    assert len(got) == len(PROMPT) and got[0] is None
    for t, entry in enumerate(got[1:]):
        assert entry.logprob == pytest.approx(float(want[t, PROMPT[t + 1]]), abs=1e-5)
        top = want[t].topk(3)
        assert [i for i, _ in entry.top] == top.indices.tolist()
        assert [v for _, v in entry.top] == pytest.approx(top.values.tolist(), abs=1e-5)
    assert target.widest == min(chunk, len(PROMPT) - 1)


def test_one_token_prompt_has_only_the_null_entry(model):
    assert prompt_logprobs(HFTarget(model), [7], 2) == [None]


def test_engine_scores_alone_with_zero_new_tokens_and_unchanged_generation_otherwise(model):
    engine = Engine(native(model), None, EngineConfig(SpecConfig(block_size=1), own_thread=False))
    scored = engine.submit(PROMPT, SamplingParams(max_new_tokens=0, prompt_logprobs=1))
    both = engine.submit(PROMPT, SamplingParams(max_new_tokens=6, prompt_logprobs=0, ignore_eos=True))
    plain = engine.submit(PROMPT, SamplingParams(max_new_tokens=6, ignore_eos=True))
    engine.run_until_idle()
    events = list(scored.events(timeout=5))
    assert len(events) == 1 and events[0].finished and events[0].finish_reason == "length"
    assert events[0].token_ids == [] and events[0].stats.prompt_tokens == len(PROMPT)
    want = reference(model, PROMPT)
    lps = events[0].prompt_logprobs
    assert lps[0] is None and len(lps) == len(PROMPT)
    expected = [float(want[t, PROMPT[t + 1]]) for t in range(len(PROMPT) - 1)]
    assert [e.logprob for e in lps[1:]] == pytest.approx(expected, abs=1e-5)
    first, *rest = list(both.events(timeout=5))
    assert first.token_ids == [] and len(first.prompt_logprobs) == len(PROMPT)
    assert [t for e in rest for t in e.token_ids] == plain.result(timeout=5).token_ids
    engine.stop()


def test_zero_new_tokens_needs_prompt_logprobs():
    with pytest.raises(ConfigError, match="max_new_tokens must be an integer >= 1"):
        SamplingParams(max_new_tokens=0)
    assert SamplingParams(max_new_tokens=0, prompt_logprobs=0).max_new_tokens == 0
