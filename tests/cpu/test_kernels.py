"""The native few-row CPU kernel (cpu/csrc/rows.c via cpu/kernels.py)."""

from __future__ import annotations

import ctypes
import shutil

import pytest
import torch
from support import kept_thread_count

from blockspec.cpu import linear as linear_mod
from blockspec.cpu import kernels
from blockspec.cpu.argmax import argmax_and_peak, greedy_ids


def test_the_kernel_builds_where_a_compiler_exists() -> None:
    """This suite runs on machines with a C compiler: there the kernel must build and load (a
    silent fallback would hide a broken build behind slower numbers)."""
    assert shutil.which("cc") or shutil.which("gcc"), "these tests expect a C compiler on the machine"
    assert kernels.kernel() is not None
    assert linear_mod.CPU_MATMUL == "native"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [*range(1, 18), 31, 64])
def test_kernel_matches_f_linear_and_is_batch_invariant(n: int, dtype: torch.dtype) -> None:
    """Any row count (one weight row at a time below the kernel's TILE_ROWS, 3-8 by build and
    element type, register tiles from it on, partial tiles included), widths off the vector
    steps (16 fp32, 32 bf16 pairs) and output counts off the tile width, with and without bias,
    and widths the tiles take in several passes (cpu/csrc/rows.c, K_PASS): the exact product's
    numbers (bf16: summed in fp32, rounded once), and each row's bits equal that row computed
    alone."""
    g = torch.Generator().manual_seed(n)
    for k, out in ((37, 5), (64, 33), (200, 19), (45, 6), (1550, 7)):
        x, w, b = (t.to(dtype) for t in (torch.randn(n, k, generator=g), torch.randn(out, k, generator=g),
                                         torch.randn(out, generator=g)))
        for bias in (None, b):
            got = kernels.rows_matmul(x, w, bias)
            assert got.dtype == dtype
            exact = torch.nn.functional.linear(x.double(), w.double(), None if bias is None else bias.double())
            if dtype == torch.float32:
                tol = 1e-5 * max(1.0, k / 200)  # the fp32 sum's rounding grows with its length
                torch.testing.assert_close(got, exact.float(), atol=tol, rtol=tol)
            else:  # one bf16 rounding of an fp32 sum: within half a bf16 step of the exact value
                torch.testing.assert_close(got.double(), exact, atol=1e-3, rtol=2 ** -8)
            for r in range(n):
                assert torch.equal(got[r : r + 1], kernels.rows_matmul(x[r : r + 1].clone(), w, bias))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_residual_connection_in_the_product_call_has_the_bits_of_a_separate_addition(dtype: torch.dtype) -> None:
    """linear(..., residual=r) is r + linear(...), bit for bit, on every path: the kernel's fp32
    call that adds r itself (one weight row at a time and register tiles, with and without bias),
    bf16 (added afterwards), rows past the kernel's limit (PyTorch's GEMM) and a residual that
    only broadcasts (added afterwards, as before)."""
    g = torch.Generator().manual_seed(3)
    with torch.inference_mode():
        for n in (1, 3, 5, 8, 17, kernels.max_rows() + 5):
            x, w, b = (t.to(dtype) for t in (torch.randn(n, 200, generator=g), torch.randn(33, 200, generator=g),
                                             torch.randn(33, generator=g)))
            r = torch.randn(n, 33, generator=g).to(dtype)
            for bias in (None, b):
                separate = r + linear_mod.linear(x, w, bias)
                assert torch.equal(linear_mod.linear(x, w, bias, residual=r), separate)
            row = torch.randn(33, generator=g).to(dtype)  # broadcast over the rows
            assert torch.equal(linear_mod.linear(x, w, b, residual=row), row + linear_mod.linear(x, w, b))


