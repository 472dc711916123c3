/* Integer products for the int8 compute mode: y[n, out] = x[n, in] . w[out, in]^T (+ bias) (+ res),
 * with x quantised to 8 bits per row and block of 32 inputs and w held in 4 or 8 bits (GGUF's
 * Q4_1 and Q8_0 values, interleaved by cpu/int8.py), the block sums taken in integers.
 *
 * Why: the exact mode rebuilds every packed weight as an fp32 number and multiplies in fp32, so a
 * few rows are already bound by the fp32 units; integer dot products (AVX-512 VNNI: 64 byte
 * products per instruction) do the same work for a fraction of the instructions, provided the
 * fp32 work is per block of 32 products and not per lane of 4.
 *
 * The arithmetic, defined exactly (cpu/int8.py emulates it in PyTorch, bit for bit):
 * - quantisation of a row, per block b of 32 inputs (as llama.cpp's Q8_1): a = max |x_i|,
 *   d = a / 127 (fp32), q_i = rint(x_i / d) clamped to [-127, 127] (0 where d is 0), and, for 4-bit
 *   weights, s = d * (float)sum q_i;
 * - per output and block b: the integer sum of the block's 32 products w q (w: the 4-bit level
 *   0..15, or the signed 8-bit value; exact, and exact again as an fp32 number: |sum| < 2^20),
 *   t_b = (dw_b * dx_b) * sum, dw and dx the block's two scales (one rounding each);
 * - the dot is acc = ((0 + t_0) + t_1) + ... in block order; 4-bit weights add, after it,
 *   ms = ((0 + m_0 s_0) + m_1 s_1) + ... (m: the block's minimum): acc + ms;
 * - then the bias (one addition) and the residual (res + that), as rows.c.
 * Every output depends on its own row of x and its own weight row only, in that fixed order, so a
 * row gets the same bits alone, beside others and on any thread split (batch invariance), and
 * the VNNI, AVX2 and plain C paths give the same bits (tested): they differ only in how they
 * form the integer sums, which are exact whatever the grouping.
 *
 * Layouts: x fp32 [n, in], `in` a multiple of 32. Weight rows go in groups of 16 (the last one
 * zero padded), each group block by block, so one 64-byte load holds 4 inputs of 16 rows and a
 * dot-product instruction sums them into the 16 rows' lanes against one broadcast 4 inputs of x
 * (no lane reduction, one fp32 step per block and 16 outputs):
 * - 4-bit qs [groups, nb, 4, 16, 4] uint8: [g, b, k, r, t] is byte 4k + t of row 16g + r's block b
 *   in GGUF's Q4 order (input 4k + t in its low nibble, input 16 + 4k + t in its high one);
 * - 8-bit qs [groups, nb, 8, 16, 4] int8: [g, b, k, r, t] is input 32b + 4k + t of row 16g + r;
 * - wd [groups, nb, 16] the blocks' d, wm [groups, nb, 16] (4-bit only) the blocks' m, as fp16 numbers (GGUF
 *   stores them so; widened to fp32 exactly): 0.625 bytes a 4-bit weight, where fp32 scales took 0.75 and
 *   a one-row product streams its weights at the memory's pace.
 */
#include <omp.h>
#include <stdlib.h>

#include "vec.h"

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define INT8_PATH 2 /* 64 byte products per vpdpbusd */
#elif defined(__AVX2__)
#define INT8_PATH 1 /* vpmaddubsw + vpmaddwd, 32 per pair */
#else
#define INT8_PATH 0 /* plain C */
#endif

/* which path this build runs: 2 VNNI, 1 AVX2, 0 plain C */
int bs_int8_path(void) { return INT8_PATH; }

#define GROUP 16 /* weight rows per group: one fp32 lane each */
#define PANEL_BYTES (256 * 1024) /* weights of a panel of groups (groups_int8): well inside an L2 cache */

/* rows of x held in registers per pass over a group's weights */
#if INT8_PATH == 2
#define MR_MAX 8
#elif INT8_PATH == 1
#define MR_MAX 3
#else
#define MR_MAX 4
#endif

typedef int8_t q16 __attribute__((vector_size(16)));

/* A tile of several rows reads its group's weights this many bytes ahead of the block being summed
 * (and the scales an eighth as far, their share of a 4-bit group's bytes): a group's blocks and the
 * next group's follow each other in memory, but the hardware prefetcher alone left a verify pass of
 * several rows waiting on them. A lone row, which streams at the memory's pace, ran slower with the
 * prefetches (BENCHMARKS.md, "Kernel measurements"). */
