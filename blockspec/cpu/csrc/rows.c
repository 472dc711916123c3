/* y[n, out] = x[n, in] . w[out, in]^T (+ bias[out]) for a few rows n (decoding, verification), summed
 * in fp32. x and w are both fp32 (bs_rows_matmul; bs_rows_matmul_res also adds a residual
 * res[n, out]) or both bf16 (bs_rows_matmul_bf16, for bf16 models: half the bytes to stream);
 * bs_rows_matmul_q4 / _q8 take fp32 weights stored in 4 / 8 bits (below) with bs_rows_matmul's bits,
 * and _q4_bf16 / _q8_bf16 the bf16 roundings of such weights with bs_rows_matmul_bf16's.
 * bias and y are fp32.
 *
 * Built at first use by blockspec/cpu/kernels.py (gcc or clang, -O3 -march=native -fopenmp
 * -std=c11, under which the compiler never fuses a * b + c itself). Written with GCC vector
 * extensions so the compiler picks the widest vector unit it has; multiply-adds are fused (one
 * rounding) where the CPU has FMA, through fma16. bf16 inputs are widened to fp32 in registers
 * (exact), or, where the CPU has AVX512_BF16, multiplied in pairs by its dot-product instruction
 * (twice the products per instruction: from 8 rows on, the tiles are bound by arithmetic).
 *
 * Why: a decoding step multiplies a handful of rows by every weight matrix; the run time should
 * be the time to stream the weights from memory once. Two tilings:
 * - up to TILE_ROWS - 1 rows: each weight row (output column) is read once per call, as one long
 *   sequential stream, and multiplied into up to eight rows' partial sums held in registers;
 * - TILE_ROWS rows and more (bf16: TILE_ROWS_BF16): tiles of BR rows x BC weight rows, so each
 *   weight vector loaded feeds BR rows and each x vector BC outputs. With one weight row at a
 *   time, loads and the per-output horizontal sums bounded 8 rows and more (BENCHMARKS.md, "Kernel measurements"). The tile's weight
 *   rows stay in cache while the row groups of x pass over them, and the next tile's are
 *   prefetched.
 *
 * Every output element is accumulated the same way whatever n, the tiling, the row grouping or
 * the thread split: 16-wide partial sums over `in` in order (fma16, or dp16 on 32-element steps),
 * one fixed reduction tree, then the scalar tail, then the bias. So a row gets the same bits alone
 * or beside others (batch invariance), which keeps speculative verification bit-equal to
 * one-token decoding.
 */
#include <stdlib.h>

#include "vec.h"

/* the bits of 32 bf16 elements from p + i, unconverted (for dp16) */
static inline v16 load32h(const void *p, int64_t i) { return load16((const float *)((const uint16_t *)p + i)); }

#if defined(__AVX512BF16__)
#define DP 1 /* bf16 products through the dot-product instruction, 32 elements per step */
/* a[i] + b[2i] c[2i] + b[2i+1] c[2i+1] (b, c: the bits of 32 bf16 each) */
static inline v16 dp16(v16 a, v16 b, v16 c) { return (v16)_mm512_dpbf16_ps((__m512)a, (__m512bh)b, (__m512bh)c); }
#else
#define DP 0
static inline v16 dp16(v16 a, v16 b, v16 c) { (void)b, (void)c; return a; } /* never called */
#endif

/* elements of `in` per vector step: 32 through dp16, else 16 */
#define STEP(bf) ((bf) && DP ? 32 : 16)

/* The one-row-at-a-time path's fp32 weight stream is prefetched this many bytes ahead, towards
 * the outer caches (locality 1): the hardware prefetcher alone left a few rows short of the
 * bandwidth two rows reach; 2048 bytes ahead lost at 4-5 rows; bf16 streams gained nothing, so
 * they go without (BENCHMARKS.md, "Kernel measurements"). */
#define STREAM_AHEAD 4096

