"""The draft context queue (dflash/feature_queue.py) and what a plain step carries.

A plain step of the DFlash runner must cost what a plain step of plain decoding costs, apart from
appending its features to the queue: no draft pass, no draft-cache upkeep, and no copy of the
queued features at the retirements and joins of a run of plain steps. What the drafter reads
at its next pass stays exactly what the eager queue (every operation applied at once) built."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import make_tiny_target

from blockspec.config import LookupConfig, SamplingParams
from blockspec.dflash.batch import DecodeBatch
from blockspec.dflash.row import make_row
from blockspec.dflash.drafter import new_drafter_for_target
from blockspec.dflash.feature_queue import FeatureQueue
from blockspec.dflash.policy import AdaptiveBlock
from blockspec.targets.native import load_native_target
from blockspec.targets.slots import EMPTY


class EagerQueue:
    """The reference: the queue as one tensor, every operation applied when it happens."""

    def __init__(self) -> None:
        self.feats: torch.Tensor | None = None
        self.pos: torch.Tensor | None = None

    def append(self, feats: torch.Tensor, pos: torch.Tensor) -> None:
        if self.feats is None:
            self.feats, self.pos = feats, pos
        else:
            self.feats, self.pos = torch.cat([self.feats, feats], 1), torch.cat([self.pos, pos], 1)

    def join(self, feats: torch.Tensor, pos: torch.Tensor) -> None:
        if self.feats is None:
            self.feats, self.pos = feats, pos
            return
        width = max(self.feats.shape[1], feats.shape[1])

        def left(t: torch.Tensor, value: float) -> torch.Tensor:
            pad = torch.full((t.shape[0], width - t.shape[1], *t.shape[2:]), value, dtype=t.dtype)
            return torch.cat([pad, t], 1)

        self.feats = torch.cat([left(self.feats, 0.0), left(feats, 0.0)])
        self.pos = torch.cat([left(self.pos, EMPTY), left(pos, EMPTY)])

    def select_rows(self, order: list[int]) -> None:
        if self.feats is not None:
            self.feats, self.pos = self.feats[order], self.pos[order]

    def take(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Everything queued from the first column that any row holds a feature in."""
        held = (self.pos != EMPTY).any(0).nonzero()
        first = int(held[0]) if len(held) else self.pos.shape[1]
        out = (self.feats[:, first:], self.pos[:, first:])
        self.feats = self.pos = None
        return out


