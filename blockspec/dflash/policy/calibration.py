"""Calibration: a step's cost at every verify width, timed on throwaway caches before serving."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from blockspec.dflash.batch import DecodeBatch
from blockspec.dflash.policy.costs import interpolate
from blockspec.dflash.proposers import (BatchDraft, BestFirstProposer, DFlashBlockProposer, Draft,
                                        PositionDistributions)
from blockspec.dflash.sampling import RowRandom
from blockspec.dflash.sparse_probs import draw, shaped
from blockspec.dflash.tree_step import TREE_TOP_K, pack_trees, propose_tree
from blockspec.dflash.tree_verify import keyed_draws
from blockspec.targets.base import greedy_forward, greedy_forward_tree
from blockspec.targets.slots import EMPTY

# The shaping sampled steps are calibrated with: chat clients' usual temperature and top-p. Steps
# of other shapings correct the calibration as they run (CostModel.observe). Not temperature 1:
# on the calibration's dummy context that spreads the 0.9 nucleus over ~1,000 tokens, where real
# text at 0.7 keeps it to a handful, so every verified and drafted position was priced with a
# sort of a far wider head (`sampling._top_p`) and the drafting sizes came out dearer per token
# than sampled steps really are.
CALIBRATION_TEMPERATURE = 0.7
CALIBRATION_TOP_P = 0.9
# The temperature sampled drafting steps' proposals are calibrated at. The drafter's distributions
# on the dummy context are flat: at 0.7 their 0.9 nucleus holds a median 117 tokens (up to 2,457,
# past the pairs kernel's 1,024: dflash/sparse_probs.py), where real text's holds 3 (mean 6;
# SmolLM2's shipped drafter on GSM8K), so the proposals would be timed on the vocabulary-wide path
# at about five times their real cost, and that share of a step prices drafting out until real
# steps measure it (`CostModel.draft_table`). At 0.3 the dummy nucleus holds 3 (3-8).
CALIBRATION_DRAFT_TEMPERATURE = 0.3


def calibration_sizes(max_block: int) -> list[int]:
    """Block sizes timed by `calibrate`; the others are interpolated. Dense at small sizes: on a
    CPU the kernel, and so the cost, changes with the row count (cpu/linear.py)."""
    return sorted({n for n in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64) if n <= max_block} | {max_block})


def time_sizes(run: Callable[[int], tuple[float, float]], sizes: list[int],
               rounds: int = 3) -> tuple[dict[int, float], dict[int, float]]:
    """The fastest of `rounds` timings of every size: `run(n)` returns the seconds of a whole step
    of n tokens and of its draft pass. The rounds take the sizes in turn (forwards, then backwards),
    after one warm-up round, so a burst of outside load lands on one or two timings of every size
    instead of on all the timings of a few sizes: timed one size after the other, a burst over the
    drafting sizes had priced drafting out for the whole run. Outside load only ever slows a
    step, so the fastest timing is the one closest to the step's own cost."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    best = {n: float("inf") for n in sizes}
    best_draft = dict(best)
    for r in range(rounds + 1):
        for n in (sizes if r % 2 == 0 else sizes[::-1]):
            total, draft = run(n)
            if r:  # round 0 warms up
                best[n] = min(best[n], total)
                best_draft[n] = min(best_draft[n], draft)
    return best, best_draft


