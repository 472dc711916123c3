"""N-gram lookup proposals: continue the text the way it continued the last time its current
ending appeared earlier in the prompt or the output (prompt-lookup decoding).

A DFlash drafter with two layers copies poorly, yet targets copy a lot: a function's signature and
docstring from the prompt, the numbers of a maths question, a repeated phrase. Where the last
tokens occurred before, what followed them then is a cheap, often long, proposal. Verification
decides as for any proposal, so output never changes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from blockspec.config import LookupConfig


@dataclass
class TokenIndex:
    """A sequence's tokens and, per token id, the positions where it occurs (appended in order).

    `extend` only appends: the positions of new tokens are indexed when a continuation is next
    asked for. A batch of several rows asks now and then (a plain step's policy choice may be held,
    and a batch that never drafts never asks), while every committed token is appended."""

    tokens: list[int] = field(default_factory=list)
    where: dict[int, list[int]] = field(default_factory=dict)
    indexed: int = 0  # tokens[:indexed] are in `where`

    def extend(self, ids: list[int]) -> None:
        self.tokens.extend(ids)

    def _catch_up(self) -> None:
        toks, where = self.tokens, self.where
        for i in range(self.indexed, len(toks)):
            at = where.get(toks[i])
            if at is None:
                where[toks[i]] = [i]
            else:
                at.append(i)
        self.indexed = len(toks)

    def continuation(self, cfg: LookupConfig, max_tokens: int) -> tuple[int, list[int]]:
        """(match length, up to max_tokens ids that followed the longest earlier occurrence of
        the sequence's last tokens); (0, []) when none of at least cfg.min_ngram matches."""
        toks = self.tokens
        n = len(toks)
        if n < 2 or max_tokens < 1:
            return 0, []
        if self.indexed < n:
            self._catch_up()
        best_len, best_at = 0, -1
        for j in reversed(self.where.get(toks[-1], ())):
            if j >= n - 1:
                continue  # the last token itself
            length = 1
            while length < cfg.max_ngram and j - length >= 0 and toks[j - length] == toks[n - 1 - length]:
                length += 1
            if length > best_len:
                best_len, best_at = length, j
                if length == cfg.max_ngram:
                    break
        if best_len < cfg.min_ngram:
            return 0, []
        return best_len, toks[best_at + 1: best_at + 1 + max_tokens]
