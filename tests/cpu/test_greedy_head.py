"""The screened greedy head (cpu/greedy_head.py): the same ids as the argmax of the fp32 logits."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_target
from support import native
from support import reference_greedy

from blockspec.config import SamplingParams, SpecConfig
from blockspec.cpu import kernels
from blockspec.cpu.argmax import greedy_ids
from blockspec.dflash.drafter import new_drafter_for_target
from blockspec.cpu.greedy_head import BOUND_SCALE, GreedyHead
from blockspec.targets.slots import EMPTY
from blockspec.targets.base import greedy_forward
from blockspec.engine.decoder import SpecDecoder

pytestmark = pytest.mark.skipif(kernels.kernel() is None, reason="needs the native CPU kernel (a C compiler)")


def _head(v: int, h: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(v, h, generator=g) * torch.rand(v, 1, generator=g) * 2  # rows of unequal norms
    w[5:8] *= 3 * w.norm(dim=1).max() / w[5:8].norm(dim=1, keepdim=True)  # the largest rows: x along one picks it
    w[11] = w[5]  # an exact tie: the first index must win
    w[20] = w[6] * (1 + 2**-22)  # logits a few fp32 ulps apart: the same bf16 rows, a screened tie
    w[21] = w[7] + 1e-6 * torch.randn(h, generator=g)
    # rows 40..79 in pairs 0.1% apart: their bf16 roundings differ, and so can their order
    w[40:80:2] *= 3 * w.norm(dim=1).max() / w[40:80:2].norm(dim=1, keepdim=True)
    w[41:80:2] = w[40:80:2] * (1 + 1e-3 * torch.randn(20, h, generator=g))
    return w.contiguous()


def _exact_ids(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """What greedy decoding picked before the screen: argmax of the fp32 kernel's logits."""
    return greedy_ids(kernels.rows_matmul(x, w, None))


@pytest.mark.parametrize("h", [64, 67])  # 67: the scalar tails of every loop
def test_screened_ids_equal_the_argmax_of_the_fp32_logits(h: int) -> None:
    w = _head(3000, h, seed=h)
    head = GreedyHead(w)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, h, generator=g) * 3
    # rows aimed at the near-ties: x along the tied / nearly tied weight rows
    x[:8] = w[[5, 6, 7, 5, 6, 7, 11, 20]] * 4 + 0.01 * torch.randn(8, h, generator=g)
    x[8:28] = w[40:80:2] * 4 + 0.01 * torch.randn(20, h, generator=g)
    seen = torch.empty(64, dtype=torch.int64)
    got = head.ids(x, seen)
    want = _exact_ids(x, w)
    assert torch.equal(got, want)
    # the case the exact pass exists for: the bf16 screen alone would pick another id
    assert not torch.equal((x.bfloat16().float() @ w.bfloat16().float().T).argmax(-1), want)
    assert got[0] == 5 and got[3] == 5 and got[6] == 5  # the tie went to the first index
    for n in (1, 2, 5, 16):  # any row count: each row alone gets the same id
        assert torch.equal(head.ids(x[:n]), _exact_ids(x[:n], w))
    # it screens: far fewer exact logits than the vocabulary, and both tied rows where tied
    assert seen.float().mean() < 30 and int(seen[0]) >= 2 and int(seen.max()) < 3000
    # leading shapes are kept
    assert torch.equal(head.ids(x.view(4, 16, h)), got.view(4, 16))


def test_the_bound_holds_with_room() -> None:
    """The screen's error against the fp32 logits stays well inside the bound the kernel trusts
    (the proof is in rows.c; this checks no factor was lost on real numbers)."""
    w = _head(2000, 96, seed=3)
    x = torch.randn(32, 96, generator=torch.Generator().manual_seed(2)) * 5
    exact = kernels.rows_matmul(x, w, None).double()
    screened = x.bfloat16().double() @ w.bfloat16().double().T
    bound = BOUND_SCALE * x.double().norm(dim=1, keepdim=True) * w.double().norm(dim=1)[None]
    assert float(((exact - screened).abs() / bound).max()) < 0.5


def test_non_finite_rows_and_other_dtypes_fall_back() -> None:
    w = _head(500, 64, seed=4)
    head = GreedyHead(w)
    x = torch.randn(3, 64)
    x[1, 7] = float("nan")
    assert head.ids(x) is None  # the caller computes the logits instead
    assert head.ids(x[[0, 2]].double()) is None
    assert not GreedyHead.available(w.double()) and GreedyHead.available(w)
    broken = w.clone()
    broken[3, 0] = float("inf")
    assert GreedyHead(broken).ids(x[[0, 2]]) is None


def _fp32_target(seed: int):
    model = make_tiny_target("llama", seed=seed, vocab_size=320, dtype=torch.float32)
    return model, native(model)


def test_native_greedy_forward_equals_the_argmax_of_its_logits() -> None:
    """Plain, ragged (packed padding) and last-position forwards, and a changed head weight."""
    _, target = _fp32_target(21)
    g = torch.Generator().manual_seed(5)
    ctx = torch.randint(0, 320, (3, 12), generator=g)
    pos = torch.arange(12).expand(3, 12).contiguous()
    block = torch.randint(0, 320, (3, 4), generator=g)
    bpos = torch.arange(12, 16).expand(3, 4).clone()
    bpos[1, 2:] = EMPTY  # a ragged step: row 1 verifies 2 tokens
    a, b = target.new_cache(3, capacity=32), target.new_cache(3, capacity=32)
    logits, feats = target.forward(ctx, pos, a, (1, 3), last_logits_only=True)
    best, feats_g = target.forward_greedy(ctx, pos, b, (1, 3), last_logits_only=True)
    assert torch.equal(best, greedy_ids(logits)) and torch.equal(feats, feats_g)
    logits, feats = target.forward(block, bpos, a, (1, 3))
    best, feats_g = greedy_forward(target, block, bpos, b, (1, 3))
    real = bpos != EMPTY
    assert best.shape == (3, 4) and torch.equal(best[real], greedy_ids(logits)[real])
    assert torch.equal(feats, feats_g)
    assert target.net.backend.greedy_head is not None  # the screen ran
    with torch.no_grad():
        target.net.lm_head.weight.mul_(-1)  # a changed head: the screen is rebuilt, not reused
    logits, _ = target.forward(block[:, :1], bpos[:, :1], a)
    assert torch.equal(greedy_forward(target, block[:, :1], bpos[:, :1], b)[0], greedy_ids(logits))


def test_fp32_dflash_through_the_screen_equals_plain_decoding() -> None:
    """Greedy speculative decoding on an fp32 native target (verification through the screened
    head) gives the target's own greedy tokens, for a batch of prompts of unequal lengths."""
    model, target = _fp32_target(22)
    drafter = new_drafter_for_target(model.config, mask_token_id=319, num_layers=1, dtype=torch.float32)
    prompts = [torch.randint(0, 320, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 9, 14)]
    params = SamplingParams(max_new_tokens=24)
    spec = SpecDecoder(target, drafter, SpecConfig(block_size=4)).generate(prompts, params)
    plain = SpecDecoder(target, None, SpecConfig(block_size=1)).generate(prompts, params)
    want = [reference_greedy(model, p, 24) for p in prompts]
    assert [r.token_ids for r in spec] == [r.token_ids for r in plain]
    # and the HF model's own greedy tokens, where fp32 rounding lets the two agree
    assert sum(r.token_ids == w for r, w in zip(plain, want)) >= 2
