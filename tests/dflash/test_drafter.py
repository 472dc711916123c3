"""Drafter checkpoints: published format round trips, and Z Lab's reference package as oracle."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import make_tiny_target

from blockspec.config import SamplingParams, SpecConfig
from blockspec.errors import CheckpointError, CompatibilityError, ConfigError
from blockspec.dflash.drafter import (
    DrafterConfig,
    default_target_layer_ids,
    load_drafter,
    new_drafter,
    new_drafter_for_target,
    save_drafter,
)
from blockspec.targets.hf import HFTarget
from blockspec.engine.decoder import SpecDecoder

PUBLISHED_QWEN3_8B = {  # the published Qwen3-8B drafter's config.json, shrunk only in size fields
    "architectures": ["DFlashDraftModel"],
    "model_type": "qwen3",
    "block_size": 16,
    "dflash_config": {"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]},
    "num_target_layers": 36,
    "num_hidden_layers": 5,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000,
    "rope_scaling": None,
    "max_position_embeddings": 40960,
    "layer_types": ["full_attention"] * 5,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "vocab_size": 151936,
    "attention_bias": False,
    "torch_dtype": "bfloat16",
}


def test_default_target_layer_ids_match_published() -> None:
    assert default_target_layer_ids(36, 5) == (1, 9, 17, 25, 33)
    assert default_target_layer_ids(30, 1) == (15,)
    assert default_target_layer_ids(28, 2) == (1, 25)


def test_published_config_parses_and_round_trips() -> None:
    cfg = DrafterConfig.from_dict(PUBLISHED_QWEN3_8B)
    assert cfg.target_layer_ids == (1, 9, 17, 25, 33)
    assert cfg.mask_token_id == 151669 and cfg.block_size == 16 and cfg.num_target_layers == 36
    out = cfg.to_dict()
    assert out["dflash_config"] == {"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]}
    assert out["architectures"] == ["DFlashDraftModel"] and out["torch_dtype"] == "bfloat16"
    assert DrafterConfig.from_dict(out) == cfg


def test_checkpoint_round_trip_single_and_sharded(tmp_path: Path) -> None:
    model = new_drafter(hidden_size=32, vocab_size=100, num_target_layers=6, mask_token_id=99,
                        num_layers=2, seed=3)
    save_drafter(model, tmp_path / "single")
    assert (tmp_path / "single" / "model.safetensors").exists()
    save_drafter(model, tmp_path / "sharded", max_shard_bytes=20_000)
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    for sub in ("single", "sharded"):
        loaded = load_drafter(tmp_path / sub)
        assert loaded.cfg == model.cfg
        for (name, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items()):
            assert torch.equal(a, b), name
    names = set(model.state_dict())
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.1.self_attn.q_norm.weight",
            "layers.0.mlp.gate_proj.weight", "layers.0.post_attention_layernorm.weight"} <= names


def _published_dir(tmp_path: Path, target) -> Path:
    drafter = new_drafter_for_target(target.config, mask_token_id=47, num_layers=2, block_size=8, seed=5)
    return save_drafter(drafter, tmp_path / "drafter")


@pytest.mark.parametrize("family", ["llama", "qwen3", "windowed"])
def test_reference_package_same_hidden_states(tmp_path: Path, family: str) -> None:
    """windowed: bidirectional layers with a sliding window shorter than the context (as the
    shipped SmolLM2 drafter has), which the reference reads from the same config keys."""
    from dflash.model import DFlashDraftModel

    target = make_tiny_target("qwen3" if family == "windowed" else family, dtype=torch.float32)
    path = _published_dir(tmp_path, target)
    if family == "windowed":
        config = json.loads((path / "config.json").read_text())
        config.update(layer_types=["sliding_attention"] * 2, sliding_window=6, is_causal=False)
        del config["use_sliding_window"]
        (path / "config.json").write_text(json.dumps(config))
        path = save_drafter(load_drafter(path), tmp_path / "saved")  # as `blockspec train` writes it
    ours = load_drafter(path)
    if family == "windowed":
        assert all(not layer.self_attn.causal and layer.self_attn.sliding_window == 6 for layer in ours.layers)
        assert json.loads((path / "config.json").read_text())["use_sliding_window"] is True
    ref = DFlashDraftModel.from_pretrained(str(path)).float().eval()
    assert list(ref.target_layer_ids) == list(ours.target_layer_ids)
    _assert_drafts_as_the_reference(ours, ref, seed=0)


def test_zlab_mixed_sliding_and_full_config_is_never_causal(tmp_path: Path) -> None:
    """A config shaped like Z Lab's Qwen3.6 drafters: sliding and full layers mixed, a window, no
    is_causal. Every layer drafts bidirectionally (as the serving engines run them), the sliding
    ones within the window over the context: the reference package's states once it is told
    is_causal false (it would otherwise make the sliding layers causal). An explicit
    `is_causal: true` still makes the layers causal."""
    from dflash.model import DFlashDraftModel

    target = make_tiny_target("qwen3", dtype=torch.float32, seed=3)
    drafter = new_drafter_for_target(target.config, mask_token_id=47, num_layers=3, block_size=8, seed=6)
    path = save_drafter(drafter, tmp_path / "zlab")
    config = json.loads((path / "config.json").read_text())
    config.update(layer_types=["sliding_attention", "sliding_attention", "full_attention"], sliding_window=6,
                  use_sliding_window=True)
    config.pop("is_causal", None)
    (path / "config.json").write_text(json.dumps(config))
    ours = load_drafter(path)
    assert [(layer.self_attn.causal, layer.self_attn.sliding_window) for layer in ours.layers] == [
        (False, 6), (False, 6), (False, None)]
    (path / "config.json").write_text(json.dumps({**config, "is_causal": False}))
    ref = DFlashDraftModel.from_pretrained(str(path)).float().eval()
    _assert_drafts_as_the_reference(ours, ref, seed=1)
    (path / "config.json").write_text(json.dumps({**config, "is_causal": True}))
    assert all(layer.self_attn.causal for layer in load_drafter(path).layers)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_reference_package_same_greedy_tokens(tmp_path: Path, family: str) -> None:
    from dflash.model import DFlashDraftModel, dflash_generate

    target = make_tiny_target(family, dtype=torch.float32, seed=7)
    path = _published_dir(tmp_path, target)
    ref = DFlashDraftModel.from_pretrained(str(path)).float().eval()
    dec = SpecDecoder(HFTarget(target), load_drafter(path), SpecConfig(block_size=8))
    for prompt in ([1, 2, 3, 4, 5, 6, 7], [9, 3], list(range(10, 30))):
        ours = dec.generate([prompt], SamplingParams(max_new_tokens=40))[0].token_ids
        theirs = dflash_generate(ref, target, torch.tensor([prompt]), 40, None, block_size=8)
        assert ours == theirs[0, len(prompt):].tolist()


def test_load_errors_name_the_problem(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="does not exist"):
        load_drafter(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="config.json"):
        load_drafter(tmp_path / "empty")
    model = new_drafter(hidden_size=32, vocab_size=100, num_target_layers=6, mask_token_id=99, seed=1)
    path = save_drafter(model, tmp_path / "d")
    (path / "model.safetensors").write_bytes(b"\x00" * 40)
    with pytest.raises(CheckpointError, match="corrupt"):
        load_drafter(path)
    path = save_drafter(model, tmp_path / "d2")
    (path / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_drafter(path)
    path = save_drafter(model, tmp_path / "d3")
    (path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        load_drafter(path)
    path = save_drafter(model, tmp_path / "d4")
    raw = json.loads((path / "config.json").read_text())
    raw["num_hidden_layers"] = 2
    (path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match="layer_types has 1 entries for 2 layers"):
        load_drafter(path)
    raw["layer_types"] = ["full_attention"] * 2
    (path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match="missing.*layers.1"):
        load_drafter(path)


def test_config_validation_errors() -> None:
    with pytest.raises(ConfigError, match="mask_token_id 100 is outside the vocabulary"):
        new_drafter(hidden_size=32, vocab_size=100, num_target_layers=6, mask_token_id=100)
    with pytest.raises(ConfigError, match="target_layer_ids .*outside"):
        new_drafter(hidden_size=32, vocab_size=100, num_target_layers=6, mask_token_id=1, target_layer_ids=(2, 6))


def test_target_drafter_mismatch_errors() -> None:
    target = HFTarget(make_tiny_target("llama"))
    wrong_hidden = new_drafter(hidden_size=64, vocab_size=48, num_target_layers=4, mask_token_id=1)
    with pytest.raises(CompatibilityError, match="hidden_size 64 != target hidden_size 32"):
        SpecDecoder(target, wrong_hidden)
    wrong_vocab = new_drafter(hidden_size=32, vocab_size=50, num_target_layers=4, mask_token_id=1)
    with pytest.raises(CompatibilityError, match="vocab_size 50 != target vocab_size 48"):
        SpecDecoder(target, wrong_vocab)
    deeper = new_drafter(hidden_size=32, vocab_size=48, num_target_layers=12, mask_token_id=1,
                         target_layer_ids=(1, 9))
    with pytest.raises(CompatibilityError, match=r"target_layer_ids \[9\] are out of range"):
        SpecDecoder(target, deeper)


def test_draft_vocabulary_restricts_proposals_and_round_trips(tmp_path: Path) -> None:
    """Only the listed tokens can be proposed; their logits equal the full head's; the file
    survives save/load, can be ignored, and the reference package still loads the directory."""
    from dflash.model import DFlashDraftModel

    target = make_tiny_target("llama", dtype=torch.float32, seed=9)
    drafter = new_drafter_for_target(target.config, mask_token_id=47, num_layers=1, block_size=8, seed=2)
    head = target.get_output_embeddings()
    hidden = torch.randn(2, 7, 32, generator=torch.Generator().manual_seed(1))
    full = drafter.logits(hidden, head)
    vocab = [3, 5, 8, 13, 21, 34, 47]
    drafter.set_draft_vocab(vocab, drafter.cfg.vocab_size)
    restricted = drafter.logits(hidden, head)
    torch.testing.assert_close(restricted[..., vocab], full[..., vocab])
    others = [t for t in range(full.shape[-1]) if t not in vocab]
    assert torch.isinf(restricted[..., others]).all()
    assert set(restricted.argmax(-1).flatten().tolist()) <= set(vocab)
    # The greedy shortcut (no full-vocabulary logits) proposes the same tokens, with or without.
    assert torch.equal(drafter.greedy_tokens(hidden, head), restricted.argmax(-1))
    # A tree's top-k (no full-vocabulary logits either): the full distribution's k best, restricted.
    top, ids = drafter.top_logprobs(hidden, head, 3)
    want_top, want_ids = torch.log_softmax(restricted.float(), -1).topk(3, dim=-1)
    assert torch.equal(ids, want_ids) and torch.allclose(top, want_top, atol=1e-6)
    drafter.set_draft_vocab(None)
    assert torch.equal(drafter.greedy_tokens(hidden, head), full.argmax(-1))
    top, ids = drafter.top_logprobs(hidden, head, 3)
    want_top, want_ids = torch.log_softmax(full.float(), -1).topk(3, dim=-1)
    assert torch.equal(ids, want_ids) and torch.allclose(top, want_top, atol=1e-6)
    drafter.set_draft_vocab(vocab, drafter.cfg.vocab_size)
    path = save_drafter(drafter, tmp_path / "d")
    assert load_drafter(path).draft_vocab.tolist() == vocab
    assert load_drafter(path, draft_vocab=False).draft_vocab is None
    DFlashDraftModel.from_pretrained(str(path))  # the extra file does not disturb other loaders
    drafter.set_draft_vocab(None)
    save_drafter(drafter, path)
    assert not (path / "draft_vocab.safetensors").exists()  # a stale vocabulary is removed
    with pytest.raises(ConfigError, match="draft vocabulary"):
        drafter.set_draft_vocab([1, 999], drafter.cfg.vocab_size)


def test_draft_vocabulary_keeps_greedy_output_identical(tmp_path: Path) -> None:
    target = make_tiny_target("qwen3", dtype=torch.float32, seed=10)
    drafter = new_drafter_for_target(target.config, mask_token_id=47, num_layers=1, block_size=8, seed=3)
    plain = SpecDecoder(HFTarget(target), None, SpecConfig(block_size=1))
    prompts = [[1, 2, 3, 4, 5, 6, 7], [9, 3], list(range(10, 30))]
    truth = [r.token_ids for r in plain.generate(prompts, SamplingParams(max_new_tokens=30))]
    drafter.set_draft_vocab(sorted({t for row in truth for t in row})[::2], drafter.cfg.vocab_size)
    dec = SpecDecoder(HFTarget(target), drafter, SpecConfig(block_size=8))
    assert [r.token_ids for r in dec.generate(prompts, SamplingParams(max_new_tokens=30))] == truth


@pytest.mark.parametrize("vocab", [None, [3, 5, 8, 13, 21, 34, 47]])
def test_bf16_drafter_beside_fp32_target(vocab: list[int] | None) -> None:
    """The drafter casts what the target hands it (features, embeddings) to its own dtype, and
    hands back logits in the head's dtype; both forwards agree; decoding stays exact."""
    from blockspec.dflash.static_drafter import StaticDrafter

    target = make_tiny_target("qwen3", dtype=torch.float32, seed=11)
    fp32 = new_drafter_for_target(target.config, mask_token_id=47, num_layers=2, block_size=8, seed=4)
    bf16 = new_drafter_for_target(target.config, mask_token_id=47, num_layers=2, block_size=8, seed=4,
                                  dtype=torch.bfloat16)
    for d in (fp32, bf16):
        d.set_draft_vocab(vocab, d.cfg.vocab_size)
    head = target.get_output_embeddings()
    g = torch.Generator().manual_seed(5)
    feats = torch.randn(1, 6, len(fp32.target_layer_ids) * 32, generator=g)  # fp32, as the target produces them
    embeds = torch.randn(1, 8, 32, generator=g)
    ctx_pos, block_pos = torch.arange(6)[None], torch.arange(6, 14)[None]
    with torch.inference_mode():
        hidden = bf16(feats, ctx_pos, embeds, block_pos, bf16.new_cache(1))
        same = bf16(feats.bfloat16(), ctx_pos, embeds.bfloat16(), block_pos, bf16.new_cache(1))
        static = StaticDrafter(bf16)
        cache = static.new_cache(1)
        cache.reserve(14, 14)
        hidden_static = static(feats, ctx_pos, embeds, block_pos, cache)
        reference = fp32(feats, ctx_pos, embeds, block_pos, fp32.new_cache(1))
    assert hidden.dtype == torch.bfloat16 and torch.equal(hidden, same)
    torch.testing.assert_close(hidden_static.float(), hidden.float(), atol=0.05, rtol=0.05)
    torch.testing.assert_close(hidden.float(), reference, atol=0.1, rtol=0.1)  # bf16 rounding only
    logits = bf16.logits(hidden, head)
    assert logits.dtype == torch.float32
    assert torch.equal(bf16.greedy_tokens(hidden, head), logits.argmax(-1))
    plain = SpecDecoder(HFTarget(target), None, SpecConfig(block_size=1))
    prompts = [[1, 2, 3, 4, 5, 6, 7], [9, 3]]
    truth = [r.token_ids for r in plain.generate(prompts, SamplingParams(max_new_tokens=20))]
    dec = SpecDecoder(HFTarget(target), bf16, SpecConfig(block_size=8))
    assert [r.token_ids for r in dec.generate(prompts, SamplingParams(max_new_tokens=20))] == truth
    sampled = dec.generate(prompts, SamplingParams(max_new_tokens=20, temperature=0.8, seed=1))
    assert all(len(r.token_ids) == 20 for r in sampled)


