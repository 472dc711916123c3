"""Decode-only throughput in `blockspec bench`: tokens after each request's first over the run's
time less its prefill passes, each pass counted once (bench/runner.py RunRecord)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from blockspec.bench import runner as runner_module
from blockspec.bench.report import write_report
from blockspec.bench.runner import EngineRunner, Output, Setting, SuitePlan, run_suite

SAMPLES = {"maths": [SimpleNamespace(id=f"m{i}", turns=[f"What is {i} + {i}?"]) for i in range(4)]}


class _Tokenizer:
    """Just enough of a tokenizer for the suite: no chat template, one id per character."""

    chat_template = None

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        return {"input_ids": [ord(c) % 50 for c in text]}

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return " ".join(map(str, ids))


class _Clock:
    """A clock that only the scripted runners move."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class _Scripted:
    """Serves `concurrency` requests per batch: one prefill pass of `prefill` seconds for the whole
    batch (each request's Output.prefill_s is that pass, as the engine records it), then `decode`
    seconds of decode steps; every request gets `tokens` tokens. The CPU-clock prefill is half
    the wall one, so a test sees which clock was read."""

    block_size, max_concurrency = 1, None

    def __init__(self, name: str, method: str, clock: _Clock, *, prefill: float, decode: float, tokens: int,
                 tells_prefill: bool = True) -> None:
        self.name, self.method, self.clock = name, method, clock
        self.prefill, self.decode, self.tokens = prefill, decode, tokens
        self.tells_prefill = tells_prefill

    def run(self, requests, concurrency, progress=None) -> list[Output]:
        outputs, passes = [], 0
        for start in range(0, len(requests), concurrency):
            batch = requests[start:start + concurrency]
            passes += 1
            self.clock.now += self.prefill + self.decode
            outputs += [Output(token_ids=list(range(1, self.tokens + 1)), finish_reason="length",
                               latency_s=self.prefill + self.decode, prefill_s=self.prefill) for _ in batch]
        if self.tells_prefill:
            self.last_prefill_s = {"wall": passes * self.prefill, "cpu": passes * self.prefill / 2}
        return outputs


@pytest.fixture
def clock(monkeypatch) -> _Clock:
    fake = _Clock()
    monkeypatch.setitem(runner_module.CLOCKS, "wall", fake)
    monkeypatch.setitem(runner_module.CLOCKS, "cpu", fake)
    return fake


def _suite(runners, concurrency: int, clock_name: str = "wall"):
    plan = SuitePlan(concurrency=(concurrency,), settings=(Setting(0.0, None),), max_new_tokens=8, warmup=False,
                     clock=clock_name)
    return run_suite(runners, SAMPLES, _Tokenizer(), plan, progress=False)


def test_batch_one_decode_only_is_tokens_after_the_first_over_time_after_prefill(clock):
    (run,) = _suite([_Scripted("ar", "ar", clock, prefill=0.5, decode=1.5, tokens=7)], 1)
    assert run.wall_s == pytest.approx(4 * 2.0) and run.prefill_s == pytest.approx(4 * 0.5)
    assert run.tokens_per_s == pytest.approx(4 * 7 / 8.0)  # end to end, prefill included
    assert run.decode_tokens == 4 * 6
    assert run.decode_tokens_per_s == pytest.approx(4 * 6 / 6.0)


def test_a_prefill_pass_shared_by_a_batch_is_taken_out_once(clock):
    # Two requests per prefill pass: the per-request prefill_s sum (4 x 0.5) would take out
    # each pass twice; the runner's pass time (2 x 0.5) is what comes off.
    (run,) = _suite([_Scripted("ar", "ar", clock, prefill=0.5, decode=1.5, tokens=7)], 2)
    assert sum(r.prefill_s for r in run.records) == pytest.approx(2.0)
    assert run.wall_s == pytest.approx(4.0) and run.prefill_s == pytest.approx(1.0)
    assert run.decode_tokens_per_s == pytest.approx(4 * 6 / 3.0)


def test_cpu_clock_takes_the_prefill_time_on_the_cpu_clock(clock):
    (run,) = _suite([_Scripted("ar", "ar", clock, prefill=0.5, decode=1.5, tokens=7)], 1, "cpu")
    assert run.prefill_s == pytest.approx(4 * 0.25)  # the runner's "cpu" figure, not its "wall" one
    assert run.decode_tokens_per_s == pytest.approx(4 * 6 / (8.0 - 1.0))


