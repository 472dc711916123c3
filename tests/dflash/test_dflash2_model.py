"""DFlash 2 drafters: the published checkpoint layout, and the forward, the selector's scores and
its greedy walk against the independent implementation in `speculators` 0.9.0 on the same random
weights (loaded into its modules through the published weight names)."""

from __future__ import annotations

import json
import types
from pathlib import Path

import pytest
import torch
from conftest import make_tiny_target
from speculators_oracle import load_speculators_dflash2, their_hidden_by_layer, their_layers, their_selector

from blockspec.errors import CheckpointError, ConfigError
from blockspec.dflash.checkpoint import expected_tensors
from blockspec.dflash.drafter import (
    DFLASH2,
    DFlashDrafter,
    DrafterConfig,
    load_drafter,
    new_drafter,
    new_drafter_for_target,
    save_drafter,
)
from blockspec.train.anchors import block_attention_mask, block_positions

SMALL = dict(conv_group_size=8, selector_rank=12, selector_top_k=5)


def dflash2_drafter(seed: int = 0, *, layers: int = 2, block_size: int = 8, hidden: int = 32, vocab: int = 48,
                    dtype: torch.dtype = torch.float32, **config) -> DFlashDrafter:
    """A random DFlash 2 drafter whose convolutions are not the identity (so they are tested)."""
    drafter = new_drafter(hidden_size=hidden, vocab_size=vocab, num_target_layers=4, mask_token_id=vocab - 1,
                          num_layers=layers, block_size=block_size, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=8, intermediate_size=2 * hidden, architecture=DFLASH2, dflash2={**SMALL, **config},
                          seed=seed, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for layer in drafter.layers:
            for conv in (layer.attention_conv, layer.mlp_conv):
                conv.base_kernel.add_(0.3 * torch.randn(conv.base_kernel.shape, generator=g))
                conv.kernel_projection.weight.copy_(0.2 * torch.randn(conv.kernel_projection.weight.shape, generator=g))
        for p in drafter.candidate_selector.parameters():  # transitions as large as the unary logits
            p.copy_(torch.randn(p.shape, generator=g) * 0.6)
    return drafter.to(dtype).eval()


# ---- the oracle --------------------------------------------------------------------------------

@pytest.fixture()
def speculators_dflash2(monkeypatch: pytest.MonkeyPatch) -> types.SimpleNamespace:
    return load_speculators_dflash2(monkeypatch)


def _cut(drafter: DFlashDrafter, n: int) -> DFlashDrafter:
    """The same drafter with only its first n layers (their weights shared)."""
    cut = DFlashDrafter(drafter.cfg)
    cut.load_state_dict(drafter.state_dict())
    cut.layers = torch.nn.ModuleList(list(cut.layers)[:n])
    return cut.to(drafter.fc.weight.dtype).eval()


# ---- forward, selector, walk against the oracle ------------------------------------------------

@pytest.mark.parametrize("batch,block", [(1, 8), (3, 8), (2, 5)])
def test_block_forward_matches_speculators_layer_by_layer(speculators_dflash2, batch: int, block: int) -> None:
    """One inference block after a context: every layer's output equals speculators' layer stack
    (their conv, its placement around attention and MLP, the K/V injection)."""
    drafter = dflash2_drafter(seed=batch, layers=3, block_size=block)
    layers = their_layers(speculators_dflash2, drafter)
    g = torch.Generator().manual_seed(block)
    c = 9
    feats = torch.randn(batch, c, len(drafter.target_layer_ids) * 32, generator=g)
    embeds = torch.randn(batch, block, 32, generator=g)
    positions = torch.arange(c + block)[None].expand(batch, -1)
    with torch.no_grad():
        theirs = their_hidden_by_layer(speculators_dflash2, drafter, feats, embeds, positions, None, layers)
        for n, want in enumerate(theirs, 1):
            ours = _cut(drafter, n)(feats, positions[:, :c], embeds, positions[:, c:])
            torch.testing.assert_close(ours, want, rtol=1e-5, atol=1e-5, msg=f"layer {n}")
    identity = dflash2_drafter(seed=0, layers=1)
    for layer in identity.layers:
        assert not torch.equal(layer.attention_conv.base_kernel[:, 1], torch.zeros_like(layer.attention_conv.base_kernel[:, 1]))


def test_packed_training_blocks_match_speculators(speculators_dflash2) -> None:
    """Training's packed pass (many anchored blocks over one sequence, the block mask of
    train/anchors.py, convolutions that stop at each block's start) equals speculators' layers
    under their anchored-block mask."""
    from torch.nn.attention.flex_attention import create_mask

    B, S = 4, 14
    drafter = dflash2_drafter(seed=5, layers=2, block_size=B)
    layers = their_layers(speculators_dflash2, drafter)
    anchors = torch.tensor([2, 3, 7, 10])
    g = torch.Generator().manual_seed(3)
    feats = torch.randn(1, S, 64, generator=g)
    embeds = torch.randn(1, anchors.numel() * B, 32, generator=g)
    blk = block_positions(anchors, B)[None]
    mask_mod, q_len, kv_len = speculators_dflash2.masks.create_anchor_block_mask_mod(
        torch.zeros(S, dtype=torch.long), S, anchors, B)
    visible = create_mask(mask_mod, None, None, q_len, kv_len, device="cpu")  # [1, 1, nB, S + nB]
    ours_mask = block_attention_mask(anchors, B, S)[None, None]
    assert torch.equal(visible, ours_mask)
    additive = torch.zeros(visible.shape).masked_fill(~visible, float("-inf"))
    with torch.no_grad():
        theirs = their_hidden_by_layer(speculators_dflash2, drafter, feats, embeds,
                                        torch.cat([torch.arange(S)[None], blk], dim=1), additive, layers)[-1]
        ours = drafter(feats, torch.arange(S)[None], embeds, blk, attn_mask=ours_mask, block_len=B)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_selector_scores_and_candidates_match_speculators(speculators_dflash2) -> None:
    drafter = dflash2_drafter(seed=2)
    sel = their_selector(speculators_dflash2, drafter)
    head = torch.nn.Linear(32, 48, bias=False)
    g = torch.Generator().manual_seed(8)
    with torch.no_grad():
        head.weight.copy_(torch.randn(48, 32, generator=g) * 0.3)
        hidden = torch.randn(3, 7, 32, generator=g)
        prev = torch.randint(0, 48, (3, 7), generator=g)
        cands = drafter.candidates(hidden, head)
        their_ids, their_scores = sel.select(head(hidden), hidden, prev)
        assert torch.equal(cands.ids, their_ids)
        torch.testing.assert_close(drafter.selector_scores(hidden, prev, cands), their_scores, rtol=1e-5, atol=1e-5)
        # the unary normaliser the confidences use
        torch.testing.assert_close(cands.logsumexp, head(hidden).logsumexp(-1))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_greedy_walk_matches_speculators_step_by_step(speculators_dflash2, seed: int) -> None:
    """The greedy walk: from the anchor, the candidate speculators scores best given the
    previous pick; it differs from the unary argmax (so the selector is really used)."""
    drafter = dflash2_drafter(seed=seed)
    sel = their_selector(speculators_dflash2, drafter)
    head = torch.nn.Linear(32, 48, bias=False)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        head.weight.copy_(torch.randn(48, 32, generator=g) * 0.3)
        hidden = torch.randn(4, 7, 32, generator=g)
        anchor = torch.randint(0, 48, (4,), generator=g)
        ours, conf = drafter.greedy_with_confidence(hidden, head, anchor)
        logits = head(hidden)
        prev, walk = anchor, []
        for t in range(7):
            ids, scores = sel.select(logits[:, t], hidden[:, t], prev)
            prev = ids.gather(1, scores.argmax(-1, keepdim=True))[:, 0]
            walk.append(prev)
        assert torch.equal(ours, torch.stack(walk, dim=1))
        assert torch.equal(drafter.greedy_tokens(hidden, head, anchor), ours)
        assert not torch.equal(ours, logits.argmax(-1))
        assert bool(((conf > 0) & (conf <= 1)).all())


# ---- the checkpoint format ---------------------------------------------------------------------

def test_dflash2_checkpoint_round_trips_in_the_published_layout(tmp_path: Path) -> None:
    drafter = dflash2_drafter(seed=4)
    path = save_drafter(drafter, tmp_path / "d")
    raw = json.loads((path / "config.json").read_text())
    assert raw["architectures"] == ["DFlash2DraftModel"]
    assert {k: raw["dflash_config"][k] for k in ("conv_kernel_size", "conv_group_size", "selector_rank",
                                                  "selector_top_k")} == {"conv_kernel_size": 2, **SMALL}
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), "pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    assert shapes["layers.1.attention_conv.base_kernel"] == (2, 2, 32)
    assert shapes["layers.0.mlp_conv.kernel_projection.weight"] == (2 * 2 * 32 // 8, 32)
    assert shapes["candidate_selector.hidden_projection.weight"] == (12, 32)
    assert shapes["candidate_selector.predecessor_codebook"] == shapes["candidate_selector.successor_codebook"] == (48, 12)
    loaded = load_drafter(path)
    assert loaded.cfg == drafter.cfg and loaded.cfg.dflash2
    for (name, a), (_, b) in zip(drafter.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), name
    assert DrafterConfig.from_dict(loaded.cfg.to_dict()) == drafter.cfg


def test_dflash2_keys_read_from_the_top_level_and_defaults() -> None:
    base = new_drafter(hidden_size=32, vocab_size=48, num_target_layers=4, mask_token_id=47).cfg.to_dict()
    top = {**base, "architectures": [DFLASH2], "conv_kernel_size": 2, "conv_group_size": 8, "selector_rank": 4,
           "selector_top_k": 3}
    cfg = DrafterConfig.from_dict(top)
    assert (cfg.conv_group_size, cfg.selector_rank, cfg.selector_top_k) == (8, 4, 3)
    assert "selector_rank" not in cfg.to_dict() and cfg.to_dict()["dflash_config"]["selector_rank"] == 4
    published = DrafterConfig.from_dict({**base, "architectures": [DFLASH2]})  # the released drafters' values
    assert (published.conv_kernel_size, published.conv_group_size, published.selector_rank,
            published.selector_top_k) == (2, 16, 256, 16)
    assert not DrafterConfig.from_dict(base).dflash2


@pytest.mark.parametrize("change,message", [
    (dict(conv_group_size=5), "conv_group_size 5 must divide hidden_size 32"),
    (dict(conv_kernel_size=9), "conv_kernel_size 9 exceeds block_size 8"),
    (dict(selector_top_k=49), "selector_top_k 49 exceeds vocab_size 48"),
    (dict(selector_rank=0), "selector_rank must be a positive integer"),
])
def test_dflash2_config_errors(change: dict, message: str) -> None:
    base = dflash2_drafter().cfg.to_dict()
    base["dflash_config"].update(change)
    with pytest.raises(ConfigError, match=message):
        DrafterConfig.from_dict(base)


def _rewrite(path: Path, edit) -> None:
    from safetensors.torch import load_file, save_file

    state = load_file(str(path / "model.safetensors"))
    edit(state)
    save_file(state, str(path / "model.safetensors"))


@pytest.mark.parametrize("name", [
    "layers.0.attention_conv.base_kernel", "layers.1.attention_conv.kernel_projection.weight",
    "layers.1.mlp_conv.base_kernel", "layers.0.mlp_conv.kernel_projection.weight",
    "candidate_selector.hidden_projection.weight", "candidate_selector.predecessor_codebook",
    "candidate_selector.successor_codebook",
])
def test_missing_or_misshapen_dflash2_weights_are_refused_by_name(tmp_path: Path, name: str) -> None:
    path = save_drafter(dflash2_drafter(seed=1), tmp_path / "missing")
    _rewrite(path, lambda state: state.pop(name))
    with pytest.raises(CheckpointError, match=rf"DFlash 2 weight {name} is missing"):
        load_drafter(path)
    path = save_drafter(dflash2_drafter(seed=1), tmp_path / "misshapen")
    _rewrite(path, lambda state: state.update({name: state[name][..., :-1].contiguous()}))
    with pytest.raises(CheckpointError, match=rf"weight {name} in .* has shape .*config.json implies"):
        load_drafter(path)


@pytest.mark.parametrize("arch,over", [
    ("DFlashDraftModel", {}),
    ("DFlashDraftModel", dict(attention_bias=True, num_key_value_heads=1, intermediate_size=40)),
    (DFLASH2, {}),
    (DFLASH2, dict(conv_kernel_size=3, conv_group_size=4, selector_rank=7, attention_bias=True)),
])
def test_expected_tensors_are_the_models_weights(arch: str, over: dict) -> None:
    """The checkpoint check (used by loading and by export, without a model) expects exactly the
    weights the model class has, with their shapes."""
    base = dflash2_drafter().cfg.to_dict()
    base["architectures"] = [arch]
    if arch != DFLASH2:
        for key in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"):
            base["dflash_config"].pop(key)
    for key, value in over.items():
        (base["dflash_config"] if key in base["dflash_config"] else base)[key] = value
    cfg = DrafterConfig.from_dict(base)
    model = DFlashDrafter(cfg)
    assert expected_tensors(cfg) == {name: tuple(t.shape) for name, t in model.state_dict().items()}


def test_dflash_config_with_dflash2_weights_is_refused(tmp_path: Path) -> None:
    path = save_drafter(dflash2_drafter(seed=1), tmp_path / "d")
    raw = json.loads((path / "config.json").read_text())
    raw["architectures"] = ["DFlashDraftModel"]
    (path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match="belongs to a DFlash 2 drafter.*DFlashDraftModel"):
        load_drafter(path)


def test_dflash_checkpoint_loads_as_before(tmp_path: Path) -> None:
    target = make_tiny_target("qwen3", dtype=torch.float32)
    drafter = new_drafter_for_target(target.config, mask_token_id=47, num_layers=2, block_size=8, seed=5)
    path = save_drafter(drafter, tmp_path / "d")
    raw = json.loads((path / "config.json").read_text())
    assert raw["architectures"] == ["DFlashDraftModel"]
    assert set(raw["dflash_config"]) == {"mask_token_id", "target_layer_ids"}
    loaded = load_drafter(path)
    assert not loaded.cfg.dflash2 and loaded.candidate_selector is None
    assert all(layer.attention_conv is None and layer.mlp_conv is None for layer in loaded.layers)
    assert set(loaded.state_dict()) == set(drafter.state_dict())
    assert not any("conv" in k or "selector" in k for k in loaded.state_dict())


def test_identity_initialised_dflash2_equals_its_dflash_backbone() -> None:
    """Freshly built DFlash 2 convolutions are the identity: the block's hidden states are the
    DFlash drafter's with the same backbone weights (what `--init` conversion will rely on)."""
    plain = new_drafter(hidden_size=32, vocab_size=48, num_target_layers=4, mask_token_id=47, num_layers=2, seed=3)
    two = new_drafter(hidden_size=32, vocab_size=48, num_target_layers=4, mask_token_id=47, num_layers=2, seed=3,
                      architecture=DFLASH2, dflash2=SMALL)
    two.load_state_dict(plain.state_dict(), strict=False)
    g = torch.Generator().manual_seed(0)
    feats, embeds = torch.randn(2, 5, 64, generator=g), torch.randn(2, 8, 32, generator=g)
    pos = torch.arange(13)[None].expand(2, -1)
    with torch.no_grad():
        torch.testing.assert_close(two(feats, pos[:, :5], embeds, pos[:, 5:]), plain(feats, pos[:, :5], embeds, pos[:, 5:]))
