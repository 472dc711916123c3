"""Standard-rule rows may draw their chain proposals from a sharpened draft distribution
(`sampling.sharpened`, STANDARD_DRAFT_FACTOR < 1; 1, the request's own q, by default): the q the
rule tests them against is then that sharpened q, the output still follows the target
(chi-square), and the same statistic catches the lossy twin that draws from the sharpened q but
tests against the request's."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_target
from support import VOCAB, chi2_pvalue, exact_joint
from test_standard_rule import UNSEEDED, _chain_drafter, as_keyed, assert_follows, sample_unseeded

import blockspec.dflash.batch as decode
import blockspec.dflash.sampling as sampling
from blockspec.config import SamplingParams, SpecConfig
from blockspec.dflash.sampling import sharpened
from blockspec.dflash.sparse_probs import SparseProbs
from blockspec.dflash.verify import verify_standard
from blockspec.engine.decoder import SpecDecoder
from blockspec.targets.hf import HFTarget


def test_sharpened_is_the_same_support_at_a_lower_temperature() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 20, generator=g, dtype=torch.float64) * 3
    logits[:, :5] = float("-inf")  # outside the support (a top-k / top-p / draft vocabulary cut)
    probs = torch.softmax(logits / 0.7, dim=-1)
    assert torch.allclose(sharpened(probs, 0.5), torch.softmax(logits / 0.35, dim=-1))
    assert sharpened(probs, 1.0) is probs
    onehot = torch.zeros(2, 20, dtype=torch.float64)
    onehot[:, 7] = 1.0
    assert torch.equal(sharpened(onehot, 0.3), onehot)
    tiny = torch.tensor([[1e-30, 1e-31, 0.0]], dtype=torch.float32)  # would underflow to 0 ** 4 unscaled
    assert torch.allclose(sharpened(tiny / tiny.sum(), 0.25), torch.tensor([[1.0, 1e-4, 0.0]]) / 1.0001)
    with pytest.raises(ValueError, match="factor"):
        sharpened(probs, 0.0)


def _first_q(monkeypatch: pytest.MonkeyPatch, factor: float) -> torch.Tensor:
    """The draft distribution the standard rule gets at the first drafting step of one unseeded
    request, decoded with STANDARD_DRAFT_FACTOR = factor."""
    seen: list[torch.Tensor] = []

    def spy(proposals, target_probs, draft_probs, *args, **kwargs):
        # the request's own q may come as its nucleus's pairs
        seen.append(draft_probs.dense() if isinstance(draft_probs, SparseProbs) else draft_probs.clone())
        return verify_standard(proposals, target_probs, draft_probs, *args, **kwargs)

    monkeypatch.setattr(sampling, "STANDARD_DRAFT_FACTOR", factor)
    monkeypatch.setattr(decode, "verify_standard_keyed", as_keyed(spy))
    torch.manual_seed(0)  # the same drafter, and the same random seed for the unseeded row
    model = make_tiny_target("llama", vocab_size=VOCAB, seed=1)
    drafter = _chain_drafter(model, "random", None)
    SpecDecoder(HFTarget(model), drafter, SpecConfig(block_size=4)).generate(
        [[1, 2, 3]], SamplingParams(max_new_tokens=4, temperature=0.9, top_p=0.95, ignore_eos=True))
    return seen[0]


def test_standard_rows_are_tested_against_the_sharpened_q_they_drew_from(monkeypatch: pytest.MonkeyPatch) -> None:
    request_q = _first_q(monkeypatch, 1.0)
    q = _first_q(monkeypatch, 0.4)
    assert torch.allclose(q, sharpened(request_q, 0.4).to(q.dtype), atol=1e-6)
    assert bool((q.amax(-1) > request_q.amax(-1)).all())  # sharper at every proposal position


def unsharpened_q(proposals, target_probs, draft_probs, accept_u, bonus_u, limit=None):
    """Lossy: tests proposals drawn from the sharpened q against the request's q."""
    return verify_standard(proposals, target_probs, sharpened(draft_probs, 1.0 / sampling.STANDARD_DRAFT_FACTOR),
                           accept_u, bonus_u, limit)


@pytest.mark.parametrize("lossy", [False, True], ids=["sharpened", "tested_against_request_q"])
def test_sharpened_chains_follow_the_target(lossy: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sampling, "STANDARD_DRAFT_FACTOR", 0.3)  # far from the request's q: a twin shows
    model = make_tiny_target("llama", vocab_size=VOCAB, seed=1)
    sp = UNSEEDED.with_(temperature=0.5)  # peaked p and q: the twin's error shows
    joint = exact_joint(model, sp)
    dec = SpecDecoder(HFTarget(model), _chain_drafter(model, "random", joint), SpecConfig(block_size=4))
    if lossy:
        monkeypatch.setattr(decode, "verify_standard_keyed", as_keyed(unsharpened_q))
        (counts,) = sample_unseeded(dec, [sp] * 400, n=2000)
        assert chi2_pvalue(counts.sum(0), joint.sum(0)) < 1e-6
        return
    (counts,) = sample_unseeded(dec, [sp] * 400, n=4000)
    assert_follows(counts, joint)
    stats = dec.generate([[1, 2, 3]] * 40, sp)
    assert {r.stats.sampling_rule for r in stats} == {"standard"}
    assert sum(r.stats.accepted_by_position[0] for r in stats) > 0  # proposals were kept
