/* The k largest values of each row of fp32 x, descending, with their indices: the head of a
 * sampled distribution that the keyed race gives clocks of their own (dflash/sampling.py,
 * RowRandom.sample), at every verified and drafted position of a sampled step.
 *
 * Why: torch.topk over a 49K vocabulary cost about as much as the shaping of the distribution
 * around it. Here it is one pass: 16 lanes at a time are compared with the k-th value held so far
 * and only a larger value is inserted (a few hundred insertions per row for k = 32 in any order,
 * none past the support of a nucleus-filtered row).
 *
 * Ties go to the lower index (it is inserted first and a later equal value is not larger), so a
 * row's head does not depend on the threads or the rows beside it. NaN is never inserted once the
 * head is full.
 */
#include "vec.h"

static inline void insert(float *vals, int64_t *idx, int64_t *count, int64_t k, float v, int64_t i) {
    int64_t j = *count < k ? (*count)++ : k - 1; /* a full head drops its smallest */
    while (j > 0 && vals[j - 1] < v) { /* strict: an equal value already held stays first */
        vals[j] = vals[j - 1];
        idx[j] = idx[j - 1];
        j--;
    }
    vals[j] = v;
    idx[j] = i;
}

static void top_row(const float *x, int64_t n, int64_t k, float *vals, int64_t *idx) {
    int64_t count = 0;
    const int64_t nv = n - n % 16;
    int64_t at = 0;
    for (; at < n && count < k; at++) insert(vals, idx, &count, k, x[at], at); /* the first k, sorted */
    for (; at < n && at % 16; at++)
        if (x[at] > vals[k - 1]) insert(vals, idx, &count, k, x[at], at);
    for (; at < nv; at += 16) {
        const v16 v = load16(x + at);
        const i16 gt = v > ((v16){0} + vals[k - 1]);
        int any = 0;
        for (int l = 0; l < 16; l++) any |= gt[l];
        if (!any) continue;
        for (int l = 0; l < 16; l++) /* the threshold rises as values go in */
            if (v[l] > vals[k - 1]) insert(vals, idx, &count, k, v[l], at + l);
    }
    for (; at < n; at++)
        if (x[at] > vals[k - 1]) insert(vals, idx, &count, k, x[at], at);
}

/* Returns 0. x: rows x n; vals, idx: rows x k (1 <= k <= n). */
int bs_top_k(const float *x, int64_t rows, int64_t n, int64_t k, float *vals, int64_t *idx, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (rows >= 2)
    for (int64_t r = 0; r < rows; r++) top_row(x + r * n, n, k, vals + r * k, idx + r * k);
    return 0;
}
