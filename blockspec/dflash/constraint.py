"""Grammar-constrained rows inside a speculative step (docs/DESIGN.md section 4.1).

A constrained row carries a `TokenConstraint`: a matcher of the row's output so far against a
grammar (a JSON schema, a regex, ...; engine/grammar.py makes them with xgrammar). The step uses
it in three places, and the output stays exactly what constrained plain decoding gives:

- before verification, `walk` runs the matcher over the row's proposals and cuts the block at
  the first proposal the grammar rejects (the target could never accept it), collecting the
  allowed-token mask at every position the target verifies;
- the target's logits at each verified position are masked (`masked`) before the argmax or the
  sample, so accepted proposals and the bonus token are what constrained plain decoding picks;
- after the commit, the matcher advances by the committed tokens only (`follow`): `walk` rolled
  it back to the committed prefix already, so rejected proposals leave no trace.

A sampled row's drafts are drawn from the draft distribution masked the same way
(`sample_masked`), so no proposal breaks the grammar: a rejection rule that compares the draft
and target distributions then sees the distribution that was really sampled. A greedy row's
drafts are the best tokens the grammar allows (`argmax_masked`): the cut then rarely fires.

Masks are bitmasks: int32 words [.., W], W = ceil(V / 32), bit t % 32 of word t // 32 set where
token t is allowed (the layout xgrammar fills).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch


class TokenConstraint(Protocol):
    """A matcher over one request's output tokens (engine/grammar.py has the xgrammar one)."""

    def fill_mask(self, out: torch.Tensor) -> None:
        """Writes the tokens allowed next into out, int32 [W] (see the module docstring)."""
        ...

    def accept(self, token: int) -> bool:
        """Advances by one token; False (and no change) when the grammar does not allow it."""
        ...

    def rollback(self, n: int) -> None:
        """Undoes the last n accepted tokens."""
        ...

    def is_terminated(self) -> bool:
        """Whether the output is complete (its stop token accepted): nothing may follow."""
        ...


def mask_width(vocab: int) -> int:
    return (vocab + 31) // 32


_BITS = torch.arange(32, dtype=torch.int32)


def unpack(bits: torch.Tensor, vocab: int) -> torch.Tensor:
    """Bitmasks [..., W] -> allowed [..., vocab] bool."""
    flat = (bits[..., None] >> _BITS.to(bits.device)) & 1  # [..., W, 32]
    return flat.reshape(*bits.shape[:-1], -1)[..., :vocab].bool()