#define INT8_AHEAD 6144

/* one row, per block b (block b's values at q + 32 stride b, its scalars at [stride b]): q [32],
 * d (the scale), s (d * sum q), c (-128 * sum q: VNNI's offset for 8-bit weights, see block_sums).
 * 16 lanes at a time, each lane's operations the scalar definition's: IEEE division, and rint as
 * (t + 1.5 * 2^23) - 1.5 * 2^23 (round half to even for |t| < 2^22; here |t| <= 127) */
static void quantize_row(const float *x, int8_t *q, float *d, float *s, int32_t *c, int64_t nb, int64_t stride) {
    const v16 zero = {0}, magic = zero + 12582912.0f, top = zero + 127.0f, bottom = zero - 127.0f;
    const i16 nosign = (i16){0} + 0x7fffffff;
    for (int64_t b = 0; b < nb; b++) {
        v16 v[2] = {load16(x + 32 * b), load16(x + 32 * b + 16)}, mag[2];
        for (int h = 0; h < 2; h++) {
            i16 bits;
            memcpy(&bits, &v[h], sizeof bits);
            bits &= nosign;
            memcpy(&mag[h], &bits, sizeof bits);
        }
        /* the largest magnitude (a maximum: exact in any order) */
        v16 m = select16(mag[1] > mag[0], mag[1], mag[0]), t;
        t = __builtin_shufflevector(m, m, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
        m = select16(t > m, t, m);
        t = __builtin_shufflevector(m, m, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
        m = select16(t > m, t, m);
        t = __builtin_shufflevector(m, m, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
        m = select16(t > m, t, m);
        const float a = m[0] > m[1] ? m[0] : m[1];
        const float db = a / 127.0f;
        int8_t *qb = q + 32 * stride * b;
        i16 sums = {0};
        for (int h = 0; h < 2; h++) {
            i16 iq = {0};
            if (db > 0.0f) {
                v16 r = v[h] / db;
                r = (r + magic) - magic;
                r = select16(r > top, top, select16(r < bottom, bottom, r));
                iq = __builtin_convertvector(r, i16);
            }
            const q16 packed = __builtin_convertvector(iq, q16);
            memcpy(qb + 16 * h, &packed, sizeof packed);
            sums += iq;
        }
        int sum = 0;
        for (int l = 0; l < 16; l++) sum += sums[l];
        d[stride * b] = db;
        s[stride * b] = db * (float)sum;
        c[stride * b] = -128 * sum;
    }
}

static inline int32_t load4(const int8_t *p) { /* 4 bytes of x, to broadcast */
    int32_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* ---- the integer sums of one block: MR rows of x (xb: the tile's block, row r at xb + 32 r) x one group's 16 rows ---- */

#if INT8_PATH == 2
/* acc + the products of w's bytes (unsigned) with the 4 bytes of x at xb + off broadcast to every
 * lane (signed), the broadcast read from memory by the instruction itself, at a constant offset
 * from one pointer: written out, the compiler held each broadcast, or each address, in a
 * register of its own and ran out of them */
typedef struct {
    int8_t b[32 * MR_MAX];
} xblock; /* a block of a tile's rows: what the instruction may read */

static inline __attribute__((always_inline)) __m512i dpbusd_x4(__m512i acc, __m512i w, const int8_t *xb, const int off) {
    __asm__("vpdpbusd %c3(%2)%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "r"(xb), "i"(off), "m"(*(const xblock *)xb));
    return acc;
}

static inline __attribute__((always_inline)) void block_sums(i16 *sum, const uint8_t *w, const int8_t *xb,
                                                             const int32_t *corr, const int MR, const int bits) {
    /* two dependency chains per row when few rows give the core too few independent sums */
    const int two = MR <= 4;
    __m512i a[MR_MAX][2];
    for (int r = 0; r < MR; r++) {
        /* 8-bit weights enter unsigned, w + 128: the sum is then w q + 128 sum q, and starts at
         * -128 sum q */
        a[r][0] = bits == 8 ? _mm512_set1_epi32(corr[r]) : _mm512_setzero_si512();
        a[r][1] = _mm512_setzero_si512();
    }
    if (bits == 4) {
        const __m512i m15 = _mm512_set1_epi8(15);
#pragma GCC unroll 4
        for (int k = 0; k < 4; k++) {
            const __m512i raw = _mm512_loadu_si512((const void *)(w + 64 * k));
            const __m512i lo = _mm512_and_si512(raw, m15), hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), m15);
#pragma GCC unroll 8
            for (int r = 0; r < MR; r++) {
                a[r][0] = dpbusd_x4(a[r][0], lo, xb, 32 * r + 4 * k);
                a[r][two] = dpbusd_x4(a[r][two], hi, xb, 32 * r + 16 + 4 * k);
            }
        }
    } else {
        const __m512i flip = _mm512_set1_epi8((char)0x80);
#pragma GCC unroll 8
        for (int k = 0; k < 8; k++) {
            const __m512i u = _mm512_xor_si512(_mm512_loadu_si512((const void *)(w + 64 * k)), flip);
#pragma GCC unroll 8
            for (int r = 0; r < MR; r++)
                a[r][k & two] = dpbusd_x4(a[r][k & two], u, xb, 32 * r + 4 * k);
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < MR; r++) sum[r] = (i16)_mm512_add_epi32(a[r][0], a[r][1]);
}
#elif INT8_PATH == 1
static inline __attribute__((always_inline)) void block_sums(i16 *sum, const uint8_t *w, const int8_t *xb,
                                                             const int32_t *corr, const int MR, const int bits) {
    (void)corr;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i a[MR_MAX][2]; /* rows 0-7 and 8-15 of the group */
    for (int r = 0; r < MR; r++) a[r][0] = a[r][1] = _mm256_setzero_si256();
    if (bits == 4) {
        const __m256i m15 = _mm256_set1_epi8(15);
#pragma GCC unroll 4
        for (int k = 0; k < 4; k++)
#pragma GCC unroll 2
            for (int h = 0; h < 2; h++) {
                const __m256i raw = _mm256_loadu_si256((const __m256i *)(w + 64 * k + 32 * h));
                const __m256i lo = _mm256_and_si256(raw, m15), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), m15);
#pragma GCC unroll 4
                for (int r = 0; r < MR; r++) {
                    /* 4 products of a level 0..15 and |q| <= 127 per 16-bit lane: no saturation */
                    const __m256i p = _mm256_add_epi16(
                        _mm256_maddubs_epi16(lo, _mm256_set1_epi32(load4(xb + 32 * r + 4 * k))),
                        _mm256_maddubs_epi16(hi, _mm256_set1_epi32(load4(xb + 32 * r + 16 + 4 * k))));
                    a[r][h] = _mm256_add_epi32(a[r][h], _mm256_madd_epi16(p, ones));
                }
            }
    } else {
#pragma GCC unroll 8
        for (int k = 0; k < 8; k++)
#pragma GCC unroll 2
            for (int h = 0; h < 2; h++) {
                const __m256i ws = _mm256_loadu_si256((const __m256i *)(w + 64 * k + 32 * h));
                const __m256i wa = _mm256_abs_epi8(ws); /* -128 -> 128 as an unsigned byte */
#pragma GCC unroll 4
                for (int r = 0; r < MR; r++) {
                    /* |w| times q with w's sign: pairs at most 2 * 128 * 127 in magnitude, no saturation */
                    const __m256i xs = _mm256_sign_epi8(_mm256_set1_epi32(load4(xb + 32 * r + 4 * k)), ws);
                    a[r][h] = _mm256_add_epi32(a[r][h], _mm256_madd_epi16(_mm256_maddubs_epi16(wa, xs), ones));
                }
            }
    }
    for (int r = 0; r < MR; r++) memcpy(&sum[r], a[r], sizeof sum[r]);
}
#else
static inline void block_sums(i16 *sum, const uint8_t *w, const int8_t *xb, const int32_t *corr, const int MR,
                              const int bits) {
    (void)corr;
    for (int r = 0; r < MR; r++)
        for (int l = 0; l < GROUP; l++) {
            int32_t s = 0;
            if (bits == 4) {
                for (int k = 0; k < 4; k++)
                    for (int t = 0; t < 4; t++) {
                        const uint8_t byte = w[64 * k + 4 * l + t];
                        s += (byte & 15) * xb[32 * r + 4 * k + t] + (byte >> 4) * xb[32 * r + 16 + 4 * k + t];
                    }
            } else {
                for (int k = 0; k < 8; k++)
                    for (int t = 0; t < 4; t++) s += ((const int8_t *)w)[64 * k + 4 * l + t] * xb[32 * r + 4 * k + t];
            }
            sum[r][l] = s;
        }
}
#endif

/* The quantised rows in tiles of MR_MAX rows, block by block, so that a tile's rows sit at fixed
 * offsets from one pointer: q [tiles][nb][MR_MAX][32], d / s / c [tiles][nb][MR_MAX] (the last
 * tile's missing rows unused) */
typedef struct {
    int8_t *q;
    float *d, *s;
    int32_t *c;
    int64_t nb;
} qrows;

/* the MR rows of tile t against one group of 16 weight rows: columns j..j + 16 of y (`valid` of
 * them real), rows MR_MAX t.. */
static inline __attribute__((always_inline)) void tile_int8(qrows x, int64_t t, const uint8_t *gq, const uint16_t *gd,
                                                            const uint16_t *gm, const float *bias, const float *res,
                                                            float *y, int64_t ldy, int64_t j, int valid, const int MR,
                                                            const int bits) {
    const int64_t nb = x.nb, wstride = bits == 4 ? 256 : 512;
    const int8_t *xq = x.q + t * nb * MR_MAX * 32;
    const float *xd = x.d + t * nb * MR_MAX, *xs = x.s + t * nb * MR_MAX;
    const int32_t *xc = x.c + t * nb * MR_MAX;
    v16 acc[MR_MAX];
#pragma GCC unroll 8
    for (int r = 0; r < MR; r++) acc[r] = (v16){0};
    for (int64_t b = 0; b < nb; b++) {
        i16 sum[MR_MAX];
        if (MR > 1 && t == 0) { /* the first tile streams the weights from memory; later ones find them in L2 */
            for (int64_t off = 0; off < wstride; off += 64) __builtin_prefetch(gq + wstride * b + INT8_AHEAD + off, 0, 3);
            __builtin_prefetch(gd + GROUP * b + INT8_AHEAD / 8, 0, 3);
            if (bits == 4) __builtin_prefetch(gm + GROUP * b + INT8_AHEAD / 8, 0, 3);
        }
        block_sums(sum, gq + wstride * b, xq + b * MR_MAX * 32, xc + b * MR_MAX, MR, bits);
        const v16 dw = load16h(gd + GROUP * b);
#pragma GCC unroll 8
        for (int r = 0; r < MR; r++)
            acc[r] = acc[r] + (dw * xd[b * MR_MAX + r]) * __builtin_convertvector(sum[r], v16);
    }
    if (bits == 4) {
        v16 ms[MR_MAX];
#pragma GCC unroll 8
        for (int r = 0; r < MR; r++) ms[r] = (v16){0};
        for (int64_t b = 0; b < nb; b++) {
            const v16 m = load16h(gm + GROUP * b);
#pragma GCC unroll 8
            for (int r = 0; r < MR; r++) ms[r] = ms[r] + m * xs[b * MR_MAX + r];
        }
#pragma GCC unroll 8
        for (int r = 0; r < MR; r++) acc[r] = acc[r] + ms[r];
    }
    /* unrolled as every loop over rows here: a loop the compiler kept would index acc, which then
     * lives in memory, stored to at every block of the loops above */
#pragma GCC unroll 8
    for (int r = 0; r < MR; r++) {
        float o[GROUP];
        memcpy(o, &acc[r], sizeof o);
        const int64_t row = t * MR_MAX + r;
        float *yr = y + row * ldy + j;
        const float *rr = res ? res + row * ldy + j : 0;
        for (int l = 0; l < valid; l++) {
            const float v = bias ? o[l] + bias[j + l] : o[l];
            yr[l] = rr ? rr[l] + v : v;
        }
    }
}

#define TILE_INT8(M) tile_int8(rows, t, gq, gd, gm, bias, res, y, out, j, valid, M, bits)

/* rows of x tile t against group g of the weight rows */
static inline __attribute__((always_inline)) void group_tile(qrows rows, int64_t g, int64_t t, int64_t n,
                                                             const uint8_t *qs, const uint16_t *wd, const uint16_t *wm,
                                                             const float *bias, const float *res, float *y,
                                                             int64_t out, const int bits) {
    const int64_t nb = rows.nb;
    const uint8_t *gq = qs + g * nb * (bits == 4 ? 256 : 512);
    const uint16_t *gd = wd + g * nb * GROUP, *gm = wm ? wm + g * nb * GROUP : 0;
    const int64_t j = g * GROUP;
    const int valid = out - j < GROUP ? (int)(out - j) : GROUP;
    switch (n - t * MR_MAX < MR_MAX ? n - t * MR_MAX : MR_MAX) {
#if MR_MAX >= 8
    case 8: TILE_INT8(8); break;
    case 7: TILE_INT8(7); break;
    case 6: TILE_INT8(6); break;
    case 5: TILE_INT8(5); break;
#endif
#if MR_MAX >= 4
    case 4: TILE_INT8(4); break;
#endif
    case 3: TILE_INT8(3); break;
    case 2: TILE_INT8(2); break;
    default: TILE_INT8(1); break;
    }
}

/* Groups [g0, g1) of the weight rows against every row of x, in panels of groups whose weights
 * fit the core's L2 cache: every tile of rows takes a panel's groups in turn, so the panel is read
 * from memory once, a tile's quantised rows stay in L1, and a tile writes runs of its rows' outputs
 * instead of a 16-column strip of every row (with many rows and a wide output, as a prompt's
 * gate/up product, the strips ran at half the speed of the others). Which tile and group come when
 * changes no output's arithmetic. */
static inline __attribute__((always_inline)) void groups_int8(qrows rows, int64_t g0, int64_t g1, int64_t n,
                                                              const uint8_t *qs, const uint16_t *wd, const uint16_t *wm,
                                                              const float *bias, const float *res, float *y,
                                                              int64_t out, const int bits) {
    const int64_t tiles = (n + MR_MAX - 1) / MR_MAX;
    const int64_t group_bytes = rows.nb * (bits == 4 ? 256 + 2 * 2 * GROUP : 512 + 2 * GROUP);
    const int64_t panel = PANEL_BYTES / group_bytes > 1 ? PANEL_BYTES / group_bytes : 1;
    for (int64_t p0 = g0; p0 < g1; p0 += panel) {
        const int64_t p1 = g1 - p0 < panel ? g1 : p0 + panel;
        for (int64_t t = 0; t < tiles; t++)
            for (int64_t g = p0; g < p1; g++) group_tile(rows, g, t, n, qs, wd, wm, bias, res, y, out, bits);
    }
}

/* Returns 0; 1 if `in` is not a multiple of 32, 2 if the quantised rows could not be allocated.
 * Groups of weight rows are split evenly between `threads` OpenMP threads. */
static inline __attribute__((always_inline)) int int8_matmul(const float *x, const uint8_t *qs, const uint16_t *wd,
                                                             const uint16_t *wm, const float *bias, const float *res,
                                                             float *y, int64_t n, int64_t in, int64_t out,
                                                             int threads, const int bits) {
    if (in % 32) return 1;
    if (n <= 0 || out <= 0) return 0;
    const int64_t nb = in / 32, groups = (out + GROUP - 1) / GROUP, tiles = (n + MR_MAX - 1) / MR_MAX;
    const int64_t slots = tiles * nb * MR_MAX;
    qrows rows = {malloc((size_t)(slots * 32)), malloc((size_t)slots * sizeof(float)),
                  malloc((size_t)slots * sizeof(float)), malloc((size_t)slots * sizeof(int32_t)), nb};
    if (!rows.q || !rows.d || !rows.s || !rows.c) {
        free(rows.q), free(rows.d), free(rows.s), free(rows.c);
        return 2;
    }
    _Pragma("omp parallel for schedule(static) num_threads(threads) if (n * in >= 65536)")
    for (int64_t r = 0; r < n; r++) {
        const int64_t at = (r / MR_MAX) * nb * MR_MAX + r % MR_MAX; /* block 0's slot of row r */
        quantize_row(x + r * in, rows.q + 32 * at, rows.d + at, rows.s + at, rows.c + at, nb, MR_MAX);
    }
    _Pragma("omp parallel num_threads(threads)")
    { /* each thread an even, contiguous share of the groups */
        const int64_t nt = omp_get_num_threads(), self = omp_get_thread_num();
        const int64_t g0 = groups * self / nt, g1 = groups * (self + 1) / nt;
        /* bits as a literal here: OpenMP's outlined body would otherwise receive it as a variable */
        if (bits == 4) groups_int8(rows, g0, g1, n, qs, wd, wm, bias, res, y, out, 4);
        else groups_int8(rows, g0, g1, n, qs, wd, wm, bias, res, y, out, 8);
    }
    free(rows.q), free(rows.d), free(rows.s), free(rows.c);
    return 0;
}

int bs_int8_matmul_q4(const float *x, const uint8_t *qs, const uint16_t *wd, const uint16_t *wm, const float *bias,
                      const float *res, float *y, int64_t n, int64_t in, int64_t out, int threads) {
    return int8_matmul(x, qs, wd, wm, bias, res, y, n, in, out, threads, 4);
}

/* wm: unused (null) */
int bs_int8_matmul_q8(const float *x, const uint8_t *qs, const uint16_t *wd, const uint16_t *wm, const float *bias,
                      const float *res, float *y, int64_t n, int64_t in, int64_t out, int threads) {
    (void)wm;
    return int8_matmul(x, qs, wd, 0, bias, res, y, n, in, out, threads, 8);
}
