"""Sampled DFlash output must follow the target's distribution exactly (statistical tests)."""

from __future__ import annotations


import pytest
import torch
from conftest import make_tiny_target
from scripted import ScriptedDrafter
from support import PROMPT, VOCAB, chi2_pvalue, exact_joint, lookup_only_steps, sample_many

from blockspec.config import SamplingParams, SpecConfig
from blockspec.dflash.drafter import new_drafter_for_target
from blockspec.targets.hf import HFTarget
from blockspec.engine.decoder import SpecDecoder
from blockspec.dflash.lookup import LookupConfig
from blockspec.dflash import sampling
from blockspec.dflash.sampling import RowRandom, probabilities
from blockspec.dflash.verify import verify_greedy

@pytest.mark.parametrize(
    "shape",
    [dict(temperature=1.0), dict(temperature=0.7, top_k=4), dict(temperature=1.3, top_p=0.8)],
    ids=["temperature", "top_k", "top_p"],
)
@pytest.mark.parametrize("drafter_kind", ["random", "scripted", "draft_vocab", "lookup"])
def test_sampled_tokens_follow_target_distribution(shape: dict, drafter_kind: str) -> None:
    model = make_tiny_target("llama", vocab_size=VOCAB, seed=1)
    sp = SamplingParams(max_new_tokens=3, ignore_eos=True, **shape)
    joint = exact_joint(model, sp)
    if drafter_kind == "random":
        drafter = new_drafter_for_target(model.config, mask_token_id=VOCAB - 1, num_layers=1, dtype=torch.float64)
    elif drafter_kind == "draft_vocab":  # q is zero outside half the vocabulary
        drafter = new_drafter_for_target(model.config, mask_token_id=VOCAB - 1, num_layers=1, dtype=torch.float64)
        drafter.set_draft_vocab(list(range(0, VOCAB, 2)), VOCAB)
    elif drafter_kind == "scripted":  # proposes the most likely continuation: many acceptances, and rejections
        greedy = [[int(joint.sum((1, 2)).argmax()), 0, 0]]
        drafter = ScriptedDrafter(model, [PROMPT] * 400, greedy * 400, error_rate=0.3)
    lookup = None
    if drafter_kind == "lookup":  # x1 in PROMPT: the deterministic lookup proposals (one-hot q) replace drafted ones
        drafter = new_drafter_for_target(model.config, mask_token_id=VOCAB - 1, num_layers=1, dtype=torch.float64)
        lookup = LookupConfig(min_ngram=1, max_ngram=2)
    dec = SpecDecoder(HFTarget(model), drafter, SpecConfig(block_size=4, lookup=lookup))
    counts = sample_many(dec, sp, n=4000, batch=400)
    if lookup is not None:
        looked = sum(r.stats.lookup_steps for r in dec.generate([PROMPT] * 50, [sp.with_(seed=i) for i in range(50)]))
        assert looked > 5, looked
    assert chi2_pvalue(counts.sum((1, 2)), joint.sum((1, 2))) > 1e-3  # x1 comes from the prefill
    assert chi2_pvalue(counts.sum(0), joint.sum(0)) > 1e-3  # (x2, x3): drafted and verified
    assert chi2_pvalue(counts, joint) > 1e-3


