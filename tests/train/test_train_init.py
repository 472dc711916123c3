"""Drafter initialisation from target layers and the feature cache."""

from __future__ import annotations

import torch

from blockspec.dflash.drafter import new_drafter_for_target
from blockspec.targets.hf import HFTarget
from blockspec.train.data import Example, ShardWriter
from blockspec.train.features import FeatureStore, target_features
import pytest

from blockspec.errors import ConfigError
from blockspec.train.init import grow_layers, init_from_target

from conftest import make_tiny_target


def test_init_copies_layers_and_fc_selects_last_fused_layer():
    model = make_tiny_target("llama", dtype=torch.float32)
    d = new_drafter_for_target(model.config, mask_token_id=5, num_layers=2, target_layer_ids=(0, 1))
    src = init_from_target(d, model, calibration_ids=torch.tensor([[1, 2, 3, 4]]))
    assert src == [2, 3]
    t = model.model.layers
    assert torch.equal(d.layers[0].self_attn.q_proj.weight, t[2].self_attn.q_proj.weight)
    assert torch.equal(d.layers[1].mlp.down_proj.weight, t[3].mlp.down_proj.weight)
    assert torch.equal(d.norm.weight, model.model.norm.weight)
    # fc(concat[f0, f1]) == f1: the context is the output of target layer 1, normed as layer 2 would
    feats = torch.randn(3, 2 * 32)
    assert torch.allclose(d.fc(feats), feats[:, 32:])
    assert torch.equal(d.hidden_norm.weight, t[2].input_layernorm.weight)
    assert float(d.layers[0].self_attn.q_norm.weight.detach()[0]) != 1.0  # calibrated to the q scale


def test_grow_layers_keeps_outputs_and_starts_new_layers_from_the_last():
    model = make_tiny_target("llama", dtype=torch.float32)
    d = new_drafter_for_target(model.config, mask_token_id=5, num_layers=2, target_layer_ids=(0, 1), seed=3)
    d.set_draft_vocab([1, 4, 9])
    grown = grow_layers(d, 4)
    assert grown.cfg.num_hidden_layers == 4 and len(grown.layers) == 4
    assert grown.cfg.layer_types == ("full_attention",) * 4
    assert torch.equal(grown.draft_vocab, d.draft_vocab)
    torch.manual_seed(0)
    ctx, block = torch.randn(2, 7, 2 * 32), torch.randn(2, 4, 32)
    pos = torch.arange(11)[None].expand(2, -1)
    with torch.no_grad():
        before = d(ctx, pos[:, :7], block, pos[:, 7:])
        after = grown(ctx, pos[:, :7], block, pos[:, 7:])
    assert torch.allclose(before, after, atol=1e-6), (before - after).abs().max()
    for new in grown.layers[2:]:
        assert torch.equal(new.self_attn.q_proj.weight, d.layers[1].self_attn.q_proj.weight)
        assert torch.equal(new.mlp.up_proj.weight, d.layers[1].mlp.up_proj.weight)
        assert not new.self_attn.o_proj.weight.any() and not new.mlp.down_proj.weight.any()
    # the original drafter is left as it was
    assert len(d.layers) == 2 and d.layers[1].self_attn.o_proj.weight.any()
    # an added layer learns: its zeroed output projections get gradients at once
    grown.train()
    out = grown(ctx, pos[:, :7], block, pos[:, 7:])
    out.pow(2).sum().backward()
    assert grown.layers[3].mlp.down_proj.weight.grad.abs().sum() > 0
    with pytest.raises(ConfigError, match="--num-layers 2"):
        grow_layers(d, 1)


def test_feature_store_matches_direct_features(tmp_path):
    model = make_tiny_target("llama", dtype=torch.float32)
    target = HFTarget(model)
    g = torch.Generator().manual_seed(0)
    exs = [Example(f"e{i}", torch.randint(0, 48, (5 + 3 * i,), generator=g).tolist(), [0, 0] + [1] * (3 + 3 * i))
           for i in range(5)]
    ShardWriter(tmp_path, shard_size=3).write(exs)
    store = FeatureStore(tmp_path, (1, 3))
    assert store.build(target, batch_size=2, dtype=torch.float32, progress=False) == 2
    assert store.build(target, batch_size=2, dtype=torch.float32, progress=False) == 0  # cached
    store.open()
    for e in exs:
        want = target_features(target, [e.input_ids], (1, 3))[0]
        assert torch.allclose(store.get(e.id), want, atol=1e-5)