/* MR rows (MR <= 8) of x (row stride in) times one weight row w -> y[r * ldy] */
static inline __attribute__((always_inline)) void tile(const void *x, const void *w, const float *bias, float *y,
                                                       const float *res, int64_t in, int64_t ldy, const int MR,
                                                       const int bf) {
    const int64_t kv = in - in % STEP(bf);
    v16 acc[8];
#pragma GCC unroll 8
    for (int r = 0; r < MR; r++) acc[r] = (v16){0};
    for (int64_t k = 0; k < kv; k += STEP(bf)) {
        if (bf && DP) {
            const v16 wv = load32h(w, k);
#pragma GCC unroll 8
            for (int r = 0; r < MR; r++) acc[r] = dp16(acc[r], wv, load32h(x, r * in + k));
        } else {
            if (!bf) __builtin_prefetch((const char *)w + 4 * k + STREAM_AHEAD, 0, 1);
            const v16 wv = load(w, k, bf);
#pragma GCC unroll 8
            for (int r = 0; r < MR; r++) acc[r] = fma16(acc[r], wv, load(x, r * in + k, bf));
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < MR; r++) {
        float s = reduce16(acc[r]);
        for (int64_t k = kv; k < in; k++) s += scalar(w, k, bf) * scalar(x, r * in + k, bf);
        s = bias ? s + *bias : s;
        y[r * ldy] = res ? res[r * ldy] + s : s;
    }
}

/* one output column for all n rows, eight rows at a time */
static inline __attribute__((always_inline)) void column(const void *x, const void *w, const float *bias, float *y,
                                                         const float *res, int64_t n, int64_t in, int64_t ldy,
                                                         const int bf) {
    int64_t r = 0;
    for (; r + 8 <= n; r += 8) tile(at(x, r * in, bf), w, bias, y + r * ldy, res ? res + r * ldy : 0, in, ldy, 8, bf);
    x = at(x, r * in, bf);
    y += r * ldy;
    res = res ? res + r * ldy : 0;
    switch (n - r) {
    case 7: tile(x, w, bias, y, res, in, ldy, 7, bf); break;
    case 6: tile(x, w, bias, y, res, in, ldy, 6, bf); break;
    case 5: tile(x, w, bias, y, res, in, ldy, 5, bf); break;
    case 4: tile(x, w, bias, y, res, in, ldy, 4, bf); break;
    case 3: tile(x, w, bias, y, res, in, ldy, 3, bf); break;
    case 2: tile(x, w, bias, y, res, in, ldy, 2, bf); break;
    case 1: tile(x, w, bias, y, res, in, ldy, 1, bf); break;
    }
}

/* ---- the tiled path ---------------------------------------------------------------------------- */

#if defined(__AVX512F__)
#define BR 4 /* rows of x per tile: BR * BC sums + BR x vectors + 1 of 32 vector registers */
#define BC 4 /* weight rows per tile */
#else
#define BR 2 /* a 16-float vector takes two of 16 registers here: 2 * (BR * BC + BR + 1) = 14 */
#define BC 2
#endif
/* From this many rows on, the tiled path. Measured on a 2-core AVX-512 (AVX512_BF16) machine,
 * SmolLM2-135M's projections and head (Zen 4): fp32 from 5 rows, bf16
 * from 3. On Zen 5 the two paths are level at 5-6 fp32 rows, the tiles ahead from 7. */
#if defined(__AVX512F__)
#define TILE_ROWS 5
#define TILE_ROWS_BF16 3
#else
#define TILE_ROWS 8 /* not measured again on narrower vector units */
#define TILE_ROWS_BF16 8
#endif
#if defined(__AVX512F__)
/* measured faster than oneDNN up to 128 rows on 2-core AVX-512 machines, slower from 160 (BENCHMARKS.md, "Kernel measurements"),
 * so a prompt of up to 128 tokens prefills here too */
#define ROWS_MAX 128
#else
#define ROWS_MAX 8 /* the tiled path is not measured on narrower vector units: oneDNN beyond 8 */
#endif

/* The most rows a caller should send here; more go to a GEMM library (cpu/linear.py). bf16:
 * every row count, because a bf16 model's speculative output stays equal to its plain decoding
 * only if every product is batch invariant (one rounding of an activation to bf16 is 0.4%, and
 * 30 layers carry it into the logits). Against oneDNN on a 2-core AVX-512 machine: with the
 * dot-product instruction faster up to 96 rows, level at 128-256, slower at 512 (prefills);
 * widened in registers, faster up to 8 rows and slower from 32 (BENCHMARKS.md, "Kernel measurements"). */
int bs_rows_max(void) { return ROWS_MAX; }
int bs_rows_max_bf16(void) { return 1 << 30; }

/* The most bf16 rows for which the kernel is also the faster choice, for callers that need no
 * batch invariance (a drafter's products only propose tokens): the measurements above. */
int bs_rows_fast_bf16(void) { return DP ? 96 : 8; }

/* GCC would reload a vector at every use; elsewhere it spans two registers */
static inline v16 keep(v16 v) {
#if defined(__AVX512F__)
    __asm__("" : "+v"(v));
#endif
    return v;
}

/* rows x cols tile (rows <= BR, cols <= BC): x rows and w rows of stride `in` -> y[r * ldy + c];
 * `next`: the following tile's weights, prefetched while this one runs. Inputs [k0, k1) only:
 * from k0 > 0 the 16-wide sums start from `part` ([rows][BC] vectors), and unless the vector part
 * of `in` ends by k1 they go back there instead of into y. A sum stored and reloaded is the same
 * chain in the same order, so splitting `in` this way keeps every bit. */
static inline __attribute__((always_inline)) void block(const void *x, const void *w, const float *bias, float *y,
                                                        const float *res, const void *next, int64_t in, int64_t ldy,
                                                        const int rows, const int cols, const int bf, int64_t k0,
                                                        int64_t k1, float *part) {
    const int64_t kv = in - in % STEP(bf), ke = k1 < kv ? k1 : kv;
    const v16 z = {0};
    v16 acc[BR][BC];
#pragma GCC unroll 4
    for (int r = 0; r < rows; r++)
#pragma GCC unroll 4
        for (int c = 0; c < cols; c++) acc[r][c] = k0 ? load16(part + (r * BC + c) * 16) : z;
    for (int64_t k = k0; k < ke; k += STEP(bf)) {
        v16 xv[BR];
#pragma GCC unroll 4
        for (int r = 0; r < rows; r++) xv[r] = keep(bf && DP ? load32h(x, r * in + k) : load(x, r * in + k, bf));
#pragma GCC unroll 4
        for (int c = 0; c < cols; c++) {
            /* the next tile's weights, contiguous (BC rows of `in`): one line per weight vector
             * used here, in address order, non-temporal. Interleaved like this tile's own reads
             * (four streams `in` apart, locality 1) they left the tiles behind one weight row at
             * a time at 2-8 fp32 rows on a 2-core Zen 5 (BENCHMARKS.md, "Kernel measurements"). Into L1 (locality 3) they
             * crowded out this tile's weights and the x rows (on Zen 4). */
            __builtin_prefetch((const char *)next + ((k / STEP(bf)) * BC + c) * 64, 0, 0);
            const v16 wv = keep(bf && DP ? load32h(w, c * in + k) : load(w, c * in + k, bf));
#pragma GCC unroll 4
            for (int r = 0; r < rows; r++)
                acc[r][c] = bf && DP ? dp16(acc[r][c], wv, xv[r]) : fma16(acc[r][c], wv, xv[r]);
        }
    }
    if (ke < kv) {
#pragma GCC unroll 4
        for (int r = 0; r < rows; r++)
#pragma GCC unroll 4
            for (int c = 0; c < cols; c++) memcpy(part + (r * BC + c) * 16, &acc[r][c], sizeof(v16));
        return;
    }
#pragma GCC unroll 4
    for (int r = 0; r < rows; r++) {
#if BC == 4
        v4 s = reduce16x4(acc[r][0], cols > 1 ? acc[r][1] : z, cols > 2 ? acc[r][2] : z, cols > 3 ? acc[r][3] : z);
#else
        v4 s = reduce16x4(acc[r][0], cols > 1 ? acc[r][1] : z, z, z);
#endif
#pragma GCC unroll 4
        for (int c = 0; c < cols; c++) {
            float t = s[c];
            for (int64_t k = kv; k < in; k++) t += scalar(w, c * in + k, bf) * scalar(x, r * in + k, bf);
            t = bias ? t + bias[c] : t;
            y[r * ldy + c] = res ? res[r * ldy + c] + t : t;
        }
    }
}

/* Inputs per pass over the row groups: a tile's weight rows and a row group's x rows stay in L1
 * only while both fit, which SmolLM2's down projection (1,536 inputs) overran: its products of
 * 16-128 rows ran well below the 576-input ones. In passes of at most K_PASS inputs (in equal
 * parts, a multiple of 32), the partial sums of up to PASS_ROWS rows kept in between, most of
 * the gap closed; passes of 512 of the 576 inputs lost (BENCHMARKS.md, "Kernel measurements"). */
#define K_PASS 640
#define PASS_ROWS 128
/* R rows from row r0, inputs [k0, k0 + kc) */
#define ROW_GROUP(R, COLS) block(xr, w, bias, yr, rr, next, in, ldy, R, COLS, bf, k0, k0 + kc, part + r0 * BC * 16)
#if BR == 4
#define WIDE_ROW_GROUPS(COLS)                                                                          \
    case 4: ROW_GROUP(4, COLS); break;                                                                 \
    case 3: ROW_GROUP(3, COLS); break;                                                                 \
    case 2: ROW_GROUP(2, COLS); break;
#else
#define WIDE_ROW_GROUPS(COLS) case 2: ROW_GROUP(2, COLS); break;
#endif
#define ROW_BLOCKS(COLS)                                                                               \
    for (int64_t k0 = 0; k0 < in; k0 += kc)                                                            \
        for (int64_t r0 = 0; r0 < n; r0 += BR) {                                                       \
            const void *xr = at(x, r0 * in, bf);                                                       \
            float *yr = y + r0 * ldy;                                                                  \
            const float *rr = res ? res + r0 * ldy : 0;                                                \
            switch (n - r0 < BR ? n - r0 : BR) {                                                       \
            WIDE_ROW_GROUPS(COLS)                                                                      \
            default: ROW_GROUP(1, COLS); break;                                                        \
            }                                                                                          \
        }

/* `cols` (<= BC) output columns for all n rows */
static inline __attribute__((always_inline)) void blocks(const void *x, const void *w, const float *bias, float *y,
                                                         const float *res, const void *next, int64_t n, int64_t in,
                                                         int64_t ldy, int cols, const int bf) {
    float part[PASS_ROWS * BC * 16]; /* [n][BC] partial sums between passes */
    const int64_t passes = n <= PASS_ROWS ? (in + K_PASS - 1) / K_PASS : 1;
    const int64_t kc = passes > 1 ? ((in + passes - 1) / passes + 31) / 32 * 32 : in + STEP(bf);
    switch (cols) {
    case BC: ROW_BLOCKS(BC) break;
#if BC == 4
    case 3: ROW_BLOCKS(3) break;
    case 2: ROW_BLOCKS(2) break;
#endif
    default: ROW_BLOCKS(1) break;
    }
}

/* Returns 0. Output columns (in groups of BC on the tiled path) are split evenly between `threads`
 * OpenMP threads (the caller passes PyTorch's count: the OpenMP default of a thread PyTorch did
 * not configure may differ). One body per element type, each with a literal `bf`, so the helpers
 * are specialised (a flag passed into the outlined OpenMP region would stay a run-time test). */
#define ROWS_MATMUL(BF)                                                                                \
    if (n < ((BF) ? TILE_ROWS_BF16 : TILE_ROWS)) {                                                     \
        _Pragma("omp parallel for schedule(static) num_threads(threads)")                              \
        for (int64_t j = 0; j < out; j++)                                                              \
            column(x, at(w, j * in, BF), bias ? bias + j : 0, y + j, res ? res + j : 0, n, in, out, BF); \
        return 0;                                                                                      \
    }                                                                                                  \
    const int64_t groups = (out + BC - 1) / BC;                                                        \
    _Pragma("omp parallel for schedule(static) num_threads(threads)")                                  \
    for (int64_t g = 0; g < groups; g++) {                                                             \
        const int64_t j = g * BC;                                                                      \
        const int cols = out - j < BC ? (int)(out - j) : BC;                                           \
        const void *next = at(w, (g + 1 < groups ? j + BC : j) * in, BF);                              \
        blocks(x, at(w, j * in, BF), bias ? bias + j : 0, y + j, res ? res + j : 0, next, n, in, out, cols, BF); \
    }                                                                                                  \
    return 0;

int bs_rows_matmul(const float *x, const float *w, const float *bias, float *y, int64_t n, int64_t in,
                   int64_t out, int threads) {
    const float *res = 0;
    ROWS_MATMUL(0)
}

/* y = res + (x . w^T + bias), res laid out like y: a layer's residual connection in the same
 * call. The product is rounded first, then added to res with one more rounding: the bits of
 * computing the product and adding it to res afterwards, as a separate addition would. */
int bs_rows_matmul_res(const float *x, const float *w, const float *bias, const float *res, float *y, int64_t n,
                       int64_t in, int64_t out, int threads) {
    ROWS_MATMUL(0)
}

/* x, w: bf16 bit patterns */
int bs_rows_matmul_bf16(const uint16_t *x, const uint16_t *w, const float *bias, float *y, int64_t n, int64_t in,
                        int64_t out, int threads) {
    const float *res = 0;
    ROWS_MATMUL(1)
}


/* ---- fp32 weights that a 4- or 8-bit GGUF left, stored packed ----------------------------------- */

/* A model converted from a GGUF file of Q4_1 or Q8_0 weights (SmolLM2-135M-Instruct: Q4_1
 * projections, a Q8_0 embedding that is also its LM head) has fp32 weights that are, per 32
 * consecutive inputs, m + d q (Q4_1: q in 0..15) or d q (Q8_0: q in -128..127), with d (and m)
 * fp16 numbers. d has 11 significant bits, so d q is exact in fp32. cpu/packed_weights.py finds such
 * matrices and keeps q plus the block's scales: 0.75 (4-bit) or 1.125 (8-bit) bytes per weight
 * instead of 4. Here each weight vector is rebuilt in registers (m + d q: one rounding, of an
 * exact product; d q: exact), which gives exactly the fp32 weights, and is then multiplied and
 * summed like the fp32 path above: the same 16-wide partial sums over `in` in order, the same
 * reduction tree, bias and residual. So every output has the bits of bs_rows_matmul on the fp32
 * weights, for any n (tested), and a one-token step streams a fifth (a third) of the bytes.
 * Layouts, `in` a multiple of 32, per block of 32 inputs:
 * - 4-bit: qs [out, in / 2] bytes, 16 per block, byte i holding input i in its low nibble and
 *   input 16 + i in its high one; sc [out, in / 32, 2]: d, m;
 * - 8-bit: qs [out, in] signed bytes; sc [out, in / 32]: d. */
typedef uint8_t b16 __attribute__((vector_size(16)));
typedef int8_t s16 __attribute__((vector_size(16)));
/* Up to 8 rows, one or two weight rows at a time, each weight vector rebuilt once for all rows
 * (faster than tiles that rebuild it per 4 rows: BENCHMARKS.md, "Kernel measurements") */
#define PACKED_TILE_ROWS 9
/* Weight rows side by side (tile_packed) up to this many rows; 8 rows side by side lost, and 4 or
 * 8 weight rows side by side for 1-2 rows gained nothing over 2 (BENCHMARKS.md, "Kernel measurements"). */
#define PACKED_PAIR_ROWS 6

/* the 16 weights from input k + 16 * hi of a packed weight row (k a multiple of 32); bits: 4 or 8 */
static inline v16 packed16(const uint8_t *qs, const float *sc, int64_t k, const int hi, const int bits) {
    if (bits == 4) {
        const uint8_t *p = qs + k / 2;
        const v16 d = (v16){0} + sc[k / 16], m = (v16){0} + sc[k / 16 + 1];
#if defined(__AVX512F__)
        /* GCC widens a byte vector element by element; one instruction here */
        const __m512i w = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
        const i16 q = (i16)(hi ? _mm512_srli_epi32(w, 4) : _mm512_and_si512(w, _mm512_set1_epi32(15)));
#else
        b16 b;
        memcpy(&b, p, sizeof b);
        const i16 wide = __builtin_convertvector(b, i16), q = hi ? wide >> 4 : wide & 15;
#endif
        return fma16(m, d, __builtin_convertvector(q, v16));
    }
    const int8_t *p = (const int8_t *)qs + k + 16 * hi;
#if defined(__AVX512F__)
    const i16 q = (i16)_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p));
