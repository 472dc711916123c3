/* The nucleus (top-p) of softmax(x * inv_t) for rows of fp32 logits, written into zeroed
 * probability rows: a sampled step's shaping of the target's and the drafter's distributions
 * (dflash/sampling.py, probabilities), which chat clients ask for with nearly every request.
 *
 * Why: PyTorch took a scaled copy, a softmax, a top-k over the vocabulary and a renormalisation
 * over it again, per verified and drafted position (BENCHMARKS.md, "Sampled decoding"). Here it
 * is two passes over each row: the maximum, then the sum of e^((x - max) inv_t) (exp16 of vec.h)
 * that also gathers the candidates, the tokens within NUCLEUS_SPAN of the maximum (weight at
 * least e^-NUCLEUS_SPAN of the peak's). Where their mass reaches top_p, the nucleus is among them
 * (every token outside is lighter than every one inside, and the nucleus is the lightest-last
 * prefix that reaches top_p), so only the candidates are ordered, and of them only the heaviest
 * until their mass reaches top_p (`nucleus_cut`). A row whose candidates fall short
 * (a flat distribution) or overflow NUCLEUS_CAP is left untouched and reported, for the caller's
 * general path.
 *
 * Ties sort by index (the lower first). The kept prefix: a token is kept while the mass before it
 * is below top_p (at least the top token), as the full sort's filter keeps it.
 *
 * bs_nucleus_pairs writes each row's nucleus as (id, probability) pairs instead of a vocabulary-wide
 * row: a verified position's nucleus is a handful of tokens, and what reads it (the keyed race, the
 * standard rule's test and residual draw) then works over those alone.
 *
 * bs_nucleus_draws is a sampled draft step's proposals whole: the pairs of its draft vocabulary's
 * logits over the target's ids, each position's keyed draw among them and its peak, one call where
 * the pairs, the id mapping, the keys and the race were a dozen small operations on the host.
 *
 * bs_nucleus_ids takes a row's logits of some tokens alone (a drafter's draft vocabulary; every
 * other logit -inf) and spreads them over the vocabulary in a scratch row of its own: the same
 * bits as bs_nucleus of the spread row, without the caller's vocabulary-wide tensors.
 */
#include <math.h>
#include <stdlib.h>

#include "keyed.h"
#include "vec.h"

#define NUCLEUS_CAP 1024
#define NUCLEUS_SPAN 9.0f

typedef struct {
    float w; /* e^((x - max) inv_t) */
    int64_t i;
} cand;

/* any lane of a comparison's mask set, by halving ORs (a lane-by-lane loop cost more than the
 * exponentials around it) */
static inline int any16(i16 m) {
    typedef int32_t i8v __attribute__((vector_size(32)));
    typedef int32_t i4v __attribute__((vector_size(16)));
    const i8v a = __builtin_shufflevector(m, m, 0, 1, 2, 3, 4, 5, 6, 7) | __builtin_shufflevector(m, m, 8, 9, 10, 11, 12, 13, 14, 15);
    const i4v b = __builtin_shufflevector(a, a, 0, 1, 2, 3) | __builtin_shufflevector(a, a, 4, 5, 6, 7);
    return (b[0] | b[1] | b[2] | b[3]) != 0;
}

/* the order a nucleus is cut in: heavier first, the lower id first among equal weights (ids are
 * distinct, so the order is total) */
static inline int heavier(cand a, cand b) { return a.w > b.w || (a.w == b.w && a.i < b.i); }

/* restores the heap order (heaviest at the root) below slot j of heap[0..n) */
static void sift_down(cand *heap, int64_t n, int64_t j) {
    const cand item = heap[j];
    for (;;) {
        int64_t c = 2 * j + 1;
        if (c >= n) break;
        if (c + 1 < n && heavier(heap[c + 1], heap[c])) c++;
        if (!heavier(heap[c], item)) break;
        heap[j] = heap[c];
        j = c;
    }
    heap[j] = item;
}

