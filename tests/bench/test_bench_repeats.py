"""`blockspec bench --repeat N`: every run's report, and each DFlash runner's speedup over AR in
every run with its median and range."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from blockspec.bench.repeats import repeat_cells, repeats_markdown
from blockspec.bench.report import summarize
from blockspec.bench.runner import RequestRecord, RunRecord
from blockspec.cli import main


def _record(runner: str, method: str, tokens: int, wall: float, prefill: float, task: str = "gsm8k",
            temperature: float = 0.0) -> RunRecord:
    """A run of two requests of tokens / 2 tokens each."""
    block = 1 if method == "ar" else 4
    requests = [RequestRecord(runner, method, block, task, 1, temperature, None, f"s{i}", 0, 10, tokens // 2,
                              "length", wall / 2, prefill / 2, tokens / wall, None, None, None, None, [], "")
                for i in range(2)]
    return RunRecord(runner, method, block, task, 1, temperature, None, requests=2, generated_tokens=tokens,
                     wall_s=wall, prefill_s=prefill, records=requests)


def _report(records: list[RunRecord], ok: bool = True) -> SimpleNamespace:
    strict = SimpleNamespace(strict=True, compared=2, ok=ok)
    return SimpleNamespace(summaries=[summarize(r) for r in records], agreements=[strict], lossless_ok=ok,
                           paths={"markdown": Path("report.md")})


def test_each_cell_holds_every_runs_ratio_to_ar_of_its_own_run() -> None:
    first = _report([_record("ar", "ar", 100, 2.0, 0.5), _record("dflash b4", "dflash", 100, 1.0, 0.5)])
    second = _report([_record("ar", "ar", 100, 4.0, 1.0), _record("dflash b4", "dflash", 100, 2.5, 1.0),
                      _record("ar", "ar", 50, 1.0, 0.0, task="humaneval")])
    cells = repeat_cells([first, second])
    assert [(c.task, c.runner) for c in cells] == [("gsm8k", "dflash b4")]  # humaneval has no DFlash run
    (cell,) = cells
    assert cell.speedups == pytest.approx((2.0, 1.6))
    # decode-only: 98 tokens (a token of each of 2 requests comes from its prefill) over the time less prefill
    assert cell.decode_speedups == pytest.approx(((98 / 0.5) / (98 / 1.5), (98 / 1.5) / (98 / 3.0)))
    md = repeats_markdown(cells, [first, second], {"command": "blockspec bench --repeat 2"})
    assert "Lossless check: passed in each of the 2 runs (2, 2 greedy DFlash outputs" in md
    assert "| gsm8k | 1 | dflash b4 | 2.00x, 1.60x | **1.80x** (1.60-2.00) | 3.00x, 2.00x | **2.50x** (2.00-3.00) |" in md


def test_a_run_missing_a_cell_shows_a_gap_and_a_failed_run_is_named() -> None:
    full = [_record("ar", "ar", 100, 2.0, 0.0), _record("dflash b4", "dflash", 100, 1.0, 0.0)]
    cells = repeat_cells([_report(full), _report(full[:1], ok=False), _report(full)])
    assert cells[0].speedups == (2.0, None, 2.0)
    md = repeats_markdown(cells, [_report(full), _report(full[:1], ok=False), _report(full)], {})
    assert "LOSSLESS CHECK FAILED in run(s) 2" in md
    assert "| 2.00x, –, 2.00x | **2.00x** (2.00-2.00) |" in md


def test_bench_repeat_writes_every_runs_report_and_the_spread(tmp_path, tiny_model_dir, tiny_drafter_dir, capsys,
                                                             monkeypatch):
    import blockspec.engine as engine_module

    built = []

    class Counted(engine_module.Engine):
        def __init__(self, *a, **k):
            built.append(1)
            super().__init__(*a, **k)

    monkeypatch.setattr(engine_module, "Engine", Counted)
    out = tmp_path / "out"
    rc = main(["bench", "--target", str(tiny_model_dir), "--drafter", str(tiny_drafter_dir), "--limit", "1",
               "--max-new-tokens", "6", "--no-progress", "--no-warmup", "--datasets", "gsm8k", "--adaptive-only",
               "--tree-nodes", "0", "--repeat", "3", "--out", str(out)])
    assert rc == 0, capsys.readouterr().err
    assert len(built) == 6  # AR's engine and the adaptive runner's, built afresh in each of the 3 runs
    data = json.loads((out / "results.json").read_text())
    assert data["runs"] == 3 and data["lossless_passed"] == [True, True, True]
    assert "--repeat 3" in data["meta"]["command"]
    (cell,) = data["cells"]
    for k, speedup in enumerate(cell["speedups"]):  # each run's ratio, as that run's own report has it
        run = json.loads((out / f"run{k + 1}" / "results.json").read_text())
        rate = {s["runner"]: s["tokens_per_s"] for s in run["summaries"]}
        assert speedup == pytest.approx(rate[cell["runner"]] / rate["ar"], rel=1e-3)  # the json rounds rates
        assert (out / f"run{k + 1}" / "report.md").exists()
    md = (out / "report.md").read_text()
    assert "# blockspec bench, 3 runs" in md and f"| gsm8k | 1 | {cell['runner']} |" in md
    assert (out / "plot.png").stat().st_size > 1000


def test_bench_repeat_must_be_positive(tmp_path, tiny_model_dir, tiny_drafter_dir, capsys):
    rc = main(["bench", "--target", str(tiny_model_dir), "--drafter", str(tiny_drafter_dir), "--repeat", "0",
               "--out", str(tmp_path)])
    assert rc != 0
    assert "--repeat must be >= 1" in capsys.readouterr().err