#else
    s16 b;
    memcpy(&b, p, sizeof b);
    const i16 q = __builtin_convertvector(b, i16);
#endif
    return __builtin_convertvector(q, v16) * sc[k / 32];
}

/* bytes of qs and floats of sc per weight row */
#define QS_ROW(bits, in) ((bits) == 4 ? (in) / 2 : (in))
#define SC_ROW(bits, in) ((bits) == 4 ? (in) / 16 : (in) / 32)

/* bf16 models: the weights are the bf16 roundings of the packed values (a GGUF converted to bf16),
 * x is bf16, and the result has the bits of bs_rows_matmul_bf16 on those weights: each rebuilt
 * fp32 weight is rounded to bf16 (to nearest, ties to even, as PyTorch converts), then multiplied
 * as that path does (in pairs through dp16 where the CPU has AVX512_BF16, else widened). */

/* fp32 lanes rounded to bf16 and widened back (finite inputs) */
static inline v16 round_bf16(v16 v) {
    u16 u;
    memcpy(&u, &v, sizeof u);
    u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
    memcpy(&v, &u, sizeof v);
    return v;
}

#if DP
/* the 32 weights from input k as bf16 bits in input order, the operand of dp16 */
static inline v16 packed32h(const uint8_t *qs, const float *sc, int64_t k, const int bits) {
    const v16 lo = packed16(qs, sc, k, 0, bits), hi = packed16(qs, sc, k, 1, bits);
    return (v16)_mm512_cvtne2ps_pbh((__m512)hi, (__m512)lo);
}
#endif