def _nucleus_by_full_sort(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """The nucleus filter the plain way: sort every probability, keep the prefix before top_p."""
    sorted_p, order = probs.sort(dim=-1, descending=True)
    before = sorted_p.cumsum(dim=-1) - sorted_p
    out = torch.zeros_like(probs).scatter(-1, order, sorted_p * (before < top_p[:, None, None]))
    return out / out.sum(dim=-1, keepdim=True)


@pytest.mark.parametrize("scale", [0.05, 1.0, 8.0])  # 0.05: nearly flat, the sorted head grows to all of V
def test_top_p_sorts_only_the_head_yet_keeps_the_full_sorts_tokens(scale: float, monkeypatch: pytest.MonkeyPatch
                                                                    ) -> None:
    """The general path (`_top_p`; the CPU kernel's nucleus: tests/cpu/test_nucleus.py)."""
    monkeypatch.setattr(sampling, "_nucleus_kernel", lambda *a: None)
    g = torch.Generator().manual_seed(int(scale * 100))
    logits = torch.randn(3, 4, 3001, generator=g) * scale
    top_p = torch.tensor([0.5, 0.9, 0.99])
    ours = probabilities(logits, torch.ones(3), torch.zeros(3, dtype=torch.long), top_p)
    want = _nucleus_by_full_sort(torch.softmax(logits, dim=-1), top_p)
    assert torch.equal(ours, want)
    kept = (ours > 0).sum(dim=-1)
    assert bool((kept >= 1).all()) and bool((kept < 3001).all())


def test_top_p_one_keeps_every_token_beside_rows_that_filter() -> None:
    logits = torch.randn(2, 3, 500, generator=torch.Generator().manual_seed(7)) * 3
    both = probabilities(logits, torch.ones(2), torch.zeros(2, dtype=torch.long), torch.tensor([1.0, 0.5]))
    alone = probabilities(logits[:1], torch.ones(1), torch.zeros(1, dtype=torch.long), torch.tensor([1.0]))
    assert torch.equal(both[:1], alone) and bool((both[0] > 0).all())
    assert bool(((both[1] > 0).sum(dim=-1) < 500).all())


def test_seed_reproducible_and_independent_of_batch_mates() -> None:
    model = make_tiny_target("llama", seed=2)
    drafter = new_drafter_for_target(model.config, mask_token_id=47, num_layers=1, dtype=torch.float64)
    dec = SpecDecoder(HFTarget(model), drafter, SpecConfig(block_size=4))
    sp = SamplingParams(max_new_tokens=12, temperature=1.0, seed=1234)
    alone = dec.generate([[5, 6, 7]], sp)[0].token_ids
    again = dec.generate([[5, 6, 7]], sp)[0].token_ids
    mates = dec.generate([[1, 2], [5, 6, 7], [9]], [sp.with_(seed=1), sp, sp.with_(seed=2)])[1].token_ids
    assert alone == again == mates
    other = dec.generate([[5, 6, 7]], sp.with_(seed=99))[0].token_ids
    assert other != alone


def test_verify_greedy_crafted_logits() -> None:
    v = 6
    logits = torch.full((2, 4, v), -5.0)
    best = torch.tensor([[1, 2, 3, 4], [0, 5, 5, 2]])
    logits.scatter_(-1, best[..., None], 5.0)
    proposals = torch.tensor([[1, 2, 0], [0, 5, 5]])
    accepted, bonus = verify_greedy(proposals, logits)
    assert accepted.tolist() == [2, 3]
    assert bonus.tolist() == [3, 2]
    # per-row limits: row 1 verifies one proposal only; what lies past it is never read
    logits[1, 2:] = float("nan")
    accepted, bonus = verify_greedy(proposals, logits, torch.tensor([3, 1]))
    assert accepted.tolist() == [2, 1]
    assert bonus.tolist() == [3, 5]


@pytest.mark.parametrize("scale,top", [(4.0, 0), (0.3, 0), (2.0, 3)], ids=["peaked", "flat", "top3"])
def test_the_keyed_race_draws_exactly_from_its_distribution(scale: float, top: int) -> None:
    """RowRandom.sample: each (seed, position) is one draw; over many seeds the draws follow p,
    whether p is peaked (the head of RACE_HEAD tokens decides), flat (the tail often wins) or
    has a few tokens only. Tokens of probability 0 never come up."""
    v, n = 100, 30000
    logits = torch.randn(v, generator=torch.Generator().manual_seed(3)) * scale
    if top:
        logits[logits.topk(v - top, largest=False).indices] = float("-inf")
    p = torch.softmax(logits, dim=-1)
    ids = RowRandom(list(range(n))).sample(p.expand(n, 1, v).contiguous(), [0] * n)[:, 0]
    counts = torch.bincount(ids, minlength=v).double()
    assert chi2_pvalue(counts, p.double()) > 1e-3


def test_the_race_is_keyed_by_seed_and_position_only() -> None:
    """A draw depends on (seed, output position) and the distribution, not on the row it sits in
    or on other draws; two distributions sharing their likely tokens mostly draw the same token
    (the coupling that speculative steps accept)."""
    v = 50
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(4, 3, v, generator=g) * 2, dim=-1)
    q = torch.softmax(torch.log(p) + 0.3 * torch.randn(4, 3, v, generator=g), dim=-1)  # close to p
    seeds = [5, 6, 7, 8]
    base = RowRandom(seeds).sample(p, [0, 10, 20, 30])
    swapped = RowRandom(seeds[::-1]).sample(p.flip(0), [30, 20, 10, 0])
    assert torch.equal(base, swapped.flip(0))  # batch order is irrelevant
    shifted = RowRandom(seeds).sample(p[:, 1:], [1, 11, 21, 31])
    assert torch.equal(base[:, 1:], shifted)  # position j of a block = output position start + j
    many = 4000
    rr = RowRandom(list(range(many)))
    same = rr.sample(p[:1, :1].expand(many, 1, v).contiguous(), [0] * many) == \
        rr.sample(q[:1, :1].expand(many, 1, v).contiguous(), [0] * many)
    overlap = float(torch.minimum(p[0, 0], q[0, 0]).sum())
    assert float(same.double().mean()) > overlap / (2 - overlap) - 0.03  # the race's coupling bound


