"""The benchmark suite and its report on a tiny random model (no downloads)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from blockspec.bench.report import check_greedy, write_report
from blockspec.bench.runner import EngineRunner, Output, Request, Setting, SuitePlan, encode_turn, run_suite
from blockspec.config import SamplingParams
from blockspec.errors import ConfigError

SAMPLES = {
    "maths": [SimpleNamespace(id="m0", turns=["Janet has 16 ducks. How many eggs?"]),
              SimpleNamespace(id="m1", turns=["def add(a, b):"])],
    "chat": [SimpleNamespace(id="c0", turns=["Write a poem.", "Now make it shorter."])],
}


@pytest.fixture(scope="module")
def pipe(tiny_model_dir, tiny_drafter_dir):
    from blockspec.api import load

    return load(str(tiny_model_dir), str(tiny_drafter_dir))


@pytest.fixture(scope="module")
def greedy_runs(pipe):
    runners = [EngineRunner(pipe.target, None, 1), EngineRunner(pipe.target, pipe.drafter, 4)]
    plan = SuitePlan(concurrency=(1, 2), settings=(Setting(0.0, False),), max_new_tokens=10, warmup=True,
                     warmup_tokens=4)
    return run_suite(runners, SAMPLES, pipe.tokenizer, plan, progress=False)


def test_report_is_well_formed(greedy_runs, tmp_path):
    report = write_report(greedy_runs, tmp_path, {"target": "tiny", "command": "blockspec bench --test"})
    md = (tmp_path / "report.md").read_text()
    assert md == report.markdown
    assert "| Task | Concurrency | AR | DFlash b4 (speedup) | τ b4 |" in md
    for task in ("maths", "chat"):
        for c in (1, 2):
            assert any(line.startswith(f"| {task} | {c} | ") for line in md.splitlines()), (task, c)
    assert "Lossless check: passed. All 8 greedy DFlash outputs" in md  # 4 requests x 2 concurrencies
    assert "Acceptance rate by block position" in md
    assert "### Decode-only (prefill left out)" in md

    data = json.loads((tmp_path / "results.json").read_text())
    assert data["lossless"]["passed"] is True
    assert data["meta"]["target"] == "tiny" and "hardware" in data["meta"]["environment"]
    # 2 runners x 2 concurrencies x (2 single-turn + 2 turns of one conversation)
    assert len(data["requests"]) == 16
    dflash = [r for r in data["requests"] if r["method"] == "dflash"]
    for r in dflash:
        assert r["generated_tokens"] == len(r["token_ids"]) <= 10
        assert sum(r["acceptance_lengths"]) == r["generated_tokens"] - 1
        assert len(r["accepted_by_position"]) == 3
        assert r["mean_tau"] >= 1.0 and r["latency_s"] > 0 and r["tokens_per_s"] > 0
    assert all(r["acceptance_lengths"] is None for r in data["requests"] if r["method"] == "ar")
    summary = next(s for s in data["summaries"] if s["runner"] == "dflash b4")
    assert {"tokens_per_s", "mean_tau", "acceptance_histogram", "acceptance_by_position", "wall_s"} <= set(summary)
    assert 0 < summary["prefill_s"] < summary["wall_s"]
    assert summary["decode_s"] == pytest.approx(summary["wall_s"] - summary["prefill_s"], abs=1e-5)
    assert summary["decode_tokens_per_s"] == pytest.approx(summary["decode_tokens"] / summary["decode_s"], rel=1e-3)
    assert sum(summary["acceptance_histogram"].values()) == sum(
        len(r["acceptance_lengths"]) for r in dflash if r["task"] == summary["task"]
        and r["concurrency"] == summary["concurrency"])

    png = (tmp_path / "plot.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.image

    image = matplotlib.image.imread(str(tmp_path / "plot.png"))
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100


def test_second_turn_follows_the_models_own_answer(greedy_runs, pipe):
    run = next(r for r in greedy_runs if r.runner == "ar" and r.task == "chat" and r.concurrency == 1)
    first, second = sorted(run.records, key=lambda r: r.turn)
    assert (first.turn, second.turn) == (0, 1)
    expected = encode_turn(pipe.tokenizer, SAMPLES["chat"][0].turns, [first.text], 1, False)
    assert second.prompt_tokens == len(expected) > first.prompt_tokens
    text = pipe.tokenizer.decode(expected)
    assert "Write a poem." in text and "Now make it shorter." in text and first.text in text


class _Corrupting:
    """Wraps a runner and changes one generated token of the first request it sees."""

    def __init__(self, inner: EngineRunner, at: int) -> None:
        self.inner, self.at, self.done = inner, at, False
        self.name, self.method, self.block_size = inner.name, inner.method, inner.block_size
        self.max_concurrency = inner.max_concurrency

    def run(self, requests, concurrency, progress=None) -> list[Output]:
        outs = self.inner.run(requests, concurrency, progress)
        if not self.done:
            ids = outs[0].token_ids
            ids[self.at] = (ids[self.at] + 1) % 300
            self.done = True
        return outs


def test_greedy_mismatch_is_flagged_loudly(pipe, tmp_path):
    runners = [EngineRunner(pipe.target, None, 1), _Corrupting(EngineRunner(pipe.target, pipe.drafter, 4), at=2)]
    plan = SuitePlan(settings=(Setting(0.0, None),), max_new_tokens=6, warmup=False)
    runs = run_suite(runners, {"maths": SAMPLES["maths"]}, pipe.tokenizer, plan, progress=False)
    agreements = check_greedy(runs)
    (dflash,) = [a for a in agreements if a.strict]
    assert dflash.compared == 2 and len(dflash.mismatches) == 1
    assert dflash.mismatches[0].first_difference == 2 and dflash.mismatches[0].sample_id == "m0"
    report = write_report(runs, tmp_path, {})
    assert not report.lossless_ok
    assert "LOSSLESS CHECK FAILED: 1 of 2 greedy DFlash outputs differ from AR" in report.markdown
    assert json.loads((tmp_path / "results.json").read_text())["lossless"]["passed"] is False


def test_sampled_setting_runs_and_is_not_lossless_checked(pipe, tmp_path):
    runners = [EngineRunner(pipe.target, None, 1), EngineRunner(pipe.target, pipe.drafter, 4)]
    plan = SuitePlan(settings=(Setting(0.8, None),), max_new_tokens=6, warmup=False, seed=3)
    runs = run_suite(runners, {"maths": SAMPLES["maths"]}, pipe.tokenizer, plan, progress=False)
    assert check_greedy(runs) == []
    report = write_report(runs, tmp_path, {})
    assert "## Temperature 0.8" in report.markdown
    assert "no greedy DFlash run" in report.markdown
    again = run_suite(runners[1:], {"maths": SAMPLES["maths"]}, pipe.tokenizer, plan, progress=False)
    assert [r.token_ids for r in again[0].records] == [r.token_ids for r in runs[1].records]  # seeded


def test_plan_validation():
    with pytest.raises(ConfigError, match="concurrency"):
        SuitePlan(concurrency=(0,))
    with pytest.raises(ConfigError, match="setting"):
        SuitePlan(settings=())
    with pytest.raises(ConfigError, match="clock"):
        SuitePlan(clock="gpu")
    for bad in (0.0, 1.5):
        with pytest.raises(ConfigError, match="top_p"):
            SuitePlan(top_p=bad)


def test_top_p_reaches_every_sampled_request(pipe, monkeypatch):
    seen = []
    runner = EngineRunner(pipe.target, None, 1)
    original = runner.run

    def spy(requests, concurrency, progress=None):
        seen.extend(r.params for r in requests)
        return original(requests, concurrency, progress)

    monkeypatch.setattr(runner, "run", spy)
    plan = SuitePlan(settings=(Setting(0.0, None), Setting(0.8, None)), max_new_tokens=4, warmup=False, top_p=0.5)
    run_suite([runner], {"maths": SAMPLES["maths"][:1]}, pipe.tokenizer, plan, progress=False)
    assert sorted((sp.temperature, sp.top_p) for sp in seen) == [(0.0, 1.0), (0.8, 0.5)]


def test_engine_runner_keeps_concurrency_in_flight_and_is_lossless(pipe):
    """Five requests through two slots (refilled as rows finish), fixed and adaptive block sizes,
    give exactly the one-at-a-time plain-decoding tokens."""
    prompts = [pipe.encode(t) for t in ("one two", "three", "four five six", "seven", "eight nine")]
    lengths = [3, 9, 5, 12, 7]  # rows leave at different steps, so slots are refilled mid-run
    requests = [Request(tuple(p), SamplingParams(max_new_tokens=n)) for p, n in zip(prompts, lengths)]
    alone = [EngineRunner(pipe.target, None, 1).run([r], 1)[0].token_ids for r in requests]
    assert [len(a) for a in alone] == lengths
    for runner in (EngineRunner(pipe.target, None, 1), EngineRunner(pipe.target, pipe.drafter, 4),
                   EngineRunner(pipe.target, pipe.drafter, 4, adaptive=True)):
        done: list[int] = []
        try:
            outs = runner.run(requests, 2, done.append)
            assert [o.token_ids for o in outs] == alone, runner.name
            assert sum(done) == len(requests)
            used = runner.last_block_sizes  # engine steps per block size in this run
            assert sum(used.values()) >= max(o.steps for o in outs) and set(used) <= set(range(1, 5))
            if runner.block_size == 1:
                assert set(used) == {1}
            again = runner.run(requests[:2], 2)  # the runner's engine serves the next round too
            assert [o.token_ids for o in again] == alone[:2]
        finally:
            runner.close()
    assert EngineRunner(pipe.target, pipe.drafter, 4, adaptive=True).name == "dflash auto<=b4"
    with pytest.raises(ConfigError, match="drafter"):
        EngineRunner(pipe.target, None, 4)


def test_each_concurrency_engine_is_ready_before_its_timed_rounds(pipe):
    """The adaptive engine of every concurrency level calibrates during the warm-up, not inside a
    measured round (what made it lose to AR at concurrency >= 8 in a real run)."""
    runner = EngineRunner(pipe.target, pipe.drafter, 4, adaptive=True)
    seen: list[tuple[int, bool]] = []
    timed = runner.run

    def run(requests, concurrency, progress=None):
        engine = runner._engines.get(concurrency)
        seen.append((concurrency, engine is not None and engine.adaptive.costs.known(concurrency)))
        return timed(requests, concurrency, progress)

    runner.run = run
    plan = SuitePlan(concurrency=(1, 2), settings=(Setting(0.0, None),), max_new_tokens=4, warmup_tokens=2)
    try:
        run_suite([runner], {"maths": SAMPLES["maths"]}, pipe.tokenizer, plan, progress=False)
    finally:
        runner.close()
    assert {c for c, _ in seen} == {1, 2}
    assert all(ready for _, ready in seen[1:]), seen  # seen[0] is the warm-up call itself


class _BatchOneBaseline:
    """A stand-in for transformers' prompt lookup (method "pld", batch 1 only)."""

    name, method, block_size, max_concurrency = "pld", "pld", 1, 1

    def __init__(self, inner: EngineRunner) -> None:
        self.inner = inner

    def run(self, requests, concurrency, progress=None) -> list[Output]:
        return self.inner.run(requests, 1, progress)


