/* Integer products for the int8 compute mode: y[n, out] = x[n, in] . w[out, in]^T (+ bias) (+ res),
 * with x quantised to 8 bits per row and block of 32 inputs and w held in 4 or 8 bits (GGUF's
 * Q4_1 and Q8_0 layouts, as cpu/packed_weights.py packs them), the block sums taken in integers.
 *
 * Why: the exact mode rebuilds every packed weight as an fp32 number and multiplies in fp32, so a
 * few rows are already bound by the fp32 units; integer dot products (AVX-512 VNNI: 64 byte
 * products per instruction) do the same work for a fraction of the instructions.
 *
 * The arithmetic, defined exactly (cpu/int8.py emulates it in PyTorch, bit for bit):
 * - quantisation of a row, per block b of 32 inputs (as llama.cpp's Q8_1): a = max |x_i|,
 *   d = a / 127 (fp32), q_i = rint(x_i / d) clamped to [-127, 127] (0 where d is 0), and, for 4-bit
 *   weights, s = d * (float)sum q_i;
 * - blocks go in pairs (b, b + 1; a missing last one counts as zeros). For a pair, 16 int32 lanes:
 *   lane l < 8 sums the 4 products w q of inputs 4l..4l+3 of block b, lane 8 + l those of block
 *   b + 1 (w: the 4-bit level 0..15, or the signed 8-bit value); each lane goes to fp32 (exact) and
 *   acc[l] = acc[l] + (dw * dx) * lane, dw and dx the lane's block scales (one rounding each);
 * - the dot is reduce16(acc) (vec.h's tree); 4-bit weights add, after it, reduce16 of 16 lanes
 *   that accumulate m_b * s_b over blocks b = 16 i + l in order (m: the block's minimum);
 * - then the bias (one addition) and the residual (res + that), as rows.c.
 * Every output depends on its own row of x and its own weight row only, in that fixed order, so a
 * row gets the same bits alone, beside others and on any thread split (batch invariance), and
 * the VNNI, AVX2 and plain C paths give the same bits (tested).
 *
 * Layouts: x fp32 [n, in], `in` a multiple of 32; 4-bit qs [out, in / 2] (byte i of a block: input
 * i in its low nibble, 16 + i in its high one), 8-bit qs [out, in] signed; wd [out, in / 32] the
 * blocks' d; wm [out, nbp] (4-bit only) the blocks' m, nbp = in / 32 rounded up to 16, zero padded.
 */
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

/* one row: q [steps * 64] (zero padded), d16 [steps * 16] (each block's d in its 8 lanes, 0 for a
 * missing block), s [nbp] (d * sum q, zero padded) */
static void quantize_row(const float *x, int8_t *q, float *d16, float *s, int64_t in, int64_t nbp) {
    const int64_t nb = in / 32;
    for (int64_t b = 0; b < nb; b++) {
        const float *xb = x + 32 * b;
        float a = 0.0f;
        for (int i = 0; i < 32; i++) {
            const float v = fabsf(xb[i]);
            a = v > a ? v : a;
        }
        const float d = a / 127.0f;
        int sum = 0;
        for (int i = 0; i < 32; i++) {
            int v = 0;
            if (d > 0.0f) {
                float t = rintf(xb[i] / d);
                t = t > 127.0f ? 127.0f : t < -127.0f ? -127.0f : t;
                v = (int)t;
            }
            q[32 * b + i] = (int8_t)v;
            sum += v;
        }
        for (int l = 0; l < 8; l++) d16[(b / 2) * 16 + (b % 2) * 8 + l] = d;
        s[b] = d * (float)sum;
    }
    if (nb % 2) {
        memset(q + 32 * nb, 0, 32);
        for (int l = 0; l < 8; l++) d16[(nb / 2) * 16 + 8 + l] = 0.0f;
    }
    for (int64_t b = nb; b < nbp; b++) s[b] = 0.0f;
}

/* ---- the 16 lanes of one pair of blocks: a weight pair decoded once (wload), dotted with rows (wdot) ---- */

#if INT8_PATH == 2
typedef struct {
    __m512i a;     /* unsigned operand: the 4-bit levels, or |w| */
    __mmask64 neg; /* 8-bit: where w < 0 (x is negated there) */
} wv;

static inline wv wload(const uint8_t *qs, int64_t p, const int bits, const int half) {
    wv w;
    if (bits == 4) {
        const uint8_t *src = qs + 32 * p;
        const __m256i raw = half ? _mm256_zextsi128_si256(_mm_loadu_si128((const __m128i *)src))
                                 : _mm256_loadu_si256((const __m256i *)src);
        const __m256i m = _mm256_set1_epi8(15);
        const __m256i lo = _mm256_and_si256(raw, m), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), m);
        const __m512i v = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1); /* lo0 lo1 hi0 hi1 */
        w.a = _mm512_shuffle_i64x2(v, v, _MM_SHUFFLE(3, 1, 2, 0));             /* lo0 hi0 lo1 hi1 */
        w.neg = 0;
    } else {
        const int8_t *src = (const int8_t *)qs + 64 * p;
        const __m512i raw = half ? _mm512_zextsi256_si512(_mm256_loadu_si256((const __m256i *)src))
                                 : _mm512_loadu_si512((const void *)src);
        w.a = _mm512_abs_epi8(raw); /* -128 -> 128 as an unsigned byte */
        w.neg = _mm512_movepi8_mask(raw);
    }
    return w;
}

