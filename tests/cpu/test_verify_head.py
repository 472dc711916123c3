"""A greedy verify pass's head (`forward_greedy(..., until_rejected=True)`,
targets/native/backends.py `head_until_rejected`): the ids up to each row's first rejected
proposal are the full head's, bit for bit, and the kernels' backends skip the positions after it."""

from __future__ import annotations

import pytest
import torch
from test_compute_modes import _decode, _drafter
from support import ragged_prompts
from test_packed import _q4_model, needs_kernel

from blockspec.targets.base import greedy_forward
from blockspec.targets.native import load_native_target
from blockspec.targets.native.backends import FIRST_VERIFY_ROWS, KernelBackend, TorchBackend

Q = FIRST_VERIFY_ROWS + 4  # a verify block wider than the head's first rows


def _greedy(target, prompt: torch.Tensor, block: torch.Tensor, until_rejected: bool) -> torch.Tensor:
    """The ids of a pass over `block` [b, Q] after `prompt` [b, P], on a fresh cache."""
    b, p = prompt.shape
    cache = target.new_cache(b, capacity=p + Q)
    target.forward(prompt, torch.arange(p)[None].repeat(b, 1), cache)
    pos = torch.arange(p, p + Q)[None].repeat(b, 1)
    return greedy_forward(target, block, pos, cache, until_rejected=until_rejected)[0]


def _accepting(target, prompt: torch.Tensor, block: torch.Tensor, k: list[int]) -> torch.Tensor:
    """block with row r's first k[r] proposals replaced by the target's own greedy ids (a causal
    pass: changing input i + 1 leaves the ids at positions <= i as they were), and its proposal
    k[r] + 1 (if any) by one the target rejects."""
    block = block.clone()
    for i in range(Q - 1):
        full = _greedy(target, prompt, block, until_rejected=False)
        for r, kr in enumerate(k):
            if i < kr:
                block[r, i + 1] = full[r, i]
            elif i == kr:
                block[r, i + 1] = (full[r, i] + 1) % 48
    return block


@needs_kernel
@pytest.mark.parametrize("compute", ["int8", "exact"])
def test_verify_head_ids_match_the_full_head_up_to_the_first_rejection(compute: str) -> None:
    target = load_native_target(_q4_model(seed=11), dtype="float32", compute=compute)
    assert isinstance(target.net.backend, KernelBackend)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 48, (4, 7), generator=g)
    # rows rejecting at the first proposal, inside the first rows, just after them, and none
    k = [0, FIRST_VERIFY_ROWS - 2, FIRST_VERIFY_ROWS, Q - 1]
    block = _accepting(target, prompt, torch.randint(0, 48, (4, Q), generator=g), k)
    full = _greedy(target, prompt, block, until_rejected=False)
    got = _greedy(target, prompt, block, until_rejected=True)
    for r, kr in enumerate(k):
        # the proposals are as built: accepted up to k, then rejected
        assert torch.equal(block[r, 1 : kr + 1], full[r, :kr]) and (kr == Q - 1 or block[r, kr + 1] != full[r, kr])
        assert torch.equal(got[r, : kr + 1], full[r, : kr + 1])  # what accept_greedy reads: bit for bit
        if kr < FIRST_VERIFY_ROWS:  # rejected within the first rows: the rest was never computed
            assert torch.equal(got[r, FIRST_VERIFY_ROWS:], torch.full((Q - FIRST_VERIFY_ROWS,), -1))
        else:
            assert torch.equal(got[r], full[r])


@needs_kernel
def test_verify_head_computes_every_position_through_pytorch() -> None:
    """PyTorch's products may give a row other bits in a smaller block: no position is skipped."""
    model = _q4_model(seed=11)
    target = load_native_target(model, dtype="float32", compute="exact")
    target.net.backend = TorchBackend(target.net)
    g = torch.Generator().manual_seed(2)
    prompt, block = torch.randint(0, 48, (2, 5), generator=g), torch.randint(0, 48, (2, Q), generator=g)
    got = _greedy(target, prompt, block, until_rejected=True)
    assert bool((got >= 0).all()) and torch.equal(got, _greedy(target, prompt, block, until_rejected=False))


@needs_kernel
@pytest.mark.parametrize("compute", ["int8", "exact"])
def test_dflash_with_the_verify_head_equals_plain_decoding(compute: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Lossless: DFlash blocks wider than the head's first rows, whose greedy verify passes skip
    the positions after a rejection."""
    model = _q4_model(seed=5)
    target = load_native_target(model, dtype="float32", compute=compute)
    prompts = ragged_prompts(3, seed=8, vocab=48)
    plain = _decode(target, None, prompts, 1, n=24)
    skipped = []
    head = KernelBackend.head_until_rejected

    def counted(self, x, ids):
        best = head(self, x, ids)
        skipped.append(int((best < 0).sum()))
        return best

    monkeypatch.setattr(KernelBackend, "head_until_rejected", counted)
    assert _decode(target, _drafter(model), prompts, Q, n=24) == plain
    assert sum(skipped) > 0  # the engine's verify passes took the head that skips
