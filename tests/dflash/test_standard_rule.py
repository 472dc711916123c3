"""The standard rule (dflash/verify.py `verify_standard`): sampled requests without a seed keep a
proposal x drawn from q with probability min(1, p(x)/q(x)) and draw from the normalised residual
max(0, p - q) at the first rejection. Lossless for chains (DFlash drafts), n-gram lookup proposals
(one-hot q), DFlash 2 walks (q over the K candidates) and ragged batches whose rows mix rules
(chi-square against the target's exact distribution), each with a test that catches a lossy
variant; a seeded row beside unseeded ones still reproduces its seed's text."""

from __future__ import annotations

import itertools

import pytest
import torch
from conftest import make_tiny_target
from scripted import ScriptedDrafter
from support import PROMPT, VOCAB, chi2_pvalue, exact_joint, lookup_only_steps
from test_dflash2_decode import random_dflash2

import blockspec.dflash.batch as decode
from blockspec.config import SamplingParams, SpecConfig
from blockspec.dflash.drafter import new_drafter_for_target
from blockspec.dflash.lookup import LookupConfig
from blockspec.dflash.sampling import sample_from
from blockspec.dflash.sparse_probs import SparseProbs, sample_from_pairs
from blockspec.dflash.verify import standard_uniforms, verify_standard
from blockspec.engine.decoder import SpecDecoder
from blockspec.errors import ConfigError
from blockspec.targets.hf import HFTarget
from blockspec.targets.native import load_native_target

UNSEEDED = SamplingParams(max_new_tokens=3, ignore_eos=True, temperature=1.0)


