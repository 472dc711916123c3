"""A native CPU kernel for fp32 and bf16 products of a few rows: `cpu/csrc/rows.c`, compiled at first use.

A decoding step multiplies a few rows by every weight matrix (one per sequence, or a verified
block per sequence), and on a CPU its time should be the time to stream the weights from memory
once. PyTorch's kernels do not manage that for so few rows. This one tiles rows and weight rows
in registers (from 5 fp32 rows, 3 bf16 ones), which beat oneDNN up to 128 rows, and its
prefetches aim at the outer caches (figures: docs/DESIGN.md section 12).
The kernel is also batch invariant: a row gets the same bits alone or beside others.
bf16 products (a bf16 drafter, or a bf16 target) sum in fp32 and stream half the bytes; with
AVX512_BF16 they multiply in pairs, faster than oneDNN's for a draft pass's rows. fp32 weights
that a 4- or 8-bit GGUF left are multiplied from a packed copy with the fp32 product's bits
(`bs_rows_matmul_q4` / `_q8`, cpu/packed_weights.py), and their bf16 roundings with the bf16
product's (`_q4_bf16` / `_q8_bf16`).

The same library holds `cpu/csrc/attention.c`, the target's batch-invariant attention for a few
query tokens (targets/native/attention.py), `cpu/csrc/norm.c`, RMSNorm in one call instead of
PyTorch's ten small operators (`rms_norm` below), `cpu/csrc/peak.c`, a draft head's argmax with
its softmax probability (`argmax_peak` below) or alone (`argmax`), `cpu/csrc/topk.c`, its top-k
with their log-softmax (`top_k`), `bs_greedy_head` in rows.c, the
greedy ids of an fp32 LM head screened in bf16 (cpu/greedy_head.py), and `cpu/csrc/rope.c`, a layer's
query/key norms, rotary embedding and K/V cache writes in one call (cpu/qkv.py).

Built with the system C compiler (`$CC`, else cc/gcc/clang; -O3 -march=native -fopenmp) into
the blockspec cache (`$BLOCKSPEC_CACHE/kernels`, default ~/.cache/blockspec/kernels), keyed by the
source, the compiler and the CPU. Without a working compiler, or with BLOCKSPEC_CPU_KERNELS=0,
`kernel()` is None and cpu/linear.py keeps PyTorch's kernels.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

import torch

from blockspec.cache_dir import cache_root

SOURCES = tuple(Path(__file__).parent / "csrc" / name
                for name in ("rows.c", "attention.c", "norm.c", "peak.c", "topk.c", "rope.c", "layers.c", "conv.c", "int8.c",
                                              "nucleus.c", "uniforms.c", "standard_rule.c", "race.c"))  # one library
HEADERS = tuple(Path(__file__).parent / "csrc" / name for name in ("vec.h", "kernels.h", "keyed.h"))
DISABLE_ENV = "BLOCKSPEC_CPU_KERNELS"
# Extra compiler flags after -march=native, e.g. "-mno-avx512vnni" to build (and test) the int8
# kernels' AVX2 path on a CPU that has VNNI.
CFLAGS_ENV = "BLOCKSPEC_CPU_CFLAGS"
_FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11")
INT8_PATHS = {2: "vnni", 1: "avx2", 0: "c"}  # cpu/csrc/int8.c's bs_int8_path()
MASK64 = 2**64 - 1  # a request's seed reaches the keyed kernels as its 64-bit residue


def _flags() -> tuple[str, ...]:
    return (*_FLAGS, *os.environ.get(CFLAGS_ENV, "").split())

_UNTRIED = object()
_kernel: object = _UNTRIED


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    return None


def _cpu_id() -> str:
    """What -march=native depends on: the CPU model and its feature flags."""
    try:
        info = Path("/proc/cpuinfo").read_text()
        lines = [ln for ln in info.splitlines() if ln.startswith(("model name", "flags", "Features"))]
        return "\n".join(sorted(set(lines)))
    except OSError:
        return platform.processor() or platform.machine()


def build(cc: str, out_dir: Path) -> Path:
    """Compiles the kernel (if not cached) and returns the shared library's path."""
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=True).stdout
    texts = [src.read_text() for src in (*SOURCES, *HEADERS)]
    key = hashlib.sha256("\0".join([*texts, cc, version, " ".join(_flags()), _cpu_id()]).encode())
    lib = out_dir / f"rows-{key.hexdigest()[:16]}.so"
    if lib.exists():
        return lib
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
        tmp_lib = Path(tmp) / lib.name
        subprocess.run([cc, *_flags(), *map(str, SOURCES), "-o", str(tmp_lib), "-lm"], capture_output=True, text=True,
                       check=True)
        os.replace(tmp_lib, lib)  # atomic: concurrent processes (torchrun) never load half a file
    return lib