def test_feature_store_grown_shard_keeps_old_features(tmp_path):
    model = make_tiny_target("llama", dtype=torch.float32)
    target = HFTarget(model)
    exs = [Example(f"e{i}", [1, 2, 3, 4 + i, 5, 6], [0, 0, 1, 1, 1, 1]) for i in range(3)]
    writer = ShardWriter(tmp_path, shard_size=10)
    writer.write(exs[:2])
    store = FeatureStore(tmp_path, (2,))
    store.build(target, dtype=torch.float32, progress=False)
    writer.write(exs[2:])  # resumed datagen appended to the same shard
    assert store.build(target, dtype=torch.float32, progress=False) == 1
    store.open()
    for e in exs:
        assert torch.allclose(store.get(e.id), target_features(target, [e.input_ids], (2,))[0], atol=1e-5)


@pytest.mark.parametrize("family", ["qwen3_5_moe_text", "qwen3_next", "gpt_oss"])
def test_init_from_moe_and_hybrid_targets_copies_what_fits(family):
    """MoE MLPs, gated attention (q_proj also makes the gate) and linear-attention layers have no
    counterpart of the drafter's shape: they stay random, said in the log; norms are copied as the
    factor they apply (1 + weight for the zero-centred norms of Qwen3-Next and Qwen3.5)."""
    model = make_tiny_target(family, dtype=torch.float32)
    with torch.no_grad():  # norms that are not all ones (or zeros): which factor is copied shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.2)
    d = new_drafter_for_target(model.config, mask_token_id=5, num_layers=2, target_layer_ids=(0, 1))
    logs: list[str] = []
    assert init_from_target(d, model, calibration_ids=torch.tensor([[1, 2, 3, 4]]), log_fn=logs.append) == [2, 3]
    assert "layer 0 MLP" in logs[0] and "layer 1 MLP" in logs[0]
    x = torch.randn(3, 32)
    with torch.no_grad():
        assert torch.allclose(d.norm(x), model.model.norm(x), atol=1e-4)
        assert torch.allclose(d.layers[1].input_layernorm(x), model.model.layers[3].input_layernorm(x), atol=1e-4)
    if family == "gpt_oss":  # plain attention: copied
        assert torch.equal(d.layers[0].self_attn.k_proj.weight, model.model.layers[2].self_attn.k_proj.weight)
    else:
        assert "layer 0 attention" in logs[0]


def test_training_starts_on_a_hybrid_moe_target(tmp_path):
    """datagen through a Qwen3.6-shaped target (Gated DeltaNet + MoE), then training steps of a
    drafter sized from its config (no dense MLP size: 3 x hidden) and initialised from it."""
    from support import CharTokenizer, prompts

    from blockspec.train.data import read_examples
    from blockspec.train.datagen import regenerate
    from blockspec.train.train_config import TrainConfig
    from blockspec.train.trainer import Trainer

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        target = HFTarget(make_tiny_target("qwen3_5_moe_text", dtype=torch.float32, vocab_size=64))
        regenerate(target, CharTokenizer(), prompts(2), tmp_path / "d", max_new_tokens=12, progress=False, backend="hf")
        cfg = TrainConfig(out=str(tmp_path / "o"), num_layers=1, block_size=4, mask_token_id=63, anchors=8,
                          batch_seqs=2, max_steps=2, lr=1e-3, warmup=0.0)
        logs: list[str] = []
        trainer = Trainer(cfg, target, read_examples(tmp_path / "d"), log_fn=logs.append)
        assert trainer.drafter.cfg.intermediate_size == 3 * 32
        assert any("start random" in line for line in logs)
        losses = [trainer.train_step(step)["loss"] for step in range(2)]
    finally:
        torch.set_num_threads(threads)
    assert all(torch.isfinite(torch.tensor(losses)))
