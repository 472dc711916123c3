"""A verified position's shaped distribution as (id, probability) pairs, and the draws from it.

A temperature / top-p request's nucleus holds a handful of tokens at each position (a few on
real text, at most the nucleus kernel's candidates), so neither side of a sampled step builds a
vocabulary-wide probability row: `shaped` returns the target's nucleus as the kernel's pairs (the
drafter's, dflash/proposers/dflash_block.py, its draft vocabulary's), and the keyed race (`draw`)
and the standard rule (dflash/verify.py) read only them. Each pair's
probability has the bits of `sampling.probabilities`'s entry, and every draw here picks the token
the same draw picks from that vocabulary-wide row (the race's head in the same order, the
inverse CDF over the same partial sums: zeros add nothing), so a seed draws the same tokens
either way (tests/dflash/test_sparse_probs.py). Requests the kernel does not shape (greedy rows,
top-k, a nucleus wider than its candidates) keep the vocabulary-wide rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from blockspec.cpu import kernels
from blockspec.dflash.sampling import RACE_HEAD, RowRandom, probabilities, sample_from, slot_uniforms


@dataclass(frozen=True, eq=False)
class SparseProbs:
    """Per position, ids [.., k] (ascending, then 0) and probs [.., k] float32 (the nucleus, then
    0) of a distribution over `vocab` tokens; every other token has probability 0."""

    ids: torch.Tensor
    probs: torch.Tensor
    vocab: int

    def __post_init__(self) -> None:
        if self.ids.shape != self.probs.shape or self.ids.dim() < 1:
            raise ValueError(f"ids {tuple(self.ids.shape)} and probs {tuple(self.probs.shape)} must share a shape")

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape of the vocabulary-wide tensor these pairs stand for: [.., vocab]."""
        return (*self.ids.shape[:-1], self.vocab)

    def __getitem__(self, index: torch.Tensor | int | slice) -> SparseProbs:
        """The pairs of some leading-dimension entries (rows of a batch)."""
        return SparseProbs(self.ids[index], self.probs[index], self.vocab)

    def reshape(self, *shape: int) -> SparseProbs:
        """As `torch.Tensor.reshape` of the vocabulary-wide tensor; the last size must be vocab."""
        if shape[-1] != self.vocab:
            raise ValueError(f"the last size must stay the vocabulary ({self.vocab}), got {shape[-1]}")
        k = self.ids.shape[-1]
        return SparseProbs(self.ids.reshape(*shape[:-1], k), self.probs.reshape(*shape[:-1], k), self.vocab)

    def dense(self) -> torch.Tensor:
        """The vocabulary-wide probabilities [.., vocab] (zeros added where padding repeats id 0)."""
        out = self.probs.new_zeros(self.shape)
        return out.scatter_add_(-1, self.ids, self.probs)


def shaped(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
           ) -> torch.Tensor | SparseProbs:
    """`sampling.probabilities` of logits [b, n, V]: as pairs where every row asks for temperature
    and top-p alone and every position's nucleus fits the kernel's candidates, else the
    vocabulary-wide probabilities [b, n, V]."""
    pairs = nucleus_pairs(logits, temperature, top_k, top_p)
    return pairs if pairs is not None else probabilities(logits, temperature, top_k, top_p)


def nucleus_pairs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
                  ) -> SparseProbs | None:
    """The pairs of `shaped`, or None where `probabilities` must shape them (a row greedy or
    with top-k or top-p 1, a nucleus wider than the kernel's candidates, no kernel)."""
    v = logits.shape[-1]
    # the rows' settings read on the host: a handful of numbers, where tensor tests cost more
    if not all(t > 0 and p < 1 and (k <= 0 or k >= v)
               for t, k, p in zip(temperature.tolist(), top_k.tolist(), top_p.tolist())):
        return None
    out = kernels.nucleus_pairs(logits.float(), temperature, top_p)
    return None if out is None else SparseProbs(*out, v)


def nucleus_draws(logits: torch.Tensor, support: torch.Tensor | None, vocab: int, temperature: torch.Tensor,
                  top_p: torch.Tensor, random: RowRandom, starts: Sequence[int]
                  ) -> tuple[SparseProbs, torch.Tensor, torch.Tensor] | None:
    """A sampled draft step's proposals in one kernel call: the pairs of logits [b, n, m] of the
    tokens `support` [m] (ascending; None: the columns are the ids) over `vocab` tokens
    as `nucleus_pairs` gives them, each position's token drawn from them as `sample_pairs` draws
    it, ids [b, n], and each position's largest probability [b, n]. None where `nucleus_pairs`
    is (every row must ask for temperature and top-p alone)."""
    if not all(t > 0 and p < 1 for t, p in zip(temperature.tolist(), top_p.tolist())):
        return None
    out = kernels.nucleus_draws(logits.float(), support, temperature, top_p, random.seeds, list(starts))
    if out is None:
        return None
    ids, probs, drawn, peaks = out
    pairs = SparseProbs(ids, probs, vocab)
    # a nucleus wider than the race's head: its tail's draw (few such positions)
    return pairs, drawn if drawn is not None else sample_pairs(random, pairs, starts), peaks