def _load() -> object | None:
    if os.environ.get(DISABLE_ENV, "1") == "0":
        return None
    cc = _compiler()
    if cc is None:
        return None
    try:
        lib = ctypes.CDLL(str(build(cc, cache_root() / "kernels")))
    except (OSError, subprocess.CalledProcessError) as e:
        detail = getattr(e, "stderr", None) or str(e)
        warnings.warn(f"blockspec: the native CPU kernel did not build ({detail.strip()[:300]}); "
                      f"using PyTorch's kernels (set {DISABLE_ENV}=0 to skip the attempt)")
        return None
    fn, fn.bf16 = lib.bs_rows_matmul, lib.bs_rows_matmul_bf16
    for f in (fn, fn.bf16):
        f.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3 + [ctypes.c_int]
        f.restype = ctypes.c_int
    fn.res = lib.bs_rows_matmul_res
    fn.res.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 3 + [ctypes.c_int]
    fn.res.restype = ctypes.c_int
    fn.q4, fn.q8 = lib.bs_rows_matmul_q4, lib.bs_rows_matmul_q8
    for f in (fn.q4, fn.q8):
        f.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 3 + [ctypes.c_int]
        f.restype = ctypes.c_int
    fn.q4_bf16, fn.q8_bf16 = lib.bs_rows_matmul_q4_bf16, lib.bs_rows_matmul_q8_bf16
    for f in (fn.q4_bf16, fn.q8_bf16):
        f.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 3 + [ctypes.c_int]
        f.restype = ctypes.c_int
    fn.max_rows = {torch.float32: int(lib.bs_rows_max()), torch.bfloat16: int(lib.bs_rows_max_bf16())}
    fn.fast_rows = {torch.float32: fn.max_rows[torch.float32], torch.bfloat16: int(lib.bs_rows_fast_bf16())}
    fn.attention = {torch.float32: lib.bs_attention, torch.bfloat16: lib.bs_attention_bf16}
    for f in fn.attention.values():
        f.argtypes = [ctypes.c_void_p] * 7 + [ctypes.c_int64] * 9 + [ctypes.c_float, ctypes.c_int]
        f.restype = ctypes.c_int
    fn.rms_norm = {torch.float32: lib.bs_rms_norm, torch.bfloat16: lib.bs_rms_norm_bf16}
    for f in fn.rms_norm.values():
        f.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 2 + [ctypes.c_float, ctypes.c_int]
        f.restype = ctypes.c_int
    fn.argmax_peak = {torch.float32: lib.bs_argmax_peak, torch.bfloat16: lib.bs_argmax_peak_bf16}
    for f in fn.argmax_peak.values():
        f.argtypes = [ctypes.c_void_p] + [ctypes.c_int64] * 2 + [ctypes.c_void_p] * 2 + [ctypes.c_int]
        f.restype = ctypes.c_int
    fn.nucleus = lib.bs_nucleus
    fn.nucleus.argtypes = [ctypes.c_void_p] + [ctypes.c_int64] * 2 + [ctypes.c_void_p] * 4 + [ctypes.c_int]
    fn.nucleus.restype = ctypes.c_int
    fn.nucleus_pairs = lib.bs_nucleus_pairs
    fn.nucleus_pairs.argtypes = [ctypes.c_void_p] + [ctypes.c_int64] * 3 + [ctypes.c_void_p] * 2 + [ctypes.c_int64] \
        + [ctypes.c_void_p] * 3 + [ctypes.c_int]
    fn.nucleus_pairs.restype = ctypes.c_int
    fn.nucleus_draws = lib.bs_nucleus_draws
    fn.nucleus_draws.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 3 + [ctypes.c_void_p] * 4 \
        + [ctypes.c_int64] + [ctypes.c_void_p] * 5 + [ctypes.c_int]
    fn.nucleus_draws.restype = ctypes.c_int
    fn.position_keys = lib.bs_position_keys
    fn.position_keys.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2 + [ctypes.c_void_p]
    fn.position_keys.restype = ctypes.c_int
    fn.pairs_race = lib.bs_pairs_race
    fn.pairs_race.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 3 + [ctypes.c_void_p] * 3
    fn.pairs_race.restype = ctypes.c_int
    fn.standard_rule = lib.bs_standard_rule
    fn.standard_rule.argtypes = [ctypes.c_void_p] + [ctypes.c_int64] * 2 + [ctypes.c_void_p] * 2 + [ctypes.c_int64] \
        + [ctypes.c_void_p] * 2 + [ctypes.c_int64] + [ctypes.c_void_p] * 4
    fn.standard_rule.restype = ctypes.c_int
    fn.nucleus_ids = lib.bs_nucleus_ids
    fn.nucleus_ids.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 3 + [ctypes.c_void_p] * 4 + [ctypes.c_int]
    fn.nucleus_ids.restype = ctypes.c_int
    fn.top_k = {torch.float32: lib.bs_top_k, torch.bfloat16: lib.bs_top_k_bf16}
    for f in fn.top_k.values():
        f.argtypes = [ctypes.c_void_p] + [ctypes.c_int64] * 3 + [ctypes.c_void_p] * 2 + [ctypes.c_int]
        f.restype = ctypes.c_int
    fn.top_k_max = int(lib.bs_top_k_max())
    fn.top_values = lib.bs_top_values
    fn.top_values.argtypes = [ctypes.c_void_p] + [ctypes.c_int64] * 3 + [ctypes.c_void_p] * 2 + [ctypes.c_int]
    fn.top_values.restype = ctypes.c_int
    fn.slot_uniforms = lib.bs_slot_uniforms
    fn.slot_uniforms.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2 + [ctypes.c_int, ctypes.c_void_p]
    fn.slot_uniforms.restype = ctypes.c_int
    fn.rope_kv = {torch.float32: lib.bs_rope_kv, torch.bfloat16: lib.bs_rope_kv_bf16}
    for f in fn.rope_kv.values():
        f.argtypes = ([ctypes.c_void_p] + [ctypes.c_int64] * 6 + [ctypes.c_void_p] * 2 + [ctypes.c_float] * 2
                      + [ctypes.c_void_p] * 2 + [ctypes.c_int64] + [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2
                      + [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 5 + [ctypes.c_int])
        f.restype = ctypes.c_int
    fn.greedy_head = lib.bs_greedy_head
    fn.greedy_head.argtypes = [ctypes.c_void_p] * 7 + [ctypes.c_int64] * 3 + [ctypes.c_void_p] * 2 + [ctypes.c_int]
    fn.greedy_head.restype = ctypes.c_int
    fn.silu_mul = {torch.float32: lib.bs_silu_mul, torch.bfloat16: lib.bs_silu_mul_bf16}
    for f in fn.silu_mul.values():
        f.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2 + [ctypes.c_int]
        f.restype = ctypes.c_int
    fn.block_conv = {torch.float32: lib.bs_block_conv, torch.bfloat16: lib.bs_block_conv_bf16}
    for f in fn.block_conv.values():
        f.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 6 + [ctypes.c_int]
        f.restype = ctypes.c_int
    fn.layers, fn.layers_bf16, fn.layers_layout = lib.bs_layers, lib.bs_layers_bf16, lib.bs_layers_layout
    for f in (fn.layers, fn.layers_bf16):
        f.argtypes = [ctypes.c_void_p] * 25 + [ctypes.c_int]
        f.restype = ctypes.c_int
    fn.layers_layout.argtypes = [ctypes.c_void_p]
    fn.layers_layout.restype = ctypes.c_int
    fn.int8 = {4: lib.bs_int8_matmul_q4, 8: lib.bs_int8_matmul_q8}
    for f in fn.int8.values():
        f.argtypes = [ctypes.c_void_p] * 7 + [ctypes.c_int64] * 3 + [ctypes.c_int]
        f.restype = ctypes.c_int
    fn.int8_path = INT8_PATHS[int(lib.bs_int8_path())]
    return fn if _agrees(fn) else None


def _agrees(fn: object) -> bool:
    """One small product, attention, RMSNorm, argmax with its softmax peak and a rope with its
    cache writes per element type prove the build runs and agrees with PyTorch."""
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(3, 37, generator=g), torch.randn(5, 37, generator=g), torch.randn(5, generator=g)
    q = torch.randn(1, 1, 2, 20, generator=g)
    k, v = torch.randn(1, 1, 4, 20, generator=g), torch.randn(1, 1, 4, 20, generator=g)
    visible = torch.tensor([[3, 4]])  # two tokens at positions 2 and 3
    causal = torch.tensor([[True, True, True, False], [True, True, True, True]])
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1e-3)):
        xd, wd = x.to(dtype), w.to(dtype)
        y = torch.empty(3, 5)
        product = fn if dtype == torch.float32 else fn.bf16
        product(xd.data_ptr(), wd.data_ptr(), b.data_ptr(), y.data_ptr(), 3, 37, 5, 1)
        want = torch.nn.functional.linear(xd.double(), wd.double(), b.double()).float()
        if dtype == torch.float32:  # the residual connection's call: the product's bits, then one addition
            residual, with_res = torch.randn(3, 5, generator=g), torch.empty(3, 5)
            fn.res(xd.data_ptr(), wd.data_ptr(), b.data_ptr(), residual.data_ptr(), with_res.data_ptr(), 3, 37, 5, 1)
            if not torch.equal(with_res, residual + y):
                return False
            if not _packed_agrees(fn):
                return False
        qd, kd, vd = q.to(dtype), k.to(dtype), v.to(dtype)
        att = torch.empty(1, 1, 2, 20)
        fn.attention[dtype](qd.data_ptr(), kd.data_ptr(), vd.data_ptr(), att.data_ptr(), visible.data_ptr(), None,
                            None, 1, 1, 1, 2, 20, 80, 80, 4, 0, 0.25, 1)
        want_att = torch.nn.functional.scaled_dot_product_attention(qd.double(), kd.double(), vd.double(),
                                                                    attn_mask=causal, scale=0.25).float()
        xn, wn = torch.randn(2, 21, generator=g).to(dtype), torch.rand(21, generator=g).to(dtype)
        normed = torch.empty_like(xn)
        fn.rms_norm[dtype](xn.data_ptr(), wn.data_ptr(), normed.data_ptr(), 2, 21, 1e-6, 1)
        want_norm = torch.nn.functional.rms_norm(xn.double(), (21,), wn.double(), 1e-6)
        logits = torch.randn(2, 37, generator=g).to(dtype)
        top, peak = torch.empty(2, dtype=torch.int64), torch.empty(2)
        fn.argmax_peak[dtype](logits.data_ptr(), 2, 37, top.data_ptr(), peak.data_ptr(), 1)
        want_peak = torch.softmax(logits.double(), -1).amax(-1).float()
        alone = torch.empty(2, dtype=torch.int64)
        fn.argmax_peak[dtype](logits.data_ptr(), 2, 37, alone.data_ptr(), None, 1)
        top3, top3_logp = torch.empty(2, 3, dtype=torch.int64), torch.empty(2, 3)
        if fn.top_k[dtype](logits.data_ptr(), 2, 37, 3, top3_logp.data_ptr(), top3.data_ptr(), 1):
            return False
        want_logp, want_top3 = torch.log_softmax(logits.double(), -1).topk(3, dim=-1)  # no ties in random logits
        # one token's two query heads and one key/value head of 20 (rope after a head norm)
        qkv, angle = torch.randn(1, 80, generator=g).to(dtype), torch.rand(1, 10, generator=g).repeat(1, 2)
        cos, sin, wq = angle.cos().to(dtype), angle.sin().to(dtype), torch.rand(20, generator=g).to(dtype)
        zero = torch.zeros(1, dtype=torch.int64)
        roped_q, cache_k, cache_v = torch.empty(2, 20, dtype=dtype), torch.empty(20, dtype=dtype), torch.empty(20, dtype=dtype)
        fn.rope_kv[dtype](qkv.data_ptr(), 1, 80, 2, 1, 2, 20, wq.data_ptr(), None, 1e-6, 1e-6, cos.data_ptr(),
                          sin.data_ptr(), 0, zero.data_ptr(), zero.data_ptr(), 1, 1, roped_q.data_ptr(), zero.data_ptr(),
                          zero.data_ptr(), cache_k.data_ptr(), cache_v.data_ptr(), 1, 1, 20, 20, 20, 1)
        heads = qkv.double().view(4, 20)
        heads = torch.cat([torch.nn.functional.rms_norm(heads[:2], (20,), wq.double(), 1e-6), heads[2:]])
        want_rope = heads * cos.double() + torch.cat([-heads[:, 10:], heads[:, :10]], -1) * sin.double()
        roped = torch.cat([roped_q, cache_k[None], cache_v[None]]).double()
        want_rope[3] = heads[3]
        if dtype == torch.float32:  # the greedy head: the argmax of the fp32 product, screened in bf16
            head = torch.randn(40, 37, generator=torch.Generator().manual_seed(1))
            head[7] = head[3]  # a tie: the first index wins
            head_logits = torch.empty(3, 40)
            fn(x.data_ptr(), head.data_ptr(), None, head_logits.data_ptr(), 3, 37, 40, 1)
            xb, hb = x.bfloat16(), head.bfloat16()
            norms, bound = head.double().norm(dim=1).float() * 1.001, x.double().norm(dim=1).float() * 0.0042
            screen, ids, seen = torch.empty(3, 40), torch.empty(3, dtype=torch.int64), torch.empty(3, dtype=torch.int64)
            fn.greedy_head(x.data_ptr(), xb.data_ptr(), head.data_ptr(), hb.data_ptr(), norms.data_ptr(),
                           bound.data_ptr(), screen.data_ptr(), 3, 37, 40, ids.data_ptr(), seen.data_ptr(), 1)
            if not torch.equal(ids, head_logits.argmax(-1)):
                return False
        if not (torch.allclose(y, want, atol=tol, rtol=tol) and torch.allclose(att, want_att, atol=tol, rtol=tol)
                and torch.allclose(normed.double(), want_norm, atol=4 * tol, rtol=4 * tol)
                and torch.equal(top, logits.float().argmax(-1)) and torch.equal(alone, top)
                and torch.allclose(peak, want_peak, atol=1e-5)
                and torch.equal(top3, want_top3) and torch.allclose(top3_logp.double(), want_logp, atol=1e-5)
                and torch.allclose(roped, want_rope, atol=8 * tol, rtol=8 * tol)):
            return False
    return True


