"""Threads that follow the free cores (cpu/threads.py): the load read from /proc/stat, the count it
picks, who may override it, and greedy output that does not depend on the counts a run passed
through."""

from __future__ import annotations

import threading

import pytest
import torch
from conftest import make_tiny_target
from support import native, ragged_prompts
from scripted import ScriptedDrafter

from blockspec.config import SamplingParams, SpecConfig
from blockspec.cpu import threads
from blockspec.cpu.threads import Governor, Sample, others_cores, parse_stat, setting, threads_for
from blockspec.engine.decoder import SpecDecoder
from blockspec.dflash.drafter import new_drafter_for_target
from blockspec.errors import ConfigError

STAT = """cpu  900 10 300 5000 40 0 7 3 0 0
cpu0 400 5 100 2600 20 0 3 2 0 0
cpu1 300 5 150 2000 10 0 2 1 0 0
cpu2 200 0 50 400 10 0 2 0 0 0
intr 1196756 0 0
ctxt 42
"""


def test_parse_stat_sums_the_cpus_this_process_may_use() -> None:
    busy0, busy1 = 400 + 5 + 100 + 3 + 2, 300 + 5 + 150 + 2 + 1  # user nice system irq softirq steal
    assert parse_stat(STAT, {0, 1}) == (busy0 + busy1, busy0 + busy1 + 2600 + 20 + 2000 + 10)
    assert parse_stat(STAT, {2}) == (252, 252 + 410)  # the all-CPUs line never counts
    assert parse_stat(STAT, {7}) == (0, 0)


def test_others_load_is_the_busy_time_less_this_process_own() -> None:
    before = Sample(busy=1000, total=4000, own=3.0)
    # 1 s on 2 CPUs at 100 ticks a second: 200 ticks, 150 of them busy, 0.5 s of them ours
    assert others_cores(before, Sample(1150, 4200, 3.5), cpus=2, hz=100) == pytest.approx(1.0)
    assert others_cores(before, Sample(1060, 4200, 3.7), cpus=2, hz=100) == 0.0  # tick rounding: never negative
    assert others_cores(before, Sample(1000, 4000, 3.0), cpus=2, hz=100) is None  # no tick passed
    with pytest.raises(ValueError, match="inconsistent"):
        Sample(busy=5, total=4, own=0.0)


@pytest.mark.parametrize("others,current,expected", [
    (0.0, 2, 2), (0.3, 2, 2),  # a quiet machine, a light background: both cores
    (0.45, 2, 1), (0.67, 2, 1), (1.0, 2, 1),  # a busy process (at 2 threads it gets only part of a core)
    (1.9, 2, 1), (2.5, 2, 1),  # never below one
    (0.5, 1, 1), (0.3, 1, 1),  # hysteresis: back to 2 only once the second core is really free...
    (0.2, 1, 2), (0.0, 1, 2),  # ...as it is here
])
def test_thread_count_for_the_free_cores_on_two_cpus(others: float, current: int, expected: int) -> None:
    assert threads_for(others, cpus=2, current=current, ceiling=2) == expected


def test_thread_count_on_more_cpus_and_under_a_ceiling() -> None:
    assert threads_for(3.0, cpus=8, current=8, ceiling=8) == 5
    assert threads_for(0.0, cpus=8, current=5, ceiling=8) == 8
    assert threads_for(0.0, cpus=8, current=2, ceiling=4) == 4  # never above where it was found


class FakeLoad:
    """/proc/stat readings for 2 CPUs at 100 ticks a second, 0.5 s apart: each reading adds the
    ticks of `others` cores' worth of other processes plus this process's own `mine` cores."""

    def __init__(self) -> None:
        self.others = 0.0
        self.mine = 1.0
        self.sample = Sample(0, 0, 0.0)
        self.t = 0.0

    def read(self) -> Sample:
        s = self.sample
        busy = round(100 * (self.others + self.mine) / 2)
        self.sample = Sample(s.busy + busy, s.total + 100, s.own + 0.5 * self.mine)
        return self.sample

    def clock(self) -> float:
        return self.t


def _governor(load: FakeLoad, count: list[int], **kw) -> Governor:
    return Governor(2, 2, load.read, hz=100, clock=load.clock, interval=0.5, get=lambda: count[0],
                    set=lambda n: count.__setitem__(0, n), **kw)


def test_governor_follows_a_busy_process_and_back() -> None:
    load, count = FakeLoad(), [2]
    gov = _governor(load, count)
    seen = []
    for others in (0.0, 0.6, 1.0, 1.0, 0.1, 0.0):
        load.others = others
        load.t += 0.5
        seen.append(gov.follow())
        assert count[0] == seen[-1]
        load.t += 0.2
        assert gov.follow() == seen[-1]  # between looks nothing is read: the count stands
    assert seen == [2, 1, 1, 1, 2, 2]
    assert gov.others == pytest.approx(0.0)


def test_governor_stands_down_when_someone_else_sets_the_count() -> None:
    load, count = FakeLoad(), [2]
    gov = _governor(load, count)
    load.t += 1.0
    load.others = 1.0
    assert gov.follow() == 1
    count[0] = 2  # torch.set_num_threads(2) by the user
    load.t += 1.0
    assert gov.follow() == 2 and gov.stood_down
    load.t += 1.0
    assert gov.follow() == 2  # theirs for good
    fixed = _governor(FakeLoad(), count := [2], fixed=1)
    assert fixed.follow() == 1 and count[0] == 1  # BLOCKSPEC_THREADS=1 or --threads 1


