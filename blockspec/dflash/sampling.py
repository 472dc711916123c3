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
    nucleus = top_p < 1
    if bool(nucleus.any()):
        if bool(nucleus.all()):
            probs = _top_p(probs, top_p)
        else:  # rows with top_p 1 keep every token, whatever their batch-mates ask (probs is softmax's own)
            probs[nucleus] = _top_p(probs[nucleus], top_p[nucleus])
    if bool(greedy.any()):
        onehot = _one_hot(logits.argmax(dim=-1), v)
        probs = torch.where(greedy[:, None, None], onehot, probs)
    return probs


NUCLEUS_HEAD = 64  # tokens sorted first per position by `_top_p` (x8 until the nucleus fits)


def _top_p(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """The nucleus filter of probs [b, n, V] by top_p [b] (< 1): per position, the most probable
    tokens in descending order until the mass before one reaches top_p (at least the top token),
    renormalised. Only the head of each distribution is sorted (torch.topk): once the mass of
    the first k tokens reaches top_p no later token can be kept, so the result is the full sort's
    (the same prefix sums, the same tokens, ties aside). A full sort of 49K probabilities took
    ~15 ms a verified block on 2 cores and made sampled DFlash slower than plain decoding."""
    v = probs.shape[-1]
    p = top_p.float()[:, None, None]  # [b, 1, 1]
    k = min(v, NUCLEUS_HEAD)
    while True:
        head, order = probs.topk(k, dim=-1)  # [b, n, k], descending
        mass = head.cumsum(dim=-1)
        if k == v or bool((mass[..., -1:] >= p).all()):
            break
        k = min(v, k * 8)  # a flat distribution (high temperature): look further
    keep = mass - head < p  # the mass before each token
    out = torch.zeros_like(probs).scatter_(-1, order, head * keep)
    return out.div_(out.sum(dim=-1, keepdim=True))


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
