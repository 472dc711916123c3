"""The proposer interface: a step's draft for one row in, a token tree out.

A drafter's output is seen through `Distributions`: for a depth and the token before it, the
candidate tokens there with their log-probabilities, best first. A DFlash drafter's positions are
independent of the token before (`PositionDistributions`); a DFlash 2 selector's are conditional
on it (proposers/dflash2.py). Proposers only read these, so one tree builder serves both.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import InitVar, dataclass
from typing import Protocol

import torch

from blockspec.dflash.token_tree import TokenTree
from blockspec.errors import ConfigError


class Distributions(Protocol):
    """Per depth 1..max_depth the drafter's candidates after a given token."""

    @property
    def max_depth(self) -> int: ...

    def children(self, depth: int, prev: int) -> tuple[list[int], list[float]]:
        """(candidate ids, their log-probabilities), in descending probability, for the token at
        `depth` (1: the first proposal) when the token before it is `prev`."""
        ...


@dataclass(frozen=True)
class PositionDistributions:
    """A DFlash drafter's per-position top-K: ids [D, K] and log-probabilities [D, K] (descending
    along K), row d - 1 for depth d; the token before does not matter. Candidates of probability
    0 (log-probability -inf: outside a draft vocabulary, a top-k or a nucleus) are left out, so a
    tree never spends a verified node on a token its drafter rules out."""

    ids: torch.Tensor
    logprobs: torch.Tensor
    lists: InitVar[tuple[list[list[int]], list[list[float]]] | None] = None

    def __post_init__(self, lists: tuple[list[list[int]], list[list[float]]] | None) -> None:
        """lists: ids.tolist() and logprobs.float().tolist() when the caller has them already
        (`batch` reads a whole batch back at once)."""
        if self.ids.dim() != 2 or self.ids.shape != self.logprobs.shape:
            raise ConfigError(f"top-k ids {tuple(self.ids.shape)} and log-probabilities {tuple(self.logprobs.shape)} "
                              "must both be [depth, k]")
        ids, lps = lists if lists is not None else (self.ids.tolist(), self.logprobs.float().tolist())
        neg = float("-inf")
        live = [None if neg not in row else [k for k, lp in enumerate(row) if lp != neg] for row in lps]
        # best-first rankings taken from these distributions, by (root, depth) (proposers/best_first.py)
        object.__setattr__(self, "rankings", {})
        object.__setattr__(self, "_ids", [row if keep is None else [row[k] for k in keep] for row, keep in zip(ids, live)])
        object.__setattr__(self, "_lp", [row if keep is None else [row[k] for k in keep] for row, keep in zip(lps, live)])

    @classmethod
    def batch(cls, ids: torch.Tensor, logprobs: torch.Tensor) -> list[PositionDistributions]:
        """One per row of a batch's top-k ids and log-probabilities [b, D, k], read back to the
        host in one transfer each."""
        ids, logprobs = ids.cpu(), logprobs.float().cpu()
        id_rows, lp_rows = ids.tolist(), logprobs.tolist()
        return [cls(ids[i], logprobs[i], (id_rows[i], lp_rows[i])) for i in range(ids.shape[0])]

    @classmethod
    def from_logits(cls, logits: torch.Tensor, k: int) -> PositionDistributions:
        """The top-k of the softmax of draft logits [D, V] at each depth."""
        logp = torch.log_softmax(logits.float(), dim=-1)
        top, ids = logp.topk(min(k, logp.shape[-1]), dim=-1)  # [D, k], descending
        return cls(ids, top)

    @property
    def max_depth(self) -> int:
        return self.ids.shape[0]

    def children(self, depth: int, prev: int) -> tuple[list[int], list[float]]:
        return self._ids[depth - 1], self._lp[depth - 1]  # type: ignore[attr-defined]


@dataclass(frozen=True)
class Draft:
    """What a step knows about one row when it proposes: the root (the last committed token),
    the drafter's distributions (None: no draft pass this step) and the row's n-gram lookup
    continuation (empty: none)."""

    root: int
    distributions: Distributions | None = None
    lookup: Sequence[int] = ()


class Proposer(Protocol):
    """Turns a row's draft into the token tree its step verifies (a chain is a tree)."""

    def propose(self, draft: Draft) -> TokenTree: ...


def need_distributions(draft: Draft, who: str) -> Distributions:
    if draft.distributions is None:
        raise ConfigError(f"the {who} proposer needs the drafter's distributions (this step has no draft pass)")
    return draft.distributions
