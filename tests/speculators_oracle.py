"""speculators==0.9.0's DFlash 2 modules as an independent oracle (MIT, Z Lab), loaded from their
files: the package's own import pulls in its training stack (datasets, loguru, ...), which its
drafter modules do not need. `make test` installs speculators==0.9.0 without dependencies."""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path

import pytest
import torch

from blockspec.dflash.drafter import DFlashDrafter


def load_speculators_dflash2(monkeypatch: pytest.MonkeyPatch) -> types.SimpleNamespace:
    """Their dflash, dflash2 and attention-mask modules (skips the test where not installed)."""
    spec = importlib.util.find_spec("speculators")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("speculators==0.9.0 is not installed (make test installs it: pip install --no-deps speculators==0.9.0)")
    root = Path(spec.submodule_search_locations[0])
    for name in ("speculators", "speculators.models", "speculators.models.dflash", "speculators.models.dflash2"):
        stub = types.ModuleType(name)
        stub.__path__ = []
        monkeypatch.setitem(sys.modules, name, stub)

    def load(name: str, rel: str) -> types.ModuleType:
        s = importlib.util.spec_from_file_location(name, root / rel)
        module = importlib.util.module_from_spec(s)
        monkeypatch.setitem(sys.modules, name, module)
        s.loader.exec_module(module)
        return module

    dflash = load("speculators.models.dflash.model_definitions", "models/dflash/model_definitions.py")
    dflash2 = load("speculators.models.dflash2.model_definitions", "models/dflash2/model_definitions.py")
    masks = load("speculators.models.dflash.attention", "models/dflash/attention.py")
    return types.SimpleNamespace(dflash=dflash, dflash2=dflash2, masks=masks)


def their_layers(oracle: types.SimpleNamespace, drafter: DFlashDrafter) -> list[torch.nn.Module]:
    """Their decoder layers built from our config.json's keys, holding our weights (loaded by
    their published names, strictly)."""
    from transformers import Qwen3Config

    cfg = drafter.cfg
    raw = {k: v for k, v in cfg.to_dict().items() if k not in ("dflash_config", "architectures")}
    hf = Qwen3Config(**raw)
    hf._attn_implementation = "eager"
    state = drafter.state_dict()
    layers = []
    for i in range(cfg.num_hidden_layers):
        layer = oracle.dflash2.Qwen3DFlash2DecoderLayer(hf, i, block_size=cfg.block_size,
                                                        conv_kernel_size=cfg.conv_kernel_size,
                                                        conv_group_size=cfg.conv_group_size)
        prefix = f"layers.{i}."
        layer.load_state_dict({k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}, strict=True)
        layers.append(layer.to(drafter.fc.weight.dtype).eval())
    return layers


def their_selector(oracle: types.SimpleNamespace, drafter: DFlashDrafter) -> torch.nn.Module:
    """Their candidate selector holding our selector's weights (loaded strictly by name)."""
    cfg = drafter.cfg
    sel = oracle.dflash2.CandidateSelector(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                                           rank=cfg.selector_rank, top_k=cfg.selector_top_k)
    state = {k[len("candidate_selector."):]: v for k, v in drafter.state_dict().items()
             if k.startswith("candidate_selector.")}
    sel.load_state_dict(state, strict=True)
    return sel.to(drafter.fc.weight.dtype).eval()


def rope_for(drafter: DFlashDrafter, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    cfg = drafter.cfg
    raw = {k: v for k, v in cfg.to_dict().items() if k not in ("dflash_config", "architectures")}
    from transformers import Qwen3Config

    rotary = Qwen3RotaryEmbedding(Qwen3Config(**raw))
    return rotary(torch.zeros(1, dtype=drafter.fc.weight.dtype), positions)


def their_hidden_by_layer(oracle, drafter, feats, embeds, positions, mask, layers) -> list[torch.Tensor]:
    """Each layer's output of their stack, after our final norm (what a drafter cut there returns)."""
    ctx = drafter.hidden_norm(drafter.fc(feats))
    cos_sin = rope_for(drafter, positions)
    h, out = embeds, []
    for layer in layers:
        h = layer(target_hidden=ctx, hidden_states=h, attention_mask=mask, position_embeddings=cos_sin)
        out.append(drafter.norm(h))
    return out
