"""Every supported target architecture decodes losslessly through the Hugging Face adapter.

Tiny random models of each (hidden 64, 4 layers, float64): greedy DFlash output equals
`model.generate(do_sample=False)` token for token, alone and in a ragged batch with one row
finishing early, with a drafter right for a random number of leading tokens each step, so nearly
every step rolls the target back mid-block (K/V slots, and the convolution and recurrent states
of hybrid targets)."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_target
from scripted import PrefixDrafter
from support import OracleDrafter, distinct_prompts, one_thread, ragged_prompts, run_with_joins  # noqa: F401 (fixture)

from blockspec.config import SamplingParams, SpecConfig
from blockspec.engine.decoder import SpecDecoder
from blockspec.engine import Engine, EngineConfig
from blockspec.errors import ConfigError
from blockspec.targets import gated_delta
from blockspec.targets.exactness import check_exact
from blockspec.targets.hf import HFTarget

ARCHITECTURES = ["llama", "qwen2", "qwen3", "qwen3_moe", "glm4_moe", "gemma3", "gpt_oss", "qwen3_next",
                 "qwen3_5_text", "qwen3_5_moe_text"]
HYBRID = ["qwen3_next", "qwen3_5_text", "qwen3_5_moe_text"]
VOCAB = 64
NEW = 48


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: thread hand-offs cost more than the work


def generate(model, prompt: list[int], n: int) -> list[int]:
    """The target's own greedy continuation, by Hugging Face generate (its own caches and kernels),
    with no stop token (the decoders under test have none either)."""
    model.generation_config.eos_token_id = None
    ids = torch.tensor([prompt])
    with torch.no_grad():  # an explicit mask: generate would take a prompt token equal to pad_token_id for padding
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                             pad_token_id=0)
    assert out.shape[1] == len(prompt) + n
    return out[0, len(prompt):].tolist()


_CASES: dict[str, tuple] = {}


def case(family: str) -> tuple:
    """(model, three prompts of different lengths, their greedy continuations), built once."""
    if family not in _CASES:
        model = make_tiny_target(family, seed=7, hidden_size=64, intermediate_size=128, vocab_size=VOCAB)
        prompts = ragged_prompts(3, seed=len(family), vocab=VOCAB)
        _CASES[family] = model, prompts, [generate(model, p, NEW) for p in prompts]
    return _CASES[family]


@pytest.mark.parametrize("family", ARCHITECTURES)
def test_greedy_output_equals_generate_alone_and_ragged(family: str) -> None:
    model, prompts, truths = case(family)
    target = HFTarget(model)
    check_exact(target)  # what load_hf_target runs: a verify pass and a rejection against single steps
    lengths = [NEW, NEW - 19, NEW - 6]  # the second row finishes early and leaves the batch
    for rows, block in (([0], 6), ([0, 1, 2], 8)):
        ps, want = [prompts[i] for i in rows], [truths[i][: lengths[i]] for i in rows]
        drafter = PrefixDrafter(model, ps, want, seed=block)
        results = SpecDecoder(target, drafter, SpecConfig(block_size=block)).generate(
            ps, [SamplingParams(max_new_tokens=lengths[i]) for i in rows])
        assert [r.token_ids for r in results] == want
        taus = [n for r in results for n in r.stats.acceptance_lengths]
        assert sum(1 < n < block for n in taus) >= len(taus) // 3, taus  # rolled back mid-block, often


@pytest.mark.parametrize("family", ["qwen3_5_text", "gpt_oss"])
def test_requests_joining_mid_flight_in_the_engine(family: str) -> None:
    model = make_tiny_target(family, seed=21)  # vocab 48: the oracle drafter's mask token is 47
    target = HFTarget(model)
    prompts = distinct_prompts(6, seed=3)
    truths = [generate(model, p, 30) for p in prompts]
    engine = Engine(target, OracleDrafter(model, target, prompts, truths, wrong_every=3),
                    EngineConfig(SpecConfig(block_size=6), max_batch=3))
    try:
        assert run_with_joins(engine, prompts, SamplingParams(max_new_tokens=30)) == truths
        assert engine.recorder.row_steps > engine.metrics.steps_total  # rows shared steps
        assert 1.3 < engine.metrics.mean_tau < 6
    finally:
        engine.stop()


def test_a_rollback_that_keeps_rejected_tokens_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The checks fail when the recurrent state is not rolled back: the greedy output of the
    test above diverges, and so does the load-time check."""
    model, prompts, truths = case("qwen3_5_text")

    def keep_everything(self, keep=None):
        original(self, None)

    original = gated_delta.DeltaState.commit
    monkeypatch.setattr(gated_delta.DeltaState, "commit", keep_everything)
    target = HFTarget(model)
    with pytest.raises(ConfigError, match="cannot be decoded exactly"):
        check_exact(target)
    drafter = PrefixDrafter(model, prompts[:1], truths[:1], seed=1)
    got = SpecDecoder(target, drafter, SpecConfig(block_size=6)).generate(
        prompts[:1], SamplingParams(max_new_tokens=NEW))[0].token_ids
    assert got != truths[0]


@pytest.mark.parametrize("family", HYBRID)
def test_gated_delta_state_after_a_rejection_equals_hugging_face_steps(family: str) -> None:
    """One layer against the Hugging Face module's own cache: a 70-token prefill (two chunks), a
    verified block of 6 of which rows keep 2 and 5, then the states and the next outputs."""
    from transformers import DynamicCache

    model = case(family)[0]
    layer = model.model.layers[0].linear_attn
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 77, 64, generator=g, dtype=torch.float64)
    state = gated_delta.DeltaState.zeros(layer, 2, torch.float64, "cpu")
    ones = torch.ones(2, 77, dtype=torch.bool)
    with torch.no_grad():
        gated_delta.delta_forward(layer, x[:, :70], state, ones[:, :70])
        block = gated_delta.delta_forward(layer, x[:, 70:76], state, ones[:, :6])
        state.commit(torch.arange(6)[None] < torch.tensor([[2], [5]]))
        for row, kept in ((0, 2), (1, 5)):
            cache = DynamicCache(config=model.config)
            layer(x[row : row + 1, :70], cache_params=cache)
            steps = torch.cat([layer(x[row : row + 1, 70 + j : 71 + j], cache_params=cache) for j in range(kept)], 1)
            theirs = cache.layers[0]
            assert torch.allclose(block[row, :kept], steps[0], atol=1e-6)
            assert torch.allclose(state.conv[row], theirs.conv_states[0][0, :, 1:], atol=1e-12)  # HF keeps K columns, uses K-1
            assert torch.allclose(state.rec[row], theirs.recurrent_states[0][0].double(), atol=1e-6)


def test_layers_whose_state_cannot_be_rolled_back_are_refused() -> None:
    import transformers as tf

    cfg = tf.Lfm2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, layer_types=["conv", "full_attention"])
    with pytest.raises(ConfigError, match="lfm2 is not supported as a target.*'conv' layers"):
        HFTarget(tf.Lfm2ForCausalLM(cfg))
