"""The drafter in the int8 compute mode (`DFlashDrafter.use_compute`): the static pass's products
(fc, q/k/v, o, gate/up, down) and the restricted draft head multiply 8-bit activations by integer
weights of 4 bits (the default) or 8 (cpu/int8.py). Held against a PyTorch reference of the same
arithmetic: the module's own pass with every product replaced by `reference_product` of the
weight's `quantize_weight` form of those bits.
The C layer program has the Python loop's bits; the exact mode is untouched (its parity tests:
test_forward_parity.py); greedy DFlash in int8 equals int8 plain decoding (test_compute_modes.py
and below)."""

from __future__ import annotations

import pytest
import torch
from test_forward_parity import _drafter, _passes

from blockspec.cpu import kernels
from blockspec.cpu.int8 import quantize_weight, reference_product
from blockspec.dflash import drafter as drafter_module
from blockspec.dflash.drafter import INT8_BITS_ENV, int8_weight_bits, new_drafter_for_target
from blockspec.dflash.static_drafter import StaticDrafter, StaticWeights
from blockspec.errors import ConfigError

needs_kernel = pytest.mark.skipif(kernels.kernel() is None, reason="the native CPU kernel did not build here")


def _int8_reference(module: torch.nn.Linear, x: torch.Tensor, bits: int = 8, **_: object) -> torch.Tensor:
    return reference_product(x, quantize_weight(module.weight.detach(), bits), module.bias)


def _head(drafter, seed: int = 4) -> torch.nn.Linear:
    head = torch.nn.Linear(32, drafter.cfg.vocab_size, bias=True)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        head.weight.normal_(0.0, 1.0, generator=g)
        head.bias.normal_(0.0, 0.5, generator=g)
    return head


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("batch", [2, 1], ids=["ragged", "one-row"])
def test_int8_pass_equals_the_pytorch_reference_and_the_program_has_the_loops_bits(
        batch: int, bits: int, monkeypatch: pytest.MonkeyPatch) -> None:
    drafter = _drafter("bidirectional")
    assert drafter.use_compute("int8", bits) == "int8" and drafter.int8_bits == bits
    rows = slice(2 - batch, 2)
    with monkeypatch.context() as patch:  # the module's pass, its products the int8 arithmetic in PyTorch
        patch.setattr(torch.nn.Linear, "forward", lambda self, x: _int8_reference(self, x, bits))
        patch.setattr(drafter_module, "project", lambda module, x, **_: _int8_reference(module, x, bits))
        with torch.inference_mode():
            want = _passes(drafter, drafter, drafter.new_cache(batch), rows)
    runs, kinds = {}, []
    for program in (False, True):
        with monkeypatch.context() as patch:
            if not program:
                patch.setattr(StaticWeights, "program", lambda *args: None)
            static = StaticDrafter(drafter)
            runs[program] = _passes(drafter, static, static.new_cache(batch), rows)
            made = static.weights._program
            kinds.append(None if made is None or made[2] is None else made[2].kinds())
    if kernels.kernel() is not None and kernels.max_rows(torch.float32, exact=False) >= 24:
        kind = 16 + bits  # the program's products read integer forms of these bits (LayerProgram.kinds)
        assert kinds[1] == [(kind,) * 4] * len(drafter.layers)
    head = _head(drafter)
    exact = StaticDrafter(_drafter("bidirectional"))  # the same weights in the exact mode
    got_exact = _passes(drafter, exact, exact.new_cache(batch), rows)
    for got_loop, got_program, ref, plain in zip(runs[False], runs[True], want, got_exact):
        assert torch.equal(got_program, got_loop)
        torch.testing.assert_close(got_loop, ref, atol=1e-4, rtol=1e-4)  # attention and norms: other kernels
        assert not torch.equal(got_loop, plain)  # the int8 mode really ran
        with torch.inference_mode():
            assert torch.equal(drafter.greedy_tokens(got_loop[:, 1:], head), drafter.greedy_tokens(ref[:, 1:], head))


