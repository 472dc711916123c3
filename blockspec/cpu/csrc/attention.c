/* Attention of a few query tokens over a KV cache, one query at a time: the decoding and
 * verification passes of the native target on a CPU (targets/native/llama.py).
 *
 * Why: PyTorch's CPU attention splits its work by the number of queries, so a query verified in
 * a block of 4 got other bits than the same query decoded alone. In fp32 that moved logits by
 * ~1e-5; in bf16, where every layer rounds its output to 8 bits of mantissa, by up to 0.4, and
 * speculative output drifted from plain decoding within a few dozen tokens. Here every query row
 * is computed the same way whatever the block: scores over its visible keys in key order (16-wide
 * partial sums over the head dimension, one fixed reduction tree), a softmax with the maximum
 * subtracted (exp16, lane by lane), then the weighted sum of values in key order; over more than
 * KEY_CHUNK keys, that per chunk of keys (fixed boundaries from key 0), the chunks then joined in
 * order. Up to CH query rows of one KV head share each key and value load, the 16 sums of four
 * rows and four keys are reduced together (reduce16x16: reduce16's tree in every lane), and the
 * rows' sums of weights run side by side, but every score, sum and output element gets its own,
 * fixed arithmetic. So a
 * query gets the same bits alone or in any block, batch or thread split (batch invariance, as
 * rows.c for the projections). Products and sums are fused multiply-adds (fma16, as rows.c).
 * Each item prefetches its keys and values, and the chunks share a lone row's long context
 * between threads (what each gained: BENCHMARKS.md, "Kernel measurements").
 *
 * Layouts: q [b, kvh, g * n, d] (the g query heads of one KV head together, n tokens each);
 * k, v: a cache [b, kvh, cap, d] with batch and head strides in elements; visible [b, n]: the
 * number of keys each token sees, 0 for padding; out [b, kvh, g * n, d] fp32. q, k and v are fp32
 * (bs_attention) or bf16 (bs_attention_bf16).
 *
 * Keys are numbered LOGICALLY: a token's keys are 0 .. visible - 1 in the order its sums take
 * them. Without `tree` logical key j is cache slot j (the cache is indexed by position). A token
 * tree's nodes share positions, so their keys are not a prefix of the cache: tree [b, n, 1 + tw]
 * gives each token its base (logical keys below it are slots 0 .. base - 1, the committed
 * context) and then the slots of its logical keys base, base + 1, ... (its ancestors by depth,
 * then itself). Chunks, the order of every sum and the partial results all follow logical
 * indices, so a tree node gets the bits its token gets in plain decoding, where the same keys
 * sit in slots 0 .. visible - 1.
 */
#include <math.h>
#include <omp.h>
#include <stdlib.h>

#include "vec.h" /* exp16, fma16 */

/* Keys are taken in chunks of KEY_CHUNK (from key 0, whatever the batch), and work items are per
 * chunk (see `attention`), so a lone row's keys are shared between threads (one token over a long
 * context had only one item per KV head: 3 items for 2 threads on SmolLM2), and the query rows of
 * a verified block take turns on a chunk while it sits in the core's cache. A query whose keys lie
 * in one chunk is computed in one item as before; any other gets each chunk's maximum, sum of
 * exponentials and unnormalised output, which `combine` joins in chunk order. Either way the
 * arithmetic depends on the query's own keys only. */
#define CH 4
#define KEY_CHUNK 256 /* a multiple of 16 */
#define PREFETCH_KEYS 8 /* keys ahead */

/* the cache slot of logical key j of a token whose logical keys from `base` on are ext[0], ext[1], ... */
static inline int64_t key_slot(int64_t j, int64_t base, const int64_t *ext) { return j < base ? j : ext[j - base]; }

/* The unscaled scores of R (<= CH) query rows qf [R, D] (fp32) against C (<= 4) consecutive keys kj
 * [C, D]: lane 4 r + c is reduce16 of row r's and key c's 16-wide fused products in order, the
 * arithmetic of every score here; the 16 sums reduced together (reduce16x16). D a literal: the
 * keys' addresses are constant offsets of one pointer. */
