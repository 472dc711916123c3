"""Temperature / top-k / top-p -> probabilities, and seeded per-request randomness.

The same `probabilities` shapes both the target's p and the drafter's q, which lossless rejection
sampling requires. Sampling itself consumes explicit uniforms, so verification stays a pure
function and each request's generator alone decides its random stream.
"""

from __future__ import annotations

import torch


def probabilities(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """logits [b, n, V] with per-row temperature/top_k/top_p [b] -> probabilities [b, n, V] (fp32).

    Rows with temperature 0 get a one-hot on the argmax (greedy). top_k 0 and top_p 1 are off.
    """
    logits = logits.float()
    b, n, v = logits.shape
    greedy = temperature <= 0
    scaled = logits / torch.where(greedy, torch.ones_like(temperature), temperature).float()[:, None, None]
    k = torch.where(top_k > 0, top_k.clamp(max=v), torch.full_like(top_k, v))
    if bool((k < v).any()):
        kth = torch.topk(scaled, int(k.max()), dim=-1).values  # [b, n, kmax]
        threshold = kth.gather(-1, (k - 1)[:, None, None].expand(b, n, 1))
        scaled = scaled.masked_fill(scaled < threshold, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if bool((top_p < 1).any()):
        sorted_p, order = probs.sort(dim=-1, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (always at least the top token).
        before = sorted_p.cumsum(dim=-1) - sorted_p
        keep = before < top_p.float()[:, None, None]
        sorted_p = sorted_p * keep
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    if bool(greedy.any()):
        onehot = _one_hot(logits.argmax(dim=-1), v)
        probs = torch.where(greedy[:, None, None], onehot, probs)
    return probs


def _one_hot(index: torch.Tensor, v: int) -> torch.Tensor:
    return torch.zeros(*index.shape, v, dtype=torch.float32, device=index.device).scatter_(
        -1, index[..., None], 1.0
    )


def sample_from(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: probs [..., V] (need not sum to 1), uniforms [...] in [0, 1) -> ids."""
    cdf = probs.cumsum(dim=-1)
    target = uniforms.to(cdf.dtype) * cdf[..., -1]
    idx = torch.searchsorted(cdf, target[..., None], right=True)[..., 0]
    return idx.clamp_(max=probs.shape[-1] - 1)


class RowRandom:
    """One generator per request, so a request's samples do not depend on its batch mates."""

    def __init__(self, seeds: list[int | None]) -> None:
        self.generators = [self._make(s) for s in seeds]

    @staticmethod
    def _make(seed: int | None) -> torch.Generator:
        g = torch.Generator()
        g.manual_seed(int(torch.randint(0, 2**62, (1,)).item()) if seed is None else seed)
        return g

    def uniforms(self, n: int) -> torch.Tensor:
        """[b, n] uniforms in [0, 1), each row from its own generator."""
        if not self.generators:
            return torch.empty(0, n)
        return torch.stack([torch.rand(n, generator=g, dtype=torch.float64) for g in self.generators])

    def select_rows(self, rows: list[int]) -> None:
        self.generators = [self.generators[i] for i in rows]

    def add(self, seed: int | None) -> None:
        self.generators.append(self._make(seed))
