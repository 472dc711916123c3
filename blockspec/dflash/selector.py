"""DFlash 2's candidate selector (docs/DESIGN.md section 3.3): proposals by a walk over the drafter's
top-K candidates instead of an independent argmax per block position.

For proposal position t, C_t are the drafter's K most likely tokens and U_t their logits. A
transition from predecessor a to candidate b scores

    S_t(a, b) = U_t(b) + < A[a] * (W h_t), B[b] >

with A, B the predecessor and successor codebooks [V, r], W the hidden projection [r, H] and h_t
the drafter's final normalised hidden state at t. A walk starts from the block's anchor (the last
verified token, the predecessor of position 1) and picks one candidate per position: the best
(greedy) or a sample of softmax(S_t(prev, .) / T) over C_t (the draft distribution q_t, zero
outside C_t). Verification is unchanged: the selector only changes what is proposed.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

# (position t, scores S_t(prev, .) [b, K] float32) -> (chosen candidate index [b], what the walk
# keeps of this position [b, K], e.g. the distribution the choice was drawn from, or None)
Pick = Callable[[int, torch.Tensor], tuple[torch.Tensor, torch.Tensor | None]]


class CandidateSelector(nn.Module):
    """Checkpoint names: `hidden_projection.weight` [r, H], `predecessor_codebook` [V, r],
    `successor_codebook` [V, r]."""

    def __init__(self, hidden_size: int, vocab_size: int, rank: int, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)
        self.predecessor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.empty(vocab_size, rank))

    def transitions(self, hidden: torch.Tensor, prev: torch.Tensor, cand_ids: torch.Tensor) -> torch.Tensor:
        """< A[prev] * (W h), B[cand] >: hidden [.., H], prev [..], cand_ids [.., K] -> [.., K]
        (float32). What training scores with the true previous token as `prev`."""
        mixed = self.predecessor_codebook[prev].float() * self.hidden_projection(hidden).float()  # [.., r]
        return (self.successor_codebook[cand_ids].float() * mixed[..., None, :]).sum(-1)

    def scores(self, hidden: torch.Tensor, prev: torch.Tensor, cand_ids: torch.Tensor,
               cand_logits: torch.Tensor) -> torch.Tensor:
        """S(prev, cand) = cand_logits + transitions: [.., K] float32."""
        return cand_logits.float() + self.transitions(hidden, prev, cand_ids)

    def walk(self, hidden: torch.Tensor, cand_ids: torch.Tensor, cand_logits: torch.Tensor, anchor: torch.Tensor,
             pick: Pick, forced: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Proposals for n positions: hidden [b, n, H], cand_ids / cand_logits [b, n, K], anchor [b]
        (position 1's predecessor). `forced` [b, n]: a token id where the proposal is fixed in
        advance (an n-gram lookup continuation), -1 elsewhere; the walk goes on from it.
        Returns (ids [b, n], what `pick` kept of each position [b, n, K], or None)."""
        b, n, k = cand_ids.shape
        # B[c] * (W h_t) once for all positions, so each step is one [K, r] x [r] product per row
        succ = self.successor_codebook[cand_ids].float() * self.hidden_projection(hidden).float()[:, :, None]
        unary = cand_logits.float()
        ids = torch.empty(b, n, dtype=torch.long, device=cand_ids.device)
        kept: list[torch.Tensor] = []
        prev = anchor
        for t in range(n):
            scores = unary[:, t] + (succ[:, t] @ self.predecessor_codebook[prev].float()[:, :, None])[..., 0]  # [b, K]
            choice, record = pick(t, scores)
            tok = cand_ids[:, t].gather(1, choice[:, None])[:, 0]
            if forced is not None:
                tok = torch.where(forced[:, t] >= 0, forced[:, t], tok)
            if record is not None:
                kept.append(record)
            ids[:, t] = tok
            prev = tok
        return ids, (torch.stack(kept, dim=1) if kept else None)


def pick_best(t: int, scores: torch.Tensor) -> tuple[torch.Tensor, None]:
    """The greedy walk's pick: the highest score (the first, i.e. the unary-likelier, on a tie)."""
    return scores.argmax(dim=-1), None