@pytest.mark.parametrize("seed", range(6))
def test_queue_builds_what_the_eager_queue_builds(seed: int) -> None:
    """Random runs of appends (some with unkept EMPTY slots), joins of prompts shorter and longer
    than the queue, retirements in any order and draft passes: the same features and positions,
    and the queue lets go of what only rows that left held, and counts its backlog."""
    rng = random.Random(seed)
    lazy, eager = FeatureQueue(), EagerQueue()
    rows, width, stamp, takes = 0, 3, [0], 0

    def features(k: int, c: int, pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        stamp[0] += 1
        feats = torch.arange(k * c * width, dtype=torch.float32).view(k, c, width) + 1000 * stamp[0]
        pos = torch.arange(c).repeat(k, 1) + 100 * stamp[0]
        if pad:
            feats[:, :pad], pos[:, :pad] = 0.0, EMPTY
        return feats, pos

    for _ in range(60):
        op = rng.choice(["append"] * 4 + ["join", "retire", "take"])
        if op == "join" or rows == 0:
            k, c = rng.randint(1, 3), rng.randint(1, 9)
            f, p = features(k, c, pad=rng.randint(0, c - 1))
            lazy.join(f, p)
            eager.join(f, p)
            rows += k
        elif op == "append":
            c = rng.choice([1, 1, 3])
            f, p = features(rows, c)
            if c > 1:
                p[:, rng.randint(1, c - 1):] = EMPTY  # rejected slots of a verify step
            lazy.append(f, p)
            eager.append(f, p)
        elif op == "retire" and rows > 1:
            order = rng.sample(range(rows), rng.randint(1, rows - 1))
            lazy.select_rows(order)
            eager.select_rows(order)
            rows = len(order)
            assert all(p.end > lazy.start for p in lazy.pieces)  # nothing kept before the oldest row's queue
            assert lazy.nbytes == sum(p.feats.nbytes for p in lazy.pieces)
        elif op == "take" and eager.feats is not None:  # a draft pass; its verify appends next
            (lf, lp), (ef, ep) = lazy.take(), eager.take()
            assert torch.equal(lp, ep) and torch.equal(lf, ef)
            assert not lazy and lazy.width == 0
            takes += 1
            f, p = features(rows, 1)
            lazy.append(f, p)
            eager.append(f, p)
        if eager.feats is not None:
            real = (eager.pos != EMPTY).int()  # each row's queue: from its first real column on
            assert lazy.backlog == int((real.shape[1] - real.argmax(1)).sum())
    assert takes > 0  # draft passes ran mid-run, not only at the end
    if eager.feats is not None:
        (lf, lp), (ef, ep) = lazy.take(), eager.take()
        assert torch.equal(lp, ep) and torch.equal(lf, ef)


def test_a_busy_queue_holds_what_its_rows_still_read() -> None:
    """A batch that never drafts replaces a row every few steps: the queue keeps only the columns
    of the rows still in it (each row's prompt and its steps since), however long the run."""
    queue, f = FeatureQueue(), 5
    lifetime, prompt = 24, 3  # 4 rows, the oldest replaced every 6 steps
    queue.join(torch.ones(4, prompt, f), torch.arange(prompt).repeat(4, 1))
    for step in range(1, 600):
        queue.append(torch.ones(4, 1, f), torch.full((4, 1), step))
        if step % 6 == 0:
            queue.select_rows([1, 2, 3])
            queue.join(torch.ones(1, prompt, f), torch.arange(prompt)[None])
        assert queue.width <= lifetime + prompt
        assert queue.backlog <= 4 * (lifetime + prompt)
        assert queue.nbytes <= (lifetime + prompt) * 4 * f * 4 + (lifetime // 6 + 1) * prompt * f * 4
    feats, pos = queue.take()
    assert feats.shape[0] == 4 and feats.shape[1] <= lifetime + prompt
    # the newest row joined at step 594: its prompt, then the 5 steps since, right-aligned
    assert (pos[3, -prompt - 5:] != EMPTY).all() and (pos[3, : -prompt - 5] == EMPTY).all()
    assert pos[3, -5:].tolist() == [595, 596, 597, 598, 599]


def test_queue_refuses_what_does_not_fit() -> None:
    queue = FeatureQueue()
    with pytest.raises(ValueError, match="no queued features"):
        queue.take()
    queue.join(torch.zeros(2, 3, 4), torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="3 rows to a queue of 2"):
        queue.append(torch.zeros(3, 1, 4), torch.zeros(3, 1, dtype=torch.long))


def test_a_plain_step_at_batch_8_carries_no_draft_work() -> None:
    """Under the policy, with drafting priced out: eight rows step plainly, one leaves and one
    joins, and nothing of the drafter runs: no draft pass, no draft-cache upkeep beyond keeping its
    rows, no read of the queue. The features queued meanwhile are the target's own tensors (no
    copy made at the retirement or the join), and the output is plain decoding's."""
    model = make_tiny_target("llama", seed=5)
    target = load_native_target(model, dtype=None, eos_token_ids=())
    drafter = new_drafter_for_target(model.config, mask_token_id=47, num_layers=1, dtype=torch.float64)
    prompts = [[(7 * i + j) % 40 + 3 for j in range(4 + i % 5)] for i in range(10)]
    params = SamplingParams(max_new_tokens=12)

    def decode(batch: DecodeBatch, step) -> dict[int, list[int]]:
        rows = [make_row(i, len(p), params, (), batch.max_block) for i, p in enumerate(prompts[:8])]
        batch.join(prompts[:8], rows)
        out, late = {}, 8
        for n in range(11):
            step(batch)
            if n == 3:  # a row leaves and another joins mid-run
                batch.rows[2].finish_reason = "cancelled"
            for r in batch.retire():
                out[r.key] = r.generated
            if n == 3:
                batch.join([prompts[late]], [make_row(late, len(prompts[late]), params, (), batch.max_block)])
        return out | {r.key: r.generated for r in batch.rows}

    plain = decode(DecodeBatch(target, None, max_block=1), lambda b: b.step(1))
    batch = DecodeBatch(target, drafter, max_block=4, lookup=LookupConfig())
    policy = AdaptiveBlock(4)
    policy.costs.set(8, [1.0, 3.0, 4.0, 5.0], [0.0, 1.0, 1.0, 1.0])  # drafting never pays
    policy.probe_every = policy.base_probe_every = 1 << 20
    calls: dict[str, int] = {}

    def spy(name: str, fn):
        def counted(*args, **kwargs):
            calls[name] = calls.get(name, 0) + 1
            return fn(*args, **kwargs)
        return counted

    class CountedDraft:  # the static drafter, its passes counted
        def __init__(self, inner) -> None:
            self.inner = inner

        def __call__(self, *args, **kwargs):
            return spy("draft pass", self.inner)(*args, **kwargs)

        def __getattr__(self, name: str):
            return getattr(self.inner, name)

    batch.draft = CountedDraft(batch.draft)
    batch.queue.take = spy("queue read", batch.queue.take)
    batch.queue.assemble = spy("queue read", batch.queue.assemble)
    queued: list[torch.Tensor] = []
    real_forward = type(target).forward_greedy

    def forward(*args, **kwargs):
        ids, feats = real_forward(*args, **kwargs)
        queued.append(feats)
        return ids, feats

    type(target).forward_greedy = forward
    try:
        def policy_step(b: DecodeBatch) -> None:
            if b.dcache is not None and not hasattr(b.dcache, "_spied"):
                b.dcache._spied = True
                for name in ("reserve", "compact", "merge", "spawn"):
                    setattr(b.dcache, name, spy(f"draft cache {name}", getattr(b.dcache, name)))
            assert policy.step(b) == 1
        out = decode(batch, policy_step)
    finally:
        type(target).forward_greedy = real_forward
    assert out == plain
    # compact: the native draft cache's no-op at every retire (as the target cache's); merge and
    # spawn: the joining row's draft cache rows, as for its target cache. Nothing else.
    assert set(calls) <= {"draft cache compact", "draft cache merge", "draft cache spawn"}, calls
    assert calls.get("draft cache merge", 0) <= 1
    pieces = batch.queue.pieces
    assert pieces and all(any(p.feats is f for f in queued) for p in pieces)  # the target's tensors, uncopied