def _packed_agrees(fn: object) -> bool:
    """The packed paths (cpu/packed_weights.py) give the fp32 path's bits on the weights they encode
    (and the bf16 path's on their bf16 roundings), at one row and at a tile's worth, with bias
    and residual."""
    g = torch.Generator().manual_seed(2)
    qs4 = torch.randint(0, 256, (6, 32), dtype=torch.uint8, generator=g)  # 6 weight rows, 64 inputs
    sc4 = torch.stack([torch.rand(6, 2, generator=g).half().float(), torch.randn(6, 2, generator=g).half().float()], -1)
    q4 = torch.cat([qs4.view(6, 2, 16) & 15, qs4.view(6, 2, 16) >> 4], -1).float()
    w4 = (sc4[..., 1:] + sc4[..., :1] * q4).reshape(6, 64).contiguous()
    qs8 = torch.randint(-128, 128, (6, 64), dtype=torch.int8, generator=g)
    sc8 = torch.rand(6, 2, 1, generator=g).half().float()
    w8 = (qs8.view(6, 2, 32).float() * sc8).reshape(6, 64).contiguous()
    b = torch.randn(6, generator=g)
    for f, qs, sc, w in ((fn.q4, qs4, sc4, w4), (fn.q8, qs8, sc8, w8)):
        for n in (1, 6, 12):
            x, res = torch.randn(n, 64, generator=g), torch.randn(n, 6, generator=g)
            y, yp = torch.empty(n, 6), torch.empty(n, 6)
            fn.res(x.data_ptr(), w.data_ptr(), b.data_ptr(), res.data_ptr(), y.data_ptr(), n, 64, 6, 1)
            if f(x.data_ptr(), qs.data_ptr(), sc.data_ptr(), b.data_ptr(), res.data_ptr(), yp.data_ptr(), n, 64, 6, 1):
                return False
            if not torch.equal(y, yp):
                return False
            # bf16: the bf16 path on the weights' bf16 roundings
            xb, wb = x.bfloat16(), w.bfloat16()
            fn.bf16(xb.data_ptr(), wb.data_ptr(), b.data_ptr(), y.data_ptr(), n, 64, 6, 1)
            fb = fn.q4_bf16 if f is fn.q4 else fn.q8_bf16
            if fb(xb.data_ptr(), qs.data_ptr(), sc.data_ptr(), b.data_ptr(), yp.data_ptr(), n, 64, 6, 1):
                return False
            if not torch.equal(y, yp):
                return False
    return True