def sample_unseeded(dec: SpecDecoder, params: list[SamplingParams], n: int) -> list[torch.Tensor]:
    """Counts [V, V, V] of (x1, x2, x3) after PROMPT per distinct entry of `params` (a batch of
    len(params) rows, run n // len(params) times; rows without a seed draw one from torch)."""
    torch.manual_seed(0)
    counts = {params.index(sp): torch.zeros(VOCAB, VOCAB, VOCAB) for sp in params}
    seeds = itertools.count(10_000)
    for _ in range(n // len(params)):
        batch = [sp if sp.seed is None else sp.with_(seed=next(seeds)) for sp in params]
        for sp, r in zip(params, dec.generate([PROMPT] * len(params), batch)):
            a, b, c = r.token_ids
            counts[params.index(sp)][a, b, c] += 1
    return [counts[k] for k in sorted(counts)]


def assert_follows(counts: torch.Tensor, joint: torch.Tensor) -> None:
    assert chi2_pvalue(counts.sum((1, 2)), joint.sum((1, 2))) > 1e-3  # x1 comes from the prefill
    assert chi2_pvalue(counts.sum(0), joint.sum(0)) > 1e-3  # (x2, x3): proposed and verified
    assert chi2_pvalue(counts, joint) > 1e-3


def as_keyed(rule):
    """A rule over uniforms as `DecodeBatch` calls the standard rule (`verify_standard_keyed`):
    the uniforms read from each position's key."""
    def keyed(proposals, target_probs, draft_probs, keys, limit=None):
        accept_u, bonus_u = standard_uniforms(keys)
        return rule(proposals, target_probs, draft_probs, accept_u, bonus_u, limit)
    return keyed


# ---- lossy variants the tests must catch ----------------------------------------------------

def residual_from_p(proposals, target_probs, draft_probs, accept_u, bonus_u, limit=None):
    """Accepts by min(1, p/q) but draws the rejected position from p instead of the residual."""
    accepted, _ = verify_standard(proposals, target_probs, draft_probs, accept_u, bonus_u, limit)
    rows = torch.arange(proposals.shape[0])
    return accepted, sample_from(target_probs[rows, accepted], bonus_u[rows, accepted])


def flat_q(proposals, target_probs, draft_probs, accept_u, bonus_u, limit=None):
    """Takes q for uniform over its support: the rule applied with a q the proposals were not drawn from."""
    support = (draft_probs > 0).to(draft_probs.dtype)
    return verify_standard(proposals, target_probs, support / support.sum(-1, keepdim=True), accept_u, bonus_u, limit)


# ---- the pure rule ----------------------------------------------------------------------------

@pytest.mark.parametrize("rule", ["standard", "residual_from_p", "flat_q", "p_for_q"])
def test_the_rule_commits_p_and_accepts_the_overlap(rule: str) -> None:
    """Context-free p and q (x_t ~ q_t independently): the committed tokens follow p at both
    positions, with rows that verify one proposal or two, and the first proposal is kept with
    probability sum min(p, q). Each lossy variant fails the same test."""
    v, n = 6, 60000
    g = torch.Generator().manual_seed(4)
    p = torch.softmax(torch.randn(3, v, generator=g) * 1.5, dim=-1)
    q = torch.softmax(torch.randn(2, v, generator=g) * 1.5, dim=-1)
    q[1, 0] = 0.0  # a token the drafter never proposes at position 2
    q[1] /= q[1].sum()
    proposals = torch.stack([torch.multinomial(q[t], n, replacement=True, generator=g) for t in range(2)], dim=1)
    accept_u, bonus_u = torch.rand(n, 2, generator=g, dtype=torch.float64), torch.rand(n, 3, generator=g, dtype=torch.float64)
    limit = torch.tensor([1, 2]).repeat(n // 2)
    fn = {"standard": verify_standard, "residual_from_p": residual_from_p, "flat_q": flat_q,
          "p_for_q": lambda pr, tp, dq, au, bu, lim: verify_standard(pr, tp, tp[:, :2], au, bu, lim)}[rule]
    accepted, bonus = fn(proposals, p.expand(n, 3, v), q.expand(n, 2, v), accept_u, bonus_u, limit)
    committed = torch.cat([proposals, bonus[:, None]], dim=1).scatter(1, accepted[:, None], bonus[:, None])
    first = torch.bincount(committed[:, 0], minlength=v).double()
    # a second token where the first proposal was kept: the second proposal or the bonus after it
    second = torch.bincount(committed[1::2, 1][accepted[1::2] >= 1], minlength=v).double()  # rows verifying two
    second_after_one = torch.bincount(committed[0::2, 1][accepted[0::2] == 1], minlength=v).double()  # a bonus
    ok = min(chi2_pvalue(first, p[0].double()), chi2_pvalue(second, p[1].double())) > 1e-3
    if rule == "standard":
        assert ok and chi2_pvalue(second_after_one, p[1].double()) > 1e-3
        overlap = float(torch.minimum(p[0], q[0]).sum())
        assert abs(float((accepted >= 1).double().mean()) - overlap) < 0.01
    else:
        assert not ok


def test_one_hot_drafts_keep_p_and_equal_q_accepts_everything() -> None:
    """A deterministic proposal (one-hot q) is kept with probability p(x); q == p keeps every
    proposal, whatever the uniforms."""
    v, n = 5, 40000
    g = torch.Generator().manual_seed(9)
    p = torch.softmax(torch.randn(2, v, generator=g) * 2, dim=-1)
    proposals = torch.full((n, 1), 3)
    onehot = torch.zeros(n, 1, v)
    onehot[..., 3] = 1.0
    u = torch.rand(n, 1, generator=g, dtype=torch.float64)
    accepted, bonus = verify_standard(proposals, p.expand(n, 2, v), onehot, u, torch.rand(n, 2, generator=g, dtype=torch.float64))
    first = torch.where(accepted == 1, proposals[:, 0], bonus)
    assert chi2_pvalue(torch.bincount(first, minlength=v).double(), p[0].double()) > 1e-3
    drawn = torch.multinomial(p[0], n, replacement=True, generator=g)[:, None]
    accepted, _ = verify_standard(drawn, p.expand(n, 2, v), p[:1].expand(n, 1, v), u, torch.rand(n, 2, dtype=torch.float64))
    assert bool((accepted == 1).all())


# ---- through the decoder ------------------------------------------------------------------------

def _chain_drafter(model, kind: str, joint: torch.Tensor):
    drafter = new_drafter_for_target(model.config, mask_token_id=VOCAB - 1, num_layers=1, dtype=torch.float64)
    if kind == "draft_vocab":  # q is zero outside half the vocabulary
        drafter.set_draft_vocab(list(range(0, VOCAB, 2)), VOCAB)
    elif kind == "scripted":  # peaked q on the likeliest continuation, often wrong: acceptances and rejections
        greedy = [[int(joint.sum((1, 2)).argmax()), 0, 0]]
        drafter = ScriptedDrafter(model, [PROMPT] * 400, greedy * 400, error_rate=0.3)
    return drafter


@pytest.mark.parametrize("shape,kind", [
    (dict(temperature=1.3, top_p=0.8), "random"), (dict(temperature=1.0), "scripted"),
    (dict(temperature=0.7, top_k=4), "draft_vocab"),
], ids=["top_p-random", "temperature-scripted", "top_k-draft_vocab"])
def test_unseeded_chains_follow_the_target(shape: dict, kind: str) -> None:
    model = make_tiny_target("llama", vocab_size=VOCAB, seed=1)
    sp = UNSEEDED.with_(**shape)
    joint = exact_joint(model, sp)
    dec = SpecDecoder(HFTarget(model), _chain_drafter(model, kind, joint), SpecConfig(block_size=4))
    (counts,) = sample_unseeded(dec, [sp] * 400, n=4000)
    assert_follows(counts, joint)
    stats = dec.generate([PROMPT] * 40, sp)
    assert {r.stats.sampling_rule for r in stats} == {"standard"}
    assert sum(r.stats.accepted_by_position[0] for r in stats) > 0  # proposals were kept, so the rule was exercised


def test_chi_square_catches_a_residual_drawn_from_p(monkeypatch: pytest.MonkeyPatch) -> None:
    model = make_tiny_target("llama", vocab_size=VOCAB, seed=1)
    joint = exact_joint(model, UNSEEDED)
    dec = SpecDecoder(HFTarget(model), _chain_drafter(model, "scripted", joint), SpecConfig(block_size=4))
    monkeypatch.setattr(decode, "verify_standard_keyed", as_keyed(residual_from_p))
    (counts,) = sample_unseeded(dec, [UNSEEDED] * 400, n=2000)
    assert chi2_pvalue(counts.sum(0), joint.sum(0)) < 1e-6


def test_chi_square_catches_a_residual_drawn_from_p_over_the_nucleus_pairs(monkeypatch: pytest.MonkeyPatch) -> None:
    """With top-p the target's p reaches the rule as its nucleus's pairs (dflash/sparse_probs.py):
    the same statistic that passes them (top_p-random above) catches the pairs' residual drawn
    from p."""
    model = make_tiny_target("llama", vocab_size=VOCAB, seed=1)
    sp = UNSEEDED.with_(temperature=1.3, top_p=0.8)
    joint = exact_joint(model, sp)
    dec = SpecDecoder(HFTarget(model), _chain_drafter(model, "scripted", joint), SpecConfig(block_size=4))
    seen = []

    def pairs_residual_from_p(proposals, target_probs, draft_probs, accept_u, bonus_u, limit=None):
        seen.append(isinstance(target_probs, SparseProbs))
        accepted, _ = verify_standard(proposals, target_probs, draft_probs, accept_u, bonus_u, limit)
        at = target_probs[torch.arange(proposals.shape[0]), accepted]  # [b, k] pairs
        return accepted, sample_from_pairs(at.ids, at.probs, bonus_u[torch.arange(proposals.shape[0]), accepted])

    monkeypatch.setattr(decode, "verify_standard_keyed", as_keyed(pairs_residual_from_p))
    (counts,) = sample_unseeded(dec, [sp] * 400, n=4000)
    assert seen and all(seen)  # every verify read pairs
    assert chi2_pvalue(counts.sum(0), joint.sum(0)) < 1e-6


LOOKUP = LookupConfig(min_ngram=1, max_ngram=2)  # x1 in PROMPT: its continuation is proposed


@pytest.mark.parametrize("lossy", [False, True], ids=["exact", "drafted_q"])
def test_unseeded_lookup_proposals_follow_the_target(lossy: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Lookup continuations replace the drafted proposals in drafting steps: their q is one-hot.
    Caught: verifying them against the drafter's q at those positions (which they were not drawn
    from)."""
    model = make_tiny_target("llama", vocab_size=VOCAB, seed=1)
    joint = exact_joint(model, UNSEEDED)
    drafter = new_drafter_for_target(model.config, mask_token_id=VOCAB - 1, num_layers=1, dtype=torch.float64)
    dec = SpecDecoder(HFTarget(model), drafter, SpecConfig(block_size=4, lookup=LOOKUP))
    if lossy:
        one_hot_where = decode._one_hot_where
        monkeypatch.setattr(decode, "_one_hot_where", lambda q, proposals, looked, vocab=None:
                            q if q is not None else one_hot_where(q, proposals, looked, vocab))
    (counts,) = sample_unseeded(dec, [UNSEEDED] * 400, n=4000 if not lossy else 2000)
    if lossy:
        assert chi2_pvalue(counts.sum(2), joint.sum(2)) < 1e-6  # (x1, x2): x2 looked up after x1 in PROMPT
        return
    assert_follows(counts, joint)
    looked = dec.generate([PROMPT] * 50, UNSEEDED)
    assert sum(r.stats.lookup_steps for r in looked) > 5
    assert sum(r.stats.lookup_accepted_by_position[0] for r in looked) > 0


def test_unseeded_lookup_steps_without_a_draft_pass_follow_the_target(monkeypatch: pytest.MonkeyPatch) -> None:
    """`step_lookup` (no draft pass, a length per row, the rest padding) under the standard rule."""
    seen = lookup_only_steps(monkeypatch)
    model = make_tiny_target("llama", vocab_size=VOCAB, seed=1)
    joint = exact_joint(model, UNSEEDED)
    drafter = new_drafter_for_target(model.config, mask_token_id=VOCAB - 1, num_layers=1, dtype=torch.float64)
    target = load_native_target(model, dtype=None, eos_token_ids=())
    dec = SpecDecoder(target, drafter, SpecConfig(block_size=4, lookup=LOOKUP))
    (counts,) = sample_unseeded(dec, [UNSEEDED] * 400, n=4000)
    assert min(seen.count(2), seen.count(3)) > 300
    assert chi2_pvalue(counts.sum(0), joint.sum(0)) > 1e-3
    assert chi2_pvalue(counts, joint) > 1e-3


def _walker(model):
    """Vocabulary 10, 4 candidates: q_t is zero on 6 tokens and depends strongly on the previous
    proposal (large selector transitions)."""
    return random_dflash2(model, seed=5, top_k=4, layers=1, scale=1.5)


@pytest.mark.parametrize("shape,mode", [
    (dict(temperature=1.0), "plain"), (dict(temperature=1.3, top_p=0.8), "plain"), (dict(temperature=1.0), "lookup"),
    (dict(temperature=0.8, top_p=0.9), "trimmed"), (dict(temperature=1.0), "flat_q"),
], ids=["temperature", "top_p", "lookup", "trimmed_top_p", "lossy_flat_q"])
def test_unseeded_walks_follow_the_target(shape: dict, mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """DFlash 2: q_t is the walk's shaped softmax over the K candidates given the previous
    proposal (zero elsewhere), one-hot where a lookup continuation leads; trimmed: each row
    verifies 1..3 tokens chosen from its confidences. A rule that takes q_t for uniform over the
    candidates is caught."""
    model = make_tiny_target("llama", vocab_size=VOCAB, seed=1)
    sp = UNSEEDED.with_(**shape)
    joint = exact_joint(model, sp)
    if mode == "trimmed":
        step = decode.DecodeBatch.step
        monkeypatch.setattr(decode.DecodeBatch, "step", lambda self, block, _=None: step(
            self, block, lambda conf, looked: [1 + int(c[0] * 997) % 3 for c in conf]))
    if mode == "flat_q":
        monkeypatch.setattr(decode, "verify_standard_keyed", as_keyed(flat_q))
    dec = SpecDecoder(HFTarget(model), _walker(model), SpecConfig(block_size=4, lookup=LOOKUP if mode == "lookup" else None))
    (counts,) = sample_unseeded(dec, [sp] * 400, n=4000)
    if mode == "flat_q":
        assert chi2_pvalue(counts.sum(0), joint.sum(0)) < 1e-6
        return
    assert_follows(counts, joint)
    kept = sum(r.stats.accepted_by_position[0] + r.stats.lookup_accepted_by_position[0]
               for r in dec.generate([PROMPT] * 100, sp))
    assert kept >= 5  # walk (or lookup) proposals were accepted


@pytest.mark.parametrize("lossy", [False, True], ids=["exact", "residual_from_p"])
def test_ragged_batches_mixing_rules_follow_the_target(lossy: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """One batch of the native target, each row verifying its own length (1..3 in turn, never
    looking at the samples; the rest padding), its rows keyed (seeded), standard (unseeded, and
    seeded with the rule forced) and greedy: every sampled kind follows the target, the greedy
    rows stay greedy."""
    step = decode.DecodeBatch.step
    turn = itertools.count()
    monkeypatch.setattr(decode.DecodeBatch, "step", lambda self, block, _=None: step(
        self, block, lambda conf, looked: [(2, 3, 2, 1)[next(turn) % 4] for _ in conf]))
    if lossy:
        monkeypatch.setattr(decode, "verify_standard_keyed", as_keyed(residual_from_p))
    model = make_tiny_target("llama", vocab_size=VOCAB, seed=1)
    sp = UNSEEDED.with_(temperature=0.8)
    joint = exact_joint(model, sp)
    greedy = SamplingParams(max_new_tokens=3, ignore_eos=True)
    target = load_native_target(model, dtype=None, eos_token_ids=())
    drafter = _chain_drafter(model, "scripted", joint)
    dec = SpecDecoder(target, drafter, SpecConfig(block_size=4))
    kinds = [sp, sp.with_(seed=0), sp.with_(seed=0, sampling_rule="standard"), greedy]
    unseeded, keyed, forced, plain = sample_unseeded(dec, kinds * 100, n=4000)
    if lossy:  # x2: the scripted proposal 0 comes up too often
        assert chi2_pvalue((unseeded + forced).sum((0, 2)), joint.sum((0, 2))) < 1e-6
        return
    for counts in (unseeded, keyed, forced):  # 1000 each: the pairs' marginals (the triples' cells are too small)
        for dims in ((1, 2), 0, 2):
            assert chi2_pvalue(counts.sum(dims), joint.sum(dims)) > 1e-3
    greedy_joint = exact_joint(model, greedy)
    assert float(plain.sum()) == float(plain[greedy_joint > 0.5].sum())
    out = dec.generate([PROMPT] * 400, kinds * 100)
    assert [r.stats.sampling_rule for r in out[:4]] == ["standard", "keyed", "standard", "greedy"]
    kept = sum(r.stats.accepted_by_position[0] for i, r in enumerate(out) if i % 4 in (0, 2))
    assert kept > 3  # the standard rule kept proposals (p ~ 0.1 each here)


def test_a_seeded_row_beside_unseeded_rows_keeps_its_seeds_text() -> None:
    """The keyed rule's reproducibility holds with standard-rule rows in the same steps, at any
    block size; without a seed the text varies from run to run."""
    model = make_tiny_target("llama", seed=2)
    seeded = SamplingParams(max_new_tokens=20, temperature=1.0, top_p=0.95, seed=1234, ignore_eos=True)
    alone = SpecDecoder(HFTarget(model), None, SpecConfig(block_size=1)).generate([[5, 6, 7]], seeded)[0].token_ids
    for block in (4, 8):
        drafter = new_drafter_for_target(model.config, mask_token_id=47, num_layers=1, dtype=torch.float64)
        dec = SpecDecoder(HFTarget(model), drafter, SpecConfig(block_size=block))
        out = dec.generate([[1, 2], [5, 6, 7], [9, 9]], [seeded.with_(seed=None), seeded, seeded.with_(seed=None)])
        assert out[1].token_ids == alone
        assert out[1].stats.sampling_rule == "keyed" and out[0].stats.sampling_rule == "standard"
    texts = {tuple(dec.generate([[5, 6, 7]], seeded.with_(seed=None))[0].token_ids) for _ in range(4)}
    assert len(texts) > 1


def test_sampling_rule_is_validated() -> None:
    with pytest.raises(ConfigError, match="sampling_rule must be one of auto, keyed, standard"):
        SamplingParams(temperature=1.0, sampling_rule="fast")
    assert SamplingParams(temperature=1.0, seed=3).rule == "keyed"
    assert SamplingParams(temperature=1.0).rule == "standard"
    assert SamplingParams(temperature=1.0, seed=3, sampling_rule="standard").rule == "standard"
    assert SamplingParams(temperature=1.0, sampling_rule="keyed").rule == "keyed"
    assert SamplingParams(sampling_rule="standard").rule == "greedy"