/* The nucleus of a row from its candidates buf[0..count) (ascending ids) and the sum of all its
 * weights: how many it keeps (buf[0..kept) heaviest first, *inv the renormalisation), or 0 (the
 * caller's path). */
static int64_t nucleus_cut(cand *buf, int64_t count, float total, float top_p, float *inv) {
    if (count > NUCLEUS_CAP) return 0;
    double near_mass = 0.0;
    for (int64_t j = 0; j < count; j++) near_mass += buf[j].w;
    const double want = (double)top_p * total;
    if (near_mass < want) return 0; /* the nucleus reaches past the candidates */
    /* The heaviest candidates one at a time off a heap, until their mass reaches top_p: the
     * prefix a full sort would give, in its order, for the few tokens a nucleus keeps (sorting
     * every candidate, a median of ~100 in a drafter's rows and up to the cap, took about a sixth
     * of a draft step's call). Each taken one goes to the end of buf, so the taken ones end up
     * there in reverse order. */
    for (int64_t j = count / 2 - 1; j >= 0; j--) sift_down(buf, count, j);
    double before = 0.0;
    int64_t kept = 0;
    while (kept < count && (kept == 0 || before < want)) {
        const cand top = buf[0];
        const int64_t last = count - 1 - kept;
        buf[0] = buf[last];
        buf[last] = top;
        sift_down(buf, last, 0);
        before += top.w;
        kept++;
    }
    /* the taken ones to buf[0..kept), heaviest first: a reversal of their span and its mirror */
    const int64_t swaps = kept < count / 2 ? kept : count / 2;
    for (int64_t j = 0; j < swaps; j++) {
        const cand t = buf[j];
        buf[j] = buf[count - 1 - j];
        buf[count - 1 - j] = t;
    }
    *inv = (float)(1.0 / before);
    return kept;
}

/* The row's nucleus in buf[0..kept) (heaviest first; probability w * *inv), or 0: the caller's path */
static int64_t nucleus_row(const float *x, int64_t n, float inv_t, float top_p, cand *buf, float *inv) {
    const int64_t nv = n - n % 16;
    float top = -INFINITY;
    int nan = 0;
    if (nv > 0) {
        v16 m = load16(x);
        i16 odd = m != m;
        for (int64_t k = 16; k < nv; k += 16) {
            const v16 v = load16(x + k);
            m = select16(v > m, v, m);
            odd |= v != v;
        }
        for (int l = 0; l < 16; l++) top = m[l] > top ? m[l] : top, nan |= odd[l];
    }
    for (int64_t k = nv; k < n; k++) top = x[k] > top ? x[k] : top, nan |= x[k] != x[k];
    if (nan || !(top > -INFINITY) || !(inv_t > 0)) return 0; /* a NaN, or every logit -inf: the caller's path */
    const float floor = -NUCLEUS_SPAN;
    int64_t count = 0;
    v16 acc = {0};
    for (int64_t k = 0; k < nv; k += 16) {
        const v16 z = (load16(x + k) - top) * inv_t;
        const v16 e = exp16(z);
        acc += e;
        const i16 near = z >= floor;
        if (!any16(near)) continue; /* most chunks hold no candidate */
        for (int l = 0; l < 16; l++)
            if (near[l]) {
                if (count < NUCLEUS_CAP) buf[count] = (cand){e[l], k + l};
                count++;
            }
    }
    float total = reduce16(acc);
    for (int64_t k = nv; k < n; k++) {
        const float z = (x[k] - top) * inv_t;
        const float e = z < -87.0f ? 0.0f : expf(z);
        total += e;
        if (z >= floor) {
            if (count < NUCLEUS_CAP) buf[count] = (cand){e, k};
            count++;
        }
    }
    return nucleus_cut(buf, count, total, top_p, inv);
}