@pytest.mark.parametrize("bits", [4, 8])
def test_int8_head_is_the_reference_product_of_the_draft_vocabulary_rows(bits: int) -> None:
    drafter = _drafter("bidirectional")
    head = _head(drafter)
    vocab = torch.tensor([3, 5, 8, 13, 21, 34, 40, 47])
    drafter.set_draft_vocab(vocab, drafter.cfg.vocab_size)
    hidden = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(7))
    with torch.inference_mode():
        exact_logits = drafter.logits(hidden, head)
        drafter.use_compute("int8", bits)
        ref = reference_product(hidden, quantize_weight(head.weight.detach()[vocab], bits), head.bias.detach()[vocab])
        logits = drafter.logits(hidden, head)
        assert torch.equal(logits[..., vocab], ref)
        assert torch.isinf(logits).sum() == 2 * 5 * (drafter.cfg.vocab_size - len(vocab))
        assert not torch.equal(logits, exact_logits)
        ids, conf = drafter.greedy_with_confidence(hidden, head)
        assert torch.equal(ids, vocab[ref.argmax(-1)])
        torch.testing.assert_close(conf, torch.softmax(ref, -1).amax(-1))
        assert torch.equal(drafter.greedy_tokens(hidden, head), ids)
        top, top_ids = drafter.top_logprobs(hidden, head, 3)
        assert torch.equal(top_ids[..., 0], ids)
        torch.testing.assert_close(top, torch.log_softmax(ref, -1).topk(3).values)
        drafter.use_compute("exact")  # back: the exact rows again
        assert torch.equal(drafter.logits(hidden, head), exact_logits)


def test_only_an_fp32_cpu_drafter_takes_the_int8_mode() -> None:
    drafter = _drafter("bidirectional")
    assert drafter.compute == "exact"
    with pytest.raises(ConfigError, match="'exact' or 'int8'"):
        drafter.use_compute("int4")
    assert drafter.to(torch.bfloat16).use_compute("int8") == "exact"  # bf16 activations: the exact path
    static = StaticDrafter(drafter)
    assert static.weights.integer(static.weights.fused()) is None


def test_the_int8_modes_weight_bits_default_to_4_and_follow_a_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    """4-bit forms unless $BLOCKSPEC_DRAFTER_BITS or `use_compute(..., bits)` says 8; a switch
    rebuilds the pass's forms and the draft head's rows (their reads key on the bits), and a bad
    value is refused with what to set."""
    monkeypatch.delenv(INT8_BITS_ENV, raising=False)
    assert int8_weight_bits() == 4
    monkeypatch.setenv(INT8_BITS_ENV, "8")
    assert int8_weight_bits() == 8 and _drafter("bidirectional").int8_bits == 8
    monkeypatch.setenv(INT8_BITS_ENV, "2")
    with pytest.raises(ConfigError, match="BLOCKSPEC_DRAFTER_BITS must be 4 or 8"):
        int8_weight_bits()
    monkeypatch.delenv(INT8_BITS_ENV)
    drafter = _drafter("bidirectional")
    with pytest.raises(ConfigError, match="4 or 8 bits"):
        drafter.use_compute("int8", 3)
    assert drafter.int8_bits == 4 and drafter.use_compute("int8") == "int8"
    weights = StaticDrafter(drafter).weights
    four = weights.read()[1]
    assert four.fc.bits == 4 and all(w.bits == 4 for layer in four.layers for w in layer)
    drafter.use_compute("int8", 8)
    eight = weights.read()[1]
    assert eight.fc.bits == 8 and all(w.bits == 8 for layer in eight.layers for w in layer)
    drafter.use_compute("int8")  # no bits: the drafter keeps its 8
    assert weights.read()[1] is eight
    head = _head(drafter)
    drafter.set_draft_vocab(torch.tensor([1, 2, 3]), drafter.cfg.vocab_size)
    assert drafter._restricted_head(head)[2].bits == 8
    drafter.use_compute("int8", 4)
    assert drafter._restricted_head(head)[2].bits == 4 and weights.read()[1].fc.bits == 4


