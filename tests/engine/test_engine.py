"""The continuous-batching engine: joins, leaves, cancel, queue bound, errors, decoding with the
adaptive block size (whose own tests are in tests/dflash/test_policy.py)."""

from __future__ import annotations

import asyncio

import pytest
import torch
from conftest import make_tiny_target
from support import OracleDrafter, distinct_prompts, reference_greedy, run_with_joins

from blockspec.config import SamplingParams, SpecConfig
from blockspec.engine import Engine, EngineConfig, QueueFullError
from blockspec.dflash.policy import AdaptiveBlock, CostModel
from blockspec.errors import ConfigError, ContextLengthError
from blockspec.dflash.drafter import new_drafter_for_target
from blockspec.targets.native import load_native_target
from blockspec.targets.slots import EMPTY
from blockspec.targets.hf import HFTarget


@pytest.fixture(scope="module")
def setup():
    model = make_tiny_target("llama", seed=21)
    target = load_native_target(model, dtype=None, eos_token_ids=())
    prompts = distinct_prompts(6, seed=3)
    truths = [reference_greedy(model, p, 30) for p in prompts]
    return model, target, prompts, truths


@pytest.mark.parametrize("backend", ["native", "hf"])
def test_requests_joining_mid_flight_get_the_same_output_as_alone(setup, backend) -> None:
    model, native, prompts, truths = setup
    target = native if backend == "native" else HFTarget(model)
    drafter = OracleDrafter(model, native, prompts, truths)
    engine = Engine(target, drafter, EngineConfig(SpecConfig(block_size=6), max_batch=3))
    try:
        outputs = run_with_joins(engine, prompts, SamplingParams(max_new_tokens=30))
        assert outputs == truths
        m = engine.metrics
        assert m.requests_total == 6 and m.requests_running == 0 and m.tokens_generated_total == 180
        assert engine.recorder.row_steps > m.steps_total  # steps really shared rows
        assert 1.5 < m.mean_tau < 6
    finally:
        engine.stop()


def test_engine_with_lookup_is_lossless_for_joining_requests(setup) -> None:
    """n-gram lookup proposals in the continuous-batching engine: rows join mid-flight, each has
    its own token index, and the output is each request's own."""
    from blockspec.dflash.lookup import LookupConfig

    model, target, prompts, truths = setup
    drafter = new_drafter_for_target(model.config, mask_token_id=47, num_layers=1, dtype=torch.float64)
    engine = Engine(target, drafter, EngineConfig(SpecConfig(block_size=6, lookup=LookupConfig(min_ngram=2)), max_batch=3))
    try:
        params = SamplingParams(max_new_tokens=30)
        handles = [engine.submit(p, params) for p in prompts[:2]]
        next(iter(handles[0].events(timeout=60)))
        handles += [engine.submit(p, params) for p in prompts[2:]]
        results = [h.result(timeout=120) for h in handles]
        assert [r.token_ids for r in results] == truths
        assert sum(r.stats.lookup_steps for r in results) > 0
    finally:
        engine.stop()


class _FixedCosts(CostModel):
    """Step costs that real timings do not move, so the test does not depend on machine load:
    a calibration is recorded (its bucket) but its timings are replaced by verify-cost-like ones."""

    def set(self, batch: int, costs: list[float], drafting: list[float] | None = None) -> None:
        super().set(batch, [1.0 + 0.1 * (n - 1) for n in range(1, self.max_block + 1)])

    def observe(self, batch: int, block: int, seconds: float) -> None:
        pass


def test_adaptive_block_size_never_changes_the_output(setup) -> None:
    model, target, prompts, truths = setup
    good = OracleDrafter(model, target, prompts, truths, wrong_every=7)
    bad = new_drafter_for_target(model.config, mask_token_id=47, num_layers=1, dtype=torch.float64)
    for drafter in (good, bad):
        engine = Engine(target, drafter, EngineConfig(SpecConfig(block_size=8, adaptive=True), max_batch=4))
        engine.adaptive.costs = _FixedCosts(max_block=8)  # the choice must not hang on machine load
        try:
            assert run_with_joins(engine, prompts, SamplingParams(max_new_tokens=30)) == truths
            assert sorted(engine.adaptive.costs.calibrated) == [1, 2, 4]  # every bucket, calibrated at start
            used = engine.metrics.block_sizes
            assert len(used) > 1  # it did adapt
            favourite = max(used, key=used.get)
            assert favourite > 2 if drafter is good else favourite == 1, used
        finally:
            engine.stop()