def test_linear_routes_few_rows_to_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    real = kernels._product

    def spy(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, residual: torch.Tensor | None = None) -> torch.Tensor:
        calls.append(x.numel() // x.shape[-1])  # rows
        return real(x, w, b, residual)

    monkeypatch.setattr(kernels, "_product", spy)
    g = torch.Generator().manual_seed(0)
    w = torch.randn(24, 40, generator=g)
    with torch.inference_mode():
        most = kernels.max_rows()
        assert most >= 8
        for rows in (1, 3, most, most + 1):
            x = torch.randn(2, rows, 40, generator=g)[:1]  # 3-D, contiguous: the kernel takes it as it is
            if rows == 3:
                x = torch.randn(2, rows, 80, generator=g)[:1, :, ::2]  # strided: the kernel gets a contiguous copy
            torch.testing.assert_close(linear_mod.linear(x, w), x @ w.t(), atol=1e-5, rtol=1e-5)
        linear_mod.linear(torch.randn(2, 24), w.t())  # a transposed weight view: not the kernel's
        with pytest.raises(RuntimeError):  # in-features that do not fit: PyTorch's error, not the kernel's read
            linear_mod.linear(torch.randn(1, 41), w)
    assert calls == [1, 3, most]
    calls.clear()
    with torch.inference_mode():
        most_bf16 = kernels.max_rows(torch.bfloat16)
        assert most_bf16 >= 1 << 20  # bf16: every row count, for batch-invariant bf16 targets
        assert kernels.max_rows(torch.float16) == 0
        wb = w.bfloat16()
        counts = (2, 300)
        for rows in counts:
            x = torch.randn(rows, 40, generator=g).bfloat16()
            got = linear_mod.linear(x, wb)
            assert got.dtype == torch.bfloat16
            torch.testing.assert_close(got.float(), (x.double() @ wb.double().t()).float(), atol=1e-2, rtol=2 ** -7)
    assert calls == list(counts)
    # products that need no batch invariance (a drafter's) leave the kernel where it is slower
    calls.clear()
    fast = kernels.max_rows(torch.bfloat16, exact=False)
    assert fast in (8, 96)  # 96 with AVX512_BF16's dot products, 8 when bf16 is widened in registers
    assert kernels.max_rows(torch.float32, exact=False) == most
    with torch.inference_mode():
        for rows in (2, fast, fast + 1, 300):
            x = torch.randn(rows, 40, generator=g).bfloat16()
            got = linear_mod.linear(x, wb, exact=False)
            torch.testing.assert_close(got.float(), (x.double() @ wb.double().t()).float(), atol=1e-2, rtol=2 ** -7)
    assert calls == [2, fast]


def test_without_a_compiler_linear_falls_back(monkeypatch: pytest.MonkeyPatch, tmp_path: object) -> None:
    """BLOCKSPEC_CPU_KERNELS=0 skips the build; a compiler that fails warns once and falls back."""
    monkeypatch.setenv("BLOCKSPEC_CACHE", str(tmp_path))
    monkeypatch.setenv(kernels.DISABLE_ENV, "0")
    assert kernels._load() is None
    monkeypatch.delenv(kernels.DISABLE_ENV)
    monkeypatch.setenv("CC", "false")  # exists, and fails whatever it is asked
    with pytest.warns(UserWarning, match="did not build"):
        assert kernels._load() is None
    monkeypatch.setattr(kernels, "_kernel", None)  # as a process without a compiler sees it
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(3, 16, generator=g), torch.randn(8, 16, generator=g)
    with torch.inference_mode():
        torch.testing.assert_close(linear_mod.linear(x, w), x @ w.t(), atol=1e-5, rtol=1e-5)


def test_a_fresh_cache_builds_the_kernel_once(monkeypatch: pytest.MonkeyPatch, tmp_path: object) -> None:
    # The caching is tried on a one-function library: the real sources take ~40 s to compile, and
    # every test that runs a kernel already proves that they build (the session loads them).
    cc = shutil.which("cc") or shutil.which("gcc")
    assert cc
    src = tmp_path / "one.c"
    src.write_text("int bs_one(void) { return 1; }\n")
    monkeypatch.setattr(kernels, "SOURCES", (src,))
    monkeypatch.setattr(kernels, "HEADERS", ())
    lib = kernels.build(cc, tmp_path / "kernels")
    assert ctypes.CDLL(str(lib)).bs_one() == 1
    stamp = lib.stat().st_mtime_ns
    assert kernels.build(cc, tmp_path / "kernels") == lib and lib.stat().st_mtime_ns == stamp
    assert [p.name for p in (tmp_path / "kernels").iterdir()] == [lib.name]  # no temporary left
    src.write_text("int bs_one(void) { return 2; }\n")  # a changed source is a new library
    changed = kernels.build(cc, tmp_path / "kernels")
    assert changed != lib and ctypes.CDLL(str(changed)).bs_one() == 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kernel", [True, False])
def test_argmax_kernels_equal_argmax_and_softmax(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype,
                                                   kernel: bool) -> None:
    if not kernel:  # PyTorch's way, where the kernel is missing
        monkeypatch.setattr(kernels, "argmax_peak", lambda logits: None)
        monkeypatch.setattr(kernels, "argmax", lambda logits: None)
    elif kernels.kernel() is None:
        pytest.skip("no C compiler: the kernel path is not built here")
    g = torch.Generator().manual_seed(2)
    for width in (300, 19065, 7):  # vector steps with a tail, a draft vocabulary, a tail alone
        logits = torch.randn(2, 5, width, generator=g)
        logits[0, 1, 3] = logits[0, 1, width - 2] = 40.0  # a tie: the first index wins, as in argmax
        logits[1, 2, : width // 2] = float("-inf")  # outside a draft vocabulary
        logits[1, 3, 5:] = float("-inf")
        logits = logits.to(dtype)
        before = logits.clone()
        top, peak = argmax_and_peak(logits)
        assert torch.equal(logits, before)  # the input is left alone
        assert top.dtype == torch.int64 and peak.dtype == torch.float32 and top.shape == peak.shape == (2, 5)
        assert torch.equal(top, logits.float().argmax(-1)) and top[0, 1] == 3
        torch.testing.assert_close(peak, torch.softmax(logits.double(), -1).amax(-1).float(), atol=1e-6, rtol=1e-5)
        alone = greedy_ids(logits)  # the argmax without the peak: one pass
        assert alone.dtype == torch.int64 and torch.equal(alone, top)
        assert torch.equal(greedy_ids(logits[:, 1]), top[:, 1])  # a strided view is read as it is
    assert greedy_ids(torch.empty(0, 4, dtype=dtype)).shape == (0,)


def test_kernel_bits_do_not_depend_on_the_thread_count() -> None:
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(5, 300, generator=g), torch.randn(301, 300, generator=g)
    with kept_thread_count():
        torch.set_num_threads(1)
        one = kernels.rows_matmul(x, w, None)
        torch.set_num_threads(2)
        two = kernels.rows_matmul(x, w, None)
    assert torch.equal(one, two)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_kernel_computes_hugging_faces_rmsnorm_row_by_row(dtype: torch.dtype) -> None:
    """cpu/csrc/norm.c: fp32 statistics, the weight's product in the model's dtype (bf16: the
    normalised row rounded first, as HF's module does), widths off the vector step, any row
    count and thread count; a row's bits do not depend on the rows beside it."""
    g = torch.Generator().manual_seed(4)
    with kept_thread_count() as before:
        for rows, n in ((1, 576), (7, 64), (3, 37), (130, 96)):  # 130 rows: the threaded loop
            x = (torch.randn(rows, n, generator=g) * 3).to(dtype)
            w = (torch.rand(n, generator=g) + 0.5).to(dtype)
            got = kernels.rms_norm(x, w, 1e-5)
            assert got is not None and got.dtype == dtype and got.shape == x.shape
            if dtype == torch.float32:
                torch.testing.assert_close(got, torch.nn.functional.rms_norm(x, (n,), w, 1e-5), atol=1e-6, rtol=1e-6)
            else:  # exactly HF's bf16 arithmetic, on these inputs
                want = w * torch.nn.functional.rms_norm(x.float(), (n,), None, 1e-5).to(dtype)
                assert torch.equal(got, want)
            for r in (0, rows - 1):
                assert torch.equal(got[r], kernels.rms_norm(x[r : r + 1].clone(), w, 1e-5)[0])
            torch.set_num_threads(1)
            assert torch.equal(got, kernels.rms_norm(x, w, 1e-5))
            torch.set_num_threads(before)


def test_rms_norm_kernel_takes_strided_rows_and_leaves_autograd_to_pytorch() -> None:
    g = torch.Generator().manual_seed(5)
    qkv = torch.randn(4, 3 * 64, generator=g)
    q = qkv[:, :64]  # a view with a row stride, as a q/k norm gets it
    w = torch.rand(64, generator=g)
    torch.testing.assert_close(kernels.rms_norm(q, w, 1e-6), torch.nn.functional.rms_norm(q, (64,), w, 1e-6))
    assert kernels.rms_norm(q, w.double(), 1e-6) is None  # mixed dtypes: the caller's PyTorch path
    trained = torch.nn.Parameter(w.clone())
    assert kernels.rms_norm(q, trained, 1e-6) is None  # gradients need PyTorch's operators
    with torch.no_grad():
        assert kernels.rms_norm(q, trained, 1e-6) is not None