/* the 32 weights from input k, rounded to bf16, stored at out */
static inline void packed_to_bf16(const uint8_t *qs, const float *sc, int64_t k, uint16_t *out, const int bits) {
#if DP
    const v16 h = packed32h(qs, sc, k, bits);
    memcpy(out, &h, sizeof h);
#else
    for (int hi = 0; hi < 2; hi++) {
        const v16 w = round_bf16(packed16(qs, sc, k, hi, bits));
        u16 u;
        memcpy(&u, &w, sizeof u);
        const h16 h = __builtin_convertvector(u >> 16, h16);
        memcpy(out + 16 * hi, &h, sizeof h);
    }
#endif
}

/* MR rows (MR <= 8) of x (fp32, or bf16 if bf) times NC (1 or 2) consecutive packed weight rows
 * (row stride qrow bytes of qs, srow floats of sc) -> y[r * ldy + c] (cf. tile). Each output is one
 * chain of fused multiply-adds in input order, and a few rows alone leave the chains waiting on
 * the adder's latency (one row: a chain of two multiply-adds per 32 weights); two weight rows side
 * by side run twice the chains and load each x vector once for both. Each output's chain is its
 * own, in the same order, so the bits do not depend on NC. */
static inline __attribute__((always_inline)) void tile_packed(const void *x, const uint8_t *qs, const float *sc,
                                                              int64_t qrow, int64_t srow, const float *bias, float *y,
                                                              const float *res, int64_t in, int64_t ldy, const int MR,
                                                              const int NC, const int bits, const int bf) {
    const uint8_t *qs1 = qs + qrow; /* the second weight row (NC == 2) */
    const float *sc1 = sc + srow;
    v16 a0[8], a1[8]; /* sums of the first and the second weight row */
#pragma GCC unroll 8
    for (int r = 0; r < MR; r++) a0[r] = a1[r] = (v16){0};
    for (int64_t k = 0; k < in; k += 32) {
        __builtin_prefetch(qs + QS_ROW(bits, k) + 1024, 0, 1);
        if (NC == 2) __builtin_prefetch(qs1 + QS_ROW(bits, k) + 1024, 0, 1);
        else __builtin_prefetch(sc + SC_ROW(bits, k) + 256, 0, 1); /* measured: 7-8 rows gain, pairs lose */
#if DP
        if (bf) {
            const v16 w0 = packed32h(qs, sc, k, bits), w1 = NC == 2 ? packed32h(qs1, sc1, k, bits) : w0;
#pragma GCC unroll 8
            for (int r = 0; r < MR; r++) {
                const v16 xv = load32h(x, r * in + k);
                a0[r] = dp16(a0[r], w0, xv);
                if (NC == 2) a1[r] = dp16(a1[r], w1, xv);
            }
            continue;
        }
#endif
        v16 lo0 = packed16(qs, sc, k, 0, bits), hi0 = packed16(qs, sc, k, 1, bits), lo1 = lo0, hi1 = hi0;
        if (NC == 2) lo1 = packed16(qs1, sc1, k, 0, bits), hi1 = packed16(qs1, sc1, k, 1, bits);
        if (bf) lo0 = round_bf16(lo0), hi0 = round_bf16(hi0), lo1 = round_bf16(lo1), hi1 = round_bf16(hi1);
#pragma GCC unroll 8
        for (int r = 0; r < MR; r++) {
            const v16 xv = load(x, r * in + k, bf);
            a0[r] = fma16(a0[r], lo0, xv);
            if (NC == 2) a1[r] = fma16(a1[r], lo1, xv);
        }
#pragma GCC unroll 8
        for (int r = 0; r < MR; r++) {
            const v16 xv = load(x, r * in + k + 16, bf);
            a0[r] = fma16(a0[r], hi0, xv);
            if (NC == 2) a1[r] = fma16(a1[r], hi1, xv);
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < MR; r++)
#pragma GCC unroll 2
        for (int c = 0; c < NC; c++) {
            float t = reduce16(c ? a1[r] : a0[r]);
            t = bias ? t + bias[c] : t;
            y[r * ldy + c] = res ? res[r * ldy + c] + t : t;
        }
}

/* NC output columns for all n rows, eight rows at a time */
#define TILE_PACKED_CASE(M)                                                                            \
    case M: tile_packed(x, qs, sc, qrow, srow, bias, y, res, in, ldy, M, NC, bits, bf); break;
static inline __attribute__((always_inline)) void column_packed(const void *x, const uint8_t *qs, const float *sc,
                                                                int64_t qrow, int64_t srow, const float *bias,
                                                                float *y, const float *res, int64_t n, int64_t in,
                                                                int64_t ldy, const int NC, const int bits,
                                                                const int bf) {
    int64_t r = 0;
    for (; r + 8 <= n; r += 8)
        tile_packed(at(x, r * in, bf), qs, sc, qrow, srow, bias, y + r * ldy, res ? res + r * ldy : 0, in, ldy, 8,
                    NC, bits, bf);
    x = at(x, r * in, bf);
    y += r * ldy;
    res = res ? res + r * ldy : 0;
    switch (n - r) {
    TILE_PACKED_CASE(7) TILE_PACKED_CASE(6) TILE_PACKED_CASE(5) TILE_PACKED_CASE(4) TILE_PACKED_CASE(3)
    TILE_PACKED_CASE(2) TILE_PACKED_CASE(1)
    }
}

/* output columns [from, out) in groups of NC, split between the threads; `from` moves past them */
#define COLUMNS_PACKED(NC, BITS, BF)                                                                   \
    do {                                                                                               \
        const int64_t groups = (out - from) / (NC);                                                    \
        _Pragma("omp parallel for schedule(static) num_threads(threads) if (groups > 1)")              \
        for (int64_t g = 0; g < groups; g++) {                                                         \
            const int64_t j = from + g * (NC);                                                         \
            column_packed(x, qs + j * qrow, sc + j * srow, qrow, srow, bias ? bias + j : 0, y + j,     \
                          res ? res + j : 0, n, in, ldy, NC, BITS, BF);                                \
        }                                                                                              \
        from += groups * (NC);                                                                         \
    } while (0)

/* the 32 fp32 weights from input k, stored at out */
static inline void packed_to_f32(const uint8_t *qs, const float *sc, int64_t k, float *out, const int bits) {
    const v16 lo = packed16(qs, sc, k, 0, bits), hi = packed16(qs, sc, k, 1, bits);
    memcpy(out, &lo, sizeof lo);
    memcpy(out + 16, &hi, sizeof hi);
}

/* One body per width and element type, with literal `BITS` and `BF` (see ROWS_MATMUL). From
 * PACKED_TILE_ROWS rows, each tile's BC weight rows are rebuilt once into a buffer (in L1/L2) of
 * fp32 or bf16 weights that the plain tiles then read, rather than once per group of BR rows. */
#define PACKED_MATMUL(BITS, BF)                                                                        \
    if (in % 32) return 1;                                                                             \
    const int64_t ldy = out, qrow = QS_ROW(BITS, in), srow = SC_ROW(BITS, in);                         \
    if (n < PACKED_TILE_ROWS) {                                                                        \
        int64_t from = 0;                                                                              \
        if (n <= PACKED_PAIR_ROWS) COLUMNS_PACKED(2, BITS, BF);                                        \
        COLUMNS_PACKED(1, BITS, BF); /* all, or an odd last one */                                     \
        return 0;                                                                                      \
    }                                                                                                  \
    const int64_t groups = (out + BC - 1) / BC;                                                        \
    int failed = 0;                                                                                    \
    _Pragma("omp parallel num_threads(threads) reduction(|| : failed)")                                \
    {                                                                                                  \
        void *buf = malloc((size_t)(BC * in) * ((BF) ? sizeof(uint16_t) : sizeof(float)));            \
        if (!buf) failed = 1;                                                                          \
        _Pragma("omp for schedule(static)")                                                            \
        for (int64_t g = 0; g < groups; g++) {                                                         \
            if (!buf) continue;                                                                        \
            const int64_t j = g * BC, nj = g + 1 < groups ? j + BC : j;                                \
            const int cols = out - j < BC ? (int)(out - j) : BC;                                       \
            for (int c = 0; c < cols; c++)                                                             \
                for (int64_t k = 0; k < in; k += 32) {                                                 \
                    const uint8_t *qc = qs + (j + c) * qrow;                                           \
                    const float *scc = sc + (j + c) * srow;                                            \
                    if (BF) packed_to_bf16(qc, scc, k, (uint16_t *)buf + c * in + k, BITS);            \
                    else packed_to_f32(qc, scc, k, (float *)buf + c * in + k, BITS);                   \
                }                                                                                      \
            blocks(x, buf, bias ? bias + j : 0, y + j, res ? res + j : 0, qs + nj * qrow, n, in, ldy, cols, BF); \
        }                                                                                              \
        free(buf);                                                                                     \
    }                                                                                                  \
    return failed ? 2 : 0;

/* fp32 x and weights: y = x . w^T (+ bias) (+ res, may be null) with w packed as above; the bits
 * of bs_rows_matmul(_res) on the unpacked weights. Returns 0; 1 if `in` is not a multiple of 32,
 * 2 if a tile buffer could not be allocated. */
int bs_rows_matmul_q4(const float *x, const uint8_t *qs, const float *sc, const float *bias, const float *res,
                      float *y, int64_t n, int64_t in, int64_t out, int threads) {
    PACKED_MATMUL(4, 0)
}

int bs_rows_matmul_q8(const float *x, const uint8_t *qs, const float *sc, const float *bias, const float *res,
                      float *y, int64_t n, int64_t in, int64_t out, int threads) {
    PACKED_MATMUL(8, 0)
}

/* bf16 x [n, in], weights packed (bits 4 or 8) whose bf16 roundings are the model's weights;
 * y fp32: the bits of bs_rows_matmul_bf16 on those bf16 weights. Returns as bs_rows_matmul_q4. */
int bs_rows_matmul_q4_bf16(const uint16_t *x, const uint8_t *qs, const float *sc, const float *bias, float *y,
                           int64_t n, int64_t in, int64_t out, int threads) {
    const float *res = 0;
    PACKED_MATMUL(4, 1)
}

int bs_rows_matmul_q8_bf16(const uint16_t *x, const uint8_t *qs, const float *sc, const float *bias, float *y,
                           int64_t n, int64_t in, int64_t out, int threads) {
    const float *res = 0;
    PACKED_MATMUL(8, 1)
}

/* ---- the greedy head ---------------------------------------------------------------------------- */

/* Greedy decoding needs only the argmax of each row of x . w^T, and for a target's LM head (49K
 * fp32 rows for SmolLM2, a fifth of the bytes a one-token forward streams) most of the time goes
 * to reading w. So the head is screened first: s = xb . wb^T, both rounded to bf16 (half the
 * bytes), through the bf16 path above. With e_j a bound on |y_j - s_j|, y_j being the fp32 logit
 * this file's fp32 path computes, no column j with s_j + e_j < max_k (s_k - e_k) can hold the
 * maximum of y (its y_j is strictly below that k's), so only the columns left (candidates: 1-2
 * per row, up to ~12, on SmolLM2's real hidden states) get their exact fp32 logit, through
 * `tile`: the same arithmetic, so the same bits, as the full product. The maximum among them,
 * the first of ties, is the full product's argmax.
 * The caller gives e_j = bound[r] * wnorm[j]: with u = 2^-9, bf16 rounding moves the exact dot
 * product by at most (2u + u^2) |x| |w_j| (Cauchy-Schwarz), and both computed sums add less than
 * 80 fp32 roundings of sum |x_i w_ji| <= |x| |w_j|; so bound[r] = 2^-8 * 1.05 * |x_r| covers it
 * with room for the roundings of the bound itself (cpu/greedy_head.py).
 * Returns 0, or 1 when a row's screen held no finite value (then the caller computes the logits). */
static int64_t greedy_row(const float *x, const float *w, const float *s, const float *wnorm, float e, int64_t in,
                          int64_t out, int64_t *candidates) {
    const int64_t nv = out - out % 16;
    v16 lo = (v16){0} - INFINITY;
    for (int64_t j = 0; j < nv; j += 16) {
        const v16 v = load16(s + j) - load16(wnorm + j) * e;
        lo = select16(v > lo, v, lo);
    }
    float lower = -INFINITY;
    for (int l = 0; l < 16; l++) lower = lo[l] > lower ? lo[l] : lower;
    for (int64_t j = nv; j < out; j++) {
        const float v = s[j] - wnorm[j] * e;
        lower = v > lower ? v : lower;
    }
    if (!isfinite(lower)) return -1;
    float best = -INFINITY;
    int64_t at_best = -1, seen = 0;
    const v16 lower16 = (v16){0} + lower;
    for (int64_t j = 0; j < out; j += 16) {
        const int lanes = out - j < 16 ? (int)(out - j) : 16;
        if (lanes == 16) {
            const i16 hit = load16(s + j) + load16(wnorm + j) * e >= lower16;
            const i16 none = {0};
            if (!memcmp(&hit, &none, sizeof hit)) continue;
        }
        for (int l = 0; l < lanes; l++) {
            if (!(s[j + l] + wnorm[j + l] * e >= lower)) continue;
            float y;
            tile(x, w + (j + l) * in, 0, &y, 0, in, 1, 1, 0);
            seen++;
            if (y > best || at_best < 0) best = y, at_best = j + l; /* ascending j: ties keep the first */
        }
    }
    *candidates = seen;
    return at_best;
}

/* x [n, in] fp32 and its bf16 rounding xb; w [out, in] fp32 and its bf16 rounding wb; wnorm [out]:
 * an upper bound of each |w_j|; bound [n] (see above); screen: n * out fp32 scratch. idx [n]: the
 * argmax of each row of x . w^T; candidates [n]: how many columns each row computed exactly. */
int bs_greedy_head(const float *x, const uint16_t *xb, const float *w, const uint16_t *wb, const float *wnorm,
                   const float *bound, float *screen, int64_t n, int64_t in, int64_t out, int64_t *idx,
                   int64_t *candidates, int threads) {
    bs_rows_matmul_bf16(xb, wb, 0, screen, n, in, out, threads);
    int failed = 0;
    _Pragma("omp parallel for schedule(static) num_threads(threads) if (n >= 2) reduction(|| : failed)")
    for (int64_t r = 0; r < n; r++) {
        idx[r] = greedy_row(x + r * in, w, screen + r * out, wnorm, bound[r], in, out, candidates + r);
        if (idx[r] < 0) failed = 1;
    }
    return failed;
}