def test_main_table_has_the_prompt_lookup_column_at_batch_one(pipe, tmp_path):
    runners = [EngineRunner(pipe.target, None, 1), _BatchOneBaseline(EngineRunner(pipe.target, None, 1)),
               EngineRunner(pipe.target, pipe.drafter, 4)]
    plan = SuitePlan(concurrency=(1, 2), settings=(Setting(0.0, None),), max_new_tokens=5, warmup=False)
    runs = run_suite(runners, {"maths": SAMPLES["maths"]}, pipe.tokenizer, plan, progress=False)
    md = write_report(runs, tmp_path, {}).markdown
    assert "| Task | Concurrency | AR | PLD (speedup) | DFlash b4 (speedup) | τ b4 |" in md
    row_c1 = next(line for line in md.splitlines() if line.startswith("| maths | 1 |"))
    row_c2 = next(line for line in md.splitlines() if line.startswith("| maths | 2 |"))
    assert "x)" in row_c1.split("|")[4]  # PLD rate with its ratio to AR
    assert row_c2.split("|")[4].strip() == "–"


class _Recording:
    """A runner that answers every request with the same tokens and logs when it ran."""

    method, block_size, max_concurrency = "ar", 1, 8

    def __init__(self, name: str, log: list[str]) -> None:
        self.name, self.log = name, log

    def run(self, requests, concurrency, progress=None):
        self.log.append(self.name)
        return [Output(token_ids=[5, 6], finish_reason="length", latency_s=0.0) for _ in requests]


def test_each_round_starts_with_the_next_runner(pipe):
    log: list[str] = []
    runners = [_Recording(n, log) for n in ("a", "b", "c")]
    samples = {"maths": [SimpleNamespace(id=f"m{i}", turns=["What is 2 + 2?"]) for i in range(4)]}
    plan = SuitePlan(settings=(Setting(0.0, None),), max_new_tokens=2, warmup=False, round_batches=1)
    runs = run_suite(runners, samples, pipe.tokenizer, plan, progress=False)
    # four rounds of one prompt: no runner always runs after the same others
    assert log == ["a", "b", "c", "b", "c", "a", "c", "a", "b", "a", "b", "c"]
    assert [len(r.records) for r in runs] == [4, 4, 4]
