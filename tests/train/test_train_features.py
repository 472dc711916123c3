"""Target features captured while decoding (datagen) equal a full forward, and training uses them."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_target
from support import ragged_prompts
from support import CharTokenizer, predictable_target, prompts

from blockspec.config import SamplingParams, SpecConfig
from blockspec.errors import ConfigError
from blockspec.dflash.drafter import new_drafter_for_target
from blockspec.targets.native import load_native_target
from blockspec.targets.hf import HFTarget
from blockspec.engine.decoder import SpecDecoder
from blockspec.train import features as F
from blockspec.train.data import read_examples
from blockspec.train.datagen import regenerate

LAYERS = (0, 2, 3)


@pytest.mark.parametrize("backend", ["hf", "native"])
def test_captured_features_equal_a_full_forward(backend: str) -> None:
    model = make_tiny_target("qwen2", seed=31)
    target = HFTarget(model, eos_token_ids=()) if backend == "hf" else load_native_target(model, dtype=None, eos_token_ids=())
    prompts_ = ragged_prompts(3, seed=32, vocab=48)
    lengths = [4, 11, 7]  # rows finish at different steps
    params = [SamplingParams(max_new_tokens=n) for n in lengths]
    drafter = new_drafter_for_target(model.config, mask_token_id=47, num_layers=1, target_layer_ids=list(LAYERS),
                                     dtype=torch.float64)
    for d, block in ((None, 1), (drafter, 4)):
        results = SpecDecoder(target, d, SpecConfig(block_size=block)).generate(prompts_, params, capture_layer_ids=LAYERS)
        for p, r in zip(prompts_, results):
            full = F.target_features(target, [p + r.token_ids], LAYERS)[0]  # [S, 3H]
            assert r.features.shape == full.shape == (len(p) + len(r.token_ids), 3 * model.config.hidden_size)
            torch.testing.assert_close(r.features[:-1], full[:-1].float(), rtol=1e-6, atol=1e-6)
            assert not r.features[-1].any()  # the last token is never fed to the target
    with pytest.raises(ConfigError, match="target_layer_ids"):
        SpecDecoder(target, drafter, SpecConfig(block_size=4)).generate(prompts_, params, capture_layer_ids=(1, 2))


def test_datagen_features_feed_the_training_cache(tmp_path, monkeypatch) -> None:
    target = predictable_target()
    data = tmp_path / "data"
    regenerate(target, CharTokenizer(), prompts(5), data, max_new_tokens=9, batch_size=3, progress=False,
               feature_layer_ids=LAYERS)
    examples = read_examples(data)
    expected = {e.id: F.target_features(target, [e.input_ids], LAYERS)[0] for e in examples}

    def no_second_pass(*a, **k):
        raise AssertionError("the features were captured by datagen; no target pass should run")

    monkeypatch.setattr(F, "target_features", no_second_pass)
    store = F.FeatureStore(data, LAYERS)
    assert store.build(target, progress=False) == 1
    store.open()
    for e in examples:
        got = store.get(e.id).float()
        assert got.shape == expected[e.id].shape
        torch.testing.assert_close(got[:-1], expected[e.id][:-1], rtol=2e-2, atol=2e-2)  # stored in bf16
    with pytest.raises(ConfigError, match="layer ids"):
        regenerate(target, CharTokenizer(), prompts(1, start=50), data, progress=False, feature_layer_ids=(9,))
    with pytest.raises(ConfigError, match="backend 'spec'"):
        regenerate(target, CharTokenizer(), prompts(1, start=50), data, progress=False, backend="hf",
                   feature_layer_ids=LAYERS)