def test_governor_sets_the_count_on_each_decoding_thread() -> None:
    """An OpenMP thread count belongs to a thread: the engine's decode thread gets its own."""
    load, counts = FakeLoad(), {}
    me = threading.get_ident
    gov = Governor(2, 2, load.read, hz=100, clock=load.clock, get=lambda: counts.get(me(), 2),
                   set=lambda n: counts.__setitem__(me(), n))
    load.others, load.t = 1.0, 1.0
    assert gov.follow() == 1
    worker = threading.Thread(target=gov.follow)
    worker.start()
    worker.join()
    assert sorted(counts.values()) == [1, 1] and not gov.stood_down


def test_setting_respects_the_users_choice() -> None:
    assert setting({}) == "auto" and setting({"BLOCKSPEC_THREADS": "auto"}) == "auto"
    assert setting({"BLOCKSPEC_THREADS": "off"}) == "off" and setting({"BLOCKSPEC_THREADS": "3"}) == 3
    assert setting({"OMP_NUM_THREADS": "2"}) == "off"  # OpenMP's own setting: left alone
    with pytest.raises(ConfigError, match="BLOCKSPEC_THREADS must be 'auto', 'off' or a thread count"):
        setting({"BLOCKSPEC_THREADS": "many"})
    with pytest.raises(ConfigError, match="BLOCKSPEC_THREADS"):
        setting({"BLOCKSPEC_THREADS": "0"})


@pytest.mark.parametrize("env,cpus,expected", [
    ({}, {0, 1}, "auto"),
    ({"BLOCKSPEC_THREADS": "off"}, {0, 1}, None),
    ({"OMP_NUM_THREADS": "2"}, {0, 1}, None),
    ({"BLOCKSPEC_THREADS": "3"}, {0, 1}, 3),
    ({}, {0}, None),  # torch runs 2 threads on 1 CPU: someone chose that, left alone
])
def test_the_process_governor_starts_only_where_the_user_left_the_count(monkeypatch, env, cpus, expected) -> None:
    for name in ("BLOCKSPEC_THREADS", "OMP_NUM_THREADS"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(threads, "_decided", False)
    monkeypatch.setattr(threads, "_governor", None)
    monkeypatch.setattr(threads, "_cpus", lambda: cpus)
    monkeypatch.setattr(threads.torch, "get_num_threads", lambda: 2)
    g = threads.governor()
    if expected is None:
        assert g is None
    elif expected == "auto":
        assert g.fixed is None and g.cpus == 2 and g.ceiling == 2
    else:
        assert g.fixed == expected
    assert threads.governor() is g  # decided once per process


@pytest.fixture
def flipping(monkeypatch: pytest.MonkeyPatch):
    """The process governor swapped for one that reads a load changing at every step, so the
    thread count goes 1, 1, 2, 1, 1, 2, ... between steps (2 threads only now and then: on a
    loaded test machine those steps are the slow ones); torch's count restored after."""
    saved = torch.get_num_threads()
    load = FakeLoad()
    gov = Governor(2, 2, load.read, hz=100, clock=load.clock, interval=0.0)
    calls = []

    def read() -> Sample:
        load.others = 0.0 if len(calls) % 3 == 2 else 1.0
        calls.append(torch.get_num_threads())
        return load.read()

    gov._read = read
    monkeypatch.setattr(threads, "_governor", gov)
    monkeypatch.setattr(threads, "_decided", True)
    yield calls
    torch.set_num_threads(saved)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_output_does_not_depend_on_thread_changes_mid_generation(flipping, dtype) -> None:
    """A native target on the C kernels (a prompt over one key chunk, so attention splits a row's
    keys between threads too): DFlash and plain decoding with the count changing at every step
    give the tokens of plain decoding at a fixed count."""
    model = make_tiny_target("llama", seed=5, dtype=torch.float32, vocab_size=300, hidden_size=64,
                             intermediate_size=192, num_hidden_layers=3)
    target = native(model.to(dtype))
    prompts = [(p * 40)[:280] for p in ragged_prompts(2, seed=11, vocab=300)]  # up to 280 tokens
    params = SamplingParams(max_new_tokens=16)
    torch.set_num_threads(1)
    fixed = SpecDecoder(target, None, SpecConfig(block_size=1))
    saved_governor = threads._governor
    threads._governor = None  # the reference: no governor, 1 thread throughout
    truth = [r.token_ids for r in fixed.generate(prompts, params)]
    threads._governor = saved_governor
    scripted = ScriptedDrafter(model, prompts, truth, error_rate=0.3, seed=1)
    trained_like = new_drafter_for_target(model.config, mask_token_id=299, num_layers=1, dtype=torch.float32)
    for drafter, block, adaptive in ((None, 1, False), (scripted, 6, False), (trained_like, 6, True)):
        flipping.clear()
        dec = SpecDecoder(target, drafter, SpecConfig(block_size=block, adaptive=adaptive))
        got = dec.generate(prompts, params)
        assert [r.token_ids for r in got] == truth, (block, adaptive)
        assert {1, 2} <= set(flipping), flipping  # the steps really ran at both counts
        if drafter is scripted:
            assert max(r.stats.mean_tau for r in got) > 1.5  # blocks were verified, not just single tokens
