"""The int8 compute mode's products (cpu/csrc/int8.c, cpu/int8.py): the kernel has the bits of its
PyTorch emulation on every path (VNNI, AVX2, plain C), and a row gets the same bits alone, in a
batch and on any thread split."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from support import kept_thread_count
from test_packed import gguf_round_trip

from blockspec.cpu import int8, kernels
from blockspec.cpu.packed_weights import pack

needs_kernel = pytest.mark.skipif(kernels.kernel() is None, reason="the native CPU kernel did not build here")
TESTS = Path(__file__).resolve().parents[1]


def _weight(kind: str, out: int, width: int, seed: int, scale: float = 0.05) -> tuple[torch.Tensor, int8.Int8Weight]:
    w = gguf_round_trip(torch.randn(out, width, generator=torch.Generator().manual_seed(seed)) * scale, kind)
    iw = int8.from_packed(pack(w))
    assert iw is not None and iw.bits == (4 if kind == "Q4_1" else 8) and iw.exact
    return w, iw


def test_quantised_rows_follow_the_defined_rounding() -> None:
    x = torch.tensor([[127.0, 63.5, -63.5, 0.5, -1.5] + [0.0] * 27 + [0.0] * 32])
    q, d, s = int8.quantize_rows(x)
    assert d.tolist() == [[1.0, 0.0]]  # an all-zero block: d = 0, q = 0
    assert q[0, :5].tolist() == [127, 64, -64, 0, -2]  # halves to even
    assert s.tolist() == [[127 + 64 - 64 + 0 - 2, 0.0]]
    assert torch.equal(q[0, 32:], torch.zeros(32))


def test_weights_become_the_integer_form_of_their_gguf_values() -> None:
    w, iw = _weight("Q4_1", 5, 96, seed=1)
    levels = iw.levels().float()  # 0..15
    assert levels.min() >= 0 and levels.max() <= 15
    d, m = iw.scales()
    rebuilt = (m[:, :, None] + d[:, :, None] * levels.view(5, 3, 32)).reshape(5, 96)
    assert torch.equal(rebuilt, w) and iw.shape == (5, 96)
    assert iw.qs.shape == (1, 3, 256) and iw.m.shape == (1, 3, 16) and not iw.m[:, :, 5:].any()  # padded rows: 0
    w8, iw8 = _weight("Q8_0", 5, 64, seed=2)
    assert torch.equal((iw8.scales()[0][:, :, None] * iw8.levels().float().view(5, 2, 32)).reshape(5, 64), w8)
    other = int8.quantize_weight(torch.randn(4, 64))  # not of a GGUF form: quantised, values change
    assert other.bits == 8 and not other.exact and other.levels().abs().max() == 127
    assert int8.quantize_weight(torch.randn(4, 40)) is None  # inputs not a multiple of 32
    assert int8.quantize_weight(torch.randn(4, 64).double()) is None
    with pytest.raises(ValueError, match="Int8Weight needs"):
        int8.Int8Weight(4, 5, iw.qs, iw.d, None, iw.source)


def test_scales_are_held_as_fp16_numbers_without_changing_a_weight() -> None:
    # a GGUF holds d and m as fp16: stored so, a 4-bit weight streams 0.625 bytes, not 0.75
    w, iw = _weight("Q4_1", 64, 576, seed=3)
    assert iw.d.dtype == iw.m.dtype == torch.float16
    assert (iw.qs.numel() + 2 * (iw.d.numel() + iw.m.numel())) / w.numel() == 0.625
    d, m = iw.scales()
    assert d.dtype == torch.float32
    assert torch.equal((m[:, :, None] + d[:, :, None] * iw.levels().float().view(64, 18, 32)).reshape(64, 576), w)
    # Q8_0's form of other matrices rounds d to fp16 first, as Q8_0 does, and q stays within +-127
    x = torch.randn(8, 64) * torch.logspace(-6, 3, 8)[:, None]
    q8 = int8.quantize_weight(x)
    assert q8.d.dtype == torch.float16 and q8.levels().abs().max() <= 127
    assert (q8.scales()[0][:, :, None] * q8.levels().float().view(8, 2, 32) - x.view(8, 2, 32)).abs().max() \
        <= 0.51 * q8.scales()[0].max() + 1e-3 * x.abs().max()
    assert int8.quantize_weight(torch.full((2, 32), 1e7)) is None  # a scale past fp16's range
    # a 4-bit form whose block minima are not fp16 numbers has no integer form (and is quantised instead)
    packed = pack(w)
    bent = dataclasses.replace(packed, sc=packed.sc * torch.tensor([1.0, 1 + 2.0 ** -20]))
    assert int8.from_packed(bent) is None
    with pytest.raises(ValueError, match="fp16 numbers"):
        int8.interleave(8, torch.zeros(2, 32, dtype=torch.int8), torch.full((2, 1), 0.1), None, (0, 0))


@needs_kernel
def test_a_4_bit_form_is_q4_1s_rounding_with_fp16_scales() -> None:
    """quantize_weight(w, 4): per block of 32, m = min and d = (max - m) / 15 as fp16 numbers, q
    the nearest of 16 levels; its products are the kernel's, as every integer form's."""
    x = torch.randn(8, 96, generator=torch.Generator().manual_seed(11)) * torch.logspace(-4, 2, 8)[:, None]
    x[3, :32] = 0.25  # a constant block: d 0, every level 0
    q4 = int8.quantize_weight(x, 4)
    assert q4.bits == 4 and not q4.exact and q4.d.dtype == q4.m.dtype == torch.float16
    levels = q4.levels().float()
    assert levels.min() >= 0 and levels.max() == 15
    d, m = q4.scales()
    rebuilt = (m[:, :, None] + d[:, :, None] * levels.view(8, 3, 32)).reshape(8, 96)
    blocks = x.view(8, 3, 32)
    assert torch.equal(m, blocks.amin(-1).half().float())
    assert torch.equal(d, ((blocks.amax(-1) - m) / 15).half().float())
    # within half a step, and a little more at the ends, where m and d were rounded to fp16
    slack = 0.51 * d[:, :, None] + 2e-3 * blocks.abs().amax(-1, keepdim=True)
    assert ((rebuilt.view(8, 3, 32) - blocks).abs() <= slack).all()
    assert torch.equal(rebuilt[3, :32], torch.full((32,), 0.25))
    assert (rebuilt - x).abs().max() > 0  # 16 levels cannot hold random weights
    assert int8.quantize_weight(torch.randn(4, 40), 4) is None
    with pytest.raises(ValueError, match="4 or 8 bits"):
        int8.quantize_weight(x, 3)
    acts = torch.randn(5, 96, generator=torch.Generator().manual_seed(12))
    assert torch.equal(int8.int8_linear(acts, q4), int8.reference_product(acts, q4))


def test_subnormal_fp16_scales_widen_exactly() -> None:
    # weights of ~1e-5: their blocks' d are fp16 subnormals, which each path widens to fp32 exactly
    for kind in ("Q4_1", "Q8_0"):
        _, iw = _weight(kind, 37, 96, seed=7, scale=2e-5)
        d = iw.scales()[0]
        assert bool(((d > 0) & (d < 2.0 ** -14)).any())  # subnormal in fp16
        x = torch.randn(5, 96, generator=torch.Generator().manual_seed(1))
        assert torch.equal(int8.int8_linear(x, iw), int8.reference_product(x, iw))


@needs_kernel
@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
@pytest.mark.parametrize("width", [32, 96, 576, 1568])  # odd and even numbers of blocks; more than 16 blocks
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 13])
def test_kernel_has_the_bits_of_its_pytorch_emulation(kind: str, width: int, rows: int) -> None:
    w, iw = _weight(kind, 37, width, seed=rows + width)  # 37: weight rows in pairs and one alone
    g = torch.Generator().manual_seed(rows)
    x, bias = torch.randn(rows, width, generator=g), torch.randn(37, generator=g)
    res = torch.randn(rows, 37, generator=g)
    x[0, :32] = 0.0  # a block of zeros
    got = int8.int8_linear(x, iw, bias, res)
    assert torch.equal(got, int8.reference_product(x, iw, bias, res))
    assert torch.equal(int8.int8_linear(x, iw), int8.reference_product(x, iw))
    assert torch.equal(int8.int8_linear(x, iw, bias, res.t().contiguous().t()), res + int8.int8_linear(x, iw, bias))
    # close to the exact product: 8-bit activations lose about 2^-8 of each block's largest value
    exact = torch.nn.functional.linear(x.double(), w.double(), bias.double()).float() + res
    assert (got - exact).abs().max() < 0.02 * exact.abs().max()


@needs_kernel
@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
def test_a_row_gets_its_bits_alone_in_a_batch_and_on_any_thread_split(kind: str) -> None:
    _, iw = _weight(kind, 71, 576, seed=9)
    x = torch.randn(16, 576, generator=torch.Generator().manual_seed(3))
    batch = int8.int8_linear(x, iw)
    with kept_thread_count():
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            assert torch.equal(int8.int8_linear(x, iw), batch)
            for r in (0, 7, 15):
                assert torch.equal(int8.int8_linear(x[r : r + 1].clone(), iw)[0], batch[r])
            assert torch.equal(int8.int8_linear(x[3:9].clone().view(2, 3, 576), iw).view(6, 71), batch[3:9])


@needs_kernel
@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
def test_rows_processed_together_get_the_bits_they_get_alone(kind: str) -> None:
    # 1..17 rows cover every tile of rows the kernel holds in registers (up to 8 with VNNI) and a
    # tile left over; 37 outputs a group of 16 weight rows cut short
    _, iw = _weight(kind, 37, 96, seed=11)
    x = torch.randn(17, 96, generator=torch.Generator().manual_seed(5))
    alone = torch.stack([int8.int8_linear(x[r : r + 1].clone(), iw)[0] for r in range(17)])
    assert torch.equal(alone, int8.reference_product(x, iw))
    with kept_thread_count():
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            for n in range(1, 18):
                assert torch.equal(int8.int8_linear(x[:n], iw), alone[:n]), (threads, n)


@needs_kernel
@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
def test_many_rows_by_a_wide_matrix_take_panels_with_the_same_bits(kind: str) -> None:
    # 700 outputs of 1568 inputs: more weight than one panel of groups (int8.c's PANEL_BYTES), so
    # a thread's groups go in several panels, each taken by 3 tiles of rows in turn, the last
    # group cut short
    _, iw = _weight(kind, 700, 1568, seed=13)
    x = torch.randn(19, 1568, generator=torch.Generator().manual_seed(6))
    want = int8.reference_product(x, iw)
    with kept_thread_count():
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            assert torch.equal(int8.int8_linear(x, iw), want), threads
            assert torch.equal(int8.int8_linear(x[11:12].clone(), iw)[0], want[11])


# Prints whether the kernel of this build has its emulation's bits, and whether rows together get
# the bits they get alone.
SCRIPT = r"""
import json, torch
from test_int8 import _weight
from blockspec.cpu import int8
out = {"path": int8.int8_path(), "equal": []}
for kind in ("Q4_1", "Q8_0"):
    for width, rows, outs, scale in ((96, 1, 37, 0.05), (576, 6, 37, 0.05), (1568, 9, 37, 0.05), (64, 17, 37, 0.05),
                                     (1568, 19, 700, 0.05), (96, 3, 37, 2e-5)):  # the last: subnormal fp16 scales
        _, iw = _weight(kind, outs, width, seed=width, scale=scale)
        x = torch.randn(rows, width, generator=torch.Generator().manual_seed(rows))
        b = torch.randn(outs)
        y = int8.int8_linear(x, iw, b)
        out["equal"].append(torch.equal(y, int8.reference_product(x, iw, b))
                            and all(torch.equal(int8.int8_linear(x[r : r + 1], iw, b)[0], y[r]) for r in range(rows)))
print(json.dumps(out))
"""


@needs_kernel
@pytest.mark.parametrize(("flags", "path"), [("-mno-avx512vnni", "avx2"), ("-mno-avx2 -mno-avx512f", "c")])
def test_forced_narrower_paths_have_the_same_arithmetic(flags: str, path: str) -> None:
    if "avx2" not in Path("/proc/cpuinfo").read_text():
        pytest.skip("no AVX2 on this CPU")
    env = {**os.environ, kernels.CFLAGS_ENV: flags,
           "PYTHONPATH": os.pathsep.join([str(TESTS / "cpu"), str(TESTS), str(TESTS.parent)])}
    run = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["path"] == path and out["equal"] == [True] * 12


def test_without_a_kernel_the_emulation_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    _, iw = _weight("Q4_1", 6, 64, seed=4)
    x = torch.randn(3, 64)
    monkeypatch.setattr(kernels, "_kernel", None)
    assert int8.int8_path() == "pytorch"
    assert torch.equal(int8.int8_linear(x, iw), int8.reference_product(x, iw))
