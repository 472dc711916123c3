"""Initialising a drafter from its target so training starts from a sensible network.

Draft layers take the weights of the target layers that follow the last fused target layer
(e.g. features of layer 27 -> draft layers = copies of target layers 28, 29), `fc` starts as the
identity on that layer's slice, `hidden_norm` as the first copied layer's input norm and `norm`
as the target's final norm. Then the first draft layer computes, for the context, exactly the K/V
that the target's own next layer computes; the drafter starts as a shortcut through the top of
the target instead of from noise.

`grow_layers` deepens a trained drafter without changing what it computes, so a run can continue
from a shallower drafter (`--init DIR --num-layers N`); `to_dflash2` turns a DFlash drafter into a
DFlash 2 one that proposes the same tokens (`--init DIR --arch dflash2`).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from blockspec.errors import ConfigError
from blockspec.dflash.drafter import DFLASH2, DFLASH2_DEFAULTS, DFlashDrafter, init_drafter_weights
from blockspec.targets.hf import _decoder


def _copy(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if dst.shape != src.shape:
        raise ConfigError(
            f"cannot initialise drafter {name} {tuple(dst.shape)} from target {tuple(src.shape)}; "
            "use --init random for drafters not shaped like the target's layers"
        )
    dst.copy_(src.to(dst.dtype))


def _fits(dst: nn.Module, src: nn.Module | None, names: tuple[str, ...]) -> bool:
    """Whether src has every projection in `names`, each shaped like dst's (a MoE MLP, a gated
    attention whose q_proj also makes the gate, or a linear-attention layer has not)."""
    if src is None:
        return False
    got = [getattr(src, n, None) for n in names]
    return all(isinstance(g, nn.Linear) and g.weight.shape == getattr(dst, n).weight.shape for g, n in zip(got, names))


def _norm_scale(norm: nn.Module) -> torch.Tensor:
    """The per-channel factor an RMS norm applies: its weight, or 1 + weight for the zero-centred
    norms of Gemma, Qwen3-Next and Qwen3.5 (found by running it on ones)."""
    w = norm.weight
    ones = torch.ones(1, w.shape[0], dtype=torch.float32, device=w.device)
    out = norm(ones.to(w.dtype)).float()[0]
    return 1.0 + w.float() if torch.allclose(out, 1.0 + w.float(), rtol=1e-2, atol=1e-3) else w


def default_source_layers(drafter: DFlashDrafter, num_target_layers: int) -> list[int]:
    """Target layers right after the last fused one (clamped to the top of the target)."""
    first = max(drafter.cfg.target_layer_ids) + 1
    n = drafter.cfg.num_hidden_layers
    first = min(first, num_target_layers - n)
    return [max(0, first + i) for i in range(n)]


@torch.no_grad()
def init_from_target(
    drafter: DFlashDrafter,
    target_model: nn.Module,
    source_layers: list[int] | None = None,
    calibration_ids: torch.Tensor | None = None,
    log_fn=None,
) -> list[int]:
    """Copies target layer weights into the drafter (see module doc); returns the source layers.

    Parts a source layer has in another shape (a MoE MLP, gated attention, a linear-attention
    layer) keep their random initialisation, said through `log_fn`. Targets without q/k norms
    (Llama) get q_norm/k_norm weights equal to the mean RMS of their query/key heads on
    `calibration_ids` [1, S] when given, so attention logits keep their scale.
    """
    dec = _decoder(target_model)
    n_target = len(dec.layers)
    sources = list(source_layers) if source_layers else default_source_layers(drafter, n_target)
    if len(sources) != drafter.cfg.num_hidden_layers:
        raise ConfigError(f"need {drafter.cfg.num_hidden_layers} source layers, got {sources}")
    attn_names, mlp_names = ("q_proj", "k_proj", "v_proj", "o_proj"), ("gate_proj", "up_proj", "down_proj")
    copies_attn = [_fits(drafter.layers[i].self_attn, getattr(dec.layers[s], "self_attn", None), attn_names)
                   for i, s in enumerate(sources)]
    rms: dict[tuple[int, str], float] = {}
    if calibration_ids is not None:
        rms = _qk_rms(target_model, dec, [s for s, ok in zip(sources, copies_attn) if ok], calibration_ids,
                      drafter.cfg.head_dim)
    random_parts = []
    for i, src in enumerate(sources):
        t, d = dec.layers[src], drafter.layers[i]
        if copies_attn[i]:
            for proj in attn_names:
                _copy(getattr(d.self_attn, proj).weight, getattr(t.self_attn, proj).weight, f"layers.{i}.{proj}")
                tb, db = getattr(t.self_attn, proj).bias, getattr(d.self_attn, proj).bias
                if db is not None and tb is not None:
                    _copy(db, tb, f"layers.{i}.{proj}.bias")
            for name in ("q_norm", "k_norm"):
                src_norm = getattr(t.self_attn, name, None)
                if src_norm is not None and getattr(src_norm, "weight", None) is not None:
                    _copy(getattr(d.self_attn, name).weight, _norm_scale(src_norm), name)
                else:
                    getattr(d.self_attn, name).weight.fill_(rms.get((src, name), 1.0))
        else:
            random_parts.append(f"layer {i} attention")
        if _fits(d.mlp, getattr(t, "mlp", None), mlp_names):
            for proj in mlp_names:
                _copy(getattr(d.mlp, proj).weight, getattr(t.mlp, proj).weight, f"layers.{i}.{proj}")
        else:
            random_parts.append(f"layer {i} MLP")
        _copy(d.input_layernorm.weight, _norm_scale(t.input_layernorm), "input_layernorm")
        _copy(d.post_attention_layernorm.weight, _norm_scale(t.post_attention_layernorm), "post_attention_layernorm")
    _copy(drafter.norm.weight, _norm_scale(dec.norm), "norm")
    _copy(drafter.hidden_norm.weight, _norm_scale(dec.layers[sources[0]].input_layernorm), "hidden_norm")
    if random_parts and log_fn is not None:
        log_fn(f"target layers {sources} have no {', '.join(random_parts)} of the drafter's shape (MoE, gated or "
               "linear attention): those start random")
    hidden = drafter.cfg.hidden_size
    ids = list(drafter.cfg.target_layer_ids)
    last = ids.index(max(ids))
    drafter.fc.weight.zero_()
    drafter.fc.weight[:, last * hidden : (last + 1) * hidden] = torch.eye(hidden, dtype=drafter.fc.weight.dtype)
    return sources


def _qk_rms(model: nn.Module, dec: nn.Module, sources: list[int], ids: torch.Tensor, head_dim: int) -> dict:
    out: dict[tuple[int, str], float] = {}
    hooks = []
    for src in sources:
        for proj, name in (("q_proj", "q_norm"), ("k_proj", "k_norm")):
            def grab(_m, _i, y, key=(src, name)):
                out[key] = float(y.float().reshape(-1, head_dim).pow(2).mean(-1).sqrt().mean())
            hooks.append(getattr(dec.layers[src].self_attn, proj).register_forward_hook(grab))
    try:
        model(input_ids=ids.to(next(model.parameters()).device))
    finally:
        for h in hooks:
            h.remove()
    return out


@torch.no_grad()
def grow_layers(drafter: DFlashDrafter, num_layers: int) -> DFlashDrafter:
    """A copy of `drafter` with `num_layers` layers whose outputs equal the original's.

    Each added layer goes on top as a copy of the last layer with its two output projections
    (`o_proj`, `down_proj`) zeroed: both residual branches add nothing, so the deeper drafter starts
    exactly where the shallower one stopped, and its input projections start from trained weights
    rather than noise (zeroed outputs still receive gradients, so the layer learns from step one).
    """
    cfg = drafter.cfg
    have = cfg.num_hidden_layers
    if num_layers < have:
        raise ConfigError(f"cannot shrink a {have}-layer drafter to {num_layers} layers; "
                          f"use --num-layers {have} or more, or start from 'target'/'random'")
    types = tuple(cfg.layer_types) + (cfg.layer_types[-1],) * (num_layers - have)
    grown = DFlashDrafter(dataclasses.replace(cfg, num_hidden_layers=num_layers, layer_types=types))
    grown.to(device=drafter.fc.weight.device, dtype=drafter.fc.weight.dtype)
    if drafter.candidate_selector is not None:  # the same codebook layout (compact or published)
        grown.candidate_selector.use_rows(drafter.candidate_selector.token_ids)
    missing, unexpected = grown.load_state_dict(drafter.state_dict(), strict=False)
    if unexpected or any(not k.startswith("layers.") for k in missing):
        raise ConfigError(f"drafter weights do not fit the grown drafter: missing {missing}, unexpected {unexpected}")
    last = drafter.layers[have - 1].state_dict()
    for layer in grown.layers[have:]:
        layer.load_state_dict(last)
        layer.self_attn.o_proj.weight.zero_()
        layer.mlp.down_proj.weight.zero_()
        if layer.self_attn.o_proj.bias is not None:
            layer.self_attn.o_proj.bias.zero_()
    if drafter.draft_vocab is not None:
        grown.set_draft_vocab(drafter.draft_vocab)
    return grown.train(drafter.training)


@torch.no_grad()
def to_dflash2(drafter: DFlashDrafter, settings: dict | None = None, *, seed: int = 0,
               std: float = 0.02) -> DFlashDrafter:
    """A DFlash 2 copy of a DFlash drafter whose greedy proposals are the original's.

    The backbone (layers, fc, norms) and the draft vocabulary are kept; with a draft vocabulary
    the codebooks hold rows for its tokens only (dflash/selector.py). The block convolutions
    start as the identity (docs/DESIGN.md section 3.2), so every hidden state is unchanged. The selector's
    codebooks start Normal(0, std) and its hidden projection at zero: every transition score is
    then 0, the walk picks each position's unary argmax, and the first gradient reaches the
    projection at once (its gradient is the codebooks' product, not zero). `settings` overrides
    DFLASH2_DEFAULTS (conv_kernel_size, conv_group_size, selector_rank, selector_top_k).
    """
    cfg = drafter.cfg
    if cfg.dflash2:
        raise ConfigError("the drafter is already a DFlash 2 drafter")
    unknown = sorted(set(settings or {}) - set(DFLASH2_DEFAULTS))
    if unknown:
        raise ConfigError(f"unknown DFlash 2 settings {unknown}; known: {sorted(DFLASH2_DEFAULTS)}")
    two = DFlashDrafter(dataclasses.replace(cfg, architecture=DFLASH2, **{**DFLASH2_DEFAULTS, **(settings or {})}))
    init_drafter_weights(two, std=std, seed=seed)  # identity convolutions, small codebooks
    missing, unexpected = two.load_state_dict(drafter.state_dict(), strict=False)
    new = ("candidate_selector.", ".attention_conv.", ".mlp_conv.")
    if unexpected or any(not any(part in k for part in new) for k in missing):
        raise ConfigError(f"drafter weights do not fit its DFlash 2 form: missing {missing}, unexpected {unexpected}")
    two.candidate_selector.hidden_projection.weight.zero_()
    two.to(device=drafter.fc.weight.device, dtype=drafter.fc.weight.dtype)
    if drafter.draft_vocab is not None:
        two.set_draft_vocab(drafter.draft_vocab)
        # codebook rows for the tokens the drafter can propose, the only ones a walk reads
        two.candidate_selector.use_rows(drafter.draft_vocab)
    return two.train(drafter.training)
