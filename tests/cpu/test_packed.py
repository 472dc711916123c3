"""Packed copies of fp32 weights that a Q4_1 or Q8_0 GGUF left (cpu/packed_weights.py): exact, or absent."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import make_tiny_target
from support import ragged_prompts

from blockspec.config import SamplingParams, SpecConfig
from blockspec.cpu import kernels
from blockspec.dflash.drafter import new_drafter_for_target
from blockspec.cpu.linear import linear, project
from blockspec.targets.native import load_native_target
from blockspec.targets.native.llama import PACKED_HEAD_ROWS
from blockspec.cpu.packed_weights import BF16_MAX_ROWS, PackedWeight, pack, pack_for, pack_q4, pack_q8, packed_linear, unpack
from blockspec.engine.decoder import SpecDecoder

needs_kernel = pytest.mark.skipif(kernels.kernel() is None, reason="the native CPU kernel did not build here")


def gguf_round_trip(weight: torch.Tensor, kind: str = "Q4_1") -> torch.Tensor:
    """`weight` through a real GGUF round trip (the gguf package's quantizer and dequantizer for
    `kind`), as a GGUF file's weights reach us."""
    pytest.importorskip("gguf")
    from gguf import GGMLQuantizationType, quants

    qtype = getattr(GGMLQuantizationType, kind)
    back = quants.dequantize(quants.quantize(weight.detach().float().numpy(), qtype), qtype)
    assert back.dtype == np.float32
    return torch.from_numpy(np.ascontiguousarray(back)).reshape(weight.shape)


def q4_model_dir(source: Path, model_dir: Path) -> Path:
    """A copy of the model directory `source` at `model_dir` whose projections hold Q4_1 GGUF
    weights, as a conversion of a GGUF file has them (not marked as one: no zoo marker)."""
    import transformers as tf

    shutil.copytree(source, model_dir)
    model = tf.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2 and "proj" in name:
                p.copy_(gguf_round_trip(p))
    model.save_pretrained(str(model_dir))
    return model_dir


def test_gguf_q4_1_weights_pack_exactly_and_others_do_not() -> None:
    g = torch.Generator().manual_seed(0)
    w = gguf_round_trip(torch.randn(40, 96, generator=g) * 0.1)
    w[3, :32] = 0.25  # a constant block: d = 0
    packed = pack_q4(w)
    assert packed is not None and packed.bits == 4 and packed.shape == (40, 96)
    assert packed.qs.shape == (40, 48) and packed.sc.shape == (40, 3, 2)
    assert torch.equal(unpack(packed), w)
    assert packed.matches(w) and pack(w).bits == 4
    assert pack(torch.randn(40, 96, generator=g)) is None  # fp32 weights not of either form
    assert pack(w[:, :80].contiguous()) is None  # inputs not a multiple of 32
    assert pack(w.double()) is None and pack(w.bfloat16()) is None
    inf = w.clone()
    inf[0, 0] = float("inf")
    assert pack(inf) is None
    mixed = w.clone()
    mixed[5, 40] += 1e-3  # one weight off the grid of its block
    assert pack_q4(mixed) is None
    with pytest.raises(ValueError, match="PackedWeight of 4 bits needs"):
        PackedWeight(4, packed.qs, packed.sc[:, :2], packed.source)


def test_gguf_q8_0_weights_pack_in_8_bits_exactly() -> None:
    g = torch.Generator().manual_seed(1)
    w = gguf_round_trip(torch.randn(24, 64, generator=g) * 0.3, "Q8_0")
    w[2, 32:] = 0.0  # an all-zero block
    assert pack_q4(w) is None  # more than 16 values per block
    packed = pack(w)
    assert packed is not None and packed.bits == 8 and packed.qs.dtype == torch.int8
    assert packed.qs.shape == (24, 64) and packed.sc.shape == (24, 2, 1)
    assert torch.equal(unpack(packed), w)
    q4_grid = gguf_round_trip(torch.randn(8, 64, generator=g))
    assert pack_q8(q4_grid) is None or torch.equal(unpack(pack_q8(q4_grid)), q4_grid)  # m != 0: rarely d q
    shifted = w.clone()
    shifted[0, 0] += 1e-4
    assert pack(shifted) is None


