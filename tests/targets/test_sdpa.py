"""`targets.sdpa`: PyTorch's attention, with cuDNN's backend left out on CUDA."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import torch
from torch.nn import functional as F
from torch.nn.attention import SDPBackend

from blockspec.targets import sdpa as sdpa_module
from blockspec.targets.sdpa import CUDA_BACKENDS, sdpa


def test_cpu_calls_are_pytorchs_own_bit_for_bit() -> None:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 5, 8, generator=g) for _ in range(3))
    mask = torch.rand(5, 5, generator=g) > 0.3
    assert torch.equal(sdpa(q, k, v, is_causal=True), F.scaled_dot_product_attention(q, k, v, is_causal=True))
    assert torch.equal(sdpa(q, k, v, attn_mask=mask), F.scaled_dot_product_attention(q, k, v, attn_mask=mask))


def test_cuda_calls_run_inside_a_backend_choice_without_cudnn(monkeypatch) -> None:
    assert SDPBackend.CUDNN_ATTENTION not in CUDA_BACKENDS
    assert SDPBackend.FLASH_ATTENTION in CUDA_BACKENDS and SDPBackend.EFFICIENT_ATTENTION in CUDA_BACKENDS
    chosen: list[list] = []
    inside: list[bool] = []

    @contextlib.contextmanager
    def recording(backends):
        chosen.append(list(backends))
        inside.append(True)
        yield
        inside.append(False)

    monkeypatch.setattr(sdpa_module, "sdpa_kernel", recording)
    monkeypatch.setattr(F, "scaled_dot_product_attention", lambda *a, **k: ("attended", inside[-1], k))
    q = SimpleNamespace(is_cuda=True)
    out = sdpa(q, None, None, is_causal=True)
    assert out == ("attended", True, {"is_causal": True})  # called inside the choice, kwargs kept
    assert chosen == [list(CUDA_BACKENDS)]
    monkeypatch.setattr(sdpa_module, "sdpa_kernel", lambda b: (_ for _ in ()).throw(AssertionError("cpu")))
    assert sdpa(SimpleNamespace(is_cuda=False), None, None)[0] == "attended"  # CPU: no backend choice
