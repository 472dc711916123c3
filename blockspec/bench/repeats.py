"""Repeated runs of one benchmark (`blockspec bench --repeat N`): each DFlash runner's speedup over
AR in every run, with their median and range.

On a machine whose speed drifts, or with sampled requests that decode different text each time, one
run's ratio moves by a few hundredths; the adaptive policy's choices move too, since each run
builds its engines and calibrates them afresh. Reporting every run's ratio side by side says how
far a single figure can be trusted. Each run keeps its full report (`run1/`, `run2/`, ...); this
file writes the summary over them.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from blockspec.bench.report import Report, Summary, environment, lossless_lines
from blockspec.bench.runner import Setting


@dataclass(frozen=True)
class Cell:
    """One DFlash runner at one task, concurrency and setting, over the runs (None: not measured
    in that run, or no decode-only time)."""

    setting: str
    task: str
    concurrency: int
    runner: str
    speedups: tuple[float | None, ...]  # end to end, DFlash over AR, per run
    decode_speedups: tuple[float | None, ...]  # prefill left out
    taus: tuple[float | None, ...]

    def as_dict(self) -> dict:
        return {"setting": self.setting, "task": self.task, "concurrency": self.concurrency, "runner": self.runner,
                "speedups": list(self.speedups), "decode_speedups": list(self.decode_speedups), "taus": list(self.taus),
                "median_speedup": _median(self.speedups), "median_decode_speedup": _median(self.decode_speedups)}


def _median(xs: Sequence[float | None]) -> float | None:
    known = [x for x in xs if x is not None]
    return statistics.median(known) if known else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _where(s: Summary) -> tuple[str, str, int]:
    """A run's setting label, task and concurrency: what a DFlash run shares with its AR run."""
    return Setting(s.run.temperature, s.run.thinking).label, s.run.task, s.run.concurrency


def repeat_cells(reports: Sequence[Report]) -> list[Cell]:
    """Per DFlash runner and (setting, task, concurrency), its ratios to AR in each report, in the
    order the runners first appear."""
    keys: list[tuple[str, str, int, str]] = []
    per_run: list[dict[tuple[str, str, int, str], tuple[float | None, float | None, float | None]]] = []
    for report in reports:
        ars = {_where(s): s for s in report.summaries if s.run.method == "ar"}
        found = {}
        for s in report.summaries:
            ar = ars.get(_where(s))
            if s.run.method != "dflash" or ar is None:
                continue
            key = (*_where(s), s.run.runner)
            if key not in keys:
                keys.append(key)
            found[key] = (_ratio(s.tokens_per_s, ar.tokens_per_s),
                          _ratio(s.run.decode_tokens_per_s, ar.run.decode_tokens_per_s), s.mean_tau)
        per_run.append(found)
    empty = (None, None, None)
    return [Cell(*key, *(tuple(run.get(key, empty)[i] for run in per_run) for i in range(3))) for key in keys]


def _x(value: float | None) -> str:
    return "–" if value is None else f"{value:.2f}x"


def _spread(values: Sequence[float | None]) -> str:
    known = [v for v in values if v is not None]
    if not known:
        return "–"
    return f"**{_median(known):.2f}x** ({min(known):.2f}-{max(known):.2f})"


def repeats_markdown(cells: Sequence[Cell], reports: Sequence[Report], meta: dict) -> str:
    """The summary over the runs: which runs passed the lossless check, then one table per setting."""
    n = len(reports)
    lines = [f"# blockspec bench, {n} runs", ""]
    failed = [i + 1 for i, r in enumerate(reports) if not r.lossless_ok]
    if failed:
        lines += [f"## ❌ LOSSLESS CHECK FAILED in run(s) {', '.join(map(str, failed))} (see their reports)", ""]
    else:
        compared = [sum(a.compared for a in r.agreements if a.strict) for r in reports]
        lines += [f"Lossless check: passed in each of the {n} runs ({', '.join(map(str, compared))} greedy DFlash "
                  "outputs, each equal to AR's token for token)." if any(compared)
                  else lossless_lines(reports[0].agreements)[0], ""]
    env = meta.get("environment", {})
    facts = [("target", meta.get("target")), ("compute", meta.get("compute")), ("hardware", env.get("hardware")),
             ("date", env.get("date")), ("prompts", meta.get("prompts")),
             ("command", f"`{meta['command']}`" if meta.get("command") else None)]
    lines += [f"- {k}: {v}" for k, v in facts if v not in (None, "")]
    lines += ["", f"Each run built its engines afresh (so its adaptive policy calibrated anew) and has its full "
              f"report in run1/ ... run{n}/. Cells: DFlash over AR in each run, end to end and decode-only, "
              "then the median over the runs (lowest-highest).", ""]
    for setting in dict.fromkeys(c.setting for c in cells):
        lines += [f"## {setting}", "",
                  "| Task | Concurrency | Runner | speedup per run | median (range) | decode-only per run "
                  "| median (range) | τ per run |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        for c in (c for c in cells if c.setting == setting):
            taus = ", ".join("–" if t is None else f"{t:.2f}" for t in c.taus)
            lines.append(f"| {c.task} | {c.concurrency} | {c.runner} | {', '.join(map(_x, c.speedups))} | "
                         f"{_spread(c.speedups)} | {', '.join(map(_x, c.decode_speedups))} | "
                         f"{_spread(c.decode_speedups)} | {taus} |")
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def plot_repeats(cells: Sequence[Cell], path: Path) -> Path:
    """Each cell's speedup in every run (dots) and its median (a bar), end to end and decode-only."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{c.task} c{c.concurrency}\n{c.runner}" + (f"\n{c.setting}" if c.setting.startswith("Temp") else "")
              for c in cells]
    fig, axes = plt.subplots(1, 2, figsize=(max(10.0, 1.2 * len(cells) + 4), 4.5), squeeze=False)
    for ax, pick, title in zip(axes[0], (lambda c: c.speedups, lambda c: c.decode_speedups),
                               ("DFlash / AR, end to end", "DFlash / AR, decode-only")):
        for i, c in enumerate(cells):
            known = [v for v in pick(c) if v is not None]
            if known:
                ax.bar(i, statistics.median(known), 0.6, color="C0", alpha=0.35)
                ax.plot([i] * len(known), known, "o", color="C0", markersize=4)
        ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.set_xticks(range(len(cells)))
        ax.set_xticklabels(labels, fontsize=7)
        ax.set_title(f"{title}: each run (dots), median (bar)", fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_repeats(reports: Sequence[Report], out_dir: str | Path, meta: dict) -> dict[str, Path]:
    """Writes report.md, results.json and plot.png over the runs into out_dir; returns their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cells = repeat_cells(reports)
    meta = {"environment": environment(), **meta}
    paths = {"markdown": out / "report.md", "json": out / "results.json", "plot": out / "plot.png"}
    paths["markdown"].write_text(repeats_markdown(cells, reports, meta))
    paths["json"].write_text(json.dumps({
        "meta": meta, "runs": len(reports),
        "lossless_passed": [r.lossless_ok for r in reports],
        "run_reports": [str(r.paths["markdown"]) for r in reports],
        "cells": [c.as_dict() for c in cells]}, indent=1))
    plot_repeats(cells, paths["plot"])
    return paths


__all__ = ["Cell", "repeat_cells", "repeats_markdown", "plot_repeats", "write_repeats"]
