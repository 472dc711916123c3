"""The n-gram lookup continuation (dflash/lookup.py) over another batch proposer's chain: a row
with a continuation proposes it in place of its first drafted proposals.

Verification does not ask where a proposal came from: it keeps proposals while they equal the
target's own tokens (a row of the standard rule treats them as drafts from a point mass). A
DFlash 2 walk goes on from the continuation (`walks`), so the drafted proposals after it follow
the tokens actually proposed. In a tree step the continuation is one more branch of each row's
tree instead (proposers/lookup.py, dflash/tree_step.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from blockspec.dflash.proposers.batched import BatchDraft, BatchProposal, BatchProposer


@dataclass(frozen=True, eq=False)
class LookupOverride:
    """`inner`'s proposals with each row's lookup continuation (`BatchDraft.lookup`) over its
    first ones; `walks`: `inner` walks on from forced tokens (`BatchDraft.forced`)."""

    inner: BatchProposer
    walks: bool = False

    def propose(self, draft: BatchDraft) -> BatchProposal:
        plan = draft.lookup
        if not any(plan):
            return self.inner.propose(draft)
        if self.walks and draft.chain:
            draft = replace(draft, forced=forced_ids(plan, draft.hidden.shape[1], draft.hidden.device))
        proposal = self.inner.propose(draft)
        if proposal.ids is None:
            return proposal
        ids, looked = splice(proposal.ids, plan)
        return replace(proposal, ids=ids, looked=tuple(looked))


def forced_ids(plan: Sequence[Sequence[int]], width: int, device: torch.device | str) -> torch.Tensor:
    """[b, width]: each row's continuation at the proposal positions it takes, -1 elsewhere."""
    rows = [list(cont[:width]) + [-1] * (width - len(cont[:width])) for cont in plan]
    return torch.tensor(rows, dtype=torch.long, device=device)


def splice(ids: torch.Tensor, plan: Sequence[Sequence[int]]) -> tuple[torch.Tensor, list[int]]:
    """ids [b, n] with row r's first proposals replaced by its continuation plan[r] (cut to n;
    a copy where any row has one), and how many proposals per row came from it."""
    n = ids.shape[1]
    cut = [list(cont[:n]) for cont in plan]
    rows_i = [i for i, cont in enumerate(cut) for _ in cont]
    if not rows_i:
        return ids, [0] * len(cut)
    cols = [k for cont in cut for k in range(len(cont))]
    vals = [t for cont in cut for t in cont]
    ri, ci, v = (torch.tensor(x, dtype=torch.long, device=ids.device) for x in (rows_i, cols, vals))
    return ids.index_put((ri, ci), v), [len(cont) for cont in cut]
