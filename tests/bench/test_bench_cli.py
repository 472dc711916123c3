"""`blockspec bench` end to end on a tiny model and the shipped data sets."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from blockspec.cli import main


def _bench(tmp_path: Path, model: Path, drafter: Path, *extra: str) -> tuple[int, Path]:
    out = tmp_path / "out"
    argv = ["bench", "--target", str(model), "--drafter", str(drafter), "--limit", "1", "--max-new-tokens", "6",
            "--no-progress", "--no-warmup", "--out", str(out), *extra]
    if "--tree-nodes" not in extra:  # these tests name chain runners; trees are the default
        argv += ["--tree-nodes", "0"]
    return main(argv), out


def test_bench_command_writes_report(tmp_path, tiny_model_dir, tiny_drafter_dir, capsys):
    pytest.importorskip("blockspec.datasets")
    from blockspec.bench.baselines import reference_available

    baselines = "hf,reference" if reference_available() else "hf"
    rc, out = _bench(tmp_path, tiny_model_dir, tiny_drafter_dir, "--datasets", "gsm8k,mt-bench",
                     "--baselines", baselines, "--block-sizes", "2,4", "--no-adaptive", "--lookup", "off",
                     "--thinking", "both", "--clock", "cpu")
    assert rc == 0, capsys.readouterr().err
    md = (out / "report.md").read_text()
    assert "| Task | Concurrency | AR | DFlash b2 (speedup) | τ b2 | DFlash b4 (speedup) | τ b4 |" in md
    assert "## Greedy (temperature 0), thinking on" in md and "## Greedy (temperature 0), thinking off" in md
    # per setting, a main-table row and a decode-only row (CPU time, as the main table)
    assert md.count("| gsm8k | 1 | ") == 4 and md.count("| mt-bench | 1 | ") == 4
    assert md.count("| Task | Concurrency | AR | DFlash b2 (speedup) | DFlash b4 (speedup) |") == 2
    assert "| gsm8k | hf generate |" in md
    assert "tokens per second of process CPU time" in md
    if reference_available():  # the reference package on the same weights, greedy: same tokens as AR
        assert "| gsm8k | reference b4 |" in md and "| mt-bench | reference b2 |" in md
    data = json.loads((out / "results.json").read_text())
    assert data["lossless"]["passed"] is True
    assert data["meta"]["command"].startswith("blockspec bench")
    for s in data["summaries"]:  # ours time their prefill passes; the baselines cannot
        assert (s["decode_tokens_per_s"] is not None) == (s["method"] in ("ar", "dflash")), s["runner"]
    turns = sorted({r["turn"] for r in data["requests"] if r["task"] == "mt-bench"})
    assert turns == [0, 1]
    assert (out / "plot.png").stat().st_size > 1000


def test_bench_adaptive_only_runs_plain_and_adaptive(tmp_path, tiny_model_dir, tiny_drafter_dir, capsys):
    rc, out = _bench(tmp_path, tiny_model_dir, tiny_drafter_dir, "--datasets", "gsm8k", "--block-sizes", "4",
                     "--adaptive-only", "--lookup", "both", "--concurrency", "1,2")
    assert rc == 0, capsys.readouterr().err
    data = json.loads((out / "results.json").read_text())
    # --lookup both: each DFlash runner without and with n-gram lookup proposals
    assert sorted({s["runner"] for s in data["summaries"]}) == ["ar", "dflash auto<=b4", "dflash+lookup auto<=b4"]
    assert sorted({s["concurrency"] for s in data["summaries"]}) == [1, 2]
    assert data["lossless"]["passed"] is True and "--adaptive-only" in data["meta"]["command"]
    assert "--lookup both" in data["meta"]["command"]
    for s in data["summaries"]:  # engine steps per block size, recorded for every run
        assert sum(s["block_sizes"].values()) > 0
        assert set(s["block_sizes"]) == {"1"} if s["runner"] == "ar" else set(s["block_sizes"]) <= {"1", "2", "3", "4"}
    md = (out / "report.md").read_text()
    assert ("| Task | Concurrency | AR | DFlash auto<=b4 (speedup) | τ auto<=b4 | DFlash+lookup auto<=b4 (speedup) "
            "| τ +lookup auto<=b4 |") in md
    assert "### Block sizes the adaptive runner chose (share of steps)" in md and "| gsm8k | 2 | dflash auto<=b4 |" in md
    assert "| gsm8k | 2 | dflash+lookup auto<=b4 |" in md


def test_bench_defaults_decode_as_every_verb(tmp_path, tiny_model_dir, tiny_drafter_dir, capsys):
    """By default bench measures what generate/serve/demo run: the adaptive policy with lookup."""
    rc, out = _bench(tmp_path, tiny_model_dir, tiny_drafter_dir, "--datasets", "gsm8k")
    assert rc == 0, capsys.readouterr().err
    data = json.loads((out / "results.json").read_text())
    assert sorted({s["runner"] for s in data["summaries"]}) == ["ar", "dflash+lookup auto<=b4"]
    assert "--adaptive --lookup on" in data["meta"]["command"]
    rc, out = _bench(tmp_path, tiny_model_dir, tiny_drafter_dir, "--datasets", "gsm8k", "--block-sizes", "4")
    assert rc == 0, capsys.readouterr().err  # fixed blocks on request, beside the adaptive runner
    data = json.loads((out / "results.json").read_text())
    assert sorted({s["runner"] for s in data["summaries"]}) == ["ar", "dflash+lookup auto<=b4", "dflash+lookup b4"]
    rc, out = _bench(tmp_path, tiny_model_dir, tiny_drafter_dir, "--datasets", "gsm8k", "--no-adaptive")
    assert rc == 0, capsys.readouterr().err  # fixed blocks alone, at the drafter's block size
    data = json.loads((out / "results.json").read_text())
    assert sorted({s["runner"] for s in data["summaries"]}) == ["ar", "dflash+lookup b4"]


def test_bench_lookup_off_runs_the_drafter_alone(tmp_path, tiny_model_dir, tiny_drafter_dir, capsys):
    rc, out = _bench(tmp_path, tiny_model_dir, tiny_drafter_dir, "--datasets", "gsm8k", "--block-sizes", "4",
                     "--no-adaptive", "--lookup", "off")
    assert rc == 0, capsys.readouterr().err
    data = json.loads((out / "results.json").read_text())
    assert sorted({s["runner"] for s in data["summaries"]}) == ["ar", "dflash b4"]


def test_bench_tree_nodes_runs_chains_and_trees(tmp_path, tiny_model_dir, tiny_drafter_dir, capsys):
    """--tree-nodes N: each DFlash runner as chains and as trees of N (the HF backend verifies
    trees), both lossless; the report counts tree steps and acceptance by rank."""
    rc, out = _bench(tmp_path, tiny_model_dir, tiny_drafter_dir, "--datasets", "gsm8k", "--block-sizes", "4",
                     "--no-adaptive", "--lookup", "off", "--backend", "hf", "--tree-nodes", "3")
    assert rc == 0, capsys.readouterr().err
    data = json.loads((out / "results.json").read_text())
    assert sorted({s["runner"] for s in data["summaries"]}) == ["ar", "dflash b4", "dflash b4 tree3"]
    assert data["lossless"]["passed"] is True and "--tree-nodes 3" in data["meta"]["command"]
    by_runner = {s["runner"]: s for s in data["summaries"]}
    assert by_runner["dflash b4 tree3"]["tree_steps"] > 0 and by_runner["dflash b4"]["tree_steps"] == 0
    assert "Token trees: accepted nodes per tree step by rank" in (out / "report.md").read_text()


def test_bench_ragged_verify_both_adds_a_ragged_adaptive_runner(tmp_path, tiny_model_dir, tiny_drafter_dir, capsys):
    rc, out = _bench(tmp_path, tiny_model_dir, tiny_drafter_dir, "--datasets", "gsm8k", "--block-sizes", "4",
                     "--adaptive-only", "--lookup", "off", "--ragged-verify", "both", "--concurrency", "2",
                     "--limit", "2")
    assert rc == 0, capsys.readouterr().err
    data = json.loads((out / "results.json").read_text())
    assert sorted({s["runner"] for s in data["summaries"]}) == ["ar", "dflash auto<=b4", "dflash auto<=b4 ragged"]
    assert data["lossless"]["passed"] is True and "--ragged-verify both" in data["meta"]["command"]
    rc, _ = _bench(tmp_path, tiny_model_dir, tiny_drafter_dir, "--ragged-verify", "on", "--no-adaptive")
    assert rc == 2 and "drop --no-adaptive" in capsys.readouterr().err


def test_bench_top_p_is_recorded_and_rerunnable(tmp_path, tiny_model_dir, tiny_drafter_dir, capsys):
    rc, out = _bench(tmp_path, tiny_model_dir, tiny_drafter_dir, "--datasets", "gsm8k", "--block-sizes", "2",
                     "--no-adaptive", "--temperature", "0.8", "--top-p", "0.5")
    assert rc == 0, capsys.readouterr().err
    data = json.loads((out / "results.json").read_text())
    assert data["meta"]["top_p"] == 0.5 and "--top-p 0.5" in data["meta"]["command"]
    assert "- top-p of the sampled settings: 0.5" in (out / "report.md").read_text()


def test_bench_samples_without_seeds_and_compares_both_rules(tmp_path, tiny_model_dir, tiny_drafter_dir, capsys):
    """Sampled requests carry no seed by default (the standard rule, as chat clients get);
    --sampling-rule both runs each DFlash runner with either rule; --seed N makes them keyed."""
    rc, out = _bench(tmp_path, tiny_model_dir, tiny_drafter_dir, "--datasets", "gsm8k", "--limit", "2",
                     "--temperature", "0.8", "--sampling-rule", "both")
    assert rc == 0, capsys.readouterr().err
    data = json.loads((out / "results.json").read_text())
    runners = sorted({s["runner"] for s in data["summaries"]})
    assert runners == ["ar", "dflash+lookup auto<=b4 keyed", "dflash+lookup auto<=b4 standard"]
    rules = {(r["runner"], r["sampling_rule"]) for r in data["requests"]}
    assert rules == {("ar", None), ("dflash+lookup auto<=b4 keyed", "keyed"),
                     ("dflash+lookup auto<=b4 standard", "standard")}
    assert "--sampling-rule both" in data["meta"]["command"] and "--seed" not in data["meta"]["command"]
    assert data["meta"]["seed"] is None
    rc, out = _bench(tmp_path, tiny_model_dir, tiny_drafter_dir, "--datasets", "gsm8k", "--limit", "2",
                     "--temperature", "0.8", "--seed", "3")
    assert rc == 0, capsys.readouterr().err
    data = json.loads((out / "results.json").read_text())
    assert {r["sampling_rule"] for r in data["requests"] if r["runner"] != "ar"} == {"keyed"}
    assert "--seed 3" in data["meta"]["command"]
    first = [r["token_ids"] for r in data["requests"]]
    rc, out = _bench(tmp_path, tiny_model_dir, tiny_drafter_dir, "--datasets", "gsm8k", "--limit", "2",
                     "--temperature", "0.8", "--seed", "3")
    assert [r["token_ids"] for r in json.loads((out / "results.json").read_text())["requests"]] == first


def test_bench_needs_a_drafter(tmp_path, tiny_model_dir, capsys):
    rc = main(["bench", "--target", str(tiny_model_dir), "--drafter", "none", "--out", str(tmp_path)])
    assert rc == 2
    assert "needs a drafter" in capsys.readouterr().err


def test_unknown_baseline_is_an_error(tmp_path, tiny_model_dir, tiny_drafter_dir, capsys, monkeypatch):
    from blockspec.commands import bench

    monkeypatch.setattr(bench, "_load_datasets", lambda *a: {"x": [SimpleNamespace(id="0", turns=["hi"])]})
    rc, _ = _bench(tmp_path, tiny_model_dir, tiny_drafter_dir, "--baselines", "vllm")
    assert rc == 2
    assert "unknown baseline" in capsys.readouterr().err


def test_thinking_modes(tiny_model_dir):
    from transformers import AutoTokenizer

    from blockspec.commands.bench import _thinking_modes

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    notes: list[str] = []
    assert _thinking_modes("both", tok, notes) == (True, False) and not notes
    assert _thinking_modes("off", tok, notes) == (False,)
    plain = SimpleNamespace(chat_template="{{ messages }}")
    assert _thinking_modes("on", plain, notes) == (None,)
    assert "no thinking switch" in notes[0]


def test_limit_parsing():
    import argparse

    from blockspec.commands.bench import _limits

    assert _limits("16") == {"*": 16}
    assert _limits("gsm8k=16,humaneval=8") == {"gsm8k": 16, "humaneval": 8}
    assert _limits("4,mt-bench=0") == {"*": 4, "mt-bench": 0}
    with pytest.raises(argparse.ArgumentTypeError):
        _limits("gsm8k=x")


def test_bench_context_puts_other_problems_in_front(tmp_path, tiny_model_dir, tiny_drafter_dir, capsys):
    rc, out = _bench(tmp_path, tiny_model_dir, tiny_drafter_dir, "--datasets", "gsm8k", "--block-sizes", "4",
                     "--adaptive-only", "--lookup", "off", "--context", "400")
    assert rc == 0, capsys.readouterr().err
    data = json.loads((out / "results.json").read_text())
    assert data["meta"]["context_tokens"] == 400 and "--context 400" in data["meta"]["command"]
    assert data["requests"] and all(r["prompt_tokens"] >= 400 for r in data["requests"])
    assert data["lossless"]["passed"] is True
    assert "to at least 400 tokens" in (out / "report.md").read_text()
    rc = main(["bench", "--target", str(tiny_model_dir), "--drafter", str(tiny_drafter_dir), "--context", "400",
               "--endpoint", "http://127.0.0.1:9/v1", "--out", str(tmp_path / "e")])
    assert rc == 2 and "--context counts tokens" in capsys.readouterr().err


def test_bench_freezes_what_it_loaded(tmp_path, tiny_model_dir, tiny_drafter_dir, capsys):
    import gc

    gc.unfreeze()
    rc, _ = _bench(tmp_path, tiny_model_dir, tiny_drafter_dir, "--datasets", "gsm8k", "--adaptive-only")
    assert rc == 0, capsys.readouterr().err
    assert gc.get_freeze_count() > 10_000  # the imports and the models, out of the collector's passes
