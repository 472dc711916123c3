"""Draws the training figure of the shipped SmolLM2 drafter's model card.

    .venv/bin/python docs/figures/make_drafter_card.py

Writes blockspec/assets/drafters/smollm2-135m-instruct/training.png. The numbers are those of its
nine training stages: the quick evaluation each run logged (4 held-out GSM8K train prompts, 48
tokens, block 16, greedy), the held-out acceptance length measured before each stage shipped
(32 held-out prompts, 128 tokens) and `blockspec bench` afterwards (first 64 test prompts, block
16, no lookup). Each stage started from the previous stage's weights.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "blockspec" / "assets" / "drafters" / "smollm2-135m-instruct" / "training.png"

# (training steps, quick-eval tau at each eval of the stage, its last one at the end)
STAGES = [
    (3300, [2.19]),  # stage 1 from random init (tau 1 at step 0)
    (7500, [2.14, 2.44, 2.54, 2.54, 2.58]),
    (7500, [2.47, 2.77, 2.61, 2.77, 2.81]),
    (7200, [2.54, 2.61, 2.81, 3.13]),
    (7000, [2.89, 2.94, 3.19, 3.13]),
    (4000, [3.08, 3.19, 3.24, 3.30]),
    (4400, [3.13, 3.08, 3.36, 3.42]),
    (4000, [2.94, 3.19, 3.24, 3.30]),
    (3400, [2.98, 3.19, 3.24, 3.30]),  # stage 9: grown to 3 layers
]
# held-out tau when each stage shipped (None: not measured then)
HELDOUT = {
    "maths (GSM8K train questions)": [None, 2.03, 2.17, 2.28, 2.37, 2.42, 2.44, 2.40, 2.47],
    "maths as code stubs": [None, None, None, None, None, 1.49, 1.89, 1.90, 1.99],
    "standard-library stubs": [None, None, None, None, None, None, 1.43, 1.59, 1.63],
}
BENCH = {
    "bench: GSM8K test, 64 prompts": [1.80, 2.01, 2.07, 2.20, 2.29, 2.31, 2.31, 2.25, 2.30],
    "bench: HumanEval, 64 prompts": [None, 1.44, 1.48, 1.52, 1.53, 1.53, 1.55, 1.61, 1.65],
}


def main() -> None:
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.4), gridspec_kw={"width_ratios": [1.4, 1]})

    xs, ys, start = [0], [1.0], 0
    for i, (steps, evals) in enumerate(STAGES):
        for j, tau in enumerate(evals, 1):
            xs.append(start + steps * j / len(evals))
            ys.append(tau)
        if i % 2 == 0:
            left.axvspan(start, start + steps, color="#eeeeee", linewidth=0)
        left.text(start + steps / 2, 0.93, str(i + 1), ha="center", va="bottom", fontsize=8, color="#666666")
        start += steps
    left.plot(xs, ys, marker="o", markersize=3, color="#e07b00", linewidth=1.3)
    left.set_xlim(0, start)
    left.set_ylim(0.9, 3.6)
    left.set_xlabel("training step (all nine stages; stage number on the axis)")
    left.set_ylabel("tau")
    left.set_title("quick eval during training (4 held-out prompts, 48 tokens)", fontsize=10)

    stages = range(1, len(STAGES) + 1)
    for (name, values), color in zip(HELDOUT.items(), ("#1f77b4", "#2ca02c", "#9467bd")):
        pts = [(s, v) for s, v in zip(stages, values) if v is not None]
        right.plot(*zip(*pts), marker="o", markersize=3.5, color=color, label=f"held out (32 prompts): {name}")
    for (name, values), color in zip(BENCH.items(), ("#1f77b4", "#d62728")):
        pts = [(s, v) for s, v in zip(stages, values) if v is not None]
        right.plot(*zip(*pts), marker="s", markersize=3, linestyle="--", color=color, label=name)
    right.set_xticks(list(stages))
    right.set_xlabel("stage")
    right.set_ylim(1.3, 2.6)
    right.set_title("tau when each stage shipped", fontsize=10)
    right.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0), frameon=False)

    fig.tight_layout(pad=0.4)
    fig.savefig(OUT, dpi=80)
    print(OUT, OUT.stat().st_size, "bytes")


if __name__ == "__main__":
    main()
