/* Attention of a few query tokens over a KV cache, one query at a time: the decoding and
 * verification passes of the native target on a CPU (models/native/llama.py).
 *
 * Why: PyTorch's CPU attention splits its work by the number of queries, so a query verified in
 * a block of 4 got other bits than the same query decoded alone. In fp32 that moved logits by
 * ~1e-5; in bf16, where every layer rounds its output to 8 bits of mantissa, by up to 0.4, and
 * speculative output drifted from plain decoding within a few dozen tokens. Here every query row
 * is computed the same way whatever the block: scores over its visible keys in key order (16-wide
 * partial sums over the head dimension, one fixed reduction tree), a softmax with the maximum
 * subtracted (exp16, lane by lane), then the weighted sum of values in key order. Up to CH
 * query rows of one KV head share each key and value load, and four keys' sums are reduced
 * together, but every score and output element gets its own, fixed arithmetic. So a query gets
 * the same bits alone or in any block, batch or thread split (batch invariance, as rows.c for
 * the projections). Products and sums are fused multiply-adds (fma16, as rows.c). Speed: level
 * with PyTorch's for blocks, 2x faster for one token per row (BENCHMARKS.md, session 18); since
 * session 26 each item prefetches its keys and values, which took SmolLM2's 30 layers at 250
 * tokens of context from 7.1 to 4.6 ms for 16 rows x 1 token, 11.9 to 6.0 for 16 x 2 and 1.04
 * to 0.85 for a 6-token verify (2 cores).
 *
 * Layouts: q [b, kvh, g * n, d] (the g query heads of one KV head together, n tokens each);
 * k, v: a cache [b, kvh, cap, d] with batch and head strides in elements; visible [b, n]: the
 * number of keys (a prefix) each token sees, 0 for padding; out [b, kvh, g * n, d] fp32. q, k and
 * v are fp32 (bs_attention) or bf16 (bs_attention_bf16).
 */
#include <math.h>
#include <stdlib.h>

#include "vec.h" /* exp16, fma16 */

/* R (<= CH) query rows of one KV head: rows idx[r] of q and out (stride d) over keys/values k, v (row
 * stride d), row r seeing seen[r] of them. The keys and values are loaded once for the R rows; each
 * row's arithmetic is the same whatever R and the other rows (it is the loop body of the r-th row). */
