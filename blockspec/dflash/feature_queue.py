"""The target features of committed tokens that the drafter has not read yet (DecodeBatch's queue).

Every verification appends its rows' features; rows leave the batch and join it with their
prompts' features; a draft pass reads everything queued at once and empties the queue (so does
the batch's fold of a long queue, `DecodeBatch.fold_queue`). Between
draft passes (a run of plain steps: most steps of a large batch under the adaptive policy) none
of that may copy what is queued: the queue grows by a column per step, and copying it at each
retirement and join cost a large batch more than the rest of its plain steps' bookkeeping
together (BENCHMARKS.md, "What a plain step carries"). So the queue keeps its pieces as they
came, with a row map each, and `take` builds the tensor once, for the draft pass.

Layout of `take`'s result, [b, W, F] and positions [b, W]: each piece's columns end at the
column the queue had reached when it came (a joining row's prompt ends with the batch's latest
column), so every row's newest feature is in the last column and shorter rows are padded on the
left with zeros at EMPTY positions; rows that left take their columns with them, the width stays.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from blockspec.targets.slots import EMPTY


@dataclass
class _Piece:
    """Features [r, c, F] and positions [r, c] ending at queue column `end`; `rows[i]` is the row
    of this piece that batch row i reads (-1: none)."""

    feats: torch.Tensor
    pos: torch.Tensor
    end: int
    rows: list[int]


class FeatureQueue:
    """Queued context features of a batch's rows (see the module docstring)."""

    def __init__(self) -> None:
        self.pieces: list[_Piece] = []
        self.batch = 0  # rows of the batch
        self.end = 0  # columns appended so far
        self.start = 0  # the column the queued features begin at

    def __bool__(self) -> bool:
        return bool(self.pieces)

    @property
    def width(self) -> int:
        """Columns `take` would return."""
        return self.end - self.start if self.pieces else 0

    def append(self, feats: torch.Tensor, pos: torch.Tensor) -> None:
        """Every row's latest features [b, c, F] at positions [b, c] (EMPTY: not kept), after
        the queued ones."""
        if feats.shape[0] != self.batch:
            raise ValueError(f"appending features of {feats.shape[0]} rows to a queue of {self.batch}")
        if not self.pieces:
            self.start = self.end
        self.end += feats.shape[1]
        self.pieces.append(_Piece(feats, pos, self.end, list(range(self.batch))))

    def join(self, feats: torch.Tensor, pos: torch.Tensor) -> None:
        """New rows' features [k, c, F] at positions [k, c] (EMPTY: left padding), ending with
        the queue's latest column; they become rows batch..batch+k-1."""
        k, c = pos.shape
        self.start = min(self.start, self.end - c) if self.pieces else self.end - c
        self.pieces.append(_Piece(feats, pos, self.end, [-1] * self.batch + list(range(k))))
        self.batch += k

    def select_rows(self, order: list[int]) -> None:
        """Keeps these rows (new row i = old row order[i]); moves no features."""
        for piece in self.pieces:
            piece.rows = [piece.rows[r] if r < len(piece.rows) else -1 for r in order]
        self.batch = len(order)

    def take(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Everything queued (`assemble`), emptying the queue: what a draft pass reads."""
        out = self._build(share=True)
        self.pieces = []
        self.start = self.end
        return out

    def assemble(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Everything queued, as features [b, W, F] and positions [b, W] (layout: module
        docstring); the queue keeps it. Needs at least one queued piece."""
        return self._build(share=False)

    def _build(self, share: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """`assemble`'s tensors. With `share`, one run that every row reads from the first column
        (a lone row's steps since its last draft pass) is returned as its pieces joined, without
        the padded copy (`take`: the queue lets go of them)."""
        if not self.pieces:
            raise ValueError("no queued features to take")
        first = self.pieces[0].feats
        width = self.end - self.start
        runs = self._runs()
        feats = pos = None
        for run in runs:
            f = torch.cat([p.feats for p in run], dim=1) if len(run) > 1 else run[0].feats
            p = torch.cat([p.pos for p in run], dim=1) if len(run) > 1 else run[0].pos
            lo, hi = run[0].end - run[0].pos.shape[1] - self.start, run[-1].end - self.start
            rows = run[0].rows
            every = rows == list(range(self.batch)) and f.shape[0] == self.batch
            if share and every and len(runs) == 1 and lo == 0 and hi == width:
                return f, p
            if feats is None:
                feats = first.new_zeros(self.batch, width, first.shape[-1])
                pos = torch.full((self.batch, width), EMPTY, dtype=torch.long, device=first.device)
            if every:
                feats[:, lo:hi], pos[:, lo:hi] = f, p
                continue
            dst = [i for i, r in enumerate(rows) if r >= 0]
            if dst:
                src = torch.tensor([rows[i] for i in dst], device=first.device)
                at = torch.tensor(dst, device=first.device)
                feats[at, lo:hi], pos[at, lo:hi] = f[src], p[src]
        return feats, pos

    def _runs(self) -> list[list[_Piece]]:
        """The pieces grouped into runs of adjacent columns read by the same rows: each run is
        joined once, so a run of plain steps costs one copy."""
        runs: list[list[_Piece]] = []
        for piece in self.pieces:
            last = runs[-1][-1] if runs else None
            if (last is not None and last.rows == piece.rows and last.end == piece.end - piece.pos.shape[1]
                    and last.feats.shape[0] == piece.feats.shape[0]):
                runs[-1].append(piece)
            else:
                runs.append([piece])
        return runs