@torch.inference_mode()
def calibrate(batch: DecodeBatch, size: int, max_block: int, context: int = 8,
              rounds: int = 3, confidence: bool = False, sampled: bool = False,
              tree: bool = False) -> tuple[list[float], list[float]]:
    """Times one step's model work (target forward of n tokens, plus a draft pass for n > 1) at
    batch size `size` for the block sizes of `calibration_sizes` (`time_sizes`: interleaved
    rounds, the fastest of each), interpolating the rest.

    Runs the target (and drafter) on throwaway caches with `context` dummy tokens per row (kept
    short: the prefill of size x context tokens is pure overhead); returns seconds: whole steps,
    and their draft passes alone (0 for block 1). confidence: time drafts that also read back
    their confidences, as trimmed steps do (`AdaptiveBlock` says which batches it trims).
    sampled: time what a sampled step runs instead of a greedy one: the target's whole logits
    (a greedy step may skip most of its head) shaped (CALIBRATION_TEMPERATURE, CALIBRATION_TOP_P)
    and drawn from, and a DFlash drafter's shaped draft distributions drawn from (a DFlash 2
    walk is timed greedy).
    tree: time tree steps of n nodes instead (`DecodeBatch._verify_tree`'s work): after the
    draft pass, the drafter's top choices read back and ranked best-first (the draft part, what
    a trim sees), then a best-first tree of min(n - 1, tree_nodes) nodes per row built, packed,
    verified in one `forward_tree` pass and walked (a DFlash 2 selector's trees are timed as a
    DFlash drafter's).
    """
    target, d = batch.target, batch.device
    layer_ids = batch.layer_ids
    ids = torch.zeros(size, context, dtype=torch.long, device=d)
    positions = torch.arange(context, device=d).expand(size, context).contiguous()
    tcache = target.new_cache(size)
    tcache.reserve(context)
    _, feats = target.forward(ids, positions, tcache, layer_ids, last_logits_only=True)
    dcache = batch.draft.new_cache(size) if batch.draft is not None else None
    shaping = (torch.full((size,), CALIBRATION_TEMPERATURE, device=d), torch.zeros(size, dtype=torch.long, device=d),
               torch.full((size,), CALIBRATION_TOP_P, device=d))
    random = RowRandom(list(range(size)))
    starts = [0] * size
    draft_shaping = (torch.full((size,), CALIBRATION_DRAFT_TEMPERATURE, device=d), *shaping[1:])
    # sampled rows without a seed, chat clients' usual request: the standard rule
    rules, constraints = ["standard"] * size, [None] * size
    head = target.head()

    def tree_step(hidden: torch.Tensor, n: int) -> Callable[[], None]:
        """The tree part of a drafting step of n nodes up to its trim; returns the rest."""
        budget = min(n - 1, batch.tree_nodes)
        top, ids = batch.drafter.top_logprobs(hidden[:, 1:n], head, min(budget, TREE_TOP_K))  # [size, n-1, k]
        top, ids = top.cpu(), ids.cpu()
        dists = [PositionDistributions(ids[i], top[i]) for i in range(size)]
        for dist in dists:
            BestFirstProposer(budget).ranked(Draft(0, dist))

        def verify() -> None:
            trees = [propose_tree(0, dist, [], budget) for dist in dists]
            packed = pack_trees(trees, [context] * size, d)
            m = packed.ids.shape[1]
            tcache.reserve(context + m)
            if sampled:
                logits, _ = target.forward_tree(packed.ids, packed.positions, packed.ancestors, tcache, layer_ids)
                keyed_draws(random, shaped(logits, *shaping), [t.depths for t in trees], starts).tolist()
            else:
                greedy_forward_tree(target, packed.ids, packed.positions, packed.ancestors, tcache,
                                    layer_ids, until_rejected=True)[0].tolist()
            tcache.reject(torch.zeros(size, m, dtype=torch.bool, device=d))

        return verify

    def run(n: int) -> tuple[float, float]:
        block_ids = torch.zeros(size, n, dtype=torch.long, device=d)  # drafted and verified alike
        block_pos = context + torch.arange(n, device=d).expand(size, n)
        t0 = time.perf_counter()
        if n > 1 and batch.draft is not None:
            dcache.reserve(context + n, context + n)
            ctx_pos = torch.full_like(positions[:, :1], EMPTY)
            hidden = batch.draft(feats[:, :1], ctx_pos, target.embed(block_ids), block_pos, dcache)
            anchor = block_ids[:, 0]  # a DFlash 2 drafter walks from it
            if sampled and batch.drafter.candidate_selector is None:  # what sampled drafting steps compute
                proposal = DFlashBlockProposer(batch.drafter, sampled=True).propose(BatchDraft(
                    hidden[:, 1:n], head, anchor, starts, random, *draft_shaping, rules, constraints,
                    confidence=confidence))
                proposal.ids.tolist()
                if confidence:
                    proposal.confidence.tolist()
            elif tree and batch.drafter.candidate_selector is None:
                pass  # a greedy tree step's chain, where it has one, is its top-k's first column (tree_step)
            elif confidence:  # what trimmed steps compute: proposals and their confidences
                batch.drafter.greedy_with_confidence(hidden[:, 1:n], target.head(), anchor)[1].tolist()
            else:
                batch.drafter.greedy_tokens(hidden[:, 1:n], target.head(), anchor).tolist()
            verify_tree = tree_step(hidden, n) if tree else None
        t1 = time.perf_counter()
        if n > 1 and tree and batch.draft is not None:
            verify_tree()
        elif sampled:  # as a sampled step does
            tcache.reserve(context + n)
            logits, _ = target.forward(block_ids, block_pos, tcache, layer_ids)
            draw(random, shaped(logits, *shaping), starts).tolist()
        else:
            tcache.reserve(context + n)
            # as a greedy step does: its head stops after the first rejected proposal's position
            greedy_forward(target, block_ids, block_pos, tcache, layer_ids, until_rejected=True)[0].tolist()
        elapsed = time.perf_counter() - t0
        if not (n > 1 and tree and batch.draft is not None):
            tcache.reject(torch.zeros(size, n, dtype=torch.bool, device=d))
        tcache.compact(1.0)
        if dcache is not None:
            dcache.compact(1.0)  # the dummy context took only empty slots: a growing cache drops them
        return elapsed, (t1 - t0 if n > 1 else 0.0)

    out, drafting = time_sizes(run, calibration_sizes(max_block), rounds)
    return interpolate(out, max_block), interpolate(drafting, max_block)
