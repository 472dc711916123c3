"""Lossless on a real model: SmolLM2-135M-Instruct from PyPI, our decoder vs `transformers`."""

from __future__ import annotations

import pytest
import torch

import blockspec

PROMPTS = [
    "What is the capital of France?",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether?",
]


@pytest.mark.slow
@pytest.mark.parametrize("backend,drafter_dtype,lookup", [("native", "float32", False), ("native", "bfloat16", False),
                                                          ("hf", "auto", False), ("native", "auto", True)])
def test_dflash_greedy_equals_transformers_generate(smollm2_dir, backend: str, drafter_dtype: str,
                                                    lookup: bool) -> None:
    from transformers import AutoModelForCausalLM

    from blockspec.api import default_drafter_for

    drafter = default_drafter_for("smollm2-135m-instruct")
    assert drafter is not None, "the shipped SmolLM2 drafter is missing from the package"
    # whole blocks every step: the tau check below is about the drafter, not the adaptive policy's timings;
    # the exact mode: transformers' numerics (auto would take int8 for this GGUF conversion)
    pipe = blockspec.load(str(smollm2_dir), str(drafter), backend=backend, drafter_dtype=drafter_dtype, lookup=lookup,
                          adaptive_block=False, compute="exact")
    assert pipe.compute == "exact"
    model = AutoModelForCausalLM.from_pretrained(str(smollm2_dir), dtype=torch.float32).eval()
    prompts = [pipe.encode([{"role": "user", "content": p}]) for p in PROMPTS]
    ours = pipe.generate_ids(prompts, blockspec.SamplingParams(max_new_tokens=24))
    for ids, got in zip(prompts, ours):
        ref = model.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False)[0, len(ids):].tolist()
        assert got.token_ids == ref
    assert "Paris" in ours[0].text
    # The trained drafter gets blocks accepted in either dtype (a broken cast would leave tau ~1).
    assert sum(r.stats.mean_tau for r in ours) / len(ours) > 1.2, [r.stats.mean_tau for r in ours]
    looked = sum(r.stats.lookup_steps for r in ours)
    # the maths answer repeats the question's words: with lookup some steps propose from it
    assert looked > 0 if lookup else looked == 0


@pytest.mark.slow
def test_bf16_target_dflash_equals_its_own_plain_decoding(smollm2_dir) -> None:
    """A bf16 target rounds every layer's output to 8 bits of mantissa, so verification must
    compute each token exactly as plain decoding does (before the batch-invariant attention,
    7 of 8 held-out outputs of 128 tokens drifted here). The reference is the same bf16 target."""
    from blockspec.api import default_drafter_for
    from blockspec.datasets import load_dataset

    params = blockspec.SamplingParams(max_new_tokens=64)
    drafter = str(default_drafter_for("smollm2-135m-instruct"))
    spec = blockspec.load(str(smollm2_dir), drafter, dtype="bfloat16", lookup=False, adaptive_block=False)
    plain = blockspec.load(str(smollm2_dir), "none", dtype="bfloat16")
    gsm8k = [s.prompt for s in load_dataset("gsm8k", limit=4)]  # the bundled test split: held out of training
    messages = [[{"role": "user", "content": p}] for p in (*PROMPTS, *gsm8k)]
    prompts = [spec.encode(m) for m in messages]
    ours = spec.generate_ids(prompts, params)
    assert [r.token_ids for r in ours] == [r.token_ids for r in plain.generate_ids(prompts, params)]
    assert sum(r.stats.mean_tau for r in ours) / len(ours) > 1.2


@pytest.mark.slow
def test_the_q4_1_target_runs_packed_with_the_bits_of_its_fp32_weights(smollm2_dir) -> None:
    """SmolLM2-135M-Instruct comes from a GGUF of Q4_1 projections and a Q8_0 embedding: all of them
    pack (cpu/packed_weights.py), and a prefill plus a 6-token verification give the logits of the
    unpacked fp32 model exactly."""
    from blockspec.targets.native import load_native_target

    packed = load_native_target(smollm2_dir, "float32", compute="exact")
    plain = load_native_target(smollm2_dir, "float32", pack_weights=False, compute="exact")
    layers = packed.net.layers
    assert sum(m.packed.bits == 4 for layer in layers for m in (layer.qkv, layer.o, layer.gate_up, layer.down)) == 120
    assert packed.net.lm_head.packed.bits == 8  # the embedding, Q8_0 in the GGUF file, is the tied head
    ids = torch.randint(0, 49152, (1, 40), generator=torch.Generator().manual_seed(0))
    caches = [t.new_cache(1, 64) for t in (packed, plain)]
    for chunk, pos in ((ids[:, :34], torch.arange(34)), (ids[:, 34:], torch.arange(34, 40))):
        a, b = (t.forward(chunk, pos[None], c, (1, 14, 27)) for t, c in zip((packed, plain), caches))
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@pytest.mark.slow
def test_int8_dflash_equals_int8_plain_decoding_on_the_q4_1_target(smollm2_dir) -> None:
    """The int8 compute mode is lossless within itself on the real model: greedy DFlash with the
    shipped drafter (ragged batch, whole blocks) gives the int8 target's own plain decoding."""
    from blockspec.api import default_drafter_for
    from blockspec.datasets import load_dataset

    params = blockspec.SamplingParams(max_new_tokens=48)
    drafter = str(default_drafter_for("smollm2-135m-instruct"))
    spec = blockspec.load(str(smollm2_dir), drafter, compute="int8", lookup=False, adaptive_block=False)
    plain = blockspec.load(str(smollm2_dir), "none", compute="int8")
    assert spec.compute == plain.compute == "int8"
    assert spec.drafter.compute == "int8"  # the drafter drafts in int8 too (fp32, its auto dtype beside int8)
    gsm8k = [s.prompt for s in load_dataset("gsm8k", limit=3)]
    prompts = [spec.encode([{"role": "user", "content": p}]) for p in (*PROMPTS, *gsm8k)]
    ours = spec.generate_ids(prompts, params)
    assert [r.token_ids for r in ours] == [r.token_ids for r in plain.generate_ids(prompts, params)]
    assert sum(r.stats.mean_tau for r in ours) / len(ours) > 1.2