def allows(bits: torch.Tensor, token: int) -> bool:
    """Whether bitmask [W] allows `token`."""
    return bool((int(bits[token // 32]) >> (token % 32)) & 1)


def masked(logits: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """logits [m, n, V] with disallowed tokens at -inf (bits [m, n, W]); a new tensor."""
    v = logits.shape[-1]
    return logits.masked_fill(~unpack(bits, v), float("-inf"))


def _fill(c: TokenConstraint, out: torch.Tensor) -> None:
    """The mask of c's next token; all ones once c is complete (that position follows a stop
    token: whatever comes there is never committed, but its distribution must stay finite)."""
    if c.is_terminated():
        out.fill_(-1)
    else:
        c.fill_mask(out)


def walk(c: TokenConstraint, proposals: list[int], width: int) -> tuple[int, torch.Tensor]:
    """Runs c over `proposals` (the block's positions 1..) up to the first one the grammar
    rejects, and rolls c back. Returns (v, masks [v + 1, W]): the proposals that can be
    verified and the mask of each block position 0..v."""
    masks = torch.empty(len(proposals) + 1, width, dtype=torch.int32)
    v = 0
    for t in proposals:
        _fill(c, masks[v])
        if c.is_terminated() or not allows(masks[v], t) or not c.accept(t):
            break
        v += 1
    if v == len(proposals):
        _fill(c, masks[v])
    c.rollback(v)
    return v, masks[: v + 1]


def follow(c: TokenConstraint, tokens: list[int]) -> bool:
    """Advances c by committed tokens; True when c is complete after them."""
    for t in tokens:
        if c.is_terminated() or not c.accept(t):
            # a committed token is always allowed (it came from masked logits): a matcher that
            # disagrees is a bug, never the client's fault
            raise RuntimeError(f"the grammar matcher refused committed token {t}")
    return c.is_terminated()


@dataclass
class RowMasks:
    """Masks of a step's constrained rows: batch rows `rows` [m] and their bitmasks [m, q, W]
    (all ones past a row's verified positions)."""

    rows: torch.Tensor
    bits: torch.Tensor


def cut_block(constraints: list[TokenConstraint | None], block: list[list[int]], lengths: list[int],
              vocab: int) -> tuple[list[int], RowMasks | None]:
    """Per row, the tokens to verify after cutting each constrained row's block (block[i]: its
    fed token then its proposals) at the first proposal its grammar rejects, and those rows'
    masks; (lengths, None) when no row is constrained."""
    rows = [i for i, c in enumerate(constraints) if c is not None]
    if not rows:
        return lengths, None
    width = mask_width(vocab)
    out = list(lengths)
    per_row = []
    for i in rows:
        v, bits = walk(constraints[i], block[i][1: lengths[i]], width)
        out[i] = v + 1
        per_row.append(bits)
    q = max(out)
    bits = torch.full((len(rows), q, width), -1, dtype=torch.int32)
    for j, b in enumerate(per_row):
        bits[j, : b.shape[0]] = b
    return out, RowMasks(torch.tensor(rows, dtype=torch.long), bits)


def first_masks(constraints: list[TokenConstraint | None], vocab: int) -> RowMasks | None:
    """The masks [m, 1, W] of each constrained row's next token; None when no row is constrained."""
    return cut_block(constraints, [[0] for _ in constraints], [1] * len(constraints), vocab)[1]


Draw = Callable[[torch.Tensor, list[int]], torch.Tensor]


def sample_masked(probs: torch.Tensor, rows: list[int], constraints: list[TokenConstraint | None],
                  starts: list[int], draw: Draw) -> torch.Tensor:
    """Proposals [m, n] for constrained batch rows `rows`, drawn position by position from their
    draft distributions probs [b, n, V] masked by the grammar after the earlier proposals (the
    rows of probs are masked and renormalised in place); each matcher is rolled back after.
    draw(p [m, 1, V], positions) samples the rows' output positions with their own draws."""
    n, v = probs.shape[1], probs.shape[2]
    bits = torch.empty(mask_width(v), dtype=torch.int32)
    ids = torch.empty(len(rows), n, dtype=torch.long)
    index = torch.tensor(rows, dtype=torch.long, device=probs.device)
    accepted = [0] * len(rows)
    for t in range(n):
        for i in rows:
            _fill(constraints[i], bits)
            allowed = unpack(bits, v).to(probs.device)
            p = probs[i, t].masked_fill_(~allowed, 0.0)
            total = p.sum()
            if total > 0:
                p.div_(total)
            else:  # the draft gives the grammar's tokens no mass: propose uniformly among them
                p.copy_(allowed.to(p.dtype) / allowed.sum())
        ids[:, t] = draw(probs[index, t: t + 1], [starts[i] + t for i in rows])[:, 0].cpu()
        for j, i in enumerate(rows):
            c = constraints[i]
            if not c.is_terminated() and c.accept(int(ids[j, t])):
                accepted[j] += 1
    for j, i in enumerate(rows):  # back to the committed prefix: these were proposals
        constraints[i].rollback(accepted[j])
    return ids


def argmax_masked(logits: torch.Tensor, rows: list[int], constraints: list[TokenConstraint | None]) -> torch.Tensor:
    """Greedy proposals [m, n] for constrained batch rows `rows` from their draft logits [m, n, V]:
    position by position the best token the grammar allows after the earlier proposals (each
    matcher is rolled back after). Where the draft gives no allowed token a finite logit, the
    plain argmax stands (the walk before verification cuts it)."""
    m, n, v = logits.shape
    bits = torch.empty(mask_width(v), dtype=torch.int32)
    ids = torch.empty(m, n, dtype=torch.long)
    accepted = [0] * m
    for j, i in enumerate(rows):
        c = constraints[i]
        for t in range(n):
            _fill(c, bits)
            row = logits[j, t].masked_fill(~unpack(bits, v).to(logits.device), float("-inf"))
            ids[j, t] = int(row.argmax())
            if c.is_terminated() or not c.accept(int(ids[j, t])):
                ids[j, t + 1:] = ids[j, t]  # past a stop token or a refused one: cut there anyway
                break
            accepted[j] += 1
        c.rollback(accepted[j])
    return ids