static inline __attribute__((always_inline)) v16 scores4x4(const float *qf, const void *kj, const int R, const int C,
                                                           const int D, const int bf) {
    v16 a[16];
#pragma GCC unroll 16
    for (int n = 0; n < 16; n++) a[n] = (v16){0};
#pragma GCC unroll 8
    for (int i = 0; i < D; i += 16) {
        v16 qv[CH];
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) qv[r] = load16(qf + r * D + i);
#pragma GCC unroll 4
        for (int c = 0; c < C; c++) {
            const v16 kv = load(kj, c * D + i, bf);
#pragma GCC unroll 4
            for (int r = 0; r < R; r++) a[4 * r + c] = fma16(a[4 * r + c], qv[r], kv);
        }
    }
    return reduce16x16(a);
}

/* the same for any head dimension d (its first dv = d rounded down to 16 inputs; the caller adds
 * the tail): sr[r][c] the unscaled score of row r and key j + c */
static inline __attribute__((always_inline)) void scores_any(v4 *sr, const float *qf, const void *k, int64_t j,
                                                             const int C, const int R, int64_t d, int64_t dv,
                                                             const int bf) {
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
    for (int r = 0; r < R; r++) sr[r] = reduce16x4(acc[r][0], acc[r][1], acc[r][2], acc[r][3]);
}

/* Before the scores of keys j .. j + 3: the keys of a later group, and this group's values for
 * the pass after the scores. Each item streams its own strip of the cache, too short for the
 * hardware prefetcher to ramp up (BENCHMARKS.md, "Kernel measurements"). */
static inline __attribute__((always_inline)) void prefetch_group(const void *k, const void *v, int64_t j,
                                                                 const int64_t d, const int bf) {
    const int64_t row_bytes = d * (bf ? 2 : 4);
#pragma GCC unroll 16
    for (int64_t off = 0; off < 4 * row_bytes; off += 64) {
        __builtin_prefetch((const char *)at(k, (j + PREFETCH_KEYS) * d, bf) + off, 0, 3);
        __builtin_prefetch((const char *)at(v, j * d, bf) + off, 0, 3);
    }
}

/* The unscaled scores of R (<= CH) query rows qf [R, D] against the keys [j, end) of k (four at a
 * time, scores4x4's arithmetic), into scores + r * KEY_CHUNK + key, each group prefetched
 * (`prefetch_group`). A function of its own per (R, D, bf), so that its loop keeps its few
 * values in registers. */
static inline __attribute__((always_inline)) void shared_scores(const float *qf, const void *k, const void *v,
                                                                int64_t j, int64_t end, float *scores, const int R,
                                                                const int D, const int bf) {
    for (; j < end; j += 4) {
        const int C = end - j < 4 ? (int)(end - j) : 4;
        prefetch_group(k, v, j, D, bf);
        const void *kj = at(k, j * D, bf);
        const v16 s = C == 4 ? scores4x4(qf, kj, R, 4, D, bf) : scores4x4(qf, kj, R, C, D, bf);
        const v4 s0 = __builtin_shufflevector(s, s, 0, 1, 2, 3), s1 = __builtin_shufflevector(s, s, 4, 5, 6, 7),
                 s2 = __builtin_shufflevector(s, s, 8, 9, 10, 11), s3 = __builtin_shufflevector(s, s, 12, 13, 14, 15);
        if (C == 4) {
            memcpy(scores + j, &s0, sizeof s0);
            if (R > 1) memcpy(scores + KEY_CHUNK + j, &s1, sizeof s1);
            if (R > 2) memcpy(scores + 2 * KEY_CHUNK + j, &s2, sizeof s2);
            if (R > 3) memcpy(scores + 3 * KEY_CHUNK + j, &s3, sizeof s3);
        } else {
            memcpy(scores + j, &s0, (size_t)C * sizeof(float));
            if (R > 1) memcpy(scores + KEY_CHUNK + j, &s1, (size_t)C * sizeof(float));
            if (R > 2) memcpy(scores + 2 * KEY_CHUNK + j, &s2, (size_t)C * sizeof(float));
            if (R > 3) memcpy(scores + 3 * KEY_CHUNK + j, &s3, (size_t)C * sizeof(float));
        }
    }
}
#define SHARED_SCORES(R, D, BF)                                                                                  \
    static __attribute__((noinline)) void shared_scores_##R##_##D##_##BF(const float *qf, const void *k,         \
                                                                         const void *v, int64_t j, int64_t end, \
                                                                         float *scores) {                       \
        shared_scores(qf, k, v, j, end, scores, R, D, BF);                                                       \
    }
