"""The one-call q/k/v placement (cpu/qkv.py, cpu/csrc/rope.c): q/k norms, rope, the query
layout and the K/V cache writes give the same bits as the PyTorch operators they replace, in the
target and in the drafter, fp32 and bf16."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_target
from support import draft_passes

from blockspec.cpu import kernels
from blockspec.dflash.drafter import init_drafter_weights, new_drafter_for_target
from blockspec.targets.native import load_native_target
from blockspec.dflash.static_drafter import StaticDrafter, StaticWeights
from blockspec.targets.native.backends import KernelBackend
from blockspec.cpu.qkv import QKVPlacement
from blockspec.targets.slots import EMPTY

pytestmark = pytest.mark.skipif(kernels.kernel() is None, reason="no C compiler: the kernel is not built here")

DTYPES = [torch.float32, torch.bfloat16]


def _counted(monkeypatch: pytest.MonkeyPatch, enabled: bool) -> list[bool]:
    """Turns the placement off (PyTorch's operators), or counts the layers it placed. The Python
    layer loops run either way (the one-call loops call the kernel directly: tests/cpu/test_layer_program.py)."""
    monkeypatch.setattr(KernelBackend, "run_program", lambda *args, **kwargs: None)
    monkeypatch.setattr(StaticWeights, "program", lambda *args: None)
    if not enabled:
        monkeypatch.setattr(QKVPlacement, "build", classmethod(lambda cls, *a, **k: None))
        return []
    placed: list[bool] = []
    call = QKVPlacement.__call__

    def counting(self: QKVPlacement, *args: object, **kwargs: object) -> torch.Tensor | None:
        out = call(self, *args, **kwargs)
        placed.append(out is not None)
        return out

    monkeypatch.setattr(QKVPlacement, "__call__", counting)
    return placed


def _target_run(family: str, dtype: torch.dtype) -> tuple[list[torch.Tensor], object]:
    """A prefill of 2 x 40 tokens (the kernel's threaded path), a ragged block (packed, with
    padding), then one token per row: every output and the final cache."""
    target = load_native_target(make_tiny_target(family, seed=21, dtype=torch.float32), dtype=dtype,
                                eos_token_ids=())
    g = torch.Generator().manual_seed(5)
    cache = target.new_cache(2)
    outs = []
    ids = torch.randint(0, 48, (2, 40), generator=g)
    outs += target.forward(ids, torch.arange(40).expand(2, 40), cache, (1, 3))
    block = torch.randint(0, 48, (2, 4), generator=g)
    positions = (40 + torch.arange(4)).expand(2, 4).clone()
    positions[1, 2:] = EMPTY
    outs += target.forward(block, positions, cache, (1, 3))
    cache.reject(torch.tensor([[True, True, False, False], [True, False, False, False]]))
    outs += target.forward(block[:, :1], torch.tensor([[42], [41]]), cache, (1, 3))
    return outs, cache


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("family", ["llama", "qwen3"])  # qwen3: per-head q/k norms
def test_target_forward_same_bits_as_pytorch_operators(family: str, dtype: torch.dtype,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    runs = {}
    for enabled in (True, False):
        with monkeypatch.context() as patch:
            placed = _counted(patch, enabled)
            runs[enabled] = _target_run(family, dtype)
        if enabled:
            assert placed and all(placed)  # every layer of every forward went through the kernel
    (got, got_cache), (want, want_cache) = runs[True], runs[False]
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    for i in range(4):
        for a, b in zip(got_cache.layer(i), want_cache.layer(i)):
            assert torch.equal(a[:, :, :42], b[:, :, :42])  # committed slots (the scratch slot aside)


@pytest.mark.parametrize("dtype", DTYPES)
def test_static_drafter_same_bits_as_pytorch_operators(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two draft passes over a padded context whose last slots the block overlaps."""
    model = make_tiny_target("llama", seed=9, dtype=torch.float32)
    drafter = new_drafter_for_target(model.config, mask_token_id=47, num_layers=2, dtype=dtype)
    init_drafter_weights(drafter, std=0.3, seed=1)
    static = StaticDrafter(drafter)
    runs = {}
    for enabled in (True, False):
        with monkeypatch.context() as patch:
            placed = _counted(patch, enabled)
            outs, cache = draft_passes(static, dtype)
        if enabled:
            assert placed and all(placed)
        runs[enabled] = (outs, [t.clone() for i in range(2) for t in cache.layer(i)])
    for a, b in zip(runs[True][0], runs[False][0]):
        assert torch.equal(a, b)
    for a, b in zip(runs[True][1], runs[False][1]):
        assert torch.equal(a[:, :, :64], b[:, :, :64])


def test_placement_refuses_what_the_kernel_does_not_take() -> None:
    """No autograd, no fp64, no GPU tensors: the caller then keeps PyTorch's operators."""
    kw = dict(heads=2, kv_heads=1, head_dim=4, cos=torch.ones(1, 4), sin=torch.zeros(1, 4),
              kv_rows=torch.zeros(1, dtype=torch.long), kv_slots=torch.zeros(1, dtype=torch.long), q_from=0,
              q_rows=torch.zeros(1, dtype=torch.long), q_cols=torch.zeros(1, dtype=torch.long), batch=1, q_len=1)
    assert QKVPlacement.build(torch.float32, torch.device("cpu"), **kw) is None  # autograd on
    with torch.inference_mode():
        assert QKVPlacement.build(torch.float64, torch.device("cpu"), **kw) is None
        assert QKVPlacement.build(torch.float32, torch.device("meta"), **kw) is None
        place = QKVPlacement.build(torch.float32, torch.device("cpu"), **kw)
        assert place is not None
        k = torch.zeros(1, 1, 3, 4)
        qkv = torch.arange(16, dtype=torch.float32)[None]  # [1, (2 + 2) * 4]
        assert place(qkv.double(), k.double(), k.double()) is None  # dtype other than the tables'
        assert place(qkv, k, k[..., :2]) is None  # caches of other shapes
        q = place(qkv, k, k.clone())
        # cos 1, sin 0: rope is the identity; queries [1, kv_heads, groups, 4], key in slot 0
        assert torch.equal(q.reshape(2, 4), qkv[0, :8].view(2, 4))
        assert torch.equal(k[0, 0, 0], qkv[0, 8:12])
        before = k.clone()
        for bad in ({"kv_slots": torch.tensor([3])}, {"kv_rows": torch.tensor([-1])}, {"q_cols": torch.tensor([1])}):
            with pytest.raises(ValueError, match="reserve the cache first"):  # checked before any write
                QKVPlacement.build(torch.float32, torch.device("cpu"), **{**kw, **bad})(qkv + 1, k, k)
            assert torch.equal(k, before)
