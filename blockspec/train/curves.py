"""Training curves from a run's log.jsonl: loss, accuracy by block position and tau (PNG)."""

from __future__ import annotations

import json
from pathlib import Path


def read_log(path: str | Path) -> tuple[list[dict], list[dict]]:
    """(train records, eval records) of a log.jsonl."""
    train, evals = [], []
    for line in Path(path).read_text().splitlines():
        try:
            r = json.loads(line)
        except json.JSONDecodeError:
            continue
        if r.get("type") == "train" and r.get("anchors", 1) == 0:
            continue  # a step whose sequences were all shorter than one block
        (train if r.get("type") == "train" else evals).append(r)
    return train, evals


def plot_curves(log: str | Path, out_png: str | Path, title: str = "DFlash drafter training") -> Path:
    """Writes a 3-panel figure: training loss, accuracy at block positions 1/2/4/8, tau."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train, evals = read_log(log)
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    steps = [r["step"] for r in train]
    ax = axes[0]
    if train:
        ax.plot(steps, [r["loss"] for r in train], lw=0.8, alpha=0.5, label=f"train loss ({train[-1].get('loss_vocab', 'full')} vocab)")
        k = max(1, len(train) // 25)
        avg = [sum(r["loss"] for r in train[max(0, i - k) : i + 1]) / len(train[max(0, i - k) : i + 1]) for i in range(len(train))]
        ax.plot(steps, avg, lw=1.5, label="moving average")
    full = [(r["step"], r["loss_full"]) for r in evals if r.get("loss_full") is not None]
    if full:
        ax.plot(*zip(*full), "o-", label="exact loss, full vocabulary (fixed batch)")
    ax.set_xlabel("step"), ax.set_ylabel("loss"), ax.set_title("loss"), ax.legend(fontsize=8)
    ax.set_yscale("log")
    ax = axes[1]
    k = max(1, len(train) // 25)

    def smooth(values: list[float]) -> list[float]:
        return [sum(values[max(0, i - k) : i + 1]) / len(values[max(0, i - k) : i + 1]) for i in range(len(values))]

    if train:
        for pos in (1, 2, 4, 8):
            if pos <= len(train[0]["acc"]):
                ax.plot(steps, smooth([r["acc"][pos - 1] for r in train]), lw=1.2, label=f"k={pos} (moving avg)")
    ax.set_xlabel("step"), ax.set_ylabel("accuracy"), ax.set_title("train accuracy by block position"), ax.legend(fontsize=8)
    ax = axes[2]
    if train:
        ax.plot(steps, smooth([r["tau_proxy"] for r in train]), lw=1.2, alpha=0.8,
                label="train tau proxy, moving avg (1 + correct prefix)")
    if evals:
        ax.plot([r["step"] for r in evals], [r["tau"] for r in evals], "o-", label="quick eval tau (SpecDecoder, greedy)")
    ax.set_xlabel("step"), ax.set_ylabel("tau"), ax.set_title("acceptance length"), ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    out_png = Path(out_png)
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
    return out_png