static inline i16 wdot(const wv *w, const int8_t *x, const int bits) {
    __m512i xv = _mm512_loadu_si512((const void *)x);
    if (bits == 8) xv = _mm512_mask_sub_epi8(xv, w->neg, _mm512_setzero_si512(), xv); /* |x| <= 127 */
    return (i16)_mm512_dpbusd_epi32(_mm512_setzero_si512(), w->a, xv);
}
#elif INT8_PATH == 1
typedef struct {
    __m256i a[2], s[2]; /* per block: the unsigned operand; 8-bit: w itself (its signs) */
} wv;

static inline wv wload(const uint8_t *qs, int64_t p, const int bits, const int half) {
    wv w;
    for (int h = 0; h < 2; h++) {
        if (h && half) {
            w.a[h] = w.s[h] = _mm256_setzero_si256();
            continue;
        }
        if (bits == 4) {
            const __m128i raw = _mm_loadu_si128((const __m128i *)(qs + 32 * p + 16 * h)), m = _mm_set1_epi8(15);
            w.a[h] = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), m), _mm_and_si128(raw, m));
            w.s[h] = w.a[h];
        } else {
            const __m256i raw = _mm256_loadu_si256((const __m256i *)(qs + 64 * p + 32 * h));
            w.a[h] = _mm256_abs_epi8(raw);
            w.s[h] = raw;
        }
    }
    return w;
}

static inline i16 wdot(const wv *w, const int8_t *x, const int bits) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i lanes[2];
    for (int h = 0; h < 2; h++) {
        __m256i xv = _mm256_loadu_si256((const __m256i *)(x + 32 * h));
        if (bits == 8) xv = _mm256_sign_epi8(xv, w->s[h]);
        /* pairs of u8 * s8 products: at most 2 * 128 * 127 in magnitude, no saturation */
        lanes[h] = _mm256_madd_epi16(_mm256_maddubs_epi16(w->a[h], xv), ones);
    }
    i16 out;
    memcpy(&out, lanes, sizeof out);
    return out;
}
#else
typedef struct {
    int16_t v[64]; /* the pair's weights as integers, in input order */
} wv;

static inline wv wload(const uint8_t *qs, int64_t p, const int bits, const int half) {
    wv w;
    for (int h = 0; h < 2; h++)
        for (int i = 0; i < 32; i++) {
            int16_t v = 0;
            if (!(h && half)) {
                if (bits == 4) {
                    const uint8_t byte = qs[32 * p + 16 * h + (i & 15)];
                    v = i < 16 ? byte & 15 : byte >> 4;
                } else {
                    v = ((const int8_t *)qs)[64 * p + 32 * h + i];
                }
            }
            w.v[32 * h + i] = v;
        }
    return w;
}

static inline i16 wdot(const wv *w, const int8_t *x, const int bits) {
    (void)bits;
    i16 out;
    for (int l = 0; l < 16; l++) {
        int32_t s = 0;
        for (int t = 0; t < 4; t++) s += (int32_t)w->v[4 * l + t] * x[4 * l + t];
        out[l] = s;
    }
    return out;
}
#endif

/* rows held in registers per weight pass: MR * NC sums of 16 lanes */
#if INT8_PATH == 2
#define MR_MAX 4
#else
#define MR_MAX 2
#endif

/* the quantised rows: xq [n][steps * 64], xd [n][steps * 16], xs [n][nbp] */
typedef struct {
    const int8_t *q;
    const float *d, *s;
    int64_t qrow, drow, nbp;
} qrows;