/* 1: the row's nucleus written into out (zeros elsewhere untouched); 0: the caller's path */
static int nucleus_dense(const float *x, int64_t n, float inv_t, float top_p, float *out, cand *buf) {
    float inv;
    const int64_t kept = nucleus_row(x, n, inv_t, top_p, buf, &inv);
    for (int64_t j = 0; j < kept; j++) out[buf[j].i] = buf[j].w * inv;
    return kept > 0;
}

/* Returns 0. x: rows x n logits; inv_t, top_p: one per row; out: rows x n, zeroed by the caller;
 * done: one per row, 1 where the row was written. */
int bs_nucleus(const float *x, int64_t rows, int64_t n, const float *inv_t, const float *top_p, float *out,
               uint8_t *done, int threads) {
    int failed = 0;
#pragma omp parallel num_threads(threads) if (rows >= 2)
    {
        cand *buf = malloc(sizeof(cand) * NUCLEUS_CAP);
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++)
            done[r] = buf ? (uint8_t)nucleus_dense(x + r * n, n, inv_t[r], top_p[r], out + r * n, buf) : 0;
        if (!buf) failed = 1;
        free(buf);
    }
    return failed;
}

/* bs_nucleus of rows whose logits are -inf but at ids[0..m) (ascending, < n): x rows x m; out
 * rows x n, zeroed by the caller; the rest as bs_nucleus. */
int bs_nucleus_ids(const float *x, const int64_t *ids, int64_t rows, int64_t m, int64_t n, const float *inv_t,
                   const float *top_p, float *out, uint8_t *done, int threads) {
    int failed = 0;
#pragma omp parallel num_threads(threads) if (rows >= 2)
    {
        cand *buf = malloc(sizeof(cand) * NUCLEUS_CAP);
        float *row = malloc(sizeof(float) * (size_t)n);
        if (row)
            for (int64_t k = 0; k < n; k++) row[k] = -INFINITY;
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) {
            done[r] = 0;
            if (!buf || !row) continue;
            for (int64_t j = 0; j < m; j++) row[ids[j]] = x[r * m + j];
            done[r] = (uint8_t)nucleus_dense(row, n, inv_t[r], top_p[r], out + r * n, buf);
        }
        if (!buf || !row) failed = 1;
        free(buf);
        free(row);
    }
    return failed;
}

static int lower_id_first(const void *a, const void *b) {
    const cand *x = a, *y = b;
    return (x->i > y->i) - (x->i < y->i);
}

/* The keyed race's winner among a nucleus buf[0..kept) (heaviest first, probability w * inv; token
 * ids support[i], or i without one) under a position's key: dflash/sparse_probs.py's
 * `race_on_host`. */
static int64_t race(const cand *buf, int64_t kept, float inv, const int64_t *support, uint64_t key) {
    double best = INFINITY;
    int64_t pick = support ? support[buf[0].i] : buf[0].i;
    for (int64_t j = 0; j < kept; j++)
        keyed_race(&best, &pick, key, support ? support[buf[j].i] : buf[j].i, buf[j].w * inv);
    return pick;
}

