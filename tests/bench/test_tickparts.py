"""`python -m blockspec.bench.tickparts`: a decoding tick's parts, the C kernels against the host work."""

from __future__ import annotations

import pytest

from blockspec.bench import tickparts
from blockspec.bench.runner import EngineRunner, Request
from blockspec.config import LookupConfig, SamplingParams
from blockspec.cpu import kernels
from blockspec.dflash.batch import DecodeBatch
from blockspec.engine.engine import Engine


@pytest.fixture(scope="module")
def pipe(tiny_model_dir, tiny_drafter_dir):
    from blockspec.api import load

    return load(str(tiny_model_dir), str(tiny_drafter_dir))


def _runners(pipe, concurrency: int = 1) -> dict[str, EngineRunner]:
    runners = {"ar": EngineRunner(pipe.target, None, 1),
               "dflash": EngineRunner(pipe.target, pipe.drafter, 4, adaptive=True, lookup=LookupConfig(), tree_nodes=3)}
    for runner in runners.values():
        runner.prepare(concurrency)
    return runners


def test_ticks_are_booked_to_their_parts_and_the_timers_leave_no_trace(pipe) -> None:
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    requests = [Request((5, 6, 7, 5, 6), params), Request((1, 2, 3), params)]
    lib, tick, verify = kernels.kernel(), Engine.__dict__["_tick"], DecodeBatch.__dict__["_verify_and_commit"]
    results = tickparts.measure(_runners(pipe), requests)
    # everything is put back
    assert kernels.kernel() is lib and Engine.__dict__["_tick"] is tick
    assert DecodeBatch.__dict__["_verify_and_commit"] is verify
    # timing changes no token: lossless against AR, and the same as an untimed run
    assert results["ar"]["outputs"] == results["dflash"]["outputs"]
    plain = EngineRunner(pipe.target, None, 1)
    assert [plain.run([r], 1)[0].token_ids for r in requests] == results["ar"]["outputs"]
    for name, r in results.items():
        # the tokens of the decoding ticks: all but what each request's prefill tick committed
        assert 0 < r["tokens"] < 2 * 12
        parts = r["parts"]
        whole = parts["tick"]
        assert r["ticks"] == whole["calls"] > 0 and r["seconds"] == whole["wall"]
        for part, p in parts.items():  # every part lies inside the ticks, its kernels inside it
            assert 0 <= p["kernel"] <= p["wall"] <= whole["wall"], (name, part, p)
        assert parts["target pass"]["calls"] >= r["ticks"]  # every decoding tick runs the target
        if lib is not None:  # the layer program runs in C: the target's pass spends time there
            assert parts["target pass"]["kernel"] > 0
        md = tickparts.table(name, r)
        assert md.startswith(f"{name}: {r['ticks']} decoding ticks") and "| target pass |" in md
    assert "draft pass" in results["dflash"]["parts"] and "draft pass" not in results["ar"]["parts"]


def test_a_tick_that_prefills_a_join_is_not_a_decoding_tick(pipe) -> None:
    """The first tick of a request admits it (its prefill, then a step of the batch): it is left out
    with the tokens it committed, so AR books one token per decoding tick."""
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    results = tickparts.measure({"ar": _runners(pipe)["ar"]}, [Request((4, 5, 6), params)])
    assert results["ar"]["ticks"] == results["ar"]["tokens"] == 4


def test_requests_in_flight_together_decode_what_they_decode_one_at_a_time(pipe) -> None:
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    requests = [Request((5, 6, 7), params), Request((1, 2, 3, 4), params), Request((9, 8), params)]
    together = tickparts.measure(_runners(pipe, 3), requests, concurrency=3)
    alone = tickparts.measure(_runners(pipe), requests)
    assert together["ar"]["outputs"] == together["dflash"]["outputs"] == alone["ar"]["outputs"]
    # three rows a tick: fewer ticks than one request at a time, each committing more
    assert together["ar"]["ticks"] < alone["ar"]["ticks"]
    assert together["ar"]["tokens"] / together["ar"]["ticks"] > 2


def test_the_library_proxy_times_every_entry_point() -> None:
    book = tickparts.Book()
    calls = []

    class Lib:
        max_rows = {"fp32": 128}
        path = "vnni"

        def __call__(self, *args):
            calls.append(("self", args))
            return 0

        def norm(self, x):
            calls.append(("norm", x))
            return 1

    lib = Lib()
    lib.per_dtype = {"fp32": lambda x: calls.append(("dtype", x)) or 2}
    proxy = tickparts.TimedLibrary(lib, book)
    assert proxy(3) == 0 and proxy.norm(4) == 1 and proxy.per_dtype["fp32"](5) == 2
    assert proxy.max_rows == {"fp32": 128} and proxy.path == "vnni"  # plain values pass through
    assert calls == [("self", (3,)), ("norm", 4), ("dtype", 5)] and book.kernel_s > 0
    with pytest.raises(AttributeError):
        proxy.missing