def kernel() -> object | None:
    """The compiled kernel (built and checked on the first call), or None where unavailable."""
    global _kernel
    if _kernel is _UNTRIED:
        _kernel = _load()
    return _kernel


def max_rows(dtype: torch.dtype = torch.float32, exact: bool = True) -> int:
    """The most rows of `dtype` (fp32 or bf16) to send to the kernel on this build (it says: fp32
    128 with AVX-512, where its register tiles were measured faster than PyTorch's GEMM, 8
    elsewhere; bf16 any number, as bf16 models need batch-invariant products to stay lossless);
    0 without a kernel or for other dtypes. exact=False (products that need no batch
    invariance, a drafter's): only as many as the kernel is faster for (bf16: 96 rows with
    AVX512_BF16, 8 without)."""
    k = kernel()
    return 0 if k is None else (k.max_rows if exact else k.fast_rows).get(dtype, 0)


def rows_matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [n, in] @ weight[out, in]^T + bias -> [n, out] in x's dtype; x and weight both fp32 or
    both bf16, contiguous, on the CPU, `kernel()` set. bf16 sums in fp32 and rounds once."""
    return _product(x, weight, bias)


def rows_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                exact: bool = True, residual: torch.Tensor | None = None) -> torch.Tensor | None:
    """x [..., in] @ weight[out, in]^T + bias (+ residual: see `_product`) -> [..., out] in x's
    dtype through the kernel, or None where it does not take them (no kernel; x, weight not CPU tensors of one dtype; a weight
    that is not contiguous; more rows than `max_rows(dtype, exact)`; shapes that do not fit). A
    strided x is copied first. For callers without autograd: cpu/linear.py's kernel path. A
    decoding step calls it ~150 times, where reshaping to [rows, in] and back cost more than the
    kernel's own call."""
    fn = _kernel if _kernel is not _UNTRIED else kernel()
    if fn is None or not x.is_cpu:
        return None
    dtype, k = x.dtype, x.shape[-1]
    if dtype is not weight.dtype or weight.dim() != 2 or weight.shape[1] != k or k == 0 or not weight.is_contiguous():
        return None
    if not 0 < x.numel() // k <= (fn.max_rows if exact else fn.fast_rows).get(dtype, 0):
        return None
    if bias is not None and (bias.dtype is not dtype or bias.shape != (weight.shape[0],) or not bias.is_contiguous()):
        return None
    return _product(x if x.is_contiguous() else x.contiguous(), weight, bias, residual)


