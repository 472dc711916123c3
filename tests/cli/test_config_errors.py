"""Invalid requests fail early with messages that name the argument and the fix."""

from __future__ import annotations

import pytest
from conftest import make_tiny_target

from blockspec.config import SamplingParams, SpecConfig
from blockspec.errors import ConfigError, ContextLengthError
from blockspec.targets.hf import HFTarget
from blockspec.engine.decoder import SpecDecoder


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(temperature=-0.1), "temperature must be"),
        (dict(temperature=float("nan")), "temperature must be"),
        (dict(top_p=0.0), "top_p must be in"),
        (dict(top_p=1.5), "top_p must be in"),
        (dict(top_k=-1), "top_k must be"),
        (dict(max_new_tokens=0), "max_new_tokens must be"),
        (dict(seed=-3), "seed must be"),
        (dict(stop=("",)), "stop must be"),
    ],
)
def test_invalid_sampling_values(kwargs: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        SamplingParams(**kwargs)


def test_invalid_block_size() -> None:
    with pytest.raises(ConfigError, match="block_size must be an integer in"):
        SpecConfig(block_size=0)
    with pytest.raises(ConfigError, match="block_size must be an integer in"):
        SpecConfig(block_size=1000)


def test_prompt_plus_max_new_tokens_beyond_context() -> None:
    model = make_tiny_target("llama", max_position_embeddings=64)
    dec = SpecDecoder(HFTarget(model), None, SpecConfig(block_size=1))
    with pytest.raises(ContextLengthError, match="exceeds the target's context of 64 tokens.*at most 4"):
        dec.generate([[1] * 60], SamplingParams(max_new_tokens=10))
    with pytest.raises(ConfigError, match="prompt is empty"):
        dec.generate([[]], SamplingParams(max_new_tokens=4))
    with pytest.raises(ConfigError, match="token ids must be in"):
        dec.generate([[1, 2, 999]], SamplingParams(max_new_tokens=4))
    with pytest.raises(ConfigError, match="list of int token ids \\(tokenize text first\\); got str 'hello'"):
        dec.generate([[1, "hello"]], SamplingParams(max_new_tokens=4))
    with pytest.raises(ConfigError, match="needs a drafter"):
        dec.generate([[1, 2]], SamplingParams(max_new_tokens=4), block_size=8)