def test_engine_with_verify_lengths_per_row_is_lossless(setup) -> None:
    """EngineConfig(ragged_verify=True): the adaptive policy gives each row of a batch its own
    verify length from its drafts' confidences; the output stays the target's."""
    model, target, prompts, truths = setup
    good = OracleDrafter(model, target, prompts, truths, wrong_every=3)
    engine = Engine(target, good, EngineConfig(SpecConfig(block_size=8, adaptive=True, ragged_verify=True), max_batch=4))
    engine.adaptive.costs = _FixedCosts(max_block=8)
    steps: list[tuple[int, int, int]] = []  # (rows, tokens verified, longest row's)
    plain = engine.batch.step

    def step(block, trim=None):
        q = plain(block, trim)
        steps.append((len(engine.batch.rows), engine.batch.verified, q))
        return q

    engine.batch.step = step
    try:
        assert run_with_joins(engine, prompts, SamplingParams(max_new_tokens=30)) == truths
    finally:
        engine.stop()
    assert any(rows > 1 and verified < rows * q for rows, verified, q in steps), steps  # ragged steps ran
    with pytest.raises(ConfigError, match="ragged_verify"):
        EngineConfig(SpecConfig(ragged_verify=1))


def test_spec_decoder_adaptive_block_is_lossless_and_adapts(setup) -> None:
    """The Python API's adaptive mode (SpecConfig.adaptive) runs the engine's policy."""
    from blockspec.config import SpecConfig
    from blockspec.engine.decoder import SpecDecoder

    model, target, prompts, truths = setup
    good = OracleDrafter(model, target, prompts, truths, wrong_every=7)
    bad = new_drafter_for_target(model.config, mask_token_id=47, num_layers=1, dtype=torch.float64)
    for drafter in (good, bad):
        decoder = SpecDecoder(target, drafter, SpecConfig(block_size=8, adaptive=True))
        decoder.adaptive_policy.costs = _FixedCosts(max_block=8)
        for prompt, truth in zip(prompts[:3], truths[:3]):
            assert decoder.generate([prompt], SamplingParams(max_new_tokens=30))[0].token_ids == truth
        used = decoder.block_choices
        favourite = max(used, key=used.get)
        assert favourite > 2 if drafter is good else favourite == 1, used
        fixed = decoder.generate(prompts[:2], SamplingParams(max_new_tokens=30), block_size=3)
        assert [r.token_ids for r in fixed] == truths[:2]
        assert decoder.block_choices == used  # an explicit block size bypasses the policy


class _CheapDrafts(_FixedCosts):
    """_FixedCosts whose calibration also timed the draft passes: 0.01 at every width."""

    def set(self, batch: int, costs: list[float], drafting: list[float] | None = None) -> None:
        CostModel.set(self, batch, [1.0 + 0.1 * (n - 1) for n in range(1, self.max_block + 1)],
                      [0.0] + [0.01] * (self.max_block - 1))


def test_adaptive_steps_draft_the_chosen_width_unless_wider_is_cheap(setup) -> None:
    """A short adaptive block costs what a fixed short block costs: the drafter sees exactly the
    chosen width, unless a lone row's step can draft wider for next to nothing; then it drafts
    the whole block and verifies what the drafts' confidences earn. The output is the target's."""
    from blockspec.dflash.batch import DecodeBatch
    from blockspec.dflash.row import make_row

    model, target, prompts, truths = setup
    for costs, n in ((_FixedCosts(max_block=8), 3), (_CheapDrafts(max_block=8), 3), (_CheapDrafts(max_block=8), 1)):
        drafter = OracleDrafter(model, target, prompts, truths, wrong_every=3)  # favours small blocks
        batch = DecodeBatch(target, drafter, max_block=8)
        params = SamplingParams(max_new_tokens=30)
        rows = [make_row(i, len(p), params, (), 8) for i, p in enumerate(prompts[:n])]
        batch.join(prompts[:n], rows)
        policy = AdaptiveBlock(8, costs=costs)
        policy.calibrate_all(batch, 4)  # before counting: calibration drafts every width itself
        widths, chosen = [], []
        draft = batch.draft
        batch.draft = lambda f, fp, emb, pos, cache: (widths.append(emb.shape[1]), draft(f, fp, emb, pos, cache))[1]
        while len(batch):
            chosen.append(policy.step(batch))
            batch.retire()
        assert [r.generated for r in rows] == truths[:n]
        drafting = [k for k in chosen if k > 1]
        if n == 1:  # cheap wide drafts for a lone row; the oracle is sure of each: all verified
            assert widths.count(8) > len(widths) // 2, widths
        else:  # no timed draft passes, or a batch of rows: exactly the chosen width
            assert widths == drafting and drafting and max(drafting) < 8, (chosen, widths)