def _product(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
             residual: torch.Tensor | None = None, packed: object | None = None) -> torch.Tensor | None:
    """The kernel's product of contiguous x [..., in] (any leading shape) -> [..., out], plus
    `residual` if given: `residual + product`, bit for bit (fp32 adds it in the same call, saving
    a pass and an operator per residual connection; other cases add it afterwards). The weight is
    `weight`, or, with `packed` (a cpu.packed_weights.PackedWeight of x's dtype), the packed copy of it;
    then None where the kernel could not allocate its tile buffer."""
    fn = kernel()
    k, n = x.shape[-1], (weight if packed is None else packed.qs).shape[0]
    shape = (*x.shape[:-1], n)
    out = torch.empty(shape, dtype=torch.float32)
    rows, threads = x.numel() // k, torch.get_num_threads()
    fp32 = x.dtype == torch.float32
    fused = (residual is not None and fp32 and residual.dtype == torch.float32 and residual.shape == shape
             and residual.is_contiguous())
    if bias is not None and not fp32:
        bias = bias.float().contiguous()
    b, r = None if bias is None else bias.data_ptr(), residual.data_ptr() if fused else None
    if packed is not None:
        args = (x.data_ptr(), packed.qs.data_ptr(), packed.sc.data_ptr(), b)
        if fp32:
            failed = (fn.q4 if packed.bits == 4 else fn.q8)(*args, r, out.data_ptr(), rows, k, n, threads)
        else:
            failed = (fn.q4_bf16 if packed.bits == 4 else fn.q8_bf16)(*args, out.data_ptr(), rows, k, n, threads)
        if failed:
            return None
    elif fused:
        fn.res(x.data_ptr(), weight.data_ptr(), b, r, out.data_ptr(), rows, k, n, threads)
    else:
        (fn if fp32 else fn.bf16)(x.data_ptr(), weight.data_ptr(), b, out.data_ptr(), rows, k, n, threads)
    out = out if fp32 else out.to(x.dtype)
    return out if residual is None or fused else residual + out


