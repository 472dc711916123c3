"""Engine runners stepping in turn (`run_task_stepped`, the bench's default `--interleave steps`):
the outputs of runs one after the other, the engines' steps alternating, and each step's time
booked to its own runner."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from blockspec.bench import runner as runner_module
from blockspec.bench.runner import EngineRunner, Setting, SuitePlan, run_suite

SAMPLES = {
    "maths": [SimpleNamespace(id=f"m{i}", turns=[f"Janet has {i} ducks. How many eggs?"]) for i in range(3)],
    "chat": [SimpleNamespace(id="c0", turns=["Write a poem.", "Now make it shorter."])],
}


@pytest.fixture(scope="module")
def pipe(tiny_model_dir, tiny_drafter_dir):
    from blockspec.api import load

    return load(str(tiny_model_dir), str(tiny_drafter_dir))


def _suite(pipe, stepped: bool, runners=None):
    runners = runners or [EngineRunner(pipe.target, None, 1), EngineRunner(pipe.target, pipe.drafter, 4)]
    plan = SuitePlan(concurrency=(2,), settings=(Setting(0.0, False),), max_new_tokens=10, warmup=False,
                     stepped=stepped)
    return run_suite(runners, SAMPLES, pipe.tokenizer, plan, progress=False)


def _ids(runs) -> dict:
    return {(r.runner, r.task, x.sample_id, x.turn): x.token_ids for r in runs for x in r.records}


def test_stepped_runners_decode_what_runs_one_after_the_other_decode(pipe) -> None:
    stepped, whole = _suite(pipe, True), _suite(pipe, False)
    assert _ids(stepped) == _ids(whole)
    ids = _ids(stepped)
    assert len(ids) == 2 * 5  # 3 maths requests, 2 chat turns (the second after each runner's own answer)
    for (runner, task, sample, turn), out in ids.items():
        if runner != "ar":
            assert out == ids[("ar", task, sample, turn)]  # lossless, stepped or not
    assert all(r.requests and r.wall_s > 0 for r in stepped)


def test_each_engine_step_is_timed_to_its_own_runner_and_the_engines_alternate(pipe, monkeypatch) -> None:
    """A clock that only moves inside a step, by 1 s for AR's engine and by 3 s for DFlash's: each
    runner's time is its own steps' count times its step, whatever the other did."""
    clock = SimpleNamespace(now=0.0)
    monkeypatch.setitem(runner_module.CLOCKS, "wall", lambda: clock.now)
    order: list[str] = []
    steps = {"ar": 0, "dflash b4": 0}
    runners = [EngineRunner(pipe.target, None, 1), EngineRunner(pipe.target, pipe.drafter, 4)]
    for r, cost in zip(runners, (1.0, 3.0)):
        def step(started, inner=r.step, name=r.name, cost=cost):
            order.append(name)
            steps[name] += 1
            clock.now += cost
            return inner(started)
        monkeypatch.setattr(r, "step", step)
    seconds = dict.fromkeys(steps, 0.0)
    for run in _suite(pipe, True, runners):  # one per runner and task
        seconds[run.runner] += run.wall_s
    assert steps["ar"] > 0 and steps["dflash b4"] > 0
    assert seconds == pytest.approx({"ar": steps["ar"] * 1.0, "dflash b4": steps["dflash b4"] * 3.0})
    assert order[:6] == ["ar", "dflash b4"] * 3  # in turn while both have work


def test_rounds_mode_runs_each_runner_whole(pipe, monkeypatch) -> None:
    calls: list[str] = []
    runners = [EngineRunner(pipe.target, None, 1), EngineRunner(pipe.target, pipe.drafter, 4)]
    for r in runners:
        monkeypatch.setattr(r, "step", lambda started, name=r.name: calls.append(name))
    _suite(pipe, False, runners)
    assert calls == []  # whole runs (`run`), no stepping


def test_a_started_round_has_its_caches_before_its_first_timed_step(pipe) -> None:
    """`start` sizes the engine's stores for the round (rows x longest request), so no runner's
    timed steps pay for growing them, whichever runner happens to grow first."""
    from blockspec.bench.runner import Request
    from blockspec.config import SamplingParams

    runner = EngineRunner(pipe.target, pipe.drafter, 4)
    requests = [Request(tuple(range(3, 3 + n)), SamplingParams(max_new_tokens=90, ignore_eos=True)) for n in (5, 40)]
    started = runner.start(requests, 2)
    engine = started[0]
    stores = engine.batch.tcache.store, engine.batch.dcache.store
    kv = [s.kv for s in stores]
    assert all(s.rows >= 2 and s.capacity >= 40 + 90 for s in stores)
    while runner.step(started)[0]:
        pass
    assert [len(o.token_ids) for o in runner.finish(started)] == [90, 90]
    assert all(s.kv is t for s, t in zip(stores, kv))  # the same storage throughout


def test_a_round_smaller_than_its_concurrency_reserves_only_its_rows(pipe) -> None:
    from blockspec.bench.runner import Request
    from blockspec.config import SamplingParams

    runner = EngineRunner(pipe.target, pipe.drafter, 4)
    request = Request(tuple(range(3, 13)), SamplingParams(max_new_tokens=20, ignore_eos=True))
    started = runner.start([request], 4)
    assert started[0].batch.tcache.store.rows == 1
    while runner.step(started)[0]:
        pass
    assert [len(o.token_ids) for o in runner.finish(started)] == [20]