def test_int8_forms_follow_a_changed_weight() -> None:
    drafter = _drafter("bidirectional")
    drafter.use_compute("int8")
    static = StaticDrafter(drafter)
    first = static.weights.integer(static.weights.fused())
    assert first is static.weights.integer(static.weights.fused())  # kept while nothing changes
    with torch.no_grad():
        drafter.layers[0].mlp.down_proj.weight.mul_(2.0)
    second = static.weights.integer(static.weights.fused())
    assert second is not first
    assert second.layers[0][3].matches(drafter.layers[0].mlp.down_proj.weight)
    with torch.no_grad():
        drafter.layers[1].self_attn.q_proj.weight.add_(1.0)  # a fused weight: rebuilt with the fusion
    third = static.weights.integer(static.weights.fused())
    assert third is not second and not torch.equal(third.layers[1][0].qs, second.layers[1][0].qs)
    gate = drafter.layers[0].mlp.gate_proj
    gate.weight = torch.nn.Parameter(gate.weight.detach() * 3.0)  # a weight replaced, not changed in place
    fourth = static.weights.integer(static.weights.fused())
    assert fourth is not third
    assert torch.equal(static.weights.fused()[0][2][: gate.weight.shape[0]], gate.weight)
    drafter.layers = torch.nn.ModuleList(list(drafter.layers)[:1])  # the layers replaced
    assert len(static.weights.fused()) == 1 and len(static.weights.integer(static.weights.fused()).layers) == 1


def test_a_pass_reads_its_weights_again_only_when_one_changed() -> None:
    """`StaticWeights.read` checks every parameter once and keeps what it read while none
    changes; a weight changed in place (a norm the program reads directly, a fused one) or
    replaced makes the next read, and the program built from it, follow it."""
    drafter = _drafter("bidirectional")
    drafter.use_compute("int8")
    w = StaticDrafter(drafter).weights
    first = w.read()
    program = w.program(*first)
    assert w.read() is first and w.program(*first) is program  # kept while nothing changes
    norm = drafter.layers[0].post_attention_layernorm
    with torch.no_grad():
        norm.weight.mul_(2.0)  # read by the program alone, not by the fused or 8-bit tables
    again = w.read()
    assert again[0] is first[0] and again[1] is first[1]  # the tables did not change...
    if program is not None:  # ...but the program, which watches the norm, is checked and built again
        rebuilt = w.program(*first)
        assert rebuilt is not program and rebuilt.fits()
        program = rebuilt
    with torch.no_grad():
        drafter.layers[1].self_attn.k_proj.weight.add_(1.0)
    second = w.read()
    assert second[0] is not first[0] and not torch.equal(second[1].layers[1][0].qs, first[1].layers[1][0].qs)
    up = drafter.layers[0].mlp.up_proj
    up.weight = torch.nn.Parameter(up.weight.detach() * 3.0)  # replaced, not changed in place
    third = w.read()
    assert third[0] is not second[0] and torch.equal(third[0][0][2][-up.weight.shape[0]:], up.weight)
    if program is not None:
        assert w.program(*third) is not program


@needs_kernel
def test_int8_drafting_keeps_greedy_output_lossless_on_an_fp32_target() -> None:
    """An fp32 drafter beside an int8 target drafts in int8 (DecodeBatch sets it); the output is
    the int8 target's plain greedy output, and the drafts come from the int8 program."""
    from conftest import make_tiny_target
    from support import ragged_prompts

    from blockspec.config import SamplingParams, SpecConfig
    from blockspec.engine.decoder import SpecDecoder
    from blockspec.targets.native import load_native_target

    model = make_tiny_target("llama", seed=5, dtype=torch.float32, hidden_size=64, intermediate_size=96,
                             num_attention_heads=4, num_key_value_heads=2)
    target = load_native_target(model, dtype="float32", compute="int8")
    drafter = new_drafter_for_target(model.config, mask_token_id=47, num_layers=2, dtype=torch.float32)
    drafter.set_draft_vocab(torch.arange(0, 48, 2), model.config.vocab_size)
    prompts = ragged_prompts(3, seed=6, vocab=48)
    params = SamplingParams(max_new_tokens=16)
    plain = [r.token_ids for r in SpecDecoder(target, None, SpecConfig(block_size=1)).generate(prompts, params)]
    spec = SpecDecoder(target, drafter, SpecConfig(block_size=6, adaptive=False))
    assert [r.token_ids for r in spec.generate(prompts, params)] == plain
    assert drafter.compute == "int8"