#define CH 4
#define PREFETCH_KEYS 8 /* keys ahead */
static inline __attribute__((always_inline)) void rows_of(const void *q, const void *k, const void *v, float *out,
                                                          const int64_t *idx, float *scores, const int64_t *seen,
                                                          int64_t stride, int64_t d, float scale, const int R,
                                                          const int bf) {
    const int64_t dv = d & ~(int64_t)15;
    int64_t most = 0;
    float top[CH], total[CH];
    float qf[R * d]; /* the rows in fp32 once (exact), not widened again for every key */
#pragma GCC unroll 4
    for (int r = 0; r < R; r++)
        for (int64_t i = 0; i < d; i++) qf[r * d + i] = scalar(q, idx[r] * d + i, bf);
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) {
        most = seen[r] > most ? seen[r] : most;
        top[r] = -INFINITY;
        total[r] = 0.0f;
    }
    /* scores, four keys at a time: each is reduced by reduce16's tree (reduce16x4) */
    const int64_t row_bytes = d * (bf ? 2 : 4);
    for (int64_t j = 0; j < most; j += 4) {
        const int C = most - j < 4 ? (int)(most - j) : 4;
        /* the keys of a later group, and this group's values for the pass after this one: each
         * item streams its own strip of the cache, too short for the hardware prefetcher to
         * ramp up (16 rows at 250 tokens of context ran at ~13 GB/s without these) */
        for (int64_t off = 0; off < 4 * row_bytes; off += 64) {
            __builtin_prefetch((const char *)at(k, (j + PREFETCH_KEYS) * d, bf) + off, 0, 3);
            __builtin_prefetch((const char *)at(v, j * d, bf) + off, 0, 3);
        }
        v16 acc[CH][4];
#pragma GCC unroll 4
        for (int r = 0; r < R; r++)
#pragma GCC unroll 4
            for (int c = 0; c < 4; c++) acc[r][c] = (v16){0};
        for (int64_t i = 0; i < dv; i += 16) {
            v16 qv[CH];
#pragma GCC unroll 4
            for (int r = 0; r < R; r++) qv[r] = load(qf, r * d + i, 0);
#pragma GCC unroll 4
            for (int c = 0; c < 4; c++) {
                if (c >= C) break;
                const v16 kv = load(k, (j + c) * d + i, bf);
#pragma GCC unroll 4
                for (int r = 0; r < R; r++) acc[r][c] = fma16(acc[r][c], qv[r], kv);
            }
        }
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            v4 s4 = reduce16x4(acc[r][0], acc[r][1], acc[r][2], acc[r][3]);
            const int live = seen[r] - j < C ? (int)(seen[r] - j) : C;
            if (live <= 0) continue;
            if (dv < d) /* a head dimension that is not a multiple of 16: its tail, scalar */
                for (int c = 0; c < live; c++)
                    for (int64_t i = dv; i < d; i++) s4[c] += qf[r * d + i] * scalar(k, (j + c) * d + i, bf);
            s4 *= scale;
            if (live == 4) {
                memcpy(scores + r * stride + j, &s4, sizeof s4);
                const float m01 = s4[0] > s4[1] ? s4[0] : s4[1], m23 = s4[2] > s4[3] ? s4[2] : s4[3];
                const float m = m01 > m23 ? m01 : m23;
                top[r] = m > top[r] ? m : top[r];
            } else {
                for (int c = 0; c < live; c++) {
                    scores[r * stride + j + c] = s4[c];
                    top[r] = s4[c] > top[r] ? s4[c] : top[r];
                }
            }
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) {
        for (int64_t j = 0; j < seen[r]; j += 16) {
            const int64_t left = seen[r] - j < 16 ? seen[r] - j : 16;
            v16 x = (v16){0} - 100.0f; /* lanes past the row's keys: exp underflows to 0 */
            memcpy(&x, scores + r * stride + j, (size_t)left * sizeof(float));
            const v16 e = exp16(x - top[r]);
            memcpy(scores + r * stride + j, &e, (size_t)left * sizeof(float));
            for (int64_t c = 0; c < left; c++) total[r] += e[c];
        }
    }
    /* values, in slabs of four vectors of the head dimension held in registers for the R rows */
    for (int64_t i0 = 0; i0 < dv; i0 += 64) {
        const int nv = dv - i0 < 64 ? (int)((dv - i0) / 16) : 4;
        v16 o[CH][4];
#pragma GCC unroll 4
        for (int r = 0; r < R; r++)
#pragma GCC unroll 4
            for (int u = 0; u < 4; u++) o[r][u] = (v16){0};
        for (int64_t j = 0; j < most; j++) {
            v16 vv[4];
#pragma GCC unroll 4
            for (int u = 0; u < 4; u++) vv[u] = u < nv ? load(v, j * d + i0 + 16 * u, bf) : (v16){0};
#pragma GCC unroll 4
            for (int r = 0; r < R; r++) {
                if (j >= seen[r]) continue;
                const v16 p = (v16){0} + scores[r * stride + j];
#pragma GCC unroll 4
                for (int u = 0; u < 4; u++) o[r][u] = fma16(o[r][u], p, vv[u]);
            }
        }
#pragma GCC unroll 4
        for (int r = 0; r < R; r++)
            for (int u = 0; u < nv; u++) memcpy(out + idx[r] * d + i0 + 16 * u, &o[r][u], sizeof o[r][u]);
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) {
        for (int64_t i = dv; i < d; i++) {
            float t = 0.0f;
            for (int64_t j = 0; j < seen[r]; j++) t += scores[r * stride + j] * scalar(v, j * d + i, bf);
            out[idx[r] * d + i] = t;
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) {
        const float inv = seen[r] > 0 ? 1.0f / total[r] : 0.0f;
        for (int64_t i = 0; i < d; i++) out[idx[r] * d + i] *= inv;
    }
}

/* Work items: (batch row, KV head, up to CH of the row's query rows that see a key). A query
 * token that sees no key (visible 0: padding of a ragged verify, whose output nobody reads) gets
 * zeros and costs nothing, so a row verifying one token beside rows verifying four pays for one.
 * Which rows share an item does not change any row's arithmetic (rows_of). */