#define SHARED_SCORES_D(R) SHARED_SCORES(R, 64, 0) SHARED_SCORES(R, 64, 1) SHARED_SCORES(R, 128, 0) SHARED_SCORES(R, 128, 1)
SHARED_SCORES_D(1)
SHARED_SCORES_D(2)
SHARED_SCORES_D(3)
SHARED_SCORES_D(4)
typedef void (*shared_scores_fn)(const float *, const void *, const void *, int64_t, int64_t, float *);
#define SHARED_ROW(R) {shared_scores_##R##_64_0, shared_scores_##R##_64_1, shared_scores_##R##_128_0, shared_scores_##R##_128_1}
static const shared_scores_fn SHARED_SCORES_FNS[CH][4] = {SHARED_ROW(1), SHARED_ROW(2), SHARED_ROW(3), SHARED_ROW(4)};

/* R (<= CH) query rows of one KV head, rows idx[r] of q and out (stride d), over the logical keys
 * [j0, j0 + KEY_CHUNK) of k, v (row stride d) that each sees (keys lo[r] .. seen[r] - 1 in all,
 * some of them in this chunk; logical key j is slot key_slot(j, base[r], ext[r])). The keys below
 * every row's base are loaded once for the R rows; a row's keys from its base on (a tree node's
 * ancestors, a few) are loaded for it alone, after them. Each row's arithmetic is the same
 * whatever R and the other rows (it is the loop body of the r-th row): scores in logical key
 * order, each by the same products and reduction tree, the softmax with the chunk's maximum
 * subtracted, then the weighted sum of values in logical key order. A row whose keys all lie in
 * this chunk gets its output; any other writes (maximum, sum, unnormalised output) to part +
 * slot[r] * (d + 2). scores: CH * KEY_CHUNK floats. T: 0 where no row has a base (no tree: the
 * per-row key code is compiled out, so chains run the code they ran before trees). */
static inline __attribute__((always_inline)) void chunk_rows(const void *q, const void *k, const void *v,
                                                             float *out, float *part, const int64_t *idx,
                                                             const int64_t *slot, float *scores, const int64_t *seen,
                                                             const int64_t *lo, const int64_t *base,
                                                             const int64_t *const *ext, int64_t j0, int64_t d,
                                                             float scale, const int R, const int T, const int bf) {
    const int64_t dv = d & ~(int64_t)15, stride = KEY_CHUNK;
    int64_t most = 0, least = KEY_CHUNK, len[CH], beg[CH]; /* per row: its keys [beg, len) of the chunk */
    int whole[CH];
    float top[CH], total[CH], *dst[CH];
    float qf[R * d]; /* the rows in fp32 once (exact), not widened again for every key */
#pragma GCC unroll 4
    for (int r = 0; r < R; r++)
        for (int64_t i = 0; i < d; i++) qf[r * d + i] = scalar(q, idx[r] * d + i, bf);
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) {
        len[r] = seen[r] - j0 < KEY_CHUNK ? seen[r] - j0 : KEY_CHUNK;
        beg[r] = lo[r] > j0 ? lo[r] - j0 : 0;
        most = len[r] > most ? len[r] : most;
        least = beg[r] < least ? beg[r] : least;
        top[r] = -INFINITY;
        total[r] = 0.0f;
        whole[r] = lo[r] / KEY_CHUNK == (seen[r] - 1) / KEY_CHUNK;
        dst[r] = whole[r] ? out + idx[r] * d : part + slot[r] * (d + 2) + 2;
    }
    /* keys [least, shared) of the chunk are slot j0 + j for every row (all of them without a tree) */
    int64_t shared = most;
