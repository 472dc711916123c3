"""DFlash 2's block convolution through the C kernel (csrc/conv.c): the PyTorch operators' bits."""

from __future__ import annotations

import pytest
import torch

from blockspec.cpu import kernels
from blockspec.dflash.conv import BlockConv

pytestmark = pytest.mark.skipif(kernels.kernel() is None, reason="no C compiler: the kernels did not build")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("taps,blocks,block_len", [(2, 1, 8), (2, 3, 5), (3, 2, 4), (1, 1, 6), (2, 1, 1)])
def test_kernel_gives_the_pytorch_operators_bits(dtype, taps, blocks, block_len, monkeypatch) -> None:
    g = torch.Generator().manual_seed(taps * 10 + blocks)
    conv = BlockConv(48, taps, 16)
    with torch.no_grad():
        conv.base_kernel.copy_(torch.randn(conv.base_kernel.shape, generator=g))
        conv.kernel_projection.weight.copy_(torch.randn(conv.kernel_projection.weight.shape, generator=g) * 0.3)
    conv = conv.to(dtype)
    x = torch.randn(2, blocks * block_len, 48, generator=g).to(dtype)
    y = torch.randn(2, blocks * block_len, 48, generator=g).to(dtype)
    calls = []
    real = kernels.block_conv

    def counted(*args):
        out = real(*args)
        calls.append(out is not None)
        return out

    with torch.inference_mode():
        monkeypatch.setattr(kernels, "block_conv", counted)
        fast_in, delta = conv.prepare(x, block_len)
        fast_out = conv.finish(y, delta, block_len)
        assert calls == [True, True]
        monkeypatch.setattr(kernels, "block_conv", lambda *args: None)
        slow_in, delta = conv.prepare(x, block_len)
        slow_out = conv.finish(y, delta, block_len)
    assert torch.equal(fast_in, slow_in) and torch.equal(fast_out, slow_out)
    if block_len > 1 and taps > 1:  # the taps do mix tokens, and never across a block start
        assert not torch.equal(fast_in, x)
        z = x.clone()
        z[:, block_len - 1] += 1  # the last token of the first block
        with torch.inference_mode():
            moved = conv.prepare(z, block_len)[0]
        assert torch.equal(moved[:, block_len:], fast_in[:, block_len:])


def test_kernel_declines_autograd_and_other_layouts() -> None:
    x = torch.randn(1, 4, 32, requires_grad=True)
    base, delta = torch.randn(2, 32), torch.randn(1, 4, 2, 2)
    assert kernels.block_conv(x, base, delta, 4) is None  # training keeps PyTorch's operators
    with torch.inference_mode():
        assert kernels.block_conv(x.detach().double(), base.double(), delta.double(), 4) is None
        assert kernels.block_conv(x.detach(), base, delta.transpose(-1, -2), 4) is None
        assert kernels.block_conv(x.detach(), base, delta, 4) is not None
