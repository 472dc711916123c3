"""Benchmark report: summaries, the greedy lossless check, Markdown, JSON and a PNG plot.

Throughput is end to end: generated tokens over the wall time of a whole run (prefill included),
so at concurrency > 1 it is the batch's aggregate rate. Decode-only throughput (a second table)
leaves prefill out: tokens after each request's first over the run's time less its prefill
passes, each pass once (RunRecord). tau is committed tokens per target verification pass
(accepted + 1); the first token, which comes from prefill, is not a pass.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import statistics
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from blockspec.bench.runner import RequestRecord, RunRecord, Setting

SPECULATIVE = ("dflash", "reference", "pld")
BASELINES = ("hf", "pld", "reference")


# ---- summaries -------------------------------------------------------------------------------


@dataclass
class Summary:
    """Aggregates of one run (runner x task x concurrency x setting)."""

    run: RunRecord
    mean_tau: float | None
    histogram: dict[int, int]  # acceptance length -> number of steps
    acceptance_by_position: list[float]  # P(draft position k accepted), k = 1..B-1 (a tree's: depth k)
    # token trees: steps that verified one, and per rank among siblings the accepted nodes per such step
    tree_steps: int = 0
    acceptance_by_rank: list[float] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.run.tokens_per_s

    def as_dict(self) -> dict:
        return {
            **self.run.as_dict(),
            "mean_tau": None if self.mean_tau is None else round(self.mean_tau, 4),
            "acceptance_histogram": {str(k): v for k, v in sorted(self.histogram.items())},
            "acceptance_by_position": [round(x, 4) for x in self.acceptance_by_position],
            "tree_steps": self.tree_steps,
            "acceptance_by_rank": [round(x, 4) for x in self.acceptance_by_rank],
            # per request, wall clock: less sensitive than the pooled rate to a burst of outside load
            "median_request_tokens_per_s": round(statistics.median(r.tokens_per_s for r in self.run.records), 3)
            if self.run.records else None,
        }


def summarize(run: RunRecord) -> Summary:
    lengths: list[int] = []
    steps = 0
    tokens_after_first = 0
    by_pos: list[int] = []
    by_rank: list[int] = []
    tree_steps = 0
    for r in run.records:
        tree_steps += r.tree_steps or 0
        for k, n in enumerate(r.accepted_by_rank or []):
            by_rank.extend([0] * (k + 1 - len(by_rank)))
            by_rank[k] += n
        if r.acceptance_lengths is not None:
            lengths += r.acceptance_lengths
        if r.accepted_by_position:
            by_pos = [a + b for a, b in zip(by_pos, r.accepted_by_position)] if by_pos else list(r.accepted_by_position)
        if r.steps:
            steps += r.steps
            tokens_after_first += max(0, r.generated_tokens - 1)
    if lengths:
        tau = sum(lengths) / len(lengths)
    elif steps and run.method in SPECULATIVE:
        tau = tokens_after_first / steps
    else:
        tau = None
    n_steps = len(lengths)
    rates = [a / n_steps for a in by_pos] if n_steps else []
    return Summary(run, tau, dict(Counter(lengths)), rates, tree_steps,
                   [n / tree_steps for n in by_rank] if tree_steps else [])


# ---- greedy lossless check ---------------------------------------------------------------------


@dataclass
class Mismatch:
    runner: str
    task: str
    concurrency: int
    setting: str
    sample_id: str
    turn: int
    first_difference: int  # index of the first differing generated token
    ar_tokens: int
    other_tokens: int


@dataclass
class Agreement:
    """Greedy outputs of one runner compared token for token with our AR outputs."""

    runner: str
    method: str
    compared: int = 0
    mismatches: list[Mismatch] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.mismatches

    @property
    def strict(self) -> bool:
        """Our DFlash must match AR exactly (lossless); other implementations are informational."""
        return self.method == "dflash"


def _first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def check_greedy(runs: Sequence[RunRecord]) -> list[Agreement]:
    """Compares every greedy non-AR run with the AR run on the same task and setting (same
    concurrency; batch-1 runners against the lowest AR concurrency)."""
    ar = {(r.task, r.thinking, r.concurrency): r for r in runs if r.method == "ar" and r.temperature == 0}
    found: dict[str, Agreement] = {}
    for run in runs:
        if run.method == "ar" or run.temperature != 0:
            continue
        base = ar.get((run.task, run.thinking, run.concurrency))
        if base is None:
            levels = sorted(c for (t, th, c) in ar if t == run.task and th == run.thinking)
            base = ar[(run.task, run.thinking, levels[0])] if levels else None
        if base is None:
            continue
        agreement = found.setdefault(run.runner, Agreement(run.runner, run.method))
        reference = {(r.sample_id, r.turn): r for r in base.records}
        setting = Setting(run.temperature, run.thinking).key
        for rec in run.records:
            expected = reference.get((rec.sample_id, rec.turn))
            if expected is None:
                continue
            agreement.compared += 1
            diff = _first_difference(expected.token_ids, rec.token_ids)
            if diff is not None:
                agreement.mismatches.append(Mismatch(run.runner, run.task, run.concurrency, setting, rec.sample_id,
                                                     rec.turn, diff, len(expected.token_ids), len(rec.token_ids)))
    return list(found.values())


# ---- environment ---------------------------------------------------------------------------------


def hardware_description() -> str:
    """CPU model and core count, plus the GPU if torch sees one."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    text = f"{os.cpu_count()} CPU cores ({cpu})"
    try:
        import torch

        if torch.cuda.is_available():
            return text + f", GPU {torch.cuda.get_device_name(0)}"
    except Exception:  # no torch or no driver: CPU only
        pass
    return text + ", no GPU"