static inline __attribute__((always_inline)) int attention(const void *q, const void *k, const void *v, float *out,
                                                           const int64_t *visible, int64_t b, int64_t kvh,
                                                           int64_t g, int64_t n, int64_t d, int64_t sb, int64_t sh,
                                                           int64_t horizon, float scale, int threads, const int bf) {
    const int64_t m = g * n, stride = horizon > 0 ? horizon : 1;
    /* per batch row: its live query rows (head-major, as laid out in q), then the items over them */
    int64_t *live = malloc((size_t)(b * m + 1) * sizeof(int64_t));
    int64_t *count = malloc((size_t)(b + 1) * sizeof(int64_t));
    int64_t *item_row = malloc((size_t)(b * ((m + CH - 1) / CH) + 1) * sizeof(int64_t));
    int64_t *item_at = malloc((size_t)(b * ((m + CH - 1) / CH) + 1) * sizeof(int64_t));
    if (!live || !count || !item_row || !item_at) {
        free(live), free(count), free(item_row), free(item_at);
        return -1;
    }
    int64_t per_head = 0; /* items of one KV head */
    for (int64_t bi = 0; bi < b; bi++) {
        int64_t c = 0;
        for (int64_t r = 0; r < m; r++)
            if (visible[bi * n + r % n] > 0) live[bi * m + c++] = r;
        count[bi] = c;
        for (int64_t r0 = 0; r0 < c; r0 += CH) item_row[per_head] = bi, item_at[per_head++] = r0;
    }
    const int64_t items = per_head * kvh;
    int failed = 0;
    _Pragma("omp parallel num_threads(threads) reduction(|| : failed)")
    {
        float *scores = malloc((size_t)(CH * stride) * sizeof(float));
        if (!scores) failed = 1;
        else {
            _Pragma("omp for schedule(static) nowait")
            for (int64_t bh = 0; bh < b * kvh; bh++) { /* zeros for the query rows that see nothing */
                const int64_t bi = bh / kvh;
                if (count[bi] == m) continue;
                for (int64_t r = 0; r < m; r++)
                    if (visible[bi * n + r % n] <= 0) memset(out + (bh * m + r) * d, 0, (size_t)d * sizeof(float));
            }
            _Pragma("omp for schedule(static)")
            for (int64_t it = 0; it < items; it++) {
                const int64_t j = it / kvh, hi = it % kvh, bi = item_row[j], r0 = item_at[j];
                const int R = count[bi] - r0 < CH ? (int)(count[bi] - r0) : CH;
                const int64_t *idx = live + bi * m + r0;
                int64_t seen[CH];
                for (int r = 0; r < R; r++) {
                    const int64_t s = visible[bi * n + idx[r] % n];
                    seen[r] = s < horizon ? s : horizon;
                }
                const int64_t qr = (bi * kvh + hi) * m, kv = bi * sb + hi * sh;
                const void *qp = at(q, qr * d, bf), *kp = at(k, kv, bf), *vp = at(v, kv, bf);
                float *op = out + qr * d;
                switch (R) {
                case 4: rows_of(qp, kp, vp, op, idx, scores, seen, stride, d, scale, 4, bf); break;
                case 3: rows_of(qp, kp, vp, op, idx, scores, seen, stride, d, scale, 3, bf); break;
                case 2: rows_of(qp, kp, vp, op, idx, scores, seen, stride, d, scale, 2, bf); break;
                default: rows_of(qp, kp, vp, op, idx, scores, seen, stride, d, scale, 1, bf); break;
                }
            }
            free(scores);
        }
    }
    free(live), free(count), free(item_row), free(item_at);
    return failed ? -1 : 0;
}

/* Returns 0, or -1 when scratch memory could not be allocated. */
int bs_attention(const float *q, const float *k, const float *v, float *out, const int64_t *visible, int64_t b,
                 int64_t kvh, int64_t g, int64_t n, int64_t d, int64_t sb, int64_t sh, int64_t horizon, float scale,
                 int threads) {
    return attention(q, k, v, out, visible, b, kvh, g, n, d, sb, sh, horizon, scale, threads, 0);
}

int bs_attention_bf16(const uint16_t *q, const uint16_t *k, const uint16_t *v, float *out, const int64_t *visible,
                      int64_t b, int64_t kvh, int64_t g, int64_t n, int64_t d, int64_t sb, int64_t sh, int64_t horizon,
                      float scale, int threads) {
    return attention(q, k, v, out, visible, b, kvh, g, n, d, sb, sh, horizon, scale, threads, 1);
}
