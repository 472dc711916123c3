"""The greedy ids of an fp32 LM head without computing every logit in fp32 (`cpu/csrc/rows.c`,
bs_greedy_head).

A greedy step needs only the argmax of each row's logits. On a CPU a one-token forward of
SmolLM2-135M streams 540 MB of fp32 weights, 113 MB of them the LM head. Here the head is
screened with a bf16 copy of its weight (half the bytes), and only the columns whose screened
logit could still be the maximum, given a proven bound on the screen's error, get their exact
fp32 logit (1-2 per row on average, at most ~12, on SmolLM2's real hidden states). The exact
logits come from the same arithmetic as the full fp32 product, so the ids are the full
product's argmax (the first of tied maxima), bit for bit: greedy output does not change.

The bound (see rows.c): |fp32 logit - screened logit| <= 2^-8 * 1.05 * |x| * |w_j|, from bf16's
relative rounding error 2^-9 on x and on w (Cauchy-Schwarz) plus fewer than 80 fp32 roundings
in each computed sum; the 5% and the rounding up of the norms below cover the roundings of the
bound itself.
"""

from __future__ import annotations

import torch

from blockspec.cpu import kernels

BOUND_SCALE = 2.0**-8 * 1.05  # per unit of |x| * |w_j|: see the module docstring
_NORM_UP = 1.0 + 1e-5  # norms rounded up (they are computed in float64, then stored in fp32)


class GreedyHead:
    """The screen of one fp32 head weight [V, H]: its bf16 copy and row norms (built once, V * H
    * 2 bytes more memory). Call `ids(x)`; None where the kernel cannot take x (the caller then
    computes the logits)."""

    def __init__(self, weight: torch.Tensor) -> None:
        w = weight.detach()
        self.key = (w.data_ptr(), w._version)
        self.weight = w.contiguous()
        self.weight_bf16 = w.to(torch.bfloat16).contiguous()
        norms = torch.linalg.vector_norm(w, dim=1, dtype=torch.float64) * _NORM_UP  # no float64 copy of w
        # a row the bound cannot cover (non-finite) leaves the whole head to the full product
        self.usable = bool(torch.isfinite(norms).all())
        self.norms = norms.float().contiguous()

    @staticmethod
    def available(weight: torch.Tensor) -> bool:
        """Whether a head weight can be screened here: fp32 on the CPU, with the native kernel."""
        return weight.dtype == torch.float32 and weight.is_cpu and weight.dim() == 2 and kernels.kernel() is not None

    def fits(self, weight: torch.Tensor) -> bool:
        """Whether this screen was built from `weight` as it is now (a head is frozen; a changed
        one needs a new screen)."""
        return self.key == (weight.data_ptr(), weight._version)

    def ids(self, x: torch.Tensor, candidates: torch.Tensor | None = None) -> torch.Tensor | None:
        """argmax over the vocabulary of x [..., H] @ weight^T -> [...] int64 (the first of tied
        maxima, as torch.argmax over the fp32 kernel's logits), or None where the kernel does not
        take x (not fp32 on the CPU, no kernel, a non-finite x). `candidates` [...] int64, if
        given, receives how many columns each row computed exactly."""
        fn = kernels.kernel()
        if fn is None or not self.usable or x.dtype != torch.float32 or not x.is_cpu:
            return None
        v, h = self.weight.shape
        if x.shape[-1] != h or x.numel() == 0:
            return None
        flat = x.detach().reshape(-1, h).contiguous()  # [n, H]
        n = flat.shape[0]
        norms = torch.linalg.vector_norm(flat, dim=1, dtype=torch.float64)  # [n]
        if not bool(torch.isfinite(norms).all()):
            return None
        bound = (norms * (BOUND_SCALE * _NORM_UP)).float().contiguous()
        xb = flat.to(torch.bfloat16).contiguous()
        screen = torch.empty(n, v)
        out = torch.empty(n, dtype=torch.int64)
        seen = torch.empty(n, dtype=torch.int64) if candidates is None else candidates.reshape(-1)
        if seen.shape != (n,) or seen.dtype != torch.int64 or not seen.is_contiguous():
            raise ValueError(f"candidates must be a contiguous int64 tensor of {n} elements")
        failed = fn.greedy_head(flat.data_ptr(), xb.data_ptr(), self.weight.data_ptr(), self.weight_bf16.data_ptr(),
                                self.norms.data_ptr(), bound.data_ptr(), screen.data_ptr(), n, h, v, out.data_ptr(),
                                seen.data_ptr(), torch.get_num_threads())
        return None if failed else out.view(x.shape[:-1])


__all__ = ["BOUND_SCALE", "GreedyHead"]
