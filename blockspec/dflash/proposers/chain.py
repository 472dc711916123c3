"""The chain proposer: at each depth the drafter's first choice after the token before it (a
plain DFlash block, or with conditional distributions DFlash 2's greedy walk)."""

from __future__ import annotations

from dataclasses import dataclass

from blockspec.dflash.proposers.base import Draft, need_distributions
from blockspec.dflash.token_tree import TokenTree
from blockspec.errors import ConfigError


@dataclass(frozen=True)
class ChainProposer:
    """Up to `length` proposals (fewer where the distributions end)."""

    length: int

    def __post_init__(self) -> None:
        if self.length < 0:
            raise ConfigError(f"a chain's length must be >= 0, got {self.length}")

    def propose(self, draft: Draft) -> TokenTree:
        dists = need_distributions(draft, "chain") if self.length else draft.distributions
        out, prev = [], draft.root
        for depth in range(1, min(self.length, dists.max_depth if dists is not None else 0) + 1):
            ids, _ = dists.children(depth, prev)
            if not ids:  # the drafter rules every token out here: the chain ends
                break
            prev = ids[0]
            out.append(prev)
        return TokenTree.chain(draft.root, out)