def test_trimmed_verify_never_changes_the_output(setup) -> None:
    """Steps that draft a block and verify only part of it, down to one token, commit the
    target's own tokens (the native cache must not read the slots past a trimmed block)."""
    import random

    from blockspec.dflash.batch import DecodeBatch
    from blockspec.dflash.row import make_row

    model, target, prompts, truths = setup
    rng = random.Random(0)
    bad = new_drafter_for_target(model.config, mask_token_id=47, num_layers=1, dtype=torch.float64)
    oracle = OracleDrafter(model, target, prompts, truths, wrong_every=6)
    # one row alone too: a lone query's forward reads every slot up to the horizon unmasked
    for drafter, n in ((oracle, 3), (bad, 3), (bad, 1)):
        batch = DecodeBatch(target, drafter, max_block=8)
        rows = [make_row(i, len(p), SamplingParams(max_new_tokens=30), (), 8) for i, p in enumerate(prompts[:n])]
        batch.join(prompts[:n], rows)
        lengths: list[int] = []

        def trim(confidence, looked):  # alone: a long verify (stale slots), then one token, often
            width = len(confidence[0]) + 1
            lengths.append(rng.randint(1, width) if n > 1 else (width, 1, 1, 3, 1)[len(lengths) % 5])
            return lengths[-1]

        while len(batch):
            batch.step(8, trim)
            batch.retire()
        assert [r.generated for r in rows] == truths[:n]
        assert 1 in lengths and max(lengths) > 4, lengths


@pytest.mark.parametrize("backend", ["native", "hf"])
def test_verify_lengths_per_row_never_change_the_output(setup, backend) -> None:
    """Ragged steps (each row verifies its own number of drafted tokens, the rest of its block
    is padding) commit the target's own tokens, on the native target (which leaves padding out
    of its matmuls) and through the Hugging Face adapter."""
    import random

    from blockspec.dflash.batch import DecodeBatch
    from blockspec.dflash.row import make_row

    model, native_target, prompts, truths = setup
    target = native_target if backend == "native" else HFTarget(model)
    rng = random.Random(1)
    oracle = OracleDrafter(model, target, prompts, truths, wrong_every=4)
    batch = DecodeBatch(target, oracle, max_block=8)
    rows = [make_row(i, len(p), SamplingParams(max_new_tokens=30), (), 8) for i, p in enumerate(prompts)]
    batch.join(prompts, rows)
    verified: list[tuple[list[int], int]] = []

    def trim(confidence, looked):
        lengths = [rng.randint(1, len(c) + 1) for c in confidence]
        verified.append((lengths, 0))
        return lengths

    while len(batch):
        batch.step(8, trim)
        verified[-1] = (verified[-1][0], batch.verified)
        batch.retire()
    assert [r.generated for r in rows] == truths
    assert all(sum(lengths) == n for lengths, n in verified)  # padding is not counted as verified
    assert any(min(lengths) == 1 and max(lengths) > 4 for lengths, _ in verified)


def test_decode_batch_reports_draft_passes_that_catch_up(setup) -> None:
    """`caught_up` after a step: its draft pass read rows that joined since the last one, or the
    context of more than one plain step; not after a plain step or a steady drafting step."""
    from blockspec.dflash.batch import DecodeBatch
    from blockspec.dflash.row import make_row

    model, target, prompts, _ = setup
    drafter = new_drafter_for_target(model.config, mask_token_id=47, num_layers=1, dtype=torch.float64)
    batch = DecodeBatch(target, drafter, max_block=4)
    rows = [make_row(i, len(p), SamplingParams(max_new_tokens=40), (), 4) for i, p in enumerate(prompts[:3])]
    batch.join(prompts[:2], rows[:2])
    seen = []
    for block in (2, 3, 1, 2, 1, 1, 2, 2):
        batch.step(block)
        seen.append(batch.caught_up)
    assert seen == [True, False, False, False, False, False, True, False]
    batch.join(prompts[2:3], rows[2:3])
    batch.step(1)
    assert not batch.caught_up
    batch.step(2)
    assert batch.caught_up


