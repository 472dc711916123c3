/* Vector types, loads, e^x and RMS statistics shared by the CPU kernels (rows.c, attention.c, norm.c, peak.c,
 * rope.c).
 * GCC vector extensions: the compiler picks the widest vector unit it has. Elements are fp32 (bf == 0) or bf16 (bf == 1);
 * bf is a literal at every call site, so each helper is compiled once per element type. */
#ifndef BLOCKSPEC_VEC_H
#define BLOCKSPEC_VEC_H
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__FMA__) || defined(__F16C__)
#include <immintrin.h>
#endif

typedef float v16 __attribute__((vector_size(64)));
typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));
typedef uint16_t h16 __attribute__((vector_size(32)));
typedef uint32_t u16 __attribute__((vector_size(64)));

static inline v16 load16(const float *p) {
    v16 v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* 16 fp16 numbers from p as fp32: exact (every fp16 number, subnormals included, is an fp32 one) */
static inline v16 load16h(const uint16_t *p) {
    v16 v;
#if defined(__AVX512F__)
    const __m512 f = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
    memcpy(&v, &f, sizeof v);
#elif defined(__F16C__)
    const __m256 lo = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)),
                 hi = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 8)));
    memcpy(&v, &lo, sizeof lo);
    memcpy((char *)&v + sizeof lo, &hi, sizeof hi);
#else
    for (int l = 0; l < 16; l++) {
        const uint32_t h = p[l], sign = (h & 0x8000u) << 16, e = (h >> 10) & 31, m = h & 1023;
        uint32_t u;
        if (e == 31) u = sign | 0x7f800000u | (m << 13); /* inf, nan */
        else if (e) u = sign | ((e + 112) << 23) | (m << 13);
        else if (!m) u = sign; /* zero */
        else { /* a subnormal: normalise the mantissa */
            int k = 0;
            uint32_t mm = m;
            while (!(mm & 1024)) mm <<= 1, k++;
            u = sign | ((uint32_t)(113 - k) << 23) | ((mm & 1023) << 13);
        }
        memcpy((char *)&v + 4 * l, &u, 4);
    }
#endif
    return v;
}

static inline const void *at(const void *p, int64_t i, const int bf) {
    return bf ? (const void *)((const uint16_t *)p + i) : (const void *)((const float *)p + i);
}

/* 16 elements from p + i as fp32 (a bf16 is the top half of an fp32: widening is exact) */
static inline v16 load(const void *p, int64_t i, const int bf) {
    if (!bf) return load16((const float *)p + i);
    h16 h;
    memcpy(&h, (const uint16_t *)p + i, sizeof h);
    u16 u = __builtin_convertvector(h, u16) << 16;
    v16 v;
    memcpy(&v, &u, sizeof v);
    return v;
}