#pragma GCC unroll 4
    for (int r = 0; r < R && T; r++) {
        const int64_t b0 = base[r] - j0;
        if (b0 < shared) shared = b0 > least ? b0 : least;
    }
    k = at(k, j0 * d, bf);
    v = at(v, j0 * d, bf);
    /* unscaled scores, four keys at a time: each is reduced by reduce16's tree (reduce16x4); a row's
     * scores outside its window [beg, len) are written too and never read */
    if (d == 64 || d == 128) /* the head dimensions of the models served */
        SHARED_SCORES_FNS[R - 1][(d == 128) * 2 + bf](qf, k, v, least & ~(int64_t)3, shared, scores);
    else
        for (int64_t j = least & ~(int64_t)3; j < shared; j += 4) {
            const int C = shared - j < 4 ? (int)(shared - j) : 4;
            prefetch_group(k, v, j, d, bf);
            v4 sr[CH];
            scores_any(sr, qf, k, j, C, R, d, dv, bf);
#pragma GCC unroll 4
            for (int r = 0; r < R; r++) {
                v4 s4 = sr[r];
                if (dv < d) /* a head dimension that is not a multiple of 16: its tail, scalar */
                    for (int c = 0; c < C; c++)
                        for (int64_t i = dv; i < d; i++) s4[c] += qf[r * d + i] * scalar(k, (j + c) * d + i, bf);
                memcpy(scores + r * stride + j, &s4, (size_t)C * sizeof(float));
            }
        }
    /* each row's own keys from `shared` on: the same products, reduction and tail per key (loops
     * over rows unrolled, as every loop here, so the per-row arrays stay in registers) */
