"""N-gram lookup proposals: the continuation search, and decoding with it stays lossless."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_target
from support import reference_greedy

from blockspec.config import SamplingParams, SpecConfig
from blockspec.dflash.policy import AdaptiveBlock, CostModel
from blockspec.errors import ConfigError
from blockspec.dflash.drafter import new_drafter_for_target
from blockspec.targets.hf import HFTarget
from blockspec.engine.decoder import SpecDecoder
from blockspec.dflash.lookup import LookupConfig, TokenIndex


class FixedCosts(CostModel):
    def set(self, batch: int, costs: list[float], drafting: list[float] | None = None) -> None:
        super().set(batch, [1.0 + 0.1 * (n - 1) for n in range(1, self.max_block + 1)])

    def observe(self, batch: int, block: int, seconds: float) -> None:
        pass


def index_of(tokens: list[int]) -> TokenIndex:
    ix = TokenIndex()
    ix.extend(tokens[:3])
    ix.extend(tokens[3:])  # built in two pieces, as decoding appends
    return ix


def test_longest_earlier_match_wins_then_the_latest() -> None:
    cfg = LookupConfig(min_ngram=1, max_ngram=4)
    # ... 7 8 9 -> 1 (3-gram match), ... 8 9 -> 2 (2-gram, later); the suffix is 7 8 9
    toks = [7, 8, 9, 1, 1, 5, 8, 9, 2, 3, 7, 8, 9]
    assert index_of(toks).continuation(cfg, 3) == (3, [1, 1, 5])
    # two equal 2-gram matches of "8 9": the later one's continuation
    toks = [8, 9, 1, 3, 8, 9, 2, 0, 8, 9]
    assert index_of(toks).continuation(cfg, 2) == (2, [2, 0])
    # max_ngram caps the match compared; the continuation is cut at max_tokens and at the end
    toks = [1, 2, 3, 4, 5, 6, 1, 2, 3, 4]
    assert index_of(toks).continuation(LookupConfig(min_ngram=2, max_ngram=2), 10) == (2, [5, 6, 1, 2, 3, 4])


def test_no_proposal_below_min_ngram_or_without_an_earlier_occurrence() -> None:
    toks = [5, 1, 2, 6, 2]  # "2" occurred before, but "6 2" did not
    assert index_of(toks).continuation(LookupConfig(min_ngram=2, max_ngram=4), 4) == (0, [])
    assert index_of(toks).continuation(LookupConfig(min_ngram=1, max_ngram=4), 4) == (1, [6, 2])
    assert index_of([1, 2, 3, 4, 5]).continuation(LookupConfig(min_ngram=1), 4) == (0, [])  # 5 is new
    assert TokenIndex().continuation(LookupConfig(), 4) == (0, [])
    assert index_of([3, 3, 3, 3]).continuation(LookupConfig(), 0) == (0, [])


def test_an_index_asked_between_appends_answers_as_one_built_at_once() -> None:
    """Appended tokens are indexed when a continuation is next asked for: asking after every
    append, after some, or only at the end gives the answers of an index of the whole sequence."""
    g = torch.Generator().manual_seed(3)
    toks = torch.randint(0, 6, (200,), generator=g).tolist()
    cfg = LookupConfig(min_ngram=1, max_ngram=3)
    for ask_every in (1, 3, 7):
        ix = TokenIndex()
        for i in range(0, len(toks), 5):
            ix.extend(toks[i:i + 5])
            if (i // 5) % ask_every == 0:
                fresh = TokenIndex()
                fresh.extend(toks[:i + 5])
                assert ix.continuation(cfg, 4) == fresh.continuation(cfg, 4)
        ix.continuation(cfg, 4)
        assert ix.where == {t: [i for i, u in enumerate(toks) if u == t] for t in set(toks)}


def test_a_shift_by_one_would_be_caught() -> None:
    """The continuation starts right after the matched occurrence, not at it."""
    toks = [4, 5, 6, 10, 11, 12, 4, 5, 6]
    match, cont = index_of(toks).continuation(LookupConfig(min_ngram=3, max_ngram=3), 3)
    assert match == 3 and cont == [10, 11, 12]


def test_lookup_config_is_validated() -> None:
    with pytest.raises(ConfigError, match="min_ngram must be an integer >= 1"):
        LookupConfig(min_ngram=0)
    with pytest.raises(ConfigError, match="max_ngram must be an integer >= min_ngram"):
        LookupConfig(min_ngram=3, max_ngram=2)
    with pytest.raises(ConfigError, match="lookup must be None or a LookupConfig"):
        SpecConfig(lookup=3)


def repetitive_prompts(batch: int, seed: int) -> list[list[int]]:
    """Prompts that repeat a phrase: the tiny targets continue them into lookup matches."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(batch):
        phrase = torch.randint(0, 47, (3 + i,), generator=g).tolist()
        out.append(phrase * 3 + phrase[:2])
    return out


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("block_size,batch,adaptive", [(4, 1, False), (8, 3, False), (16, 4, False), (8, 3, True)])
def test_greedy_with_lookup_equals_plain(family: str, block_size: int, batch: int, adaptive: bool) -> None:
    """Tiny random targets fall into loops within 60 tokens: lookup proposes them, an untrained
    drafter does not. The output stays the target's own, token for token."""
    model = make_tiny_target(family, seed=block_size)
    drafter = new_drafter_for_target(model.config, mask_token_id=47, num_layers=1, dtype=torch.float64, seed=batch)
    prompts = repetitive_prompts(batch, seed=block_size + batch)
    taus = {}
    for lookup in (None, LookupConfig(min_ngram=2)):
        dec = SpecDecoder(HFTarget(model), drafter, SpecConfig(block_size=block_size, adaptive=adaptive, lookup=lookup))
        if adaptive:  # step costs that machine load cannot move: verifying n tokens costs 1 + 0.1 (n - 1)
            dec.adaptive_policy = AdaptiveBlock(block_size, costs=FixedCosts(max_block=block_size))
        results = dec.generate(prompts, SamplingParams(max_new_tokens=60))
        for p, r in zip(prompts, results):
            assert r.token_ids == reference_greedy(model, p, 60)
            assert sum(r.stats.acceptance_lengths) + 1 == len(r.token_ids)
            assert len(r.stats.lookup_accepted_by_position) == block_size - 1
        taus[lookup is not None] = sum(sum(r.stats.acceptance_lengths) for r in results) / sum(
            r.stats.steps for r in results)
        steps = sum(r.stats.lookup_steps for r in results)
        assert steps > 0 if lookup is not None else steps == 0
    assert taus[True] > taus[False] + 0.3, taus


