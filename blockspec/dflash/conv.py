"""DFlash 2's grouped dynamic causal convolution inside a draft block (docs/DESIGN.md section 3.2).

Each decoder layer of a DFlash 2 drafter wraps its attention and its MLP in one of these: the
sublayer's normalised input `n` gives a per-token kernel offset `kernel_projection(n)` once; side 0
convolves the sublayer's input, side 1 its output, both with taps that look back inside the block
only (position p of a block sees positions p, p-1, ... of the same block, never the context or
another block). Channels are grouped: a group of `group_size` channels shares one dynamic offset,
while the base kernel is per channel:

    out_t[c] = sum_j (base[side, j, c] + delta_t[side, j, group(c)]) * x_{t-j}[c]

With base[:, 0] = 1, every other tap 0 and a zero projection, both sides are the identity, which
is how a DFlash checkpoint becomes a DFlash 2 one without changing its output.
"""

from __future__ import annotations

import torch
from torch import nn

from blockspec.cpu import kernels
from blockspec.cpu.linear import project


class BlockConv(nn.Module):
    """The pair of convolutions around one sublayer (checkpoint names `base_kernel`,
    `kernel_projection.weight`). `prepare` convolves the input and returns the output side's
    offsets, `finish` convolves the output with them."""

    def __init__(self, hidden_size: int, kernel_size: int, group_size: int) -> None:
        super().__init__()
        if hidden_size % group_size:
            raise ValueError(f"hidden_size {hidden_size} is not a multiple of conv_group_size {group_size}")
        self.kernel_size = kernel_size
        self.group_size = group_size
        self.num_groups = hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.empty(2, kernel_size, hidden_size))  # [side, tap, H]
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * self.num_groups, bias=False)
        self.reset_identity()

    def reset_identity(self) -> None:
        """Both sides the identity: base tap 0 one, other taps and the projection zero."""
        with torch.no_grad():
            self.base_kernel.zero_()
            self.base_kernel[:, 0] = 1.0
            self.kernel_projection.weight.zero_()

    def prepare(self, x: torch.Tensor, block_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """x [b, s, H] (normalised sublayer input; s a multiple of block_len, the blocks laid end
        to end) -> (side 0's output [b, s, H], side 1's offsets [b, s, T, G])."""
        b, s, _ = x.shape
        # the CPU kernels' product where they take it (as the drafter's other products): oneDNN's
        # bf16 one for a few rows cost more inside a draft pass (docs/DESIGN.md section 12)
        delta = project(self.kernel_projection, x, exact=False).view(b, s, 2, self.kernel_size, self.num_groups)
        return self._convolve(x, 0, delta[:, :, 0], block_len), delta[:, :, 1]

    def finish(self, y: torch.Tensor, delta: torch.Tensor, block_len: int) -> torch.Tensor:
        """y [b, s, H] (the sublayer's output), delta from `prepare` -> side 1's output [b, s, H]."""
        return self._convolve(y, 1, delta, block_len)

    def _convolve(self, x: torch.Tensor, side: int, delta: torch.Tensor, block_len: int) -> torch.Tensor:
        b, s, h = x.shape
        if s % block_len:
            raise ValueError(f"a pass of {s} block tokens does not split into blocks of {block_len}")
        fast = kernels.block_conv(x, self.base_kernel[side], delta, block_len)  # the same bits, one call
        if fast is not None:
            return fast
        g, gs, taps = self.num_groups, self.group_size, self.kernel_size
        # float32 throughout: a bf16 drafter's few elementwise products cost less so than in bf16
        xf = x.float().view(b, s, g, gs)
        coef = self.base_kernel[side].float().view(taps, g, gs) + delta.float()[..., None]  # [b, s, T, G, gs]
        out = xf * coef[:, :, 0]
        for tap in range(1, min(taps, block_len)):
            # x_{t-tap} weighs on t only inside t's block
            term = xf[:, :-tap] * coef[:, tap:, tap]  # [b, s - tap, G, gs]
            if s > block_len:  # blocks laid end to end (training): no tap reaches into the previous one
                term = term * (torch.arange(tap, s, device=x.device) % block_len >= tap).view(1, s - tap, 1, 1)
            out[:, tap:] += term
        return out.view(b, s, h).to(x.dtype)
