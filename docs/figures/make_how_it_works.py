"""Draws docs/figures/how_it_works.png, the README's picture of one DFlash step.

    .venv/bin/python docs/figures/make_how_it_works.py

One step: the drafter fills a block of masked positions in one pass, the target checks the whole
block in one pass, and the step keeps the agreeing prefix plus the target's own next token.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch  # noqa: E402

OUT = Path(__file__).with_name("how_it_works.png")

LAST = "is"
DRAFT = ["Paris", ".", "It", "is", "a"]
TARGET = ["Paris", ".", "It", "has", "…"]  # the target's own choice at each block position
ACCEPTED = 3  # leading proposals equal to the target's choice

COMMITTED, MASK, ACCEPT, BONUS, REJECT, NEUTRAL = "#c9daf8", "#e6e6e6", "#b6e3b6", "#ffd27f", "#f4c7c3", "#ffffff"

CELL_W, CELL_H, GAP = 1.0, 0.62, 0.12
X0 = 3.3  # where block position 0 starts


def cell(ax, col: int, y: float, text: str, color: str, *, strike: bool = False, dim: bool = False) -> None:
    x = X0 + col * (CELL_W + GAP)
    ax.add_patch(FancyBboxPatch((x, y), CELL_W, CELL_H, boxstyle="round,pad=0.02,rounding_size=0.08",
                                facecolor=color, edgecolor="#555555", linewidth=1.0))
    ax.text(x + CELL_W / 2, y + CELL_H / 2, text, ha="center", va="center", fontsize=11,
            color="#999999" if dim else "#111111", family="DejaVu Sans")
    if strike:
        ax.plot([x + 0.12, x + CELL_W - 0.12], [y + CELL_H / 2, y + CELL_H / 2], color="#b03030", linewidth=1.6)


def label(ax, y: float, title: str, note: str) -> None:
    ax.text(0.05, y + CELL_H * 0.68, title, ha="left", va="center", fontsize=11.5, weight="bold")
    ax.text(0.05, y + CELL_H * 0.18, note, ha="left", va="center", fontsize=8.8, color="#444444")


def arrow(ax, y_from: float, y_to: float, text: str) -> None:
    x = X0 + 2.5 * (CELL_W + GAP) + CELL_W / 2 + GAP / 2
    ax.add_patch(FancyArrowPatch((x, y_from), (x, y_to), arrowstyle="-|>", mutation_scale=14,
                                 color="#555555", linewidth=1.2))
    ax.text(x + 0.18, (y_from + y_to) / 2, text, ha="left", va="center", fontsize=8.8, color="#333333",
            style="italic")


def main() -> None:
    fig, ax = plt.subplots(figsize=(9.6, 4.9))
    ax.set_xlim(0, X0 + 6 * (CELL_W + GAP) + 0.2)
    ax.set_ylim(-0.35, 6.0)
    ax.axis("off")

    rows = {"block": 5.0, "draft": 3.6, "target": 2.2, "commit": 0.6}
    for k in range(6):
        x = X0 + k * (CELL_W + GAP) + CELL_W / 2
        ax.text(x, rows["block"] + CELL_H + 0.15, f"{k}", ha="center", va="bottom", fontsize=8, color="#777777")
    ax.text(X0 - 0.1, rows["block"] + CELL_H + 0.22, "block position", ha="right", va="bottom", fontsize=8,
            color="#777777")

    label(ax, rows["block"], "Block in", "last committed token + masks")
    cell(ax, 0, rows["block"], LAST, COMMITTED)
    for k in range(1, 6):
        cell(ax, k, rows["block"], "MASK", MASK, dim=True)

    arrow(ax, rows["block"] - 0.05, rows["draft"] + CELL_H + 0.05,
          "drafter: ONE pass, fed the target's hidden states")
    label(ax, rows["draft"], "1. Draft", "a guess at every position at once")
    for k, tok in enumerate(DRAFT, 1):
        cell(ax, k, rows["draft"], tok, NEUTRAL)

    arrow(ax, rows["draft"] - 0.05, rows["target"] + CELL_H + 0.05,
          "target: ONE pass over the whole block")
    label(ax, rows["target"], "2. Verify", "the target's own choice, same positions")
    for k, tok in enumerate(TARGET, 1):
        agree = k <= ACCEPTED
        cell(ax, k, rows["target"], tok, ACCEPT if agree else (BONUS if k == ACCEPTED + 1 else MASK),
             dim=k > ACCEPTED + 1)
        mark = "✓" if agree else ("✗" if k == ACCEPTED + 1 else "")
        x = X0 + k * (CELL_W + GAP) + CELL_W - 0.02
        ax.text(x, rows["target"] - 0.08, mark, ha="right", va="top", fontsize=12,
                color="#2e7d32" if agree else "#b03030")

    arrow(ax, rows["target"] - 0.05, rows["commit"] + CELL_H + 0.05, "keep while they agree, then take the target's token")
    label(ax, rows["commit"], "3. Commit", "agreeing prefix + the target's next token")
    for k, tok in enumerate(DRAFT[:ACCEPTED], 1):
        cell(ax, k, rows["commit"], tok, ACCEPT)
    cell(ax, ACCEPTED + 1, rows["commit"], TARGET[ACCEPTED], BONUS)
    for k in range(ACCEPTED + 2, 6):
        cell(ax, k, rows["commit"], DRAFT[k - 1], NEUTRAL, strike=True, dim=True)
    ax.text(X0 + 1 * (CELL_W + GAP), rows["commit"] - 0.22,
            "4 tokens for one drafter pass + one target pass; the text is exactly the target's own",
            ha="left", va="center", fontsize=9, color="#333333")

    fig.tight_layout(pad=0.3)
    fig.savefig(OUT, dpi=90)
    print(OUT)


if __name__ == "__main__":
    main()