def test_chi_square_detects_a_lossy_verifier(monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control: accepting every proposal (drafter distribution) must fail the test."""
    import blockspec.dflash.batch as decode

    def accept_all(proposals, best, limit=None):  # every proposal, then the target's token after them
        m = proposals.shape[1]
        return torch.full((proposals.shape[0],), m, dtype=torch.long), best[:, m]

    monkeypatch.setattr(decode, "accept_greedy", accept_all)
    model = make_tiny_target("llama", vocab_size=VOCAB, seed=1)
    sp = SamplingParams(max_new_tokens=3, ignore_eos=True, temperature=1.0)
    joint = exact_joint(model, sp)
    drafter = ScriptedDrafter(model, [PROMPT] * 400, [[0, 0, 0]] * 400, error_rate=0.3)
    dec = SpecDecoder(HFTarget(model), drafter, SpecConfig(block_size=4))
    counts = sample_many(dec, sp, n=2000, batch=400)
    assert chi2_pvalue(counts.sum(0), joint.sum(0)) < 1e-6


@pytest.mark.parametrize("rollback", ["exact", "keeps_rejected_tokens"])
def test_sampled_tokens_follow_a_hybrid_targets_distribution(rollback: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Qwen3.5-style target (Gated DeltaNet layers, their states rolled back after rejections),
    with weights large enough (init std 0.3) that the context shapes the next token's distribution.
    Negative control: a rollback that leaves rejected tokens in the recurrent state must fail."""
    from blockspec.targets.gated_delta import DeltaState

    if rollback == "keeps_rejected_tokens":
        commit = DeltaState.commit
        monkeypatch.setattr(DeltaState, "commit", lambda self, keep=None: commit(self, None))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # batch 500 of a tiny model: thread hand-offs cost more than the work
    try:
        model = make_tiny_target("qwen3_5_text", vocab_size=VOCAB, seed=1, initializer_range=0.3)
        sp = SamplingParams(max_new_tokens=3, ignore_eos=True, temperature=1.0)
        joint = exact_joint(model, sp)
        greedy = [[int(joint.sum((1, 2)).argmax()), 0, 0]]
        drafter = ScriptedDrafter(model, [PROMPT] * 500, greedy * 500, error_rate=0.3)
        dec = SpecDecoder(HFTarget(model), drafter, SpecConfig(block_size=4))
        counts = sample_many(dec, sp, n=4000 if rollback == "exact" else 2000, batch=500)
    finally:
        torch.set_num_threads(threads)
    if rollback == "exact":
        assert chi2_pvalue(counts.sum((1, 2)), joint.sum((1, 2))) > 1e-3
        assert chi2_pvalue(counts.sum(0), joint.sum(0)) > 1e-3
        assert chi2_pvalue(counts, joint) > 1e-3
    else:
        assert chi2_pvalue(counts.sum(0), joint.sum(0)) < 1e-6


def _trimmed_steps(monkeypatch: pytest.MonkeyPatch, trim) -> None:
    """Every drafted step of a SpecDecoder verifies only `trim(...)` tokens of its block."""
    import blockspec.dflash.batch as decode

    plain = decode.DecodeBatch.step
    monkeypatch.setattr(decode.DecodeBatch, "step", lambda self, block, _=None: plain(self, block, trim))


def _trim_sampling_setup():
    model = make_tiny_target("llama", vocab_size=VOCAB, seed=1)
    sp = SamplingParams(max_new_tokens=3, ignore_eos=True, temperature=0.3)  # peaked: q and p differ
    drafter = new_drafter_for_target(model.config, mask_token_id=VOCAB - 1, num_layers=1, dtype=torch.float64)
    return model, sp, exact_joint(model, sp), SpecDecoder(HFTarget(model), drafter, SpecConfig(block_size=4))


def test_a_verify_length_chosen_from_draft_peaks_keeps_sampling_exact(monkeypatch: pytest.MonkeyPatch) -> None:
    """Adaptive steps verify as many drafted tokens as the drafts' confidences make worth it
    (AdaptiveBlock.trimmer); decided from the draft distributions' peaks, the output stays exact."""
    seen: list[int] = []

    def trim(confidence, looked):  # any function of the peaks (x2 drafted: verify 1 or 2 tokens)
        seen.append(1 + int(confidence[0][0] * 997) % 2)
        return seen[-1]

    _trimmed_steps(monkeypatch, trim)
    _, sp, joint, dec = _trim_sampling_setup()
    counts = sample_many(dec, sp, n=1600, batch=1)
    assert set(seen) == {1, 2} and min(seen.count(1), seen.count(2)) > 150  # both lengths, often
    assert chi2_pvalue(counts.sum(0), joint.sum(0)) > 1e-3  # (x2, x3): x2 drafted, verified or not


def test_verify_lengths_per_row_keep_sampling_exact(monkeypatch: pytest.MonkeyPatch) -> None:
    """A ragged step: each row of a batch verifies its own number of drafted tokens (chosen from
    its draft peaks) and the rest of its block is padding, which the native target leaves out of
    its matmuls; the output still follows the target's distribution."""
    from blockspec.targets.native import load_native_target

    seen: list[int] = []

    def trim(confidence, looked):  # per row, any function of its peaks
        lengths = [1 + int(c[0] * 997) % 3 for c in confidence]
        seen.extend(lengths)
        return lengths

    _trimmed_steps(monkeypatch, trim)
    model, sp, joint, plain = _trim_sampling_setup()
    target = load_native_target(model, dtype=None, eos_token_ids=())
    assert target.skips_padding
    dec = SpecDecoder(target, plain.drafter, SpecConfig(block_size=4))
    counts = sample_many(dec, sp, n=1600, batch=32)
    assert min(seen.count(1), seen.count(2), seen.count(3)) > 150, [seen.count(n) for n in (1, 2, 3)]
    assert chi2_pvalue(counts.sum(0), joint.sum(0)) > 1e-3
    assert chi2_pvalue(counts.sum(1).sum(1), joint.sum(1).sum(1)) > 1e-3


def test_lookup_steps_without_a_draft_pass_keep_sampling_exact(monkeypatch: pytest.MonkeyPatch) -> None:
    """Steps that verify n-gram lookup continuations alone (DecodeBatch.step_lookup: no draft
    pass, a length per row, the rest padding; as the adaptive policy runs them) treat each
    continuation as a one-hot draft: the output still follows the target's distribution."""
    from blockspec.targets.native import load_native_target

    seen = lookup_only_steps(monkeypatch)
    model = make_tiny_target("llama", vocab_size=VOCAB, seed=1)
    sp = SamplingParams(max_new_tokens=3, ignore_eos=True, temperature=1.0)
    joint = exact_joint(model, sp)
    drafter = new_drafter_for_target(model.config, mask_token_id=VOCAB - 1, num_layers=1, dtype=torch.float64)
    target = load_native_target(model, dtype=None, eos_token_ids=())
    dec = SpecDecoder(target, drafter, SpecConfig(block_size=4, lookup=LookupConfig(min_ngram=1, max_ngram=2)))
    counts = sample_many(dec, sp, n=4000, batch=400)
    assert min(seen.count(2), seen.count(3)) > 300, [seen.count(n) for n in (1, 2, 3)]
    assert chi2_pvalue(counts.sum(0), joint.sum(0)) > 1e-3  # (x2, x3): looked up and verified
    assert chi2_pvalue(counts, joint) > 1e-3


def test_a_verify_length_chosen_from_the_samples_keeps_sampling_exact(monkeypatch: pytest.MonkeyPatch) -> None:
    """With keyed races a committed token is the target's own draw whatever was proposed, so even
    a verify length that reads the sampled proposals (verifying a drafted token only when it is
    the drafter's favourite) leaves the output exact. Under min(p, q) rejection sampling this
    biased the output towards such samples."""
    import blockspec.dflash.sampling as sampling

    last = {}
    sample = sampling.RowRandom.sample

    def remembering(self, probs, starts):
        last["probs"], last["ids"] = probs, sample(self, probs, starts)
        return last["ids"]

    def trim(confidence, looked):  # reads the sampled proposal
        q_of_sample = float(last["probs"][0, 0, last["ids"][0, 0]])
        return 2 if q_of_sample >= confidence[0][0] else 1  # only the drafter's favourite

    monkeypatch.setattr(sampling.RowRandom, "sample", remembering)
    _trimmed_steps(monkeypatch, trim)
    _, sp, joint, dec = _trim_sampling_setup()
    counts = sample_many(dec, sp, n=1600, batch=1)
    assert chi2_pvalue(counts.sum(0), joint.sum(0)) > 1e-3
