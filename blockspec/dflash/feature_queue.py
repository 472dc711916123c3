"""The target features of committed tokens that the drafter has not read yet (DecodeBatch's queue).

Every verification appends its rows' features; rows leave the batch and join it with their
prompts' features; a draft pass reads everything queued at once and empties the queue (so does
the batch's fold of a long queue, `DecodeBatch.fold_queue`). Between
draft passes (a run of plain steps: most steps of a large batch under the adaptive policy) none
of that may copy what is queued: the queue grows by a column per step, and copying it at each
retirement and join cost a large batch more than the rest of its plain steps' bookkeeping
together (BENCHMARKS.md, "What a plain step carries"). So the queue keeps its pieces as they
came, each with the ids of the rows it holds, and `take` builds the tensor once, for the draft
pass. Rows keep their id while they stay, so a retirement reorders the batch's ids alone.

Layout of `take`'s result, [b, W, F] and positions [b, W]: each piece's columns end at the
column the queue had reached when it came (a joining row's prompt ends with the batch's latest
column), so every row's newest feature is in the last column and shorter rows are padded on the
left with zeros at EMPTY positions. The width is what the longest-queued row still in the batch
needs: the columns before it held only rows that left (a busy batch replaces a row every few
dozen steps), so the pieces that end before it are let go of.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from blockspec.targets.slots import EMPTY


@dataclass
class _Piece:
    """Features [r, c, F] and positions [r, c] ending at queue column `end`; `ids[j]` is the id
    of the row that its row j belongs to. Pieces appended while the batch kept its rows share one
    `ids` list, which is never mutated."""

    feats: torch.Tensor
    pos: torch.Tensor
    end: int
    ids: list[int]


class FeatureQueue:
    """Queued context features of a batch's rows (see the module docstring)."""

    def __init__(self) -> None:
        self.pieces: list[_Piece] = []
        self.end = 0  # columns appended so far
        self.live: list[int] = []  # the id of each row of the batch; replaced, never mutated
        self.since: list[int] = []  # per row, the column its queued features begin at
        self.nbytes = 0  # the queued pieces' features
        self._next_id = 0

    def __bool__(self) -> bool:
        return bool(self.pieces)

    @property
    def batch(self) -> int:
        """Rows of the batch."""
        return len(self.live)

    @property
    def start(self) -> int:
        """The column the queued features begin at: the oldest row's queue."""
        return min(self.since, default=self.end) if self.pieces else self.end

    @property
    def width(self) -> int:
        """Columns `take` would return."""
        return self.end - self.start if self.pieces else 0

    @property
    def backlog(self) -> int:
        """Context tokens queued over all rows (a verify step's unkept slots counted): what the
        next draft pass reads, padding aside."""
        return sum(self.end - s for s in self.since) if self.pieces else 0

    def append(self, feats: torch.Tensor, pos: torch.Tensor) -> None:
        """Every row's latest features [b, c, F] at positions [b, c] (EMPTY: not kept), after
        the queued ones."""
        if feats.shape[0] != self.batch:
            raise ValueError(f"appending features of {feats.shape[0]} rows to a queue of {self.batch}")
        if not self.pieces:
            self.since = [self.end] * self.batch
        self.end += feats.shape[1]
        self.pieces.append(_Piece(feats, pos, self.end, self.live))
        self.nbytes += feats.nbytes

    def join(self, feats: torch.Tensor, pos: torch.Tensor) -> None:
        """New rows' features [k, c, F] at positions [k, c] (EMPTY: left padding), ending with
        the queue's latest column; they become rows batch..batch+k-1."""
        k = pos.shape[0]
        if not self.pieces:
            self.since = [self.end] * self.batch
        ids = list(range(self._next_id, self._next_id + k))
        self._next_id += k
        real = (pos != EMPTY).sum(1).tolist()  # [k]: left padding before each prompt
        self.since = self.since + [self.end - n for n in real]
        self.pieces.append(_Piece(feats, pos, self.end, ids))
        self.nbytes += feats.nbytes
        self.live = self.live + ids

    def select_rows(self, order: list[int]) -> None:
        """Keeps these rows (new row i = old row order[i]); moves no features."""
        self.live = [self.live[r] for r in order]
        if not self.pieces:
            return
        self.since = [self.since[r] for r in order]
        start = self.start
        gone = 0  # pieces are in column order: those ending at or before the start go
        while gone < len(self.pieces) and self.pieces[gone].end <= start:
            self.nbytes -= self.pieces[gone].feats.nbytes
            gone += 1
        if gone:
            del self.pieces[:gone]

    def take(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Everything queued (`assemble`), emptying the queue: what a draft pass reads."""
        out = self._build(share=True)
        self.pieces = []
        self.nbytes = 0
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
        start = self.start
        width = self.end - start
        runs = self._runs()

        def blank() -> tuple[torch.Tensor, torch.Tensor]:
            return (first.new_zeros(self.batch, width, first.shape[-1]),
                    torch.full((self.batch, width), EMPTY, dtype=torch.long, device=first.device))

        feats = pos = None
        for run in runs:
            ids = run[0].ids
            every = ids is self.live or ids == self.live
            if not every:
                where = {rid: j for j, rid in enumerate(ids)}
                dst = [i for i, rid in enumerate(self.live) if rid in where]
                if not dst:  # only rows that left
                    continue
            f = torch.cat([p.feats for p in run], dim=1) if len(run) > 1 else run[0].feats
            p = torch.cat([p.pos for p in run], dim=1) if len(run) > 1 else run[0].pos
            lo, hi = run[0].end - run[0].pos.shape[1] - start, run[-1].end - start
            if lo < 0:  # the run began before the oldest row still queued: those columns are gone
                f, p, lo = f[:, -lo:], p[:, -lo:], 0
            if share and every and len(runs) == 1 and lo == 0 and hi == width:
                return f, p
            if feats is None:
                feats, pos = blank()
            if every:
                feats[:, lo:hi], pos[:, lo:hi] = f, p
                continue
            src = torch.tensor([where[self.live[i]] for i in dst], device=first.device)
            at = torch.tensor(dst, device=first.device)
            feats[at, lo:hi], pos[at, lo:hi] = f[src], p[src]
        # every queued piece held rows that left: the live rows' columns are empty
        return (feats, pos) if feats is not None else blank()

    def _runs(self) -> list[list[_Piece]]:
        """The pieces grouped into runs of adjacent columns held by the same rows: each run is
        joined once, so a run of plain steps costs one copy."""
        runs: list[list[_Piece]] = []
        for piece in self.pieces:
            last = runs[-1][-1] if runs else None
            if (last is not None and last.ids is piece.ids and last.end == piece.end - piece.pos.shape[1]
                    and last.feats.shape[0] == piece.feats.shape[0]):
                runs[-1].append(piece)
            else:
                runs.append([piece])
        return runs