def test_engine_config_checks_lookup() -> None:
    from blockspec.engine import EngineConfig

    with pytest.raises(ConfigError, match="lookup must be None or a LookupConfig"):
        EngineConfig(SpecConfig(lookup=True))


@pytest.mark.parametrize("backend", ["native", "hf"])
def test_lookup_steps_without_a_draft_pass_equal_plain(backend: str) -> None:
    """DecodeBatch.step_lookup: rows verify their lookup continuations with no draft pass, each
    its own length (longer ones cut to the continuation), the rest of the block padding; mixed
    with drafting and plain steps, the output is the target's own, token for token."""
    import random

    from blockspec.targets.native import load_native_target
    from blockspec.dflash.batch import DecodeBatch
    from blockspec.dflash.row import make_row

    model = make_tiny_target("llama", seed=4)
    target = load_native_target(model, dtype=None, eos_token_ids=()) if backend == "native" else HFTarget(model)
    drafter = new_drafter_for_target(model.config, mask_token_id=47, num_layers=1, dtype=torch.float64, seed=2)
    prompts = repetitive_prompts(4, seed=9)
    batch = DecodeBatch(target, drafter, max_block=8, lookup=LookupConfig(min_ngram=2))
    rows = [make_row(i, len(p), SamplingParams(max_new_tokens=60), (), 8) for i, p in enumerate(prompts)]
    batch.join(prompts, rows)
    rng = random.Random(0)
    ragged = lookup_only = 0
    while len(batch):
        plan = batch.lookup_plan()
        if any(plan) and rng.random() < 0.8:
            lengths = [rng.randint(1, 8) for _ in plan]
            expect = [min(n, 1 + len(cont)) for n, cont in zip(lengths, plan)]
            assert batch.step_lookup(lengths) == max(expect)
            assert batch.verified == sum(expect) or min(expect) == max(expect)  # padding is not counted
            ragged += min(expect) < max(expect)
            lookup_only += 1
        else:
            batch.step(rng.choice([1, 4, 8]))
        batch.retire()
    for p, r in zip(prompts, rows):
        assert r.generated == reference_greedy(model, p, 60)
        assert sum(r.stats.acceptance_lengths) + 1 == len(r.generated)
    assert lookup_only > 10 and ragged > 3, (lookup_only, ragged)
    assert sum(sum(r.stats.lookup_accepted_by_position) for r in rows) > 10
    with pytest.raises(ValueError, match="verify lengths for"):
        DecodeBatch(target, drafter, max_block=8).step_lookup([2])


def test_adaptive_lone_row_verifies_lookup_without_drafting() -> None:
    """The adaptive policy runs lookup continuations as steps of their own for a lone row (no draft
    pass, whose calibrated share of a step it saves): fewer draft passes, the same tokens."""
    model = make_tiny_target("llama", seed=5)
    drafter = new_drafter_for_target(model.config, mask_token_id=47, num_layers=1, dtype=torch.float64, seed=1)
    prompt = repetitive_prompts(1, seed=3)[0]
    dec = SpecDecoder(HFTarget(model), drafter, SpecConfig(block_size=8, adaptive=True, lookup=LookupConfig(min_ngram=2)))
    costs = CostModel(max_block=8)  # a draft pass is 0.3 of a step; machine load cannot move these
    costs.observe = lambda *args: None
    costs.set(1, [1.0] + [1.3 + 0.05 * (n - 1) for n in range(2, 9)], [0.0] + [0.3] * 7)
    dec.adaptive_policy = AdaptiveBlock(8, costs=costs)
    result = dec.generate([prompt], SamplingParams(max_new_tokens=60))[0]
    assert result.token_ids == reference_greedy(model, prompt, 60)
    assert dec.adaptive_policy.lookup_steps > 5 and sum(result.stats.lookup_accepted_by_position) > 10