def environment() -> dict:
    import torch
    import transformers

    return {
        "date": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "hardware": hardware_description(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "load_average_1m": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
    }


# ---- Markdown ------------------------------------------------------------------------------------


def _fmt_rate(x: float) -> str:
    return f"{x:.1f}" if x >= 10 else f"{x:.2f}"


def _fmt_tau(x: float | None) -> str:
    return "–" if x is None else f"{x:.2f}"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return lines


def _settings(summaries: Sequence[Summary]) -> list[Setting]:
    seen: list[Setting] = []
    for s in summaries:
        st = Setting(s.run.temperature, s.run.thinking)
        if st not in seen:
            seen.append(st)
    return seen


def _ordered(values: Sequence) -> list:
    return list(dict.fromkeys(values))


def _column(runner: str) -> str:
    """'dflash b16' -> 'DFlash b16', 'dflash+lookup auto<=b16' -> 'DFlash+lookup auto<=b16'."""
    return "DFlash" + runner.removeprefix("dflash")


def _main_table(summaries: Sequence[Summary]) -> list[str]:
    """`Task | Concurrency | AR | [PLD (speedup)] | DFlash bN (speedup) | tau bN` (one pair per
    block size). Prompt lookup, a training-free speculative baseline, runs at batch 1 only
    (transformers supports no more), so its column is empty at higher concurrency."""
    by = {(s.run.task, s.run.concurrency, s.run.runner): s for s in summaries}
    dflash = _ordered(s.run.runner for s in summaries if s.run.method == "dflash")
    pld = _ordered(s.run.runner for s in summaries if s.run.method == "pld")
    tasks = _ordered(s.run.task for s in summaries)
    levels = sorted({s.run.concurrency for s in summaries if s.run.method in ("ar", "dflash")})
    header = ["Task", "Concurrency", "AR"] + [f"PLD ({n}) (speedup)" if len(pld) > 1 else "PLD (speedup)" for n in pld]
    for name in dflash:
        header += [f"{_column(name)} (speedup)", f"τ {name.removeprefix('dflash').strip()}"]
    rows = []
    for task in tasks + ["all"]:
        for c in levels:
            if task == "all":
                runs = {n: [s for s in summaries if s.run.runner == n and s.run.concurrency == c]
                        for n in ["ar", *pld, *dflash]}
                if len(tasks) < 2 or not runs["ar"]:
                    continue
                rate = {n: _pooled_rate(v) for n, v in runs.items()}
                tau = {n: _pooled_tau(v) for n, v in runs.items()}
                label = "**all**"
            else:
                cells = {n: by.get((task, c, n)) for n in ["ar", *pld, *dflash]}
                if cells["ar"] is None and not any(cells.values()):
                    continue
                rate = {n: (v.tokens_per_s if v else None) for n, v in cells.items()}
                tau = {n: (v.mean_tau if v else None) for n, v in cells.items()}
                label = task
            ar = rate["ar"]
            row = [label, str(c), _fmt_rate(ar) if ar else "–"]
            for n in pld:
                r = rate[n]
                row.append("–" if not r else f"{_fmt_rate(r)}" + (f" ({r / ar:.2f}x)" if ar else ""))
            for n in dflash:
                r = rate[n]
                if r is None:
                    row += ["–", "–"]
                    continue
                speed = f" ({r / ar:.2f}x)" if ar else ""
                row += [f"{_fmt_rate(r)}{speed}", _fmt_tau(tau[n])]
            rows.append(row)
    return _table(header, rows)


def _decode_table(summaries: Sequence[Summary]) -> list[str]:
    """`Task | Concurrency | AR | DFlash X (speedup) ...` in decode-only tokens/s, for the runners
    that can tell their prefill time (our AR and DFlash); empty when none can."""
    known = [s for s in summaries if s.run.method in ("ar", "dflash") and s.run.decode_s is not None]
    if not known:
        return []
    names = _ordered(s.run.runner for s in known if s.run.method == "ar")[:1]
    names += _ordered(s.run.runner for s in known if s.run.method == "dflash")
    tasks = _ordered(s.run.task for s in known)
    levels = sorted({s.run.concurrency for s in known})
    by = {(s.run.task, s.run.concurrency, s.run.runner): s.run for s in known}
    header = ["Task", "Concurrency"] + ["AR" if n == "ar" else f"{_column(n)} (speedup)" for n in names]
    rows = []
    for task in tasks + (["all"] if len(tasks) > 1 else []):
        for c in levels:
            runs = {n: [by[(t, c, n)] for t in tasks if (t, c, n) in by] if task == "all"
                    else [by[(task, c, n)]] if (task, c, n) in by else [] for n in names}
            if not any(runs.values()):
                continue
            rate = {n: _pooled_decode_rate(v) for n, v in runs.items()}
            ar = rate.get("ar")
            row = ["**all**" if task == "all" else task, str(c)]
            for n in names:
                r = rate[n]
                if r is None:
                    row.append("–")
                elif n == "ar":
                    row.append(_fmt_rate(r))
                else:
                    row.append(_fmt_rate(r) + (f" ({r / ar:.2f}x)" if ar else ""))
            rows.append(row)
    return _table(header, rows)


def _pooled_decode_rate(runs: Sequence[RunRecord]) -> float | None:
    """Decode-only tokens over decode-only time of several runs together (None: none known)."""
    if not runs:
        return None
    seconds = sum(r.decode_s for r in runs)
    return sum(r.decode_tokens for r in runs) / seconds if seconds > 0 else 0.0


def _pooled_rate(summaries: Sequence[Summary]) -> float:
    tokens = sum(s.run.generated_tokens for s in summaries)
    wall = sum(s.run.wall_s for s in summaries)
    return tokens / wall if wall > 0 else 0.0


def _pooled_tau(summaries: Sequence[Summary]) -> float | None:
    pairs = [(s.mean_tau, sum(len(r.acceptance_lengths or []) for r in s.run.records)) for s in summaries]
    pairs = [(t, n) for t, n in pairs if t is not None and n]
    total = sum(n for _, n in pairs)
    return sum(t * n for t, n in pairs) / total if total else None


def _baseline_table(summaries: Sequence[Summary], agreements: dict[str, Agreement]) -> list[str]:
    """Each baseline at concurrency 1 against our AR and DFlash on the same task."""
    base = [s for s in summaries if s.run.method in BASELINES]
    if not base:
        return []
    ours = {(s.run.task, s.run.runner): s for s in summaries
            if s.run.method in ("ar", "dflash") and s.run.concurrency == 1}
    dflash = _ordered(s.run.runner for s in summaries if s.run.method == "dflash")
    header = ["Task", "Baseline", "tokens/s", "τ", "AR (ours) ÷ baseline"]
    header += [f"{_column(n)} (ours) ÷ baseline" for n in dflash]
    header += ["same tokens as AR"]
    rows = []
    for s in base:
        row = [s.run.task, s.run.runner, _fmt_rate(s.tokens_per_s), _fmt_tau(s.mean_tau)]
        for n in ["ar", *dflash]:
            mine = ours.get((s.run.task, n))
            row.append(f"{mine.tokens_per_s / s.tokens_per_s:.2f}x" if mine and s.tokens_per_s else "–")
        row.append(_agreement_cell(s.run, agreements.get(s.run.runner)))
        rows.append(row)
    return _table(header, rows)


def _agreement_cell(run: RunRecord, agreement: Agreement | None) -> str:
    if run.temperature != 0 or agreement is None:
        return "–"
    bad = sum(1 for m in agreement.mismatches if m.task == run.task and m.concurrency == run.concurrency)
    n = sum(1 for _ in run.records)
    return f"{n - bad}/{n}"


def _acceptance_tables(summaries: Sequence[Summary]) -> list[str]:
    spec = [s for s in summaries if s.run.method == "dflash" and s.run.concurrency == min(
        x.run.concurrency for x in summaries if x.run.method == "dflash")]
    if not spec:
        return []
    width = max(s.run.block_size for s in spec)
    lines = ["Acceptance length per step (accepted + 1), share of steps:", ""]
    header = ["Task", "Runner", "τ", "steps"] + [str(k) for k in range(1, width + 1)]
    rows = []
    for s in spec:
        total = sum(s.histogram.values())
        cells = [f"{100 * s.histogram.get(k, 0) / total:.0f}%" if total and k <= s.run.block_size else ""
                 for k in range(1, width + 1)]
        rows.append([s.run.task, s.run.runner, _fmt_tau(s.mean_tau), str(total)] + cells)
    lines += _table(header, rows)
    lines += ["", "Acceptance rate by block position (share of steps whose draft token k was accepted):", ""]
    header = ["Task", "Runner"] + [f"k={k}" for k in range(1, width)]
    rows = [[s.run.task, s.run.runner] + [f"{x:.2f}" for x in s.acceptance_by_position]
            + [""] * (width - 1 - len(s.acceptance_by_position)) for s in spec]
    lines += _table(header, rows)
    trees = [s for s in spec if s.tree_steps]
    if trees:
        ranks = max(len(s.acceptance_by_rank) for s in trees)
        lines += ["", "Token trees: accepted nodes per tree step by rank among their siblings (rank 1: the "
                  "drafter's first choice; a chain accepts rank 1 only):", ""]
        header = ["Task", "Runner", "tree steps"] + [f"rank {k}" for k in range(1, ranks + 1)]
        rows = [[s.run.task, s.run.runner, str(s.tree_steps)] + [f"{x:.2f}" for x in s.acceptance_by_rank]
                + [""] * (ranks - len(s.acceptance_by_rank)) for s in trees]
        lines += _table(header, rows)
    return lines


def _block_size_table(summaries: Sequence[Summary]) -> list[str]:
    runs = [s.run for s in summaries if " auto<=" in s.run.runner and s.run.block_sizes]
    if not runs:
        return []
    sizes = sorted({n for r in runs for n in r.block_sizes})
    rows = []
    for r in runs:
        total = sum(r.block_sizes.values())
        rows.append([r.task, str(r.concurrency), r.runner, str(total)]
                    + [f"{100 * r.block_sizes.get(n, 0) / total:.0f}%" for n in sizes])
    return _table(["Task", "Concurrency", "Runner", "steps"] + [str(n) for n in sizes], rows)


def lossless_lines(agreements: Sequence[Agreement]) -> list[str]:
    strict = [a for a in agreements if a.strict]
    if not strict:
        return ["Lossless check: no greedy DFlash run to compare with AR."]
    bad = [m for a in strict for m in a.mismatches]
    compared = sum(a.compared for a in strict)
    if not bad:
        return [f"Lossless check: passed. All {compared} greedy DFlash outputs equal the AR outputs token for token."]
    lines = [
        f"## ❌ LOSSLESS CHECK FAILED: {len(bad)} of {compared} greedy DFlash outputs differ from AR",
        "",
        "Greedy speculative decoding must reproduce plain decoding exactly. First differences:",
        "",
    ]
    rows = [[m.runner, m.task, str(m.concurrency), m.sample_id, str(m.turn), str(m.first_difference),
             str(m.ar_tokens), str(m.other_tokens)] for m in bad[:20]]
    header = ["Runner", "Task", "Concurrency", "Sample", "Turn", "First diff", "AR tokens", "DFlash tokens"]
    lines += _table(header, rows)
    if len(bad) > 20:
        lines.append(f"... and {len(bad) - 20} more (see results.json)")
    return lines


def _loads(start: float | None, end: float | None) -> str | None:
    if start is None and end is None:
        return None
    return f"{start if start is not None else '?'} / {end if end is not None else '?'} (other processes share the CPU)"


def markdown(summaries: Sequence[Summary], agreements: Sequence[Agreement], meta: dict) -> str:
    env = meta.get("environment", {})
    lines = ["# blockspec bench", ""]
    lines += lossless_lines(agreements) + [""]
    facts = [
        ("target", meta.get("target")), ("drafter", meta.get("drafter")), ("backend", meta.get("backend")),
        ("dtype", meta.get("dtype")), ("compute", meta.get("compute")), ("drafter's compute", meta.get("drafter_compute")),
        ("packed weights", meta.get("packed_weights")),
        ("device", meta.get("device")), ("hardware", env.get("hardware")), ("date", env.get("date")),
        ("torch / transformers", f"{env.get('torch')} / {env.get('transformers')}" if env else None),
        ("torch threads", env.get("torch_threads")),
        ("load average (1 min) at start / end", _loads(meta.get("load_average_at_start"), env.get("load_average_1m"))),
        ("max new tokens", meta.get("max_new_tokens")),
        ("context", f"other problems in front of each prompt, to at least {meta['context_tokens']} tokens"
         if meta.get("context_tokens") else None),
        ("top-p of the sampled settings", meta.get("top_p") if meta.get("top_p", 1.0) != 1.0 else None),
        ("prompts", meta.get("prompts")),
        ("command", f"`{meta['command']}`" if meta.get("command") else None),
    ]
    lines += [f"- {k}: {v}" for k, v in facts if v not in (None, "")]
    for note in meta.get("notes", []):
        lines.append(f"- note: {note}")
    per = ("second of process CPU time (`--clock cpu`)" if meta.get("clock") == "cpu"
           else "second of wall-clock time")
    lines += ["", f"Cells are end-to-end output tokens per {per}, prefill included; speedup is DFlash ÷ AR "
              "(our decoder, block size 1, same target); τ is tokens committed per verification pass. "
              "Decode-only tables leave prefill out: the tokens after each request's first (which comes "
              "from its prefill) over the run's time less the time of its prefill passes, on the same "
              "clock. At concurrency > 1 a prefill pass stalls every request in flight, so it is taken "
              "out once, however many requests it admitted: the figure is the rate of the decode steps "
              "alone. Only runners that time their prefill passes (ours) have one.", ""]
    by_agreement = {a.runner: a for a in agreements}
    for setting in _settings(summaries):
        part = [s for s in summaries if Setting(s.run.temperature, s.run.thinking) == setting]
        lines += [f"## {setting.label}", ""] + _main_table(part) + [""]
        decode = _decode_table(part)
        if decode:
            lines += ["### Decode-only (prefill left out)", ""]
            lines += decode + [""]
        base = _baseline_table(part, by_agreement)
        if base:
            lines += ["### Against baselines (batch 1)", ""] + base + [""]
        acc = _acceptance_tables(part)
        if acc:
            lines += ["### Acceptance", ""] + acc + [""]
        used = _block_size_table(part)
        if used:
            lines += ["### Block sizes the adaptive runner chose (share of steps)", ""] + used + [""]
    return "\n".join(lines).rstrip() + "\n"


# ---- plot ----------------------------------------------------------------------------------------


def plot(summaries: Sequence[Summary], path: Path) -> Path:
    """tokens/s and tau per task (lowest concurrency), one row of panels per setting."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    settings = _settings(summaries)
    fig, axes = plt.subplots(len(settings), 2, figsize=(12, 4 * len(settings)), squeeze=False)
    for row, setting in zip(axes, settings):
        part = [s for s in summaries if Setting(s.run.temperature, s.run.thinking) == setting]
        low = min(s.run.concurrency for s in part)
        part = [s for s in part if s.run.concurrency == low or s.run.method in BASELINES]
        tasks = _ordered(s.run.task for s in part)
        runners = _ordered(s.run.runner for s in part)
        by = {(s.run.task, s.run.runner): s for s in part}
        width = 0.8 / max(1, len(runners))
        for i, name in enumerate(runners):
            xs = [t + (i - (len(runners) - 1) / 2) * width for t in range(len(tasks))]
            rates = [by[(task, name)].tokens_per_s if (task, name) in by else 0.0 for task in tasks]
            row[0].bar(xs, rates, width, label=name, color=f"C{i}")  # one colour per runner in both panels
            taus = [by[(task, name)].mean_tau if (task, name) in by else None for task in tasks]
            if any(t is not None for t in taus):
                row[1].bar(xs, [t or 0.0 for t in taus], width, label=name, color=f"C{i}")
        for ax, title in zip(row, (f"output tokens/s (concurrency {low}; baselines batch 1)", "mean τ")):
            ax.set_xticks(range(len(tasks)))
            ax.set_xticklabels(tasks)
            ax.set_title(f"{setting.label}: {title}", fontsize=10)
            ax.grid(axis="y", alpha=0.3)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=8)
        row[1].axhline(1.0, color="grey", linewidth=0.8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ---- files ---------------------------------------------------------------------------------------


def results_json(runs: Sequence[RunRecord], summaries: Sequence[Summary], agreements: Sequence[Agreement],
                 meta: dict) -> dict:
    return {
        "meta": meta,
        "lossless": {
            "passed": all(a.ok for a in agreements if a.strict),
            "checks": [
                {"runner": a.runner, "method": a.method, "strict": a.strict, "compared": a.compared,
                 "mismatches": [vars(m) for m in a.mismatches]}
                for a in agreements
            ],
        },
        "summaries": [s.as_dict() for s in summaries],
        "requests": [r.as_dict() for run in runs for r in run.records],
    }


@dataclass
class Report:
    markdown: str
    summaries: list[Summary]
    agreements: list[Agreement]
    paths: dict[str, Path]

    @property
    def lossless_ok(self) -> bool:
        return all(a.ok for a in self.agreements if a.strict)


def write_report(runs: Sequence[RunRecord], out_dir: str | Path, meta: dict) -> Report:
    """Writes report.md, results.json and plot.png into out_dir."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"environment": environment(), **meta}
    summaries = [summarize(r) for r in runs]
    agreements = check_greedy(runs)
    text = markdown(summaries, agreements, meta)
    paths = {"markdown": out / "report.md", "json": out / "results.json", "plot": out / "plot.png"}
    paths["markdown"].write_text(text)
    paths["json"].write_text(json.dumps(results_json(runs, summaries, agreements, meta), indent=1))
    plot(summaries, paths["plot"])
    return Report(text, summaries, agreements, paths)


__all__ = ["Agreement", "Mismatch", "Report", "RequestRecord", "Summary", "check_greedy", "markdown", "plot",
           "summarize", "write_report"]