def draw(random: RowRandom, probs: torch.Tensor | SparseProbs, starts: list[int]) -> torch.Tensor:
    """`RowRandom.sample` of probs [b, n, V] (a tensor or its pairs): ids [b, n]."""
    return random.sample(probs, starts) if isinstance(probs, torch.Tensor) else sample_pairs(random, probs, starts)


def sample_pairs(random: RowRandom, probs: SparseProbs, starts: Sequence[int]) -> torch.Tensor:
    """`RowRandom.sample` of the vocabulary-wide rows these pairs stand for, [b, n] ids: the same
    race (the RACE_HEAD most probable tokens, the higher probability first and the lower id on
    ties, with their own clocks; the rest one competitor), the same token for a seed."""
    ids, p = probs.ids, probs.probs  # [b, n, k]
    b, n, k = ids.shape
    if k == 1:  # every nucleus one token: it wins its race whatever the clocks
        return ids[..., 0]
    fast = kernels.pairs_race(ids, p, random.seeds, list(starts))  # the same race (cpu/csrc/race.c)
    if fast is not None:
        return fast.to(ids.device)
    keys = random.keys(list(starts), n).to(ids.device)  # [b, n]
    h = min(RACE_HEAD, probs.vocab, k)
    if k == h:  # the head holds every pair: the race on the host, a few numbers a position
        return race_on_host(ids, p, torch.log(slot_uniforms(keys, ids)))
    order = p.argsort(dim=-1, descending=True, stable=True)[..., :h]  # ids ascend: ties by id
    head, head_ids = p.gather(-1, order), ids.gather(-1, order)  # [b, n, h]
    arrival = -torch.log(slot_uniforms(keys, head_ids)) / head.double()  # [b, n, h]; p = 0: never (inf)
    first = arrival.argmin(dim=-1)  # [b, n]
    out = head_ids.gather(-1, first[..., None])[..., 0]
    if not bool((head[..., -1] > 0).any()):
        return out  # the head holds every token of mass > 0
    tail = p.scatter(-1, order, 0.0)  # [b, n, k], ids ascending as the vocabulary-wide tail's
    # every kept probability is at least 2^-30 (the kernel's candidates), so this float64 sum is
    # exact in any order: the vocabulary-wide row's sum
    mass = tail.sum(dim=-1, dtype=torch.float64)  # [b, n]
    reserved = torch.tensor([probs.vocab, probs.vocab + 1], dtype=torch.int64, device=ids.device)
    u = slot_uniforms(keys, reserved)  # [b, n, 2]: the tail's clock and pick
    tail_first = -torch.log(u[..., 0]) / mass  # mass 0: inf, never first
    wins = tail_first < arrival.gather(-1, first[..., None])[..., 0]  # [b, n]
    if bool(wins.any()):
        out = torch.where(wins, sample_from_pairs(ids, tail, u[..., 1]), out)
    return out


def race_on_host(ids: torch.Tensor, probs: torch.Tensor, log_u: torch.Tensor) -> torch.Tensor:
    """The winner [..] of each position's exponential race among tokens ids [.., k] with
    probabilities probs [.., k] (log_u: the log of each one's clock uniform), on the host: a few
    numbers a position, where tensor operations cost more than their arithmetic. The first least
    arrival -log(u) / p (in float64, as `RowRandom.sample` divides) in the head's order, the higher
    probability first and the lower id on ties; p = 0 never wins."""
    out = []
    flat_ids = ids.reshape(-1, ids.shape[-1]).tolist()
    flat_p = probs.reshape(-1, ids.shape[-1]).tolist()
    for pos_ids, pos_p, pos_log in zip(flat_ids, flat_p, log_u.reshape(-1, ids.shape[-1]).tolist()):
        best, pick = float("inf"), pos_ids[0]
        for i in sorted(range(len(pos_ids)), key=lambda i: (-pos_p[i], pos_ids[i])):
            if pos_p[i] > 0 and -pos_log[i] / pos_p[i] < best:
                best, pick = -pos_log[i] / pos_p[i], pos_ids[i]
        out.append(pick)
    return torch.tensor(out, dtype=torch.int64, device=ids.device).reshape(ids.shape[:-1])


def sample_from_pairs(ids: torch.Tensor, probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """`sampling.sample_from` of the rows these pairs stand for (ids ascending): ids [..]. The
    partial sums are the vocabulary-wide row's at its nonzero entries, so the same token."""
    return ids.gather(-1, sample_from(probs, uniforms)[..., None])[..., 0]