static inline float scalar(const void *p, int64_t i, const int bf) {
    if (!bf) return ((const float *)p)[i];
    uint32_t u = (uint32_t)((const uint16_t *)p)[i] << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* 16 lanes -> 4: lane i sums the lanes congruent to i mod 4, (a[i] + a[i+8]) + (a[i+4] + a[i+12]) */
static inline v4 fold4(v16 a) {
    v8 b = __builtin_shufflevector(a, a, 0, 1, 2, 3, 4, 5, 6, 7) + __builtin_shufflevector(a, a, 8, 9, 10, 11, 12, 13, 14, 15);
    return __builtin_shufflevector(b, b, 0, 1, 2, 3) + __builtin_shufflevector(b, b, 4, 5, 6, 7);
}

/* the sum of 16 lanes by one fixed tree */
static inline float reduce16(v16 a) {
    v4 c = fold4(a);
    return (c[0] + c[2]) + (c[1] + c[3]);
}
/* {reduce16(a), reduce16(b), reduce16(c), reduce16(d)} in four vector additions: the same tree */
static inline v4 reduce16x4(v16 a, v16 b, v16 c, v16 d) {
    v4 fa = fold4(a), fb = fold4(b), fc = fold4(c), fd = fold4(d);
    v4 ab = __builtin_shufflevector(fa, fb, 0, 1, 4, 5) + __builtin_shufflevector(fa, fb, 2, 3, 6, 7);
    v4 cd = __builtin_shufflevector(fc, fd, 0, 1, 4, 5) + __builtin_shufflevector(fc, fd, 2, 3, 6, 7);
    return __builtin_shufflevector(ab, cd, 0, 2, 4, 6) + __builtin_shufflevector(ab, cd, 1, 3, 5, 7);
}
/* {reduce16(a[0]), ..., reduce16(a[15])}: the same tree for 16 vectors at once (pairs of vectors
 * folded side by side: 45 shuffles and additions, against 88 for four reduce16x4) */
static inline v16 reduce16x16(const v16 *a) {
    v16 t1[8], t2[4], t3[2];
#pragma GCC unroll 8
    for (int p = 0; p < 8; p++) /* lanes 0-7: a[2p][i] + a[2p][i + 8]; 8-15: the same of a[2p + 1] */
        t1[p] = __builtin_shufflevector(a[2 * p], a[2 * p + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
                __builtin_shufflevector(a[2 * p], a[2 * p + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
#pragma GCC unroll 4
    for (int p = 0; p < 4; p++) /* 4 lanes per vector: b[i] + b[i + 4] */
        t2[p] = __builtin_shufflevector(t1[2 * p], t1[2 * p + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
                __builtin_shufflevector(t1[2 * p], t1[2 * p + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
#pragma GCC unroll 2
    for (int p = 0; p < 2; p++) /* 2 lanes per vector: c[0] + c[2], c[1] + c[3] */
        t3[p] = __builtin_shufflevector(t2[2 * p], t2[2 * p + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
                __builtin_shufflevector(t2[2 * p], t2[2 * p + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
    return __builtin_shufflevector(t3[0], t3[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
           __builtin_shufflevector(t3[0], t3[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}
/* e^x per lane for x <= 0 (scores minus their maximum): x = n ln2 + t with |t| <= ln2 / 2, e^t by
 * Cephes' degree-6 polynomial (relative error ~1e-7), times 2^n through the exponent bits; below
 * -87 it is 0. Lane by lane, so a score's weight does not depend on its neighbours. libm's expf,
 * one call per score, took most of a batched verify's attention (attention.c); peak.c sums a
 * softmax's denominator with it. */
typedef int32_t i16 __attribute__((vector_size(64)));
static inline v16 select16(i16 mask, v16 a, v16 b) { /* a where mask, else b (C has no vector ?:) */
    i16 ia, ib;
    memcpy(&ia, &a, sizeof ia);
    memcpy(&ib, &b, sizeof ib);
    ia = (mask & ia) | (~mask & ib);
    v16 r;
    memcpy(&r, &ia, sizeof r);
    return r;
}

static inline v16 exp16(v16 x) {
    const v16 lo = (v16){0} - 87.0f;
    const i16 under = x < lo;
    x = select16(under, lo, x);
    const i16 n = __builtin_convertvector(x * 1.44269504088896341f - 0.5f, i16); /* round(x / ln2), x <= 0 */
    const v16 nf = __builtin_convertvector(n, v16);
    const v16 t = (x - nf * 0.693359375f) - nf * -2.12194440e-4f;
    v16 p = t * 1.9875691500e-4f + 1.3981999507e-3f;
    p = p * t + 8.3334519073e-3f;
    p = p * t + 4.1665795894e-2f;
    p = p * t + 1.6666665459e-1f;
    p = p * t + 5.0000001201e-1f;
    p = p * (t * t) + t + 1.0f;
    i16 bits;
    memcpy(&bits, &p, sizeof bits);
    bits += n << 23;
    v16 e;
    memcpy(&e, &bits, sizeof e);
    return select16(under, (v16){0}, e);
}

/* fp32 -> bf16 bits, rounding to nearest even (NaN kept a NaN) */
static inline uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* 1 / sqrt(mean of squares + eps) of one row */
static inline float inv_rms(const void *x, int64_t n, float eps, const int bf) {
    const int64_t nv = n - n % 16;
    v16 acc = {0};
    for (int64_t k = 0; k < nv; k += 16) {
        const v16 v = load(x, k, bf);
        acc += v * v;
    }
    float ss = reduce16(acc);
    for (int64_t k = nv; k < n; k++) {
        const float v = scalar(x, k, bf);
        ss += v * v;
    }
    return 1.0f / sqrtf(ss / (float)n + eps);
}

/* a + b * c, one rounding where the CPU has fused multiply-add (written out: the compiler must not
 * decide loop by loop, or rows would get different bits on different paths) */
static inline v16 fma16(v16 a, v16 b, v16 c) {
#if defined(__AVX512F__)
    return (v16)_mm512_fmadd_ps((__m512)b, (__m512)c, (__m512)a);
#elif defined(__FMA__)
    v8 lo = (v8)_mm256_fmadd_ps((__m256)__builtin_shufflevector(b, b, 0, 1, 2, 3, 4, 5, 6, 7),
                                (__m256)__builtin_shufflevector(c, c, 0, 1, 2, 3, 4, 5, 6, 7),
                                (__m256)__builtin_shufflevector(a, a, 0, 1, 2, 3, 4, 5, 6, 7));
    v8 hi = (v8)_mm256_fmadd_ps((__m256)__builtin_shufflevector(b, b, 8, 9, 10, 11, 12, 13, 14, 15),
                                (__m256)__builtin_shufflevector(c, c, 8, 9, 10, 11, 12, 13, 14, 15),
                                (__m256)__builtin_shufflevector(a, a, 8, 9, 10, 11, 12, 13, 14, 15));
    return __builtin_shufflevector(lo, hi, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
#else
    return a + b * c;
#endif
}
#endif
