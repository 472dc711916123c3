"""Training curves from a run's log.jsonl: loss, accuracy by block position and tau (PNG); for a
DFlash 2 run also the selector's accuracy and the top-K recall by block position."""

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
    """Writes a 3-panel figure: training loss, accuracy at block positions 1/2/4/8, tau; DFlash 2
    runs get a 4th: unary top-1, selector and top-K accuracy by block position."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train, evals = read_log(log)
    dflash2 = bool(train) and "selector_acc" in train[-1]
    fig, axes = plt.subplots(1, 4 if dflash2 else 3, figsize=(20 if dflash2 else 15, 4))
    steps = [r["step"] for r in train]
    ax = axes[0]
    if train:
        ax.plot(steps, [r["loss"] for r in train], lw=0.8, alpha=0.5, label=f"train loss ({train[-1].get('loss_vocab', 'full')} vocab)")
        k = max(1, len(train) // 25)
        avg = [sum(r["loss"] for r in train[max(0, i - k) : i + 1]) / len(train[max(0, i - k) : i + 1]) for i in range(len(train))]
        ax.plot(steps, avg, lw=1.5, label="moving average")
        if dflash2:  # the total above adds the selector's loss; this part compares with loss_full
            ax.plot(steps, [r["unary_loss"] for r in train], lw=1.0, label="train unary loss (DFlash part)")
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
        if dflash2:
            ax.plot(steps, smooth([r["tau_proxy_selector"] for r in train]), lw=1.2, alpha=0.8,
                    label="train tau proxy of the selector, moving avg")
    if evals:
        ax.plot([r["step"] for r in evals], [r["tau"] for r in evals], "o-", label="quick eval tau (SpecDecoder, greedy)")
    ax.set_xlabel("step"), ax.set_ylabel("tau"), ax.set_title("acceptance length"), ax.legend(fontsize=8)
    if dflash2:
        ax = axes[3]
        last = train[-max(1, len(train) // 10):]  # the last tenth of the run, averaged
        positions = list(range(1, len(last[0]["acc"]) + 1))
        k = last[-1].get("selector_top_k", "K")
        for key, label in (("acc", "unary top-1"), ("selector_acc", "selector (true predecessor)"),
                           ("topk_recall", f"unary top-{k} recall")):
            ax.plot(positions, [sum(r[key][p - 1] for r in last) / len(last) for p in positions], "o-", label=label)
        ax.set_xticks(positions)
        ax.set_xlabel("block position"), ax.set_ylabel("accuracy")
        ax.set_title("by block position (last tenth of training)"), ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    out_png = Path(out_png)
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
    return out_png