def test_cancel_frees_the_slot(setup) -> None:
    _, target, prompts, truths = setup
    engine = Engine(target, None, EngineConfig(SpecConfig(block_size=1), max_batch=1))
    try:
        long = engine.submit(prompts[0], SamplingParams(max_new_tokens=400, ignore_eos=True))
        waiting = engine.submit(prompts[1], SamplingParams(max_new_tokens=30))
        next(long.events(timeout=60))
        long.cancel()
        events = list(long.events(timeout=60))
        assert events[-1].finished and events[-1].finish_reason == "cancelled"
        assert waiting.result(timeout=60).token_ids == truths[1]
        assert engine.metrics.requests_running == 0 and engine.metrics.cancelled_total == 1
        queued = engine.submit(prompts[2], SamplingParams(max_new_tokens=5))
        queued.cancel()  # cancelled before or right after admission
        assert queued.result(timeout=60).finish_reason in ("cancelled", "length")
    finally:
        engine.stop()


def test_queue_full_raises(setup) -> None:
    _, target, prompts, _ = setup
    engine = Engine(target, None, EngineConfig(SpecConfig(block_size=1), max_batch=1, max_queue=1))
    params = SamplingParams(max_new_tokens=400, ignore_eos=True)
    try:
        handles = [engine.submit(prompts[0], params), engine.submit(prompts[1], params)]
        with pytest.raises(QueueFullError, match="max_queue"):
            engine.submit(prompts[2], params)
        for h in handles:
            h.cancel()
        for h in handles:
            assert h.result(timeout=60).finish_reason == "cancelled"
        assert engine.submit(prompts[2], SamplingParams(max_new_tokens=3)).result(timeout=60).finish_reason == "length"
    finally:
        engine.stop()


def test_invalid_requests_fail_at_submit(setup) -> None:
    _, target, prompts, _ = setup
    engine = Engine(target, None, EngineConfig(SpecConfig(block_size=1)))
    with pytest.raises(ContextLengthError):
        engine.submit(prompts[0], SamplingParams(max_new_tokens=10_000))
    assert not engine.running  # nothing was queued, the thread never started


class FlakyTarget:
    """Delegates to a target but raises on chosen forward calls."""

    def __init__(self, target, fail_on: set[int]) -> None:
        self.inner = target
        self.info = target.info
        self.calls = 0
        self.fail_on = fail_on

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def forward(self, *args, **kwargs):
        self.calls += 1
        if self.calls in self.fail_on:
            raise RuntimeError("injected failure")
        return self.inner.forward(*args, **kwargs)


def test_exception_in_a_step_fails_that_step_only(setup) -> None:
    model, target, prompts, truths = setup
    flaky = FlakyTarget(target, fail_on={4})  # call 1 = prefill, 2.. = steps
    drafter = new_drafter_for_target(model.config, mask_token_id=47, num_layers=1, dtype=torch.float64)
    engine = Engine(flaky, drafter, EngineConfig(SpecConfig(block_size=4), max_batch=2))
    try:
        failed = engine.submit(prompts[0], SamplingParams(max_new_tokens=30))
        events = list(failed.events(timeout=60))
        assert events[-1].finish_reason == "error" and "injected failure" in events[-1].error
        with pytest.raises(RuntimeError, match="injected failure"):
            failed.result()
        assert engine.running
        assert engine.generate(prompts[1], SamplingParams(max_new_tokens=30), timeout=60).token_ids == truths[1]
        assert engine.metrics.errors_total == 1
    finally:
        engine.stop()
    assert not engine.running