@needs_kernel
@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 8, 9, 13, 16, 33, 128])
@pytest.mark.parametrize("out", [70, 71])  # up to 6 rows the kernel takes weight rows in pairs: an odd one is left
@pytest.mark.parametrize("width", [128, 1568])  # 1568: the tiles take it in several passes
def test_packed_product_has_the_bits_of_the_fp32_kernel(rows: int, kind: str, out: int, width: int) -> None:
    g = torch.Generator().manual_seed(rows)
    w = gguf_round_trip(torch.randn(out, width, generator=g) * 0.05, kind)
    packed = pack(w)
    assert packed.bits == (4 if kind == "Q4_1" else 8)
    x, bias, res = torch.randn(rows, width, generator=g), torch.randn(out, generator=g), torch.randn(rows, out, generator=g)
    if rows > kernels.max_rows(torch.float32):  # an AVX2 build takes 8 fp32 rows: the caller keeps the weight
        assert packed_linear(x, packed, None) is None
        return
    assert torch.equal(packed_linear(x, packed, None), linear(x, w))
    assert torch.equal(packed_linear(x, packed, bias), linear(x, w, bias))
    assert torch.equal(packed_linear(x, packed, bias, res), linear(x, w, bias, residual=res))
    assert torch.equal(packed_linear(x, packed, bias, res.t().contiguous().t()), res + linear(x, w, bias))  # strided
    torch.testing.assert_close(packed_linear(x, packed, bias), torch.nn.functional.linear(x.double(), w.double(),
                                                                                        bias.double()).float())
    x3 = x.reshape(1, rows, width)
    assert torch.equal(packed_linear(x3, packed, None)[0], linear(x, w))
    assert torch.equal(packed_linear(x[-1:].clone(), packed, None)[0], linear(x, w)[-1])  # a row alone: its bits


@needs_kernel
@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
@pytest.mark.parametrize("rows", [1, 2, 3, 6, 8, 9, 40, 200])
@pytest.mark.parametrize("out", [36, 37])
def test_bf16_roundings_of_packed_values_multiply_with_the_bits_of_the_bf16_kernel(rows: int, kind: str, out: int) -> None:
    g = torch.Generator().manual_seed(100 + rows)
    source = gguf_round_trip(torch.randn(out, 96, generator=g) * 0.05, kind)
    weight = source.bfloat16()  # a bf16 model converted from the GGUF
    packed = pack_for(weight, source)
    assert packed is not None and packed.dtype == torch.bfloat16 and packed.matches(weight)
    x, bias = torch.randn(rows, 96, generator=g).bfloat16(), torch.randn(out, generator=g).bfloat16()
    res = torch.randn(rows, out, generator=g).bfloat16()
    for lo in range(0, rows, BF16_MAX_ROWS):  # more rows than that take the bf16 weights
        xs, rs = x[lo : lo + BF16_MAX_ROWS], res[lo : lo + BF16_MAX_ROWS]
        assert torch.equal(packed_linear(xs, packed, bias), linear(xs, weight, bias))
        assert torch.equal(packed_linear(xs, packed, None, rs), linear(xs, weight, residual=rs))
    assert (packed_linear(x, packed, None) is None) == (rows > BF16_MAX_ROWS)
    fn = kernels.kernel()  # the kernel itself takes any number of rows
    y, want = torch.empty(rows, out), torch.empty(rows, out)
    fn.bf16(x.data_ptr(), weight.data_ptr(), None, want.data_ptr(), rows, 96, out, 2)
    f = fn.q4_bf16 if packed.bits == 4 else fn.q8_bf16
    assert f(x.data_ptr(), packed.qs.data_ptr(), packed.sc.data_ptr(), None, y.data_ptr(), rows, 96, out, 2) == 0
    assert torch.equal(y, want)
    assert packed_linear(x.float(), packed, None) is None  # an fp32 x: not this weight's dtype
    assert pack_for(weight, None) is None and pack_for(weight, source[:, :64]) is None
    assert pack_for(weight, torch.randn(out, 96, generator=g)) is None  # a source it was not rounded from
    assert pack_for(weight.half(), source) is None