/* bs_nucleus_pairs, and with seeds each row's keyed draw and peak (bs_nucleus_draws). */
static int pairs_rows(const float *x, const int64_t *support, int64_t groups, int64_t per, int64_t n,
                      const float *temperature, const float *top_p, const uint64_t *seeds, const int64_t *starts,
                      int64_t width, int64_t *ids, float *probs, int64_t *drawn, float *peaks, int64_t *out,
                      int threads) {
    const int64_t rows = groups * per;
    int64_t *kept_of = malloc(sizeof(int64_t) * (size_t)(rows > 0 ? rows : 1));
    if (!kept_of) return 1;
    int failed = 0, all_done = 1, all_raced = 1;
    int64_t widest = 1;
#pragma omp parallel num_threads(threads) if (rows >= 2) reduction(max : widest) reduction(& : all_done, all_raced)
    {
        cand *buf = malloc(sizeof(cand) * NUCLEUS_CAP);
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) {
            float inv = 0.0f;
            const int64_t g = r / per;
            int64_t kept = buf ? nucleus_row(x + r * n, n, 1.0f / temperature[g], top_p[g], buf, &inv) : 0;
            if (kept > width) kept = 0;
            if (seeds && kept > 0) {
                peaks[r] = buf[0].w * inv;
                if (kept <= RACE_HEAD)
                    drawn[r] = race(buf, kept, inv, support, keyed_position(seeds[g], starts[g] + r % per));
                else
                    all_raced = 0;
            }
            if (kept > 1) qsort(buf, (size_t)kept, sizeof(cand), lower_id_first);
            for (int64_t j = 0; j < kept; j++) {
                ids[r * width + j] = support ? support[buf[j].i] : buf[j].i;
                probs[r * width + j] = buf[j].w * inv;
            }
            all_done &= kept > 0;
            widest = kept > widest ? kept : widest;
            kept_of[r] = kept;
        }
        if (!buf) failed = 1;
        free(buf);
    }
    if (failed) {
        free(kept_of);
        return 1;
    }
    /* rows x width -> rows x widest, in place: row r moves to r * widest <= r * width */
    for (int64_t r = 0; r < rows; r++) {
        const int64_t kept = kept_of[r];
        for (int64_t j = 0; j < widest; j++) {
            const int64_t from = r * width + j, to = r * widest + j;
            ids[to] = j < kept ? ids[from] : 0;
            probs[to] = j < kept ? probs[from] : 0.0f;
        }
    }
    free(kept_of);
    out[0] = widest;
    out[1] = all_done;
    out[2] = all_done && all_raced;
    return 0;
}

/* bs_nucleus's rows as (id, probability) pairs, the ids ascending. x: rows x n logits, rows =
 * groups x per (a batch row's positions share its temperature[g] > 0 and top_p[g]: inverse
 * temperature 1.0f / temperature[g], as the caller's bs_nucleus rows get it). ids, probs: rows x
 * width scratch; on return they hold rows x k pairs, k = out[0] the most any row keeps (each row's
 * pairs, then id 0 with probability 0), with bs_nucleus's bits; out[1] = 1 where every row was
 * done, 0 where some nucleus is the caller's (wider than the candidates or than width). out holds
 * 3. Returns 0, 1 where scratch memory ran out. */
int bs_nucleus_pairs(const float *x, int64_t groups, int64_t per, int64_t n, const float *temperature,
                     const float *top_p, int64_t width, int64_t *ids, float *probs, int64_t *out, int threads) {
    return pairs_rows(x, NULL, groups, per, n, temperature, top_p, NULL, NULL, width, ids, probs, NULL, NULL, out,
                      threads);
}

/* A sampled draft step's proposals in one call: bs_nucleus_pairs of the logits of the tokens
 * support[0..n) (ascending ids, the pairs' ids read through it; NULL: the columns are the ids),
 * with each row's keyed draw drawn[r] (group g's position j = r % per keyed by seeds[g] and output
 * position starts[g] + j, as `RowRandom.keys`) and its peak peaks[r], the largest probability.
 * out[2] = 1 where every row was drawn, 0 where some nucleus is wider than the race's head (the
 * caller's race then draws its tail). */
int bs_nucleus_draws(const float *x, const int64_t *support, int64_t groups, int64_t per, int64_t n,
                     const float *temperature, const float *top_p, const uint64_t *seeds, const int64_t *starts,
                     int64_t width, int64_t *ids, float *probs, int64_t *drawn, float *peaks, int64_t *out,
                     int threads) {
    return pairs_rows(x, support, groups, per, n, temperature, top_p, seeds, starts, width, ids, probs, drawn, peaks,
                      out, threads);
}