def test_drafter_dtype_resolution() -> None:
    from blockspec.api import resolve_drafter_dtype
    from blockspec.cpu.linear import cpu_bf16_matmul

    auto = torch.bfloat16 if cpu_bf16_matmul() else torch.float32
    assert resolve_drafter_dtype("auto", "float32", "cpu") == auto
    assert resolve_drafter_dtype("auto", "bfloat16", "cpu") == torch.bfloat16
    assert resolve_drafter_dtype("auto", "float16", "cuda") == torch.float16
    assert resolve_drafter_dtype("auto", "float32", "cuda") == torch.float32
    assert resolve_drafter_dtype("float32", "float32", "cpu") == torch.float32
    assert resolve_drafter_dtype("auto", "float32", "cpu", "int8") == torch.float32  # drafts in int8 too
    assert resolve_drafter_dtype("bfloat16", "float32", "cpu", "int8") == torch.bfloat16  # asked for: kept
    with pytest.raises(ConfigError, match="drafter_dtype must be 'auto' or one of"):
        resolve_drafter_dtype("int8", "float32", "cpu")


def _assert_drafts_as_the_reference(ours, ref, seed: int) -> None:
    """One pass of 11 context features and an 8-token block: our hidden states = the reference's."""
    g = torch.Generator().manual_seed(seed)
    ctx = torch.randn(1, 11, 32 * len(ours.target_layer_ids), generator=g)
    emb = torch.randn(1, 8, 32, generator=g)
    pos = torch.arange(19)[None]
    with torch.no_grad():
        a = ours(ctx, pos[:, :11], emb, pos[:, 11:])
        b = ref(position_ids=pos, noise_embedding=emb, target_hidden=ctx)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