def argmax_peak(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(argmax [..], softmax probability at it [..] float32) of logits [.., V] (fp32 or bf16, on
    the CPU) through `cpu/csrc/peak.c`; None where the kernel does not take them (no kernel, other
    dtypes, autograd)."""
    if torch.is_grad_enabled() and logits.requires_grad:
        return None
    return _peak(logits, with_peak=True)


def argmax(logits: torch.Tensor) -> torch.Tensor | None:
    """argmax [..] (int64, the first of tied maxima) of logits [.., V] (fp32 or bf16, on the CPU)
    through `cpu/csrc/peak.c` in one pass; None where the kernel does not take them."""
    out = _peak(logits, with_peak=False)
    return None if out is None else out[0]


def _peak(logits: torch.Tensor, with_peak: bool) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """`cpu/csrc/peak.c` over the rows of logits [.., V]: argmax, and the softmax peak if asked."""
    fn = kernel()
    f = None if fn is None else fn.argmax_peak.get(logits.dtype)
    if f is None or logits.shape[-1] == 0:
        return None
    x = logits.detach().contiguous()
    top = torch.empty(x.shape[:-1], dtype=torch.int64)
    peak = torch.empty(x.shape[:-1], dtype=torch.float32) if with_peak else None
    f(x.data_ptr(), x.numel() // x.shape[-1], x.shape[-1], top.data_ptr(), None if peak is None else peak.data_ptr(),
      torch.get_num_threads())
    return top, peak


def nucleus(logits: torch.Tensor, inv_t: torch.Tensor, top_p: torch.Tensor, support: torch.Tensor | None = None,
            vocab: int = 0) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The top-p nucleus of softmax(logits * inv_t) per row of fp32 logits [r, V] on the CPU
    (inv_t, top_p [r]) through `cpu/csrc/nucleus.c`: (probabilities [r, V], zero outside each
    row's nucleus; done [r] bool). Rows not done (a nucleus wider than the kernel's candidates)
    are zero: the caller filters them its own way. With `support` [m] (ascending token ids <
    vocab), logits [r, m] are those tokens' alone, every other one -inf: the probabilities
    [r, vocab] have the bits of the full row's. None where the kernel does not take them."""
    fn = kernel()
    if fn is None or logits.dtype != torch.float32 or logits.dim() != 2 or not logits.is_cpu or logits.shape[-1] == 0:
        return None
    x = logits.detach().contiguous()
    rows = x.shape[0]
    inv = inv_t.detach().to(torch.float32).contiguous()
    p = top_p.detach().to(torch.float32).contiguous()
    done = torch.zeros(rows, dtype=torch.uint8)
    threads = torch.get_num_threads()
    if support is None:
        out = torch.zeros_like(x)
        failed = fn.nucleus(x.data_ptr(), rows, x.shape[-1], inv.data_ptr(), p.data_ptr(), out.data_ptr(),
                            done.data_ptr(), threads)
    else:
        ids = support.detach().to(torch.int64).contiguous()
        if ids.shape != (x.shape[-1],) or not ids.is_cpu:
            return None
        out = torch.zeros(rows, vocab)
        failed = fn.nucleus_ids(x.data_ptr(), ids.data_ptr(), rows, x.shape[-1], vocab, inv.data_ptr(),
                                p.data_ptr(), out.data_ptr(), done.data_ptr(), threads)
    if failed:
        return None
    return out, done.bool()


NUCLEUS_PAIRS = 1024  # the most pairs a row of `nucleus_pairs` holds (cpu/csrc/nucleus.c's candidates)


def nucleus_pairs(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`nucleus` as (id, probability) pairs of fp32 logits [b, n, V] on the CPU, row r's positions
    at temperature[r] > 0 (inverse 1 / temperature in float32, as `nucleus` is given it) and
    top_p[r] [b]: ids [b, n, k] int64 (ascending, then 0) and probs [b, n, k] float32 (`nucleus`'s
    bits, then 0), k the most any position keeps. None where some position's nucleus is the
    caller's (wider than the kernel's candidates) or the kernel does not take them."""
    fn = kernel()
    if fn is None or logits.dtype != torch.float32 or logits.dim() != 3 or not logits.is_cpu or logits.shape[-1] == 0:
        return None
    b, n, v = logits.shape
    x = logits.detach().contiguous()
    t = temperature.detach().to(torch.float32).contiguous()
    p = top_p.detach().to(torch.float32).contiguous()
    width = min(NUCLEUS_PAIRS, v)
    ids = torch.empty(b * n * width, dtype=torch.int64)
    probs = torch.empty(b * n * width, dtype=torch.float32)
    out = (ctypes.c_int64 * 3)()  # the widest row, every row done (and drawn)
    if fn.nucleus_pairs(x.data_ptr(), b, n, v, t.data_ptr(), p.data_ptr(), width, ids.data_ptr(), probs.data_ptr(),
                        out, torch.get_num_threads()) or not out[1]:
        return None
    k = int(out[0])
    return ids[: b * n * k].view(b, n, k), probs[: b * n * k].view(b, n, k)


def _keyed_args(seeds: list[int], starts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows' seeds and first output positions as the keyed kernels read them (keyed.h): each seed
    as its 64-bit residue's bit pattern, read unsigned; the caller keeps both alive through the
    call (a temporary's memory would be freed, and reused, before the call reads it)."""
    return torch.tensor([s & MASK64 for s in seeds], dtype=torch.uint64), torch.tensor(starts, dtype=torch.int64)


def nucleus_draws(logits: torch.Tensor, support: torch.Tensor | None, temperature: torch.Tensor, top_p: torch.Tensor,
                  seeds: list[int], starts: list[int]
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor] | None:
    """`nucleus_pairs` of fp32 logits [b, n, m] of the tokens `support` [m] (ascending; None: the
    columns are the ids), the pairs' ids read through it, with each position's keyed race winner
    (row r's position j keyed by seeds[r] at output position starts[r] + j, as
    `RowRandom.keys`) and its largest probability: (ids [b, n, k], probs [b, n, k], drawn [b, n]
    or None where some nucleus is wider than the race's head, peaks [b, n]). None as
    `nucleus_pairs`."""
    fn = kernel()
    if fn is None or logits.dtype != torch.float32 or logits.dim() != 3 or not logits.is_cpu or logits.shape[-1] == 0:
        return None
    b, n, v = logits.shape
    x = logits.detach().contiguous()
    ids_of = None
    if support is not None:
        if support.shape != (v,) or not support.is_cpu:
            return None
        ids_of = support.detach().to(torch.int64).contiguous()
    t = temperature.detach().to(torch.float32).contiguous()
    p = top_p.detach().to(torch.float32).contiguous()
    keys_in, at = _keyed_args(seeds, starts)
    width = min(NUCLEUS_PAIRS, v)
    ids = torch.empty(b * n * width, dtype=torch.int64)
    probs = torch.empty(b * n * width, dtype=torch.float32)
    drawn = torch.empty(b, n, dtype=torch.int64)
    peaks = torch.empty(b, n, dtype=torch.float32)
    out = (ctypes.c_int64 * 3)()  # the widest row, every row done, every row drawn
    if fn.nucleus_draws(x.data_ptr(), 0 if ids_of is None else ids_of.data_ptr(), b, n, v, t.data_ptr(), p.data_ptr(),
                        keys_in.data_ptr(), at.data_ptr(), width, ids.data_ptr(), probs.data_ptr(), drawn.data_ptr(),
                        peaks.data_ptr(), out, torch.get_num_threads()) or not out[1]:
        return None
    k = int(out[0])
    return ids[: b * n * k].view(b, n, k), probs[: b * n * k].view(b, n, k), drawn if out[2] else None, peaks


def pairs_race(ids: torch.Tensor, probs: torch.Tensor, seeds: list[int], starts: list[int]) -> torch.Tensor | None:
    """dflash/sparse_probs.py's `sample_pairs` through `cpu/csrc/race.c` (the same tokens): each
    position's keyed race among its pairs ids [b, n, k] int64 / probs [b, n, k] float32, row r's
    position j keyed by seeds[r] at output position starts[r] + j -> ids [b, n]; None where some
    position has more tokens than the race's head (its tail draws on the host) or the kernel
    does not run."""
    fn = kernel()
    if fn is None or ids.dim() != 3 or probs.dtype != torch.float32 or not ids.is_cpu or not probs.is_cpu:
        return None
    b, n, k = ids.shape
    pairs_ids, pairs_p = ids.to(torch.int64).contiguous(), probs.contiguous()
    keys_in, at = _keyed_args(seeds, starts)
    drawn = torch.empty(b, n, dtype=torch.int64)
    if fn.pairs_race(pairs_ids.data_ptr(), pairs_p.data_ptr(), b, n, k, keys_in.data_ptr(), at.data_ptr(),
                     drawn.data_ptr()):
        return None
    return drawn


def standard_rule(proposals: torch.Tensor, p_ids: torch.Tensor, p_probs: torch.Tensor, q_ids: torch.Tensor,
                  q_probs: torch.Tensor, keys: torch.Tensor, limit: torch.Tensor | None
                  ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """dflash/verify.py's standard rule over pairs through `cpu/csrc/standard_rule.c` (the same
    outcome): proposals [b, m] (m >= 1), the target's pairs p_ids, p_probs [b, m+1, k], the
    draft's q_ids, q_probs [b, m, kq], each position's key [b, m+1], limit [b] or None ->
    (accepted [b], bonus [b]); None where the kernel does not take them."""
    fn = kernel()
    b, m = proposals.shape
    if (fn is None or m < 1 or p_probs.dtype != torch.float32 or q_probs.dtype != torch.float32
            or not all(t.is_cpu for t in (proposals, p_ids, q_ids, keys))):
        return None
    args = [t.to(dtype).contiguous() for t, dtype in ((proposals, torch.int64), (p_ids, torch.int64), (p_probs, torch.float32),
                                                      (q_ids, torch.int64), (q_probs, torch.float32), (keys, torch.int64))]
    lim = None if limit is None else limit.to(torch.int64).contiguous()
    accepted, bonus = torch.empty(b, dtype=torch.int64), torch.empty(b, dtype=torch.int64)
    x, pi, pp, qi, qp, ks = args
    if fn.standard_rule(x.data_ptr(), b, m, pi.data_ptr(), pp.data_ptr(), pi.shape[-1], qi.data_ptr(), qp.data_ptr(),
                        qi.shape[-1], ks.data_ptr(), 0 if lim is None else lim.data_ptr(), accepted.data_ptr(),
                        bonus.data_ptr()):
        return None
    return accepted, bonus


def position_keys(seeds: list[int], starts: list[int], n: int) -> torch.Tensor | None:
    """dflash/sampling.py's `RowRandom.keys` through `cpu/csrc/uniforms.c` (the same bits): [b, n]
    int64 keys of row r's output positions starts[r] .. starts[r] + n - 1 under seeds[r]; None
    where the kernel does not run."""
    fn = kernel()
    if fn is None:
        return None
    out = torch.empty(len(seeds), n, dtype=torch.int64)
    if len(seeds) and n:
        keys_in, at = _keyed_args(seeds, starts)
        fn.position_keys(keys_in.data_ptr(), at.data_ptr(), len(seeds), n, out.data_ptr())
    return out


def top_k(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(log-softmax [.., k] float32, ids [.., k] int64) of the k largest logits [.., V] (fp32 or
    bf16, on the CPU), larger first and the lower id first on equal logits, through
    `cpu/csrc/topk.c`; None where the kernel does not take them (no kernel, other dtypes,
    autograd, k outside 1..min(V, its limit))."""
    fn = kernel()
    f = None if fn is None else fn.top_k.get(logits.dtype)
    n = logits.shape[-1]
    if f is None or not 1 <= k <= min(n, fn.top_k_max) or (torch.is_grad_enabled() and logits.requires_grad):
        return None
    x = logits.detach().contiguous()
    rows = x.numel() // n
    logp = torch.empty(*x.shape[:-1], k, dtype=torch.float32)
    ids = torch.empty(*x.shape[:-1], k, dtype=torch.int64)
    if rows and f(x.data_ptr(), rows, n, k, logp.data_ptr(), ids.data_ptr(), torch.get_num_threads()):
        return None
    return logp, ids


def top_values(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(values, indices) [.., k] of the k largest of each row of fp32 x [.., n] on the CPU,
    descending, the lower index first on equal values, through `cpu/csrc/topk.c`: torch.topk's
    values; None where the kernel does not take them."""
    fn = kernel()
    if fn is None or x.dtype != torch.float32 or not x.is_cpu or not 1 <= k <= x.shape[-1]:
        return None
    flat = x.detach().reshape(-1, x.shape[-1]).contiguous()
    vals = torch.empty(flat.shape[0], k, dtype=torch.float32)
    idx = torch.empty(flat.shape[0], k, dtype=torch.int64)
    if fn.top_values(flat.data_ptr(), flat.shape[0], flat.shape[1], k, vals.data_ptr(), idx.data_ptr(),
                     torch.get_num_threads()):
        return None
    return vals.reshape(*x.shape[:-1], k), idx.reshape(*x.shape[:-1], k)


def slot_uniforms(keys: torch.Tensor, slots: torch.Tensor) -> torch.Tensor | None:
    """dflash/sampling.py's `slot_uniforms` through `cpu/csrc/uniforms.c` (the same bits): keys
    [...] int64 against slots [k] (shared) or [..., k] (per key) -> [..., k] float64; None where
    the kernel does not take them (no kernel, other dtypes or shapes, not the CPU)."""
    fn = kernel()
    if fn is None or keys.dtype != torch.int64 or slots.dtype != torch.int64 or not keys.is_cpu or not slots.is_cpu:
        return None
    k = slots.shape[-1]
    per_key = slots.dim() > 1
    if per_key and slots.shape[:-1] != keys.shape:
        return None
    keys_c, slots_c = keys.contiguous(), slots.contiguous()
    out = torch.empty(*keys.shape, k, dtype=torch.float64)
    fn.slot_uniforms(keys_c.data_ptr(), slots_c.data_ptr(), keys.numel(), k, int(per_key), out.data_ptr())
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor | None:
    """silu(gate) * up of gate_up [..., 2 I] (gate first) -> [..., I] through `cpu/csrc/layers.c`
    (fp32 or bf16 on the CPU; bf16 rounds where PyTorch's bf16 operators do), or None where the
    kernel does not take it (the caller then uses PyTorch's operators). The native models use it
    on both of their paths (the Python loops and `bs_layers`), so their bits agree."""
    fn = kernel()
    f = None if fn is None else fn.silu_mul.get(gate_up.dtype)
    if f is None or not gate_up.is_cpu or gate_up.shape[-1] % 2 or torch.is_grad_enabled() and gate_up.requires_grad:
        return None
    if not gate_up.is_contiguous():
        gate_up = gate_up.contiguous()
    inter = gate_up.shape[-1] // 2
    out = torch.empty((*gate_up.shape[:-1], inter), dtype=gate_up.dtype)
    f(gate_up.data_ptr(), out.data_ptr(), gate_up.numel() // max(1, 2 * inter), inter, torch.get_num_threads())
    return out


def block_conv(x: torch.Tensor, base: torch.Tensor, delta: torch.Tensor, block_len: int) -> torch.Tensor | None:
    """One side of DFlash 2's block convolution (dflash/conv.py) through `csrc/conv.c`: x
    [b, s, H], base [T, H], delta [b, s, T, G] (each token's T * G values contiguous) -> [b, s, H]
    with the bits of BlockConv's PyTorch operators; None where the kernel does not take it (no
    kernel, dtypes other than fp32 or bf16 alike, autograd, another layout)."""
    fn = kernel()
    f = None if fn is None else fn.block_conv.get(x.dtype)
    if f is None or base.dtype != x.dtype or delta.dtype != x.dtype or torch.is_grad_enabled() and (
            x.requires_grad or base.requires_grad or delta.requires_grad):
        return None
    b, s, h = x.shape
    taps, groups = delta.shape[-2:]
    if (x.device.type != "cpu" or not x.is_contiguous() or not base.is_contiguous() or delta.stride(-1) != 1
            or delta.stride(-2) != groups or delta.stride(0) != s * delta.stride(1) or h % groups):
        return None
    out = torch.empty_like(x)
    f(x.data_ptr(), base.data_ptr(), delta.data_ptr(), out.data_ptr(), b * s, h, taps, groups, delta.stride(1),
      block_len, torch.get_num_threads())
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """Hugging Face's RMSNorm of x [..., n] (on the CPU) by weight [n] through `cpu/csrc/norm.c`
    (statistics in fp32, the product by weight in x's dtype), or None where the kernel does not
    take it (no kernel, dtypes other than fp32 or bf16 alike, autograd). Kept lean: it runs ~60
    times per decoding step."""
    fn = kernel()
    f = None if fn is None else fn.rms_norm.get(x.dtype)
    if f is None or weight.dtype != x.dtype or torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return None
    if not x.is_contiguous():
        x = x.contiguous()
    if not weight.is_contiguous():
        weight = weight.contiguous()
    out = torch.empty_like(x)
    n = x.shape[-1]
    f(x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.numel() // max(1, n), n, eps, torch.get_num_threads())
    return out
