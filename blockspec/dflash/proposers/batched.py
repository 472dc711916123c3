"""The batched proposal interface: what a drafting step proposes for all its rows at once, from
one pass over the draft head.

A `BatchProposer` reads the drafter's final hidden states at a block's proposal positions
(`BatchDraft`) and returns the step's `BatchProposal`: the chain each row verifies (wanted where
the step verifies chains, or where its trim is offered trees and may answer with a chain), the
distributions each row's token tree grows from (tree_step.py builds the trees with the per-row
proposers once the step knows their budgets), the confidences a trim reads and, for rows of the
standard rule, the distributions their proposals were drawn from. Everything comes from the same
head pass, so a step offered trees pays for the head once whether it verifies a tree or a chain.

`DecodeBatch` picks one implementation per configuration of its rows (dflash/batch.py
`_proposer`): a DFlash drafter's block, greedy or sampled (proposers/dflash_block.py); a DFlash 2
drafter's selector walk, greedy or sampled (proposers/dflash2_walk.py); with n-gram lookup on,
either one under the lookup override (proposers/lookup_override.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import nn

from blockspec.dflash.constraint import TokenConstraint
from blockspec.dflash.proposers.base import Distributions
from blockspec.dflash.sampling import RowRandom, probabilities
from blockspec.dflash.sparse_probs import SparseProbs
from blockspec.errors import ConfigError


@dataclass(frozen=True)
class BatchDraft:
    """One drafting step's inputs for b rows and D proposal positions.

    hidden [b, D, H]: the drafter's final states at block positions 1..D; head: the target's
    output head; last [b]: each row's last committed token (the root); starts: per row the
    output position that block position 1 predicts (what keyed draws are keyed by); random: the
    rows' keyed randomness; temperature, top_k, top_p [b]: each row's shaping (temperature 0:
    greedy); rules: each row's verification rule; constraints: each row's grammar (None: free);
    lookup: per row its n-gram lookup continuation, at most D ids (empty: none); forced [b, D]:
    ids a walk must take (a lookup continuation), -1 elsewhere, or None; chain: whether the chain
    proposals are wanted; confidence: whether a trim reads their confidences; tree_top_k: the
    candidates per depth a token tree may choose among (0: no tree this step)."""

    hidden: torch.Tensor
    head: nn.Module
    last: torch.Tensor
    starts: Sequence[int]
    random: RowRandom
    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    rules: Sequence[str]
    constraints: Sequence[TokenConstraint | None]
    lookup: Sequence[Sequence[int]] = ()
    forced: torch.Tensor | None = None
    chain: bool = True
    confidence: bool = False
    tree_top_k: int = 0

    def __post_init__(self) -> None:
        if self.hidden.dim() != 3:
            raise ConfigError(f"draft hidden states must be [batch, positions, hidden], got {tuple(self.hidden.shape)}")
        if self.tree_top_k < 0:
            raise ConfigError(f"tree_top_k must be >= 0 (0: no tree), got {self.tree_top_k}")
        if not self.chain and not self.tree_top_k:
            raise ConfigError("a step must want the chain's proposals, a tree's distributions, or both")

    @property
    def keep_q(self) -> bool:
        """Whether proposals must come with the distributions they were drawn from (a row of the
        standard rule tests them against it)."""
        return "standard" in self.rules

    @property
    def vocab(self) -> int:
        """The target's output vocabulary (the rows of its head: what its logits span)."""
        return int(self.head.weight.shape[0])

    def probs(self, logits: torch.Tensor, support: torch.Tensor | None = None) -> torch.Tensor:
        """logits [b, .., V] shaped by each row's temperature, top-k and top-p, as the target's
        own are (dflash/sampling.py); with `support` [m] (a draft vocabulary's ids) logits [b, ..,
        m] of those tokens alone, the probabilities still [b, .., V]."""
        return probabilities(logits, self.temperature, self.top_k, self.top_p, support, self.vocab)


@dataclass(frozen=True)
class BatchProposal:
    """A step's proposals: ids [b, D] (None where the chain was not wanted), their confidences
    [b, D] a trim reads (None where not asked), the standard rule's q [b, D, V] or its nucleus's
    pairs (None unless a row needs it), per row the distributions its tree grows from (None: no tree), and per row how
    many leading proposals came from n-gram lookup (empty: none did)."""

    ids: torch.Tensor | None
    confidence: torch.Tensor | None = None
    draft_q: torch.Tensor | SparseProbs | None = None
    distributions: list[Distributions] | None = None
    looked: tuple[int, ...] = field(default=())


class BatchProposer(Protocol):
    """Turns one head pass over a batch's draft hidden states into the step's proposals."""

    def propose(self, draft: BatchDraft) -> BatchProposal: ...