/* MR rows x NC (1 or 2) consecutive weight rows -> y[r * ldy + c] */
static inline __attribute__((always_inline)) void tile_int8(qrows x, const uint8_t *qs, const float *wd,
                                                            const float *wm, int64_t qrow, int64_t nb,
                                                            const float *bias, const float *res, float *y,
                                                            int64_t ldy, const int MR, const int NC, const int bits) {
    const int64_t steps = (nb + 1) / 2;
    v16 acc[MR_MAX][2];
#pragma GCC unroll 4
    for (int r = 0; r < MR; r++) acc[r][0] = acc[r][1] = (v16){0};
    for (int64_t p = 0; p < steps; p++) {
        const int half = 2 * p + 1 >= nb;
        wv w[2];
        v16 sw[2];
#pragma GCC unroll 2
        for (int c = 0; c < NC; c++) {
            w[c] = wload(qs + c * qrow, p, bits, half);
            const float d0 = wd[c * nb + 2 * p], d1 = half ? 0.0f : wd[c * nb + 2 * p + 1];
            sw[c] = (v16){d0, d0, d0, d0, d0, d0, d0, d0, d1, d1, d1, d1, d1, d1, d1, d1};
        }
#pragma GCC unroll 4
        for (int r = 0; r < MR; r++) {
            const v16 sx = load16(x.d + r * x.drow + 16 * p);
            const int8_t *xr = x.q + r * x.qrow + 64 * p;
#pragma GCC unroll 2
            for (int c = 0; c < NC; c++) {
                const v16 lanes = __builtin_convertvector(wdot(&w[c], xr, bits), v16);
                acc[r][c] = acc[r][c] + (sw[c] * sx) * lanes;
            }
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < MR; r++)
#pragma GCC unroll 2
        for (int c = 0; c < NC; c++) {
            float t = reduce16(acc[r][c]);
            if (bits == 4) {
                v16 ms = {0};
                for (int64_t b = 0; b < x.nbp; b += 16)
                    ms = ms + load16(wm + c * x.nbp + b) * load16(x.s + r * x.nbp + b);
                t = t + reduce16(ms);
            }
            t = bias ? t + bias[c] : t;
            y[r * ldy + c] = res ? res[r * ldy + c] + t : t;
        }
}

#define TILE_INT8(M, NC) tile_int8(xr, qs + j * qrow, wd + j * nb, wm ? wm + j * nbp : 0, qrow, nb, \
                                   bias ? bias + j : 0, res ? res + r0 * out + j : 0, y + r0 * out + j, out, M, NC, bits)
#if MR_MAX == 4
#define WIDE_INT8(NC)                                                                                 \
    case 4: TILE_INT8(4, NC); break;                                                                   \
    case 3: TILE_INT8(3, NC); break;
#else
#define WIDE_INT8(NC)
#endif
#define ROWS_INT8(NC)                                                                                 \
    for (int64_t r0 = 0; r0 < n; r0 += MR_MAX) {                                                       \
        qrows xr = rows;                                                                               \
        xr.q += r0 * rows.qrow, xr.d += r0 * rows.drow, xr.s += r0 * rows.nbp;                         \
        switch (n - r0 < MR_MAX ? n - r0 : MR_MAX) {                                                   \
        WIDE_INT8(NC)                                                                                  \
        case 2: TILE_INT8(2, NC); break;                                                               \
        default: TILE_INT8(1, NC); break;                                                              \
        }                                                                                              \
    }

/* Returns 0; 1 if `in` is not a multiple of 32, 2 if the quantised rows could not be allocated.
 * Weight rows go in pairs, split evenly between `threads` OpenMP threads. */
static inline __attribute__((always_inline)) int int8_matmul(const float *x, const uint8_t *qs, const float *wd,
                                                             const float *wm, const float *bias, const float *res,
                                                             float *y, int64_t n, int64_t in, int64_t out,
                                                             int threads, const int bits) {
    if (in % 32) return 1;
    if (n <= 0 || out <= 0) return 0;
    const int64_t nb = in / 32, steps = (nb + 1) / 2, nbp = (nb + 15) / 16 * 16;
    const int64_t qrow = bits == 4 ? in / 2 : in;
    int8_t *xq = malloc((size_t)(n * steps * 64));
    float *xd = malloc((size_t)(n * steps * 16) * sizeof(float));
    float *xs = malloc((size_t)(n * nbp) * sizeof(float));
    if (!xq || !xd || !xs) {
        free(xq), free(xd), free(xs);
        return 2;
    }
    _Pragma("omp parallel for schedule(static) num_threads(threads) if (n * in >= 65536)")
    for (int64_t r = 0; r < n; r++)
        quantize_row(x + r * in, xq + r * steps * 64, xd + r * steps * 16, xs + r * nbp, in, nbp);
    const qrows rows = {xq, xd, xs, steps * 64, steps * 16, nbp};
    const int64_t pairs = out / 2;
    _Pragma("omp parallel for schedule(static) num_threads(threads)")
    for (int64_t g = 0; g < pairs + out % 2; g++) {
        const int64_t j = 2 * g;
        if (g < pairs) {
            ROWS_INT8(2)
        } else {
            ROWS_INT8(1)
        }
    }
    free(xq), free(xd), free(xs);
    return 0;
}

int bs_int8_matmul_q4(const float *x, const uint8_t *qs, const float *wd, const float *wm, const float *bias,
                      const float *res, float *y, int64_t n, int64_t in, int64_t out, int threads) {
    return int8_matmul(x, qs, wd, wm, bias, res, y, n, in, out, threads, 4);
}

/* wm: unused (null) */
int bs_int8_matmul_q8(const float *x, const uint8_t *qs, const float *wd, const float *wm, const float *bias,
                      const float *res, float *y, int64_t n, int64_t in, int64_t out, int threads) {
    (void)wm;
    return int8_matmul(x, qs, wd, 0, bias, res, y, n, in, out, threads, 8);
}
