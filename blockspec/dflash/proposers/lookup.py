"""The lookup proposer: a row's n-gram lookup continuation (dflash/lookup.py) as one more branch
of another proposer's tree, sharing the prefix the two agree on; alone, a chain."""

from __future__ import annotations

from dataclasses import dataclass

from blockspec.dflash.proposers.base import Draft, Proposer
from blockspec.dflash.token_tree import TokenTree
from blockspec.errors import ConfigError


@dataclass(frozen=True)
class LookupProposer:
    """`inner`'s tree (None: the root alone) plus up to `max_tokens` of the lookup continuation."""

    inner: Proposer | None
    max_tokens: int

    def __post_init__(self) -> None:
        if self.max_tokens < 0:
            raise ConfigError(f"a lookup branch's max_tokens must be >= 0, got {self.max_tokens}")

    def propose(self, draft: Draft) -> TokenTree:
        tree = self.inner.propose(draft) if self.inner is not None else TokenTree.chain(draft.root, [])
        branch = list(draft.lookup)[: self.max_tokens]
        return tree.merge(branch) if branch else tree