def test_a_runner_that_cannot_tell_its_prefill_has_no_decode_only_figure(clock, tmp_path):
    (run,) = _suite([_Scripted("ar", "ar", clock, prefill=0.5, decode=1.5, tokens=7, tells_prefill=False)], 1)
    assert run.prefill_s is None and run.decode_s is None and run.decode_tokens_per_s is None
    assert run.tokens_per_s == pytest.approx(4 * 7 / 8.0)
    report = write_report([run], tmp_path, {})
    assert "### Decode-only" not in report.markdown
    summary = json.loads((tmp_path / "results.json").read_text())["summaries"][0]
    assert summary["decode_tokens_per_s"] is None and summary["prefill_s"] is None


def test_report_and_results_json_carry_decode_only_with_its_speedup(clock, tmp_path):
    # AR: 4 x (1 + 3) s, 8 tokens each. DFlash: 4 x (1 + 1) s, 8 tokens each.
    ar = _Scripted("ar", "ar", clock, prefill=1.0, decode=3.0, tokens=8)
    dflash = _Scripted("dflash b4", "dflash", clock, prefill=1.0, decode=1.0, tokens=8)
    runs = _suite([ar, dflash], 1)
    report = write_report(runs, tmp_path, {})
    lines = report.markdown.splitlines()
    # end to end: 32/16 = 2.00 against 32/8 = 4.00 (2.00x); decode-only: 28/12 against 28/4 (3.00x)
    assert "| maths | 1 | 2.00 | 4.00 (2.00x) | – |" in lines
    at = lines.index("### Decode-only (prefill left out)")
    assert lines[at + 2] == "| Task | Concurrency | AR | DFlash b4 (speedup) |"
    assert lines[at + 4] == "| maths | 1 | 2.33 | 7.00 (3.00x) |"
    assert "less the time of its prefill passes" in report.markdown
    data = json.loads((tmp_path / "results.json").read_text())
    by = {s["runner"]: s for s in data["summaries"]}
    assert by["ar"]["decode_tokens"] == 28 and by["ar"]["decode_s"] == pytest.approx(12.0)
    assert by["ar"]["decode_tokens_per_s"] == pytest.approx(28 / 12, abs=1e-3)
    assert by["dflash b4"]["decode_tokens_per_s"] == pytest.approx(7.0)
    assert by["dflash b4"]["tokens_per_s"] == pytest.approx(4.0)


def test_all_row_pools_decode_tokens_over_decode_time(clock, tmp_path):
    samples = {"maths": SAMPLES["maths"][:1], "code": SAMPLES["maths"][1:4]}
    ar = _Scripted("ar", "ar", clock, prefill=1.0, decode=2.0, tokens=5)
    plan = SuitePlan(settings=(Setting(0.0, None),), max_new_tokens=8, warmup=False)
    runs = run_suite([ar], samples, _Tokenizer(), plan, progress=False)
    md = write_report(runs, tmp_path, {}).markdown.splitlines()
    at = md.index("### Decode-only (prefill left out)")
    assert md[at + 6] == "| **all** | 1 | 2.00 |"  # 4 requests x 4 tokens over 4 x 2 s


@pytest.fixture(scope="module")
def pipe(tiny_model_dir, tiny_drafter_dir):
    from blockspec.api import load

    return load(str(tiny_model_dir), str(tiny_drafter_dir))


def test_engine_counts_a_prefill_pass_once_for_all_it_admits(pipe):
    runner = EngineRunner(pipe.target, None, 1)
    prompts = [SimpleNamespace(id=f"p{i}", turns=[f"def add{i}(a, b):"]) for i in range(2)]
    plan = SuitePlan(concurrency=(2,), settings=(Setting(0.0, None),), max_new_tokens=6, warmup=False)
    (run,) = run_suite([runner], {"code": prompts}, pipe.tokenizer, plan, progress=False)
    passes = {r.prefill_s for r in run.records}
    assert len(passes) == 1  # both requests joined in one prefill pass, each recording that pass
    assert runner.last_prefill_s["wall"] == pytest.approx(passes.pop(), abs=1e-5)
    assert runner.last_prefill_s["cpu"] > 0
    assert 0 < run.prefill_s < run.wall_s
    assert run.decode_tokens_per_s == pytest.approx(run.decode_tokens / (run.wall_s - run.prefill_s))
