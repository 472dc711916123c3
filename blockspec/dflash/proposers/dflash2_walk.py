"""A DFlash 2 drafter's block proposals: the selector's walk over each position's candidates
(dflash/selector.py), batched, greedy or sampled.

Greedy (every row at temperature 0): the best-scoring candidate after the token before. Sampled
(any row sampling): position t's proposal is drawn from q_t, the row's shaping (temperature,
top-k, top-p, as the target's p gets it) of the scores S_t(prev, .) over the candidates, zero
elsewhere, racing the clocks the target's own draw at that output position races with. A step's
trees grow from the selector's conditional scores over the same candidates
(`SelectorDistributions`), so the head runs once whether the step verifies a tree or a chain.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from blockspec.dflash.drafter import Candidates, DFlashDrafter
from blockspec.dflash.proposers.batched import BatchDraft, BatchProposal
from blockspec.dflash.proposers.dflash2 import SelectorDistributions


@dataclass(frozen=True, eq=False)
class DFlash2WalkProposer:
    """`drafter`'s selector walk (a drafter with a candidate selector); `sampled`: some row samples."""

    drafter: DFlashDrafter
    sampled: bool

    def propose(self, draft: BatchDraft) -> BatchProposal:
        hidden, head = draft.hidden, draft.head
        cands = dists = None
        if draft.tree_top_k:
            # the normaliser puts the trees' node probabilities on the unary distribution's scale
            cands = self.drafter.candidates(hidden, head, normaliser=True)
            selector = self.drafter.candidate_selector
            dists = [SelectorDistributions(selector, hidden[i], cands.ids[i], cands.logits[i], cands.logsumexp[i])
                     for i in range(hidden.shape[0])]
        if not draft.chain:
            return BatchProposal(None, None, None, dists)
        if self.sampled:
            ids, conf, q = self._sample_walk(draft, cands)
            return BatchProposal(ids, conf, q, dists)
        ids, conf = self.drafter.greedy_with_confidence(hidden, head, draft.last, draft.forced,
                                                        confidence=draft.confidence, cands=cands)
        return BatchProposal(ids, conf, None, dists)

    def _sample_walk(self, draft: BatchDraft, cands: Candidates | None
                     ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """The sampled walk's ids [b, D]; with `draft.confidence` the peaks [b, D] of the unary
        candidates' shaped distributions times their unary mass (the confidences a trim reads,
        which, unlike q_t, do not depend on the earlier samples), else None; with `draft.keep_q`
        the q_t each proposal was drawn from, spread over the vocabulary [b, D, V], else None."""
        hidden = draft.hidden
        if cands is None:
            cands = self.drafter.candidates(hidden, draft.head, normaliser=draft.confidence)
        starts = list(draft.starts)

        def pick(t: int, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            probs = draft.probs(scores[:, None])[:, 0]  # [b, K]
            # the clocks of the candidates' own ids at this output position: the target's sample
            # there races with the same clocks, so the walk's choice is what it will mostly accept
            return draft.random.race(probs, cands.ids[:, t], [s + t for s in starts]), probs

        ids, kept = self.drafter.walk(hidden, cands, draft.last, pick, draft.forced)  # kept [b, D, K]
        q = None
        if draft.keep_q:
            q = kept.new_zeros(*kept.shape[:2], draft.vocab).scatter_(-1, cands.ids, kept)
        if not draft.confidence:
            return ids, None, q
        mass = torch.exp(cands.logits.logsumexp(-1) - cands.logsumexp)  # [b, D]
        return ids, draft.probs(cands.logits).max(dim=-1).values * mass, q