@needs_kernel
def test_packed_product_declines_what_it_cannot_take() -> None:
    w = gguf_round_trip(torch.randn(8, 64) * 0.1)
    packed = pack(w)
    assert packed_linear(torch.randn(2, 64).double(), packed, None) is None
    assert packed_linear(torch.randn(2, 32), packed, None) is None  # wrong width
    assert packed_linear(torch.randn(kernels.max_rows() + 1, 64), packed, None) is None  # a long prefill: fp32
    assert packed_linear(torch.randn(2, 64, requires_grad=True), packed, None) is None  # autograd: F.linear


def _q4_model(seed: int):
    """A tiny fp32 Llama whose projections hold Q4_1 GGUF weights and its head Q8_0 ones (as
    SmolLM2-135M-Instruct's GGUF file has them)."""
    model = make_tiny_target("llama", seed=seed, dtype=torch.float32, hidden_size=64, intermediate_size=96,
                             num_attention_heads=4, num_key_value_heads=2)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2 and "proj" in name:
                p.copy_(gguf_round_trip(p))
            elif name == "lm_head.weight":
                p.copy_(gguf_round_trip(p, "Q8_0"))
    return model


@needs_kernel
def test_native_target_with_packed_weights_computes_the_same_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    import blockspec.cpu.linear as linear_module

    calls = []

    def counting(*args, **kwargs):
        calls.append(args[0].shape)
        return packed_linear(*args, **kwargs)

    monkeypatch.setattr(linear_module, "packed_linear", counting)
    model = _q4_model(seed=3)
    packed = load_native_target(model, dtype="float32")
    plain = load_native_target(model, dtype="float32", pack_weights=False)
    layers = packed.net.layers
    assert all(m.packed.bits == 4 for layer in layers for m in (layer.qkv, layer.o, layer.gate_up, layer.down))
    assert packed.net.lm_head.packed.bits == 8
    assert all(getattr(m, "packed", None) is None for layer in plain.net.layers for m in (layer.qkv, layer.o))
    assert packed.net.packed_summary() == f"{4 * len(layers)} matrices in 4 bits, 1 matrix in 8 bits"
    assert plain.net.packed_summary() is None
    ids = torch.tensor([[5, 9, 11, 2, 30, 7, 7, 1]])
    caches = (packed.new_cache(1, 32), plain.new_cache(1, 32))
    outs = [t.forward(ids, torch.arange(8)[None], c, (1, 3)) for t, c in zip((packed, plain), caches)]
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    # the packed target's projections went packed (through the one-call layer loop, which reads
    # the same packed copies) and so did its head
    assert packed.net.backend.program.kinds() == [(4, 4, 4, 4)] * len(layers)
    assert plain.net.backend.program.kinds() == [(0, 0, 0, 0)] * len(layers)
    assert len(calls) == 1
    step = torch.tensor([[4, 8, 15]])
    outs = [t.forward(step, torch.arange(8, 11)[None], c, (1, 3)) for t, c in zip((packed, plain), caches)]
    assert torch.equal(outs[0][0], outs[1][0])
    # greedy steps of a few tokens take the head's packed copy, longer ones its bf16 screen; both
    # give the argmax of the unpacked model's logits
    start = 11
    for n, head_calls in ((PACKED_HEAD_ROWS, 1), (PACKED_HEAD_ROWS + 2, 0)):
        calls.clear()
        step, pos = torch.arange(16, 16 + n)[None], torch.arange(start, start + n)[None]
        best, _ = packed.forward_greedy(step, pos, caches[0], ())
        logits, _ = plain.forward(step, pos, caches[1], ())
        assert torch.equal(best, logits.argmax(-1)) and len(calls) == head_calls  # projections: the layer loop's
        start += n
    # greedy DFlash on the packed target equals plain decoding on the unpacked one
    prompts = ragged_prompts(3, seed=4, vocab=48)
    truth = [r.token_ids for r in SpecDecoder(plain, None, SpecConfig(block_size=1)).generate(
        prompts, SamplingParams(max_new_tokens=12))]
    drafter = new_drafter_for_target(model.config, mask_token_id=47, num_layers=1, dtype=torch.float32)
    got = SpecDecoder(packed, drafter, SpecConfig(block_size=8)).generate(prompts, SamplingParams(max_new_tokens=12))
    assert [r.token_ids for r in got] == truth