#pragma GCC unroll 4
    for (int r = 0; r < R && T; r++) {
        for (int64_t j = shared > beg[r] ? shared : beg[r]; j < len[r]; j++) {
            const void *kr = at(k, -j0 * d + key_slot(j0 + j, base[r], ext[r]) * d, bf);
            v16 acc = (v16){0};
            for (int64_t i = 0; i < dv; i += 16) acc = fma16(acc, load(qf, r * d + i, 0), load(kr, i, bf));
            float s = reduce16(acc);
            for (int64_t i = dv; i < d; i++) s += qf[r * d + i] * scalar(kr, i, bf);
            scores[r * stride + j] = s;
        }
    }
    /* each row's window of scores scaled (one rounding each) and its maximum (exact in any order) */
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) {
        float *sc = scores + r * stride;
        v16 m16 = (v16){0} - INFINITY;
        int64_t j = beg[r];
        for (; j + 16 <= len[r]; j += 16) {
            const v16 x = load16(sc + j) * scale;
            memcpy(sc + j, &x, sizeof x);
            m16 = select16(x > m16, x, m16);
        }
        float m = -INFINITY;
        for (; j < len[r]; j++) {
            sc[j] *= scale;
            m = sc[j] > m ? sc[j] : m;
        }
        for (int l = 0; l < 16; l++) m = m16[l] > m ? m16[l] : m;
        top[r] = m;
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) {
        for (int64_t j = beg[r]; j < len[r]; j += 16) {
            const int64_t left = len[r] - j < 16 ? len[r] - j : 16;
            if (left == 16) {
                const v16 e = exp16(load16(scores + r * stride + j) - top[r]);
                memcpy(scores + r * stride + j, &e, sizeof e);
                continue;
            }
            v16 x = (v16){0} - 100.0f; /* lanes past the row's keys: exp underflows to 0 */
            memcpy(&x, scores + r * stride + j, (size_t)left * sizeof(float));
            const v16 e = exp16(x - top[r]);
            memcpy(scores + r * stride + j, &e, (size_t)left * sizeof(float));
        }
    }
    /* each row's sum of its weights in key order: one chain of additions per row, the rows' chains
     * interleaved (alone, each addition waits for the one before) */
    int64_t cb = 0, ce = KEY_CHUNK; /* the keys every row sees */
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) {
        cb = beg[r] > cb ? beg[r] : cb;
        ce = len[r] < ce ? len[r] : ce;
    }
    {
        const int64_t mid0 = cb < ce ? cb : most, mid1 = cb < ce ? ce : most;
        for (int64_t j = least; j < mid0; j++)
#pragma GCC unroll 4
            for (int r = 0; r < R; r++)
                if (j >= beg[r] && j < len[r]) total[r] += scores[r * stride + j];
        for (int64_t j = mid0; j < mid1; j++)
#pragma GCC unroll 4
            for (int r = 0; r < R; r++) total[r] += scores[r * stride + j];
        for (int64_t j = mid1; j < most; j++)
#pragma GCC unroll 4
            for (int r = 0; r < R; r++)
                if (j >= beg[r] && j < len[r]) total[r] += scores[r * stride + j];
    }
    /* values, in slabs of four vectors of the head dimension held in registers for the R rows */
    for (int64_t i0 = 0; i0 < dv; i0 += 64) {
        const int nv = dv - i0 < 64 ? (int)((dv - i0) / 16) : 4;
        v16 o[CH][4];
#pragma GCC unroll 4
        for (int r = 0; r < R; r++)
#pragma GCC unroll 4
            for (int u = 0; u < 4; u++) o[r][u] = (v16){0};
        for (int64_t j = least; j < shared; j++) {
            v16 vv[4];
#pragma GCC unroll 4
            for (int u = 0; u < 4; u++) vv[u] = u < nv ? load(v, j * d + i0 + 16 * u, bf) : (v16){0};
#pragma GCC unroll 4
            for (int r = 0; r < R; r++) {
                if (j < beg[r] || j >= len[r]) continue;
                const v16 p = (v16){0} + scores[r * stride + j];
#pragma GCC unroll 4
                for (int u = 0; u < 4; u++) o[r][u] = fma16(o[r][u], p, vv[u]);
            }
        }
#pragma GCC unroll 4
        for (int r = 0; r < R && T; r++) /* then each row's own keys, still in logical order */
            for (int64_t j = shared > beg[r] ? shared : beg[r]; j < len[r]; j++) {
                const void *vr = at(v, -j0 * d + key_slot(j0 + j, base[r], ext[r]) * d, bf);
                const v16 p = (v16){0} + scores[r * stride + j];
#pragma GCC unroll 4
                for (int u = 0; u < 4; u++) o[r][u] = fma16(o[r][u], p, u < nv ? load(vr, i0 + 16 * u, bf) : (v16){0});
            }
#pragma GCC unroll 4
        for (int r = 0; r < R; r++)
            for (int u = 0; u < nv; u++) memcpy(dst[r] + i0 + 16 * u, &o[r][u], sizeof o[r][u]);
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) {
        for (int64_t i = dv; i < d; i++) {
            float t = 0.0f;
            for (int64_t j = beg[r]; j < len[r]; j++)
                t += scores[r * stride + j] * scalar(v, (T ? key_slot(j0 + j, base[r], ext[r]) - j0 : j) * d + i, bf);
            dst[r][i] = t;
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) {
        if (!whole[r]) { /* a chunk of a longer row: `combine` finishes it */
            dst[r][-2] = top[r];
            dst[r][-1] = total[r];
            continue;
        }
        const float inv = seen[r] > lo[r] ? 1.0f / total[r] : 0.0f;
        for (int64_t i = 0; i < d; i++) dst[r][i] *= inv;
    }
}

/* chunk_rows of a token tree's rows: instantiated here, outside `attention`, so the code that
 * chains and plain decoding run stays as it was (the same inlining and registers) */
#define TREE_ROWS_ARGS const void *q, const void *k, const void *v, float *out, float *part, const int64_t *idx, \
    const int64_t *slot, float *scores, const int64_t *seen, const int64_t *lo, const int64_t *base,         \
    const int64_t *const *ext, int64_t j0, int64_t d, float scale, int R
#define TREE_ROWS_BODY(BF)                                                                                   \
    switch (R) {                                                                                            \
    case 4: chunk_rows(q, k, v, out, part, idx, slot, scores, seen, lo, base, ext, j0, d, scale, 4, 1, BF); break; \
    case 3: chunk_rows(q, k, v, out, part, idx, slot, scores, seen, lo, base, ext, j0, d, scale, 3, 1, BF); break; \
    case 2: chunk_rows(q, k, v, out, part, idx, slot, scores, seen, lo, base, ext, j0, d, scale, 2, 1, BF); break; \
    default: chunk_rows(q, k, v, out, part, idx, slot, scores, seen, lo, base, ext, j0, d, scale, 1, 1, BF); break; \
    }
