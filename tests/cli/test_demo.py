"""What the demo says when DFlash loses, and about other processes' load (commands/demo.py)."""

from __future__ import annotations

from types import SimpleNamespace

from blockspec.commands import demo
from blockspec.cpu import threads


def test_the_demo_says_why_dflash_lost_in_one_line() -> None:
    plain = demo.why_slower(1.1, {1: 90, 4: 10}, trained=True)
    assert plain.startswith("DFlash decoded plainly in 90% of steps: the drafter's acceptance on this prompt (tau 1.10)")
    drafted = demo.why_slower(1.6, {1: 1, 3: 3}, trained=True)
    assert "drafted in 75% of steps" in drafted and "tau 1.60" in drafted
    assert "untrained" in demo.why_slower(1.0, {1: 5}, trained=False)
    assert all("\n" not in line for line in (plain, drafted))


def test_the_demo_names_the_load_that_took_threads(monkeypatch) -> None:
    monkeypatch.setattr(threads, "governor", lambda: SimpleNamespace(others=1.04, cpus=2, threads=1))
    assert demo.load_note() == "other processes used ~1.0 of 2 cores: decoding ran on 1 thread"
    monkeypatch.setattr(threads, "governor", lambda: SimpleNamespace(others=0.1, cpus=2, threads=2))
    assert demo.load_note() == ""  # a quiet machine: nothing to say
    monkeypatch.setattr(threads, "governor", lambda: None)
    assert demo.load_note() == ""