@needs_kernel
def test_bf16_native_target_packs_its_fp32_sources_and_keeps_its_bits() -> None:
    model = _q4_model(seed=8)
    packed = load_native_target(model, dtype="bfloat16")
    plain = load_native_target(model, dtype="bfloat16", pack_weights=False)
    layers = packed.net.layers
    assert all(m.packed.dtype == torch.bfloat16 for layer in layers for m in (layer.qkv, layer.o, layer.down))
    assert packed.net.lm_head.packed.bits == 8
    ids = torch.tensor([[5, 9, 11, 2, 30, 7, 7, 1, 4, 8]])
    caches = (packed.new_cache(1, 32), plain.new_cache(1, 32))
    for chunk, pos in ((ids[:, :7], torch.arange(7)), (ids[:, 7:], torch.arange(7, 10))):
        a, b = (t.forward(chunk, pos[None], c, (1, 3)) for t, c in zip((packed, plain), caches))
        assert a[0].dtype == torch.bfloat16 and torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@needs_kernel
def test_a_weight_changed_after_packing_is_read_from_its_fp32_tensor() -> None:
    model = _q4_model(seed=5)
    target = load_native_target(model, dtype="float32")
    o = target.net.layers[0].o
    x = torch.randn(3, 64)
    with torch.no_grad():
        before = project(o, x)
        o.weight.mul_(3.0)  # in place: the packed copy is stale now
        after, want = project(o, x), linear(x, o.weight)
    assert not o.packed.matches(o.weight)
    assert torch.equal(after, want) and not torch.equal(after, before)


def test_packing_can_be_turned_off_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    model = _q4_model(seed=6)
    monkeypatch.setenv("BLOCKSPEC_PACK_WEIGHTS", "0")
    assert getattr(load_native_target(model, dtype="float32").net.layers[0].o, "packed", None) is None
    monkeypatch.setenv("BLOCKSPEC_PACK_WEIGHTS", "1")
    assert load_native_target(model, dtype="float32").net.layers[0].o.packed is not None
    assert getattr(load_native_target(model, dtype="float64").net.layers[0].o, "packed", None) is None


@needs_kernel
def test_bench_reports_a_packed_target_and_stays_lossless(tmp_path, tiny_model_dir, tiny_drafter_dir) -> None:
    from blockspec.cli import main

    model_dir = q4_model_dir(tiny_model_dir, tmp_path / "q4_1")
    out = tmp_path / "out"
    rc = main(["bench", "--target", str(model_dir), "--drafter", str(tiny_drafter_dir), "--datasets", "gsm8k",
               "--limit", "2", "--max-new-tokens", "8", "--adaptive-only", "--no-progress", "--no-warmup",
               "--out", str(out)])
    md = (out / "report.md").read_text()
    assert rc == 0
    assert "- packed weights: 16 matrices in 4 bits (exact; BLOCKSPEC_PACK_WEIGHTS=0 turns them off)" in md
    assert "Lossless check: passed" in md


def _converted(tmp_path, monkeypatch: pytest.MonkeyPatch, seed: int = 9):
    """A tiny model of GGUF weights as a converted model of a fresh blockspec cache."""
    monkeypatch.setenv("BLOCKSPEC_CACHE", str(tmp_path / "cache"))
    model_dir = tmp_path / "cache" / "models" / "q4"
    _q4_model(seed).save_pretrained(str(model_dir))
    return model_dir


class _CountPacking:
    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from blockspec.cpu import packed_cache

        self.calls, real = 0, packed_cache.pack_linears

        def counting(*args, **kwargs):
            self.calls += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(packed_cache, "pack_linears", counting)