static __attribute__((noinline)) void tree_rows_f32(TREE_ROWS_ARGS) { TREE_ROWS_BODY(0) }
static __attribute__((noinline)) void tree_rows_bf16(TREE_ROWS_ARGS) { TREE_ROWS_BODY(1) }
static inline void tree_rows(TREE_ROWS_ARGS, const int bf) {
    (bf ? tree_rows_bf16 : tree_rows_f32)(q, k, v, out, part, idx, slot, scores, seen, lo, base, ext, j0, d, scale, R);
}

/* out[d] of a query from its `chunks` partial results p (each: maximum, sum, d unnormalised
 * outputs), joined in chunk order under the largest maximum */
static void combine(float *out, const float *p, int64_t chunks, int64_t d) {
    float top = -INFINITY, total = 0.0f;
    for (int64_t c = 0; c < chunks; c++) top = p[c * (d + 2)] > top ? p[c * (d + 2)] : top;
    for (int64_t i = 0; i < d; i++) out[i] = 0.0f;
    for (int64_t c = 0; c < chunks; c++) {
        const float *pc = p + c * (d + 2), w = expf(pc[0] - top);
        total += w * pc[1];
        for (int64_t i = 0; i < d; i++) out[i] += w * pc[2 + i];
    }
    const float inv = 1.0f / total;
    for (int64_t i = 0; i < d; i++) out[i] *= inv;
}

/* the logical keys a query token sees end at visible[i] (at most horizon, and with a tree at most
 * its base + tw) and start at start[i] (0 when start is null: the whole prefix; a sliding window's
 * first key otherwise) */
static inline int64_t keys_to(const int64_t *visible, int64_t i, int64_t horizon, const int64_t *tree, int64_t tw) {
    int64_t s = visible[i] < horizon ? visible[i] : horizon;
    if (tree && s > tree[i * (tw + 1)] + tw) s = tree[i * (tw + 1)] + tw;
    return s;
}
static inline int64_t keys_from(const int64_t *start, int64_t i, int64_t to) {
    const int64_t f = start ? start[i] : 0;
    return f < 0 ? 0 : f < to ? f : to;
}

/* whether every slot a tree token reads lies in the cache's first horizon slots */
static int tree_fits(const int64_t *visible, const int64_t *start, const int64_t *tree, int64_t tw, int64_t b,
                     int64_t n, int64_t horizon) {
    for (int64_t t = 0; t < b * n; t++) {
        const int64_t s = keys_to(visible, t, horizon, tree, tw), f = keys_from(start, t, s), *own = tree + t * (tw + 1);
        for (int64_t j = own[0] > f ? own[0] : f; j < s; j++)
            if (own[1 + j - own[0]] < 0 || own[1 + j - own[0]] >= horizon) return 0;
    }
    return 1;
}

/* Work items: (batch row, KV head, key chunk, up to CH of the row's query rows that see a key in
 * the chunk), in that order, so the items of one chunk follow each other (its keys and values are
 * read from memory once) and a thread's items are neighbours in the cache. Each thread takes a
 * contiguous run of items holding an equal share of the keys (a chunk's tail and a verified
 * block's short rows weigh less). A query token that sees no key (visible 0: padding of a ragged
 * verify, whose output nobody reads) gets zeros and costs nothing, so a row verifying one token
 * beside rows verifying four pays for one. Which rows share an item, and which thread runs it,
 * does not change any row's arithmetic (chunk_rows). */
