"""How the adaptive policy tells a step how much to verify: the trim callable and its answer."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from blockspec.dflash.tree_step import TreeOffer

# A step's verify length from its drafts: (per row, the peak probability of the draft
# distribution at each proposal position; per row, how many leading proposals came from n-gram
# lookup instead) -> tokens to verify, in 1..block: one length for every row, or a list with one
# per row (a ragged step; the rows' unverified tail is padding, which costs nothing where the
# target `skips_padding`). It sees the draft distributions only, never the target nor the
# sampled proposals: whether a sampled proposal is verified must not depend on the proposal
# itself (verifying only the likely-looking samples would bias the output towards them), and the
# peaks are fixed before any sample is drawn. Greedy, the peak is the proposal's own probability.
# Where the step may verify token trees, the trim is also given each row's `TreeOffer` and may
# answer with a `Shape` that says whether the step verifies trees or chains (a plain length
# verifies trees there).
Trim = Callable[..., "int | list[int] | Shape"]


@dataclass(frozen=True)
class Shape:
    """A trim's answer where trees are offered: the verify length (one, or one per row) and
    whether the step verifies token trees of those widths (else chains)."""

    lengths: int | list[int]
    tree: bool


__all__ = ["Shape", "TreeOffer", "Trim"]