def _same_packed(a, b) -> bool:
    for (_, ma), (_, mb) in zip(a.net.packable(), b.net.packable(), strict=True):
        pa, pb = ma.packed, mb.packed
        if (pa is None) != (pb is None):
            return False
        if pa is not None and not (pa.bits == pb.bits and pa.dtype == pb.dtype and torch.equal(pa.qs, pb.qs)
                                   and torch.equal(pa.sc, pb.sc) and pb.matches(mb.weight)):
            return False
    return True


@needs_kernel
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_packed_weights_kept_beside_a_converted_model_load_bit_identical(tmp_path, monkeypatch, dtype) -> None:
    model_dir = _converted(tmp_path, monkeypatch)
    packing = _CountPacking(monkeypatch)
    fresh = load_native_target(model_dir, dtype)
    kept = model_dir / f"packed-{dtype}.safetensors"
    assert packing.calls == 1 and kept.is_file()
    assert not list(model_dir.glob(".*.tmp"))  # written under a temporary name, then renamed
    again = load_native_target(model_dir, dtype)
    assert packing.calls == 1  # read back, not packed again
    assert _same_packed(fresh, again) and again.net.packed_summary() == fresh.net.packed_summary()
    ids = torch.tensor([[5, 9, 11, 2, 30, 7, 7, 1]])
    a, b = (t.forward(ids, torch.arange(8)[None], t.new_cache(1, 16), (1, 3)) for t in (fresh, again))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@needs_kernel
def test_a_damaged_stale_or_foreign_packed_file_is_rebuilt_not_trusted(tmp_path, monkeypatch) -> None:
    from blockspec.cpu import packed_cache

    model_dir = _converted(tmp_path, monkeypatch)
    packing = _CountPacking(monkeypatch)
    fresh = load_native_target(model_dir, "float32")
    kept = model_dir / "packed-float32.safetensors"
    good = kept.read_bytes()

    def reload_packs_again(why: str) -> None:
        before = packing.calls
        got = load_native_target(model_dir, "float32")
        assert packing.calls == before + 1, why
        assert _same_packed(fresh, got), why
        load_native_target(model_dir, "float32")  # and the file written then is good again
        assert packing.calls == before + 1, why

    kept.write_bytes(good[:-1] + bytes([good[-1] ^ 1]))
    reload_packs_again("one bit of the payload flipped: the checksum differs")
    kept.write_bytes(good[: len(good) // 2])
    reload_packs_again("truncated")
    kept.write_bytes(b"not a safetensors file")
    reload_packs_again("garbage")
    weights = model_dir / "model.safetensors"
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10**9))
    reload_packs_again("the model's weights were rewritten")
    monkeypatch.setattr(packed_cache, "FORMAT", packed_cache.FORMAT + 1)
    reload_packs_again("another packing format")
    # a file with the right key and checksum whose scales do not rebuild these weights
    names = fresh.net.packable()
    wrong = {n: None if m.packed is None else PackedWeight(m.packed.bits, m.packed.qs, m.packed.sc * 2,
                                                           m.packed.source) for n, m in names}
    packed_cache.save(kept, wrong, packed_cache.source_key(model_dir, torch.float32))
    reload_packs_again("packed from other weights")


@needs_kernel
def test_packed_weights_are_not_kept_for_models_outside_the_cache_or_when_writing_fails(tmp_path, monkeypatch) -> None:
    import warnings

    from blockspec.cpu import packed_cache

    model_dir = _converted(tmp_path, monkeypatch)
    outside = tmp_path / "mine"
    model_dir.rename(outside)
    packing = _CountPacking(monkeypatch)
    load_native_target(outside, "float32")
    load_native_target(outside, "float32")
    assert packing.calls == 2 and sorted(p.name for p in outside.iterdir()) == ["config.json", "generation_config.json",
                                                                               "model.safetensors"]
    assert not (tmp_path / "cache" / "models").exists() or not any((tmp_path / "cache" / "models").iterdir())
    outside.rename(model_dir)

    def failing(*args, **kwargs):
        raise OSError("read-only file system")

    monkeypatch.setattr(packed_cache, "save", failing)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        target = load_native_target(model_dir, "float32")
    assert target.net.packed_summary() is not None  # packed all the same
    assert any("could not keep the packed weights" in str(w.message) for w in caught)
