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

The codebooks may hold rows for a drafter's draft vocabulary alone ([Vd, r], `token_ids` saying
whose row is which): the drafter proposes nothing else, so the other tokens' successor rows are
never read, and a predecessor outside it (an anchor the drafter cannot propose) reads a zero row,
exactly as the published [V, r] layout with zero rows there would: its transitions are 0 and the
walk follows the unary logits. `expand_rows` writes that published layout.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

# (position t, scores S_t(prev, .) [b, K] float32) -> (chosen candidate index [b], what the walk
# keeps of this position [b, K], e.g. the distribution the choice was drawn from, or None)
Pick = Callable[[int, torch.Tensor], tuple[torch.Tensor, torch.Tensor | None]]


CODEBOOKS = ("predecessor_codebook", "successor_codebook")


def expand_rows(rows: torch.Tensor, token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """A compact codebook [Vd, r] (row i: token token_ids[i]) in the published layout [V, r],
    zero rows for the other tokens."""
    full = rows.new_zeros(vocab_size, rows.shape[1])
    full[token_ids.to(rows.device)] = rows
    return full


class CandidateSelector(nn.Module):
    """Checkpoint names: `hidden_projection.weight` [r, H], `predecessor_codebook` and
    `successor_codebook` [V, r] (published), or [Vd, r] over `token_ids` (compact, `use_rows`)."""

    def __init__(self, hidden_size: int, vocab_size: int, rank: int, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.vocab_size = vocab_size
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)
        self.predecessor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        # compact layout: the sorted token ids [Vd] whose rows the codebooks hold, and each token's
        # row [V] (-1: none, a zero row); both None in the published layout
        self.register_buffer("token_ids", None, persistent=False)
        self.register_buffer("row_of", None, persistent=False)

    def use_rows(self, token_ids: torch.Tensor | None) -> None:
        """Re-lays the codebooks over these sorted token ids' rows (None: all V rows, the published
        layout). A token's row is kept where both layouts hold it, zero where only the new one does."""
        old = self.token_ids
        dev = self.predecessor_codebook.device
        if token_ids is None and old is None:
            return
        if token_ids is not None:
            token_ids = torch.as_tensor(token_ids, dtype=torch.long, device=dev)
            if old is not None and torch.equal(old, token_ids):
                return
        for name in CODEBOOKS:
            rows = getattr(self, name).data
            full = expand_rows(rows, old, self.vocab_size) if old is not None else rows
            new = full if token_ids is None else full[token_ids]
            setattr(self, name, nn.Parameter(new.contiguous(), requires_grad=getattr(self, name).requires_grad))
        if token_ids is None:
            self.token_ids = self.row_of = None
            return
        row_of = torch.full((self.vocab_size,), -1, dtype=torch.long, device=dev)
        row_of[token_ids] = torch.arange(token_ids.numel(), device=dev)
        self.token_ids, self.row_of = token_ids, row_of

    def codebook_rows(self, codebook: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The rows [.., r] of tokens ids [..] in `codebook` (either layout); zero for a token
        the compact layout has no row for."""
        if self.row_of is None:
            return codebook[ids]
        row = self.row_of[ids]
        return codebook[row.clamp(min=0)] * (row >= 0).unsqueeze(-1).to(codebook.dtype)

    def published(self) -> dict[str, torch.Tensor]:
        """The codebooks by checkpoint name in the published [V, r] layout."""
        out = {}
        for name in CODEBOOKS:
            rows = getattr(self, name).detach()
            out[name] = rows if self.token_ids is None else expand_rows(rows, self.token_ids, self.vocab_size)
        return out

    def transitions(self, hidden: torch.Tensor, prev: torch.Tensor, cand_ids: torch.Tensor) -> torch.Tensor:
        """< A[prev] * (W h), B[cand] >: hidden [.., H], prev [..], cand_ids [.., K] -> [.., K]
        (float32). What training scores with the true previous token as `prev`."""
        pred = self.codebook_rows(self.predecessor_codebook, prev).float()  # [.., r]
        mixed = pred * self.hidden_projection(hidden).float()  # [.., r]
        return (self.codebook_rows(self.successor_codebook, cand_ids).float() * mixed[..., None, :]).sum(-1)

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
        succ = (self.codebook_rows(self.successor_codebook, cand_ids).float()
                * self.hidden_projection(hidden).float()[:, :, None])  # [b, n, K, r]
        unary = cand_logits.float()
        ids = torch.empty(b, n, dtype=torch.long, device=cand_ids.device)
        kept: list[torch.Tensor] = []
        prev = anchor
        for t in range(n):
            pred = self.codebook_rows(self.predecessor_codebook, prev).float()  # [b, r]
            scores = unary[:, t] + (succ[:, t] @ pred[:, :, None])[..., 0]  # [b, K]
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