def test_streaming_events_per_request_params_and_aevents(setup) -> None:
    model, target, prompts, truths = setup
    drafter = OracleDrafter(model, target, prompts, truths)
    engine = Engine(target, drafter, EngineConfig(SpecConfig(block_size=5), max_batch=4))
    try:
        greedy = engine.submit(prompts[0], SamplingParams(max_new_tokens=30))
        sampled = engine.submit(prompts[1], SamplingParams(max_new_tokens=20, temperature=1.0, top_k=5, seed=3))
        stop_at = truths[2][6]
        stopped = engine.submit(prompts[2], SamplingParams(max_new_tokens=30, stop_token_ids=(stop_at,)))
        cut = engine.submit(prompts[3], SamplingParams(max_new_tokens=30),
                            stop_check=lambda ids: 4 if len(ids) >= 4 else None)
        streamed = []
        for event in greedy.events(timeout=60):
            streamed += event.token_ids
        assert streamed == truths[0] and event.finished and event.stats.mean_tau > 1.5

        async def collect(handle):
            return [e async for e in handle.aevents()]

        events = asyncio.run(collect(sampled))
        tokens = [t for e in events for t in e.token_ids]
        assert len(tokens) == 20 and events[-1].finish_reason == "length"
        assert sampled.result().token_ids == tokens
        result = stopped.result(timeout=60)
        assert result.token_ids == truths[2][: truths[2].index(stop_at) + 1] and result.finish_reason == "stop"
        assert cut.result(timeout=60).token_ids == truths[3][:4]
    finally:
        engine.stop()


def test_stop_cancels_queued_and_running(setup) -> None:
    _, target, prompts, _ = setup
    engine = Engine(target, None, EngineConfig(SpecConfig(block_size=1), max_batch=1))
    params = SamplingParams(max_new_tokens=400, ignore_eos=True)
    running = engine.submit(prompts[0], params)
    queued = engine.submit(prompts[1], params)
    next(running.events(timeout=60))
    engine.stop()
    assert running.result(timeout=10).finish_reason == "cancelled"
    assert queued.result(timeout=10).finish_reason == "cancelled"


def test_run_until_idle_runs_what_its_callback_submits_after_the_last_request_ends(setup) -> None:
    """The callback hears that the only running request ended and submits another: that one is
    decoded before run_until_idle returns, not left queued with its handle waiting forever."""
    model, target, prompts, truths = setup
    drafter = OracleDrafter(model, target, prompts, truths, wrong_every=5)
    engine = Engine(target, drafter, EngineConfig(SpecConfig(block_size=6), max_batch=2, own_thread=False))
    first = engine.submit(prompts[0], SamplingParams(max_new_tokens=30))
    later = []

    def replace(_ended: int) -> None:
        if not later:
            later.append(engine.submit(prompts[1], SamplingParams(max_new_tokens=30)))

    engine.run_until_idle(replace)
    assert first.result(timeout=0).token_ids == truths[0]
    assert later[0].result(timeout=0).token_ids == truths[1]


def test_engine_without_own_thread_decodes_on_the_callers_thread(setup) -> None:
    model, target, prompts, truths = setup
    drafter = OracleDrafter(model, target, prompts, truths, wrong_every=5)
    engine = Engine(target, drafter, EngineConfig(SpecConfig(block_size=6, adaptive=True), max_batch=2, own_thread=False))
    engine.adaptive.costs = _FixedCosts(max_block=6)
    assert engine.wait_ready()  # calibrates here, on this thread
    assert sorted(engine.adaptive.costs.calibrated) == [1, 2]
    handles = [engine.submit(p, SamplingParams(max_new_tokens=30)) for p in prompts]
    assert not engine.running and not any(h.done for h in handles)  # nothing decodes on its own
    finished: list[int] = []
    engine.run_until_idle(finished.append)
    assert not engine.running
    assert sum(finished) == len(prompts) and len(finished) > 1  # progress came step by step
    assert [h.result(timeout=0).token_ids for h in handles] == truths
    assert engine.metrics.requests_running == 0 and engine.metrics.queue_depth == 0
    engine.run_until_idle()  # nothing left: returns at once
    assert engine.generate(prompts[0], SamplingParams(max_new_tokens=30)).token_ids == truths[0]
    with pytest.raises(ConfigError, match="run_until_idle"):
        engine.start()
    with pytest.raises(ConfigError, match="own_thread must be True or False"):
        EngineConfig(own_thread="no")
    threaded = Engine(target, drafter, EngineConfig(SpecConfig(block_size=6), max_batch=2))
    with pytest.raises(ConfigError, match="own_thread=False"):
        threaded.run_until_idle()