static inline __attribute__((always_inline)) int attention(const void *q, const void *k, const void *v, float *out,
                                                           const int64_t *visible, const int64_t *start,
                                                           const int64_t *tree, int64_t tw, int64_t b, int64_t kvh,
                                                           int64_t g, int64_t n, int64_t d, int64_t sb, int64_t sh,
                                                           int64_t horizon, float scale, int threads, const int bf) {
    const int64_t m = g * n;
    if (tree && !tree_fits(visible, start, tree, tw, b, n, horizon)) return -2;
    /* per batch row: its live query rows (head-major, as laid out in q) and the keys each sees
     * (from, sees), its chunks, and where its longer queries' partial results go (per KV head,
     * row, chunk) */
    int64_t *live = malloc((size_t)(b * m + 1) * sizeof(int64_t));
    int64_t *sees = malloc((size_t)(b * m + 1) * sizeof(int64_t));
    int64_t *from = malloc((size_t)(b * m + 1) * sizeof(int64_t));
    int64_t *count = malloc((size_t)(b + 1) * sizeof(int64_t));
    int64_t *chunks = malloc((size_t)(b + 1) * sizeof(int64_t));
    int64_t *slot0 = malloc((size_t)(b + 1) * sizeof(int64_t)); /* first slot of the row's partials */
    int64_t *item = 0, *work = 0; /* per item: bi, hi, c, R, CH row indices; keys before it */
    float *part = 0;
    int failed = !live || !sees || !from || !count || !chunks || !slot0;
    int64_t items = 0, slots = 0;
    for (int64_t bi = 0; bi < b && !failed; bi++) {
        int64_t c = 0, most = 0;
        for (int64_t r = 0; r < m; r++) {
            const int64_t t = bi * n + r % n, s = keys_to(visible, t, horizon, tree, tw), f = keys_from(start, t, s);
            if (s <= f) continue;
            live[bi * m + c] = r, from[bi * m + c] = f, sees[bi * m + c++] = s;
            most = s > most ? s : most;
        }
        count[bi] = c;
        chunks[bi] = (most + KEY_CHUNK - 1) / KEY_CHUNK;
        slot0[bi] = slots;
        if (chunks[bi] > 1) slots += kvh * c * chunks[bi];
        items += kvh * chunks[bi] * ((c + CH - 1) / CH); /* at most: a chunk may hold fewer rows */
    }
    enum { FIELDS = 4 + CH };
    if (!failed) {
        item = malloc((size_t)(items * FIELDS + 1) * sizeof(int64_t));
        work = malloc((size_t)(items + 1) * sizeof(int64_t));
        part = slots ? malloc((size_t)(slots * (d + 2)) * sizeof(float)) : 0;
        failed = !item || !work || (slots && !part);
    }
    if (failed) {
        free(live), free(sees), free(from), free(count), free(chunks), free(slot0), free(item), free(work), free(part);
        return -1;
    }
    int64_t it = 0;
    work[0] = 0;
    for (int64_t bi = 0; bi < b; bi++)
        for (int64_t hi = 0; hi < kvh; hi++)
            for (int64_t ch = 0; ch < chunks[bi]; ch++) {
                const int64_t j0 = ch * KEY_CHUNK;
                int64_t *f = 0, keys = 0;
                for (int64_t li = 0; li < count[bi]; li++) {
                    const int64_t s = sees[bi * m + li], fr = from[bi * m + li];
                    if (s <= j0 || fr >= j0 + KEY_CHUNK) continue;
                    if (!f || f[3] == CH) {
                        if (f) work[it] = work[it - 1] + keys, keys = 0;
                        f = item + it++ * FIELDS;
                        f[0] = bi, f[1] = hi, f[2] = ch, f[3] = 0;
                    }
                    f[4 + f[3]++] = li;
                    keys += (s - j0 < KEY_CHUNK ? s - j0 : KEY_CHUNK) - (fr > j0 ? fr - j0 : 0) + 16; /* + a row's fixed cost */
                }
                if (f) work[it] = work[it - 1] + keys;
            }
    items = it;
    const int64_t total = work[items];
    _Pragma("omp parallel num_threads(threads) reduction(|| : failed)")
    {
        const int64_t nt = omp_get_num_threads(), self = omp_get_thread_num();
        float *scores = malloc((size_t)(CH * KEY_CHUNK) * sizeof(float));
        if (!scores) failed = 1;
        _Pragma("omp for schedule(static) nowait")
        for (int64_t bh = 0; bh < b * kvh; bh++) { /* zeros for the query rows that see nothing */
            const int64_t bi = bh / kvh;
            if (count[bi] == m) continue;
            for (int64_t r = 0; r < m; r++) {
                const int64_t s = keys_to(visible, bi * n + r % n, horizon, tree, tw);
                if (s <= keys_from(start, bi * n + r % n, s)) memset(out + (bh * m + r) * d, 0, (size_t)d * sizeof(float));
            }
        }
        for (int64_t i = 0; i < items && scores; i++) {
            /* the thread whose share of the keys holds this item's middle */
            if ((work[i] + work[i + 1]) / 2 * nt / (total > 0 ? total : 1) != self) continue;
            const int64_t *f = item + i * FIELDS, bi = f[0], hi = f[1], ch = f[2], j0 = ch * KEY_CHUNK;
            const int R = (int)f[3];
            const int64_t qr = (bi * kvh + hi) * m, kv = bi * sb + hi * sh;
            int64_t idx[CH], seen[CH], lo[CH], slot[CH], base[CH];
            const int64_t *ext[CH];
            for (int r = 0; r < R; r++) {
                const int64_t li = f[4 + r];
                idx[r] = live[bi * m + li], seen[r] = sees[bi * m + li], lo[r] = from[bi * m + li];
                slot[r] = slot0[bi] + (hi * count[bi] + li) * chunks[bi] + ch;
                const int64_t *own = tree ? tree + (bi * n + idx[r] % n) * (tw + 1) : 0;
                base[r] = own ? own[0] : INT64_MAX, ext[r] = own ? own + 1 : 0;
            }
            const void *qp = at(q, qr * d, bf), *kp = at(k, kv, bf), *vp = at(v, kv, bf);
            float *op = out + qr * d;
            if (tree) tree_rows(qp, kp, vp, op, part, idx, slot, scores, seen, lo, base, ext, j0, d, scale, R, bf);
            else switch (R) {
            case 4: chunk_rows(qp, kp, vp, op, part, idx, slot, scores, seen, lo, base, ext, j0, d, scale, 4, 0, bf); break;
            case 3: chunk_rows(qp, kp, vp, op, part, idx, slot, scores, seen, lo, base, ext, j0, d, scale, 3, 0, bf); break;
            case 2: chunk_rows(qp, kp, vp, op, part, idx, slot, scores, seen, lo, base, ext, j0, d, scale, 2, 0, bf); break;
            default: chunk_rows(qp, kp, vp, op, part, idx, slot, scores, seen, lo, base, ext, j0, d, scale, 1, 0, bf); break;
            }
        }
        if (slots) { /* the queries longer than a chunk, once every chunk is done */
            _Pragma("omp barrier")
            _Pragma("omp for schedule(static)")
            for (int64_t bh = 0; bh < b * kvh; bh++) {
                const int64_t bi = bh / kvh, hi = bh % kvh;
                if (chunks[bi] < 2) continue;
                for (int64_t li = 0; li < count[bi]; li++) {
                    const int64_t c0 = from[bi * m + li] / KEY_CHUNK, c1 = (sees[bi * m + li] - 1) / KEY_CHUNK;
                    if (c0 == c1) continue;
                    combine(out + ((bi * kvh + hi) * m + live[bi * m + li]) * d,
                            part + (slot0[bi] + (hi * count[bi] + li) * chunks[bi] + c0) * (d + 2), c1 - c0 + 1, d);
                }
            }
        }
        free(scores);
    }
    free(live), free(sees), free(from), free(count), free(chunks), free(slot0), free(item), free(work), free(part);
    return failed ? -1 : 0;
}

/* tree: null, or [b, n, 1 + tw] (see the top of this file). Returns 0, -1 when scratch memory could
 * not be allocated, -2 when a tree slot lies outside [0, horizon) (nothing written). */
int bs_attention(const float *q, const float *k, const float *v, float *out, const int64_t *visible,
                 const int64_t *start, const int64_t *tree, int64_t b, int64_t kvh, int64_t g, int64_t n, int64_t d,
                 int64_t sb, int64_t sh, int64_t horizon, int64_t tw, float scale, int threads) {
    return attention(q, k, v, out, visible, start, tree, tw, b, kvh, g, n, d, sb, sh, horizon, scale, threads, 0);
}

int bs_attention_bf16(const uint16_t *q, const uint16_t *k, const uint16_t *v, float *out, const int64_t *visible,
                      const int64_t *start, const int64_t *tree, int64_t b, int64_t kvh, int64_t g, int64_t n,
                      int64_t d, int64_t sb, int64_t sh, int64_t horizon, int64_t tw, float scale, int threads) {
    return attention(q, k, v, out, visible, start, tree, tw, b, kvh, g, n, d, sb, sh, horizon, scale, threads, 1);
}
