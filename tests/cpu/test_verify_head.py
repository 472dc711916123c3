"""A greedy verify pass's head (`forward_greedy` / `forward_tree_greedy(..., until_rejected=True)`,
targets/native/backends.py `head_until_rejected`): the ids along each row's accepted path (up to
its first rejected proposal, or a tree's walk) are the full head's, bit for bit, and the kernels'
backends skip the other positions."""

from __future__ import annotations

import pytest
import torch
from test_compute_modes import _decode, _drafter
from support import ragged_prompts
from test_packed import _q4_model, needs_kernel

from blockspec.config import SamplingParams, SpecConfig
from blockspec.dflash.token_tree import TokenTree
from blockspec.dflash.tree_verify import walk
from blockspec.engine.decoder import SpecDecoder
from blockspec.targets.base import greedy_forward, greedy_forward_tree
from blockspec.targets.native import load_native_target
from blockspec.targets.native.backends import FIRST_VERIFY_ROWS, KernelBackend, TorchBackend
from blockspec.targets.native.llama import tree_parents

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
@pytest.mark.parametrize("trees", [False, True])
def test_dflash_with_the_verify_head_equals_plain_decoding(compute: str, trees: bool,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Lossless: DFlash blocks (or token trees) wider than the head's first rows, whose greedy
    verify passes skip the positions off the accepted path."""
    model = _q4_model(seed=5)
    target = load_native_target(model, dtype="float32", compute=compute)
    prompts = ragged_prompts(3, seed=8, vocab=48)
    plain = _decode(target, None, prompts, 1, n=24)
    skipped = {False: 0, True: 0}  # by pass kind: tree or chain
    head = KernelBackend.head_until_rejected

    def counted(self, x, ids, parents=None):
        best = head(self, x, ids, parents)
        skipped[parents is not None] += int((best < 0).sum())
        return best

    monkeypatch.setattr(KernelBackend, "head_until_rejected", counted)
    cfg = SpecConfig(block_size=Q, adaptive=False, tree_nodes=12 if trees else 0)
    out = SpecDecoder(target, _drafter(model), cfg).generate(prompts, SamplingParams(max_new_tokens=24))
    assert [r.token_ids for r in out] == plain
    assert skipped[trees] > 0  # the engine's verify passes took the head that skips


@needs_kernel
@pytest.mark.parametrize("compute", ["int8", "exact"])
def test_tree_verify_head_gives_the_full_heads_walk(compute: str) -> None:
    """Trees of 3 branches of 4 tokens (13 nodes, best-first order: depth 3 starts at node 7), the
    target's greedy continuation cut at random depths and placed as any child: the walk over the
    ids is the full head's; short walks leave the later nodes out, deep ones compute them."""
    target = load_native_target(_q4_model(seed=13), dtype="float32", compute=compute)
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, 48, (1, 6), generator=g)

    def tree_pass(ids, pos, anc, until_rejected):  # on a fresh cache holding the prompt
        cache = target.new_cache(1, capacity=32)
        target.forward(prompt, torch.arange(6)[None], cache)
        return greedy_forward_tree(target, ids, pos, anc, cache, (1,), until_rejected=until_rejected)

    plain: list[int] = []
    for _ in range(6):  # the target's own greedy continuation after the prompt
        ids = torch.tensor([prompt[0].tolist() + plain])
        best, _ = greedy_forward(target, ids, torch.arange(ids.shape[1])[None], target.new_cache(1, 16))
        plain.append(int(best[0, -1]))
    skipped = deep = 0
    for cut in (0, 1, 2, 3, 4, 4, 1):
        wrong = [[int(t) for t in torch.randint(0, 48, (4,), generator=g)] for _ in range(2)]
        rank = int(torch.randint(0, 3, (1,), generator=g))
        truth = plain[1:5]
        tree = TokenTree.from_paths(plain[0], wrong[:rank] + [truth[:cut] + wrong[-1][cut:]] + wrong[rank:])
        ids = torch.tensor([list(tree.tokens)])
        pos = torch.tensor([tree.positions(6)])
        anc = tree.ancestor_mask()
        assert tree_parents(anc, 1)[0].tolist() == [-1, *tree.parents[1:]]
        full, feats = tree_pass(ids, pos, anc, False)
        got, got_feats = tree_pass(ids, pos, anc, True)
        want = walk(tree, full[0])
        assert walk(tree, got[0]) == want and torch.equal(got_feats, feats)
        assert torch.equal(got[0, list(want.path)], full[0, list(want.path)])
        if want.path[-1] < FIRST_VERIFY_ROWS:
            skipped += bool((got < 0).any())
        else:
            deep += 1
            assert torch.equal(got, full)
    assert skipped and deep