def test_plain_steps_queue_every_committed_tokens_features_for_the_next_draft(setup) -> None:
    """Between draft passes the features of committed tokens wait for the drafter (kept as pieces,
    so plain steps, retirements and joins copy nothing): whatever plain steps, retirements and joins happen meanwhile,
    the next draft pass gets each row's features of exactly the tokens it has not seen, in
    order, equal to a full forward's."""
    from blockspec.dflash.batch import DecodeBatch
    from blockspec.dflash.row import make_row
    from blockspec.train.features import target_features

    model, target, prompts, truths = setup
    drafter = new_drafter_for_target(model.config, mask_token_id=47, num_layers=1, dtype=torch.float64)
    batch = DecodeBatch(target, drafter, max_block=4)
    rows = [make_row(i, len(p), SamplingParams(max_new_tokens=30), (), 4) for i, p in enumerate(prompts[:3])]
    batch.join(prompts[:3], rows[:3])
    batch.step(4)  # a draft pass: the prompts' features are in the draft cache now
    seen = {r.key: len(prompts[r.key]) for r in batch.rows}  # that pass gave the drafter the prompts
    for _ in range(3):
        batch.step(1)
    assert len(batch.queue.pieces) == 4  # the draft step's verify and three plain steps, not yet joined
    rows[1].finish_reason = "cancelled"
    batch.retire()
    batch.step(1)
    late = make_row(3, len(prompts[3]), SamplingParams(max_new_tokens=30), (), 4)
    batch.join([prompts[3]], [late])
    seen[3] = 0
    batch.step(1)
    feats, pos = batch.queue.assemble()  # [b, c, L*H], [b, c] (EMPTY left padding)
    assert [r.key for r in batch.rows] == [0, 2, 3]
    layer_ids = drafter.target_layer_ids
    for i, r in enumerate(batch.rows):
        ids = prompts[r.key] + r.generated[:-1]  # every token fed to the target so far
        keep = pos[i] != EMPTY
        want = torch.arange(seen[r.key], len(ids))
        assert torch.equal(pos[i][keep].cpu(), want), (r.key, pos[i])
        full = target_features(target, [ids], layer_ids)[0]  # [S, L*H]
        torch.testing.assert_close(feats[i][keep].float(), full[want], rtol=1e-6, atol=1e-6)
    for r, truth in ((rows[0], truths[0]), (rows[2], truths[2])):  # and the output is the target's
        while r.finish_reason is None:
            batch.step(4)
            batch.retire()
        assert r.generated == truth


@pytest.mark.parametrize("tree_nodes", [0, 7])
def test_reserved_caches_never_grow_while_requests_decode(setup, tree_nodes) -> None:
    """`Engine.reserve` sizes the target's and the drafter's stores up front: joins and steps
    (chains or trees) within that size write into the same storage, and the output is unchanged.
    Without it the same requests grow both stores mid-run."""
    model, target, prompts, _ = setup
    drafter = new_drafter_for_target(model.config, mask_token_id=47, num_layers=1, dtype=torch.float64)
    new = 80  # past the stores' first 64 slots
    truths = [reference_greedy(model, p, new) for p in prompts]

    def run(reserve: bool) -> tuple[list[list[int]], list[bool]]:
        engine = Engine(target, drafter, EngineConfig(SpecConfig(block_size=6, tree_nodes=tree_nodes), max_batch=3,
                                                      release_idle_s=None))
        try:
            if reserve:
                engine.reserve(3, max(len(p) for p in prompts) + new)
            before = [None, None] if not reserve else [engine.batch.tcache.store.kv, engine.batch.dcache.store.kv]
            outputs = run_with_joins(engine, prompts, SamplingParams(max_new_tokens=new))
            after = [engine.batch.tcache.store.kv, engine.batch.dcache.store.kv]
            assert engine.batch.tcache.store.capacity >= max(len(p) for p in prompts) + new
        finally:
            engine.stop()
        return outputs, [a is b for a, b in zip(after, before)]

    outputs, kept = run(reserve=True)
    assert outputs == truths and kept == [True, True]
    outputs, kept = run(reserve=False)
    assert outputs == truths and kept == [False, False]


def test_reserve_is_for_an_idle_engine(setup) -> None:
    model, target, prompts, _ = setup
    engine = Engine(target, None, EngineConfig(SpecConfig(block_size=1), max_batch=2, own_thread=False))
    with pytest.raises(ConfigError, match="rows >= 1 and tokens >= 1"):
        engine.reserve(2, 0)
    engine.submit(prompts[0], SamplingParams(max_new_tokens=4))
    engine.step_once()  # the request joined and decodes
    with pytest.raises(ConfigError, match="idle engine"):
        engine.reserve(2, 64)
    engine.run_until_idle()
    engine.reserve(2, 64)  # idle again
    assert engine.batch.tcache.store.capacity >= 64 + 2 and engine.batch.tcache.store.rows >= 2
