"""DFlash 2's selector (dflash/selector.py) as proposals: its conditional scores as distributions
for the tree builder, and its greedy walk as a proposer.

At depth t the candidates are the drafter's top-K of position t, scored S_t(prev, .) given the
token before; a path's probability is the product along it of each node's conditional draft
probability: the "conditional path score" a best-first tree grows by. With the unary
distribution's normaliser (`log_norm`) a candidate's probability is its score's share of the
unary distribution whose candidates' logits are replaced by their scores, the tokens outside the
candidates keeping their mass (as the greedy walk's confidence reads it): a selector whose
transitions are all 0 then scores every node exactly as the DFlash tree of the same drafter does,
and a tree never takes the top K for the whole distribution. Without it, the softmax over the K
candidates alone, which overrates every node where the top K hold little of the mass.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from blockspec.dflash.proposers.base import Draft
from blockspec.dflash.selector import CandidateSelector, pick_best
from blockspec.dflash.token_tree import TokenTree
from blockspec.errors import ConfigError


@dataclass(frozen=True)
class SelectorDistributions:
    """One row's selector inputs: hidden [D, H] (the drafter's final states at depths 1..D),
    cand_ids and cand_logits [D, K] (each position's top-K, descending), log_norm [D] (the unary
    distribution's log normaliser at each depth, or None)."""

    selector: CandidateSelector
    hidden: torch.Tensor
    cand_ids: torch.Tensor
    cand_logits: torch.Tensor
    log_norm: torch.Tensor | None = None

    def __post_init__(self) -> None:
        d, k = self.cand_ids.shape if self.cand_ids.dim() == 2 else (-1, -1)
        if d < 0 or self.cand_logits.shape != (d, k) or self.hidden.dim() != 2 or self.hidden.shape[0] != d:
            raise ConfigError(f"selector inputs must be hidden [D, H], candidates [D, K]; got {tuple(self.hidden.shape)}, "
                              f"{tuple(self.cand_ids.shape)}, {tuple(self.cand_logits.shape)}")

    @property
    def max_depth(self) -> int:
        return self.cand_ids.shape[0]

    @torch.inference_mode()
    def children(self, depth: int, prev: int) -> tuple[list[int], list[float]]:
        t = depth - 1
        prev_t = torch.tensor(prev, dtype=torch.long, device=self.cand_ids.device)
        scores = self.selector.scores(self.hidden[t], prev_t, self.cand_ids[t], self.cand_logits[t])  # [K]
        if self.log_norm is None:
            logp = torch.log_softmax(scores, dim=-1)
        else:
            norm = self.log_norm[t].float()
            # log of the unary mass outside the candidates, which their scores do not replace
            outside = norm + torch.log1p(-torch.exp(self.cand_logits[t].float().logsumexp(-1) - norm).clamp(max=1.0))
            logp = scores - torch.logaddexp(scores.logsumexp(-1), outside)
        # stable: on a tie the unary-likelier candidate first, as the selector's own walk picks
        logp, order = logp.sort(descending=True, stable=True)
        return self.cand_ids[t][order].tolist(), logp.tolist()


@dataclass(frozen=True)
class SelectorWalkProposer:
    """The selector's greedy walk from the root, `length` proposals: what a DFlash 2 step
    proposes today, as a chain (the selector's batched walk, not one node at a time)."""

    length: int

    def __post_init__(self) -> None:
        if self.length < 0:
            raise ConfigError(f"a walk's length must be >= 0, got {self.length}")

    @torch.inference_mode()
    def propose(self, draft: Draft) -> TokenTree:
        dists = draft.distributions
        if not isinstance(dists, SelectorDistributions):
            raise ConfigError("the DFlash 2 walk proposer needs a DFlash 2 drafter's selector distributions")
        n = min(self.length, dists.max_depth)
        if n == 0:
            return TokenTree.chain(draft.root, [])
        anchor = torch.tensor([draft.root], dtype=torch.long, device=dists.cand_ids.device)
        ids, _ = dists.selector.walk(dists.hidden[None, :n], dists.cand_ids[None, :n], dists.cand_logits[None, :n],
                                     anchor, pick_best)
        return TokenTree.chain(draft.root, ids[0].tolist())
