/* The k largest logits of each row, in a defined order, with their log-softmax: the drafter's
 * top choices a token tree grows from (cpu/top_k.py, dflash/drafter.py top_logprobs). fp32 rows
 * (bs_top_k) or bf16 rows (bs_top_k_bf16, widened exactly). bs_top_values gives the k largest
 * values themselves, for the head of a sampled distribution (dflash/sampling.py).
 *
 * Order: larger logit first, and on equal logits the lower index first. peak.c's argmax breaks
 * ties the same way, so the first column is the greedy draft: a step that verifies a tree or a
 * chain from one head pass reads the chain from it (dflash/batch.py). torch.topk leaves tie order
 * unspecified; cpu/top_k.py's PyTorch path follows this rule instead.
 *
 * Why: torch.topk and log_softmax take several passes over a draft vocabulary of tens of
 * thousands per position. Here it is two: one keeps the k best in a small sorted list, testing
 * 16 logits at a time against the k-th best (after the first few hundred logits almost none pass),
 * the other sums e^(x - max) as peak.c does.
 *
 * NaN logits are never taken after the list fills; a draft with NaN logits proposes garbage
 * either way, and verification stays exact.
 */
#include <math.h>

#include "vec.h"

#define TOP_K_MAX 64

/* (v, i), i above every index held, into the list val/idx of *count (at most k) entries sorted
 * by value descending: after every entry of a value >= v (equal values keep their lower index first) */
static inline void keep(float *val, int64_t *idx, int *count, const int k, const float v, const int64_t i) {
    int p = *count < k ? (*count)++ : k - 1;
    while (p > 0 && val[p - 1] < v) {
        val[p] = val[p - 1];
        idx[p] = idx[p - 1];
        p--;
    }
    val[p] = v;
    idx[p] = i;
}

static inline int any16(const i16 m) {
    uint64_t w[8];
    memcpy(w, &m, sizeof w);
    return ((w[0] | w[1]) | (w[2] | w[3]) | (w[4] | w[5]) | (w[6] | w[7])) != 0;
}

/* The k largest of row x [n] into val/idx [k], ordered as the header says. */
static inline void select_row(const void *x, const int64_t n, const int k, float *val, int64_t *idx, const int bf) {
    int count = 0;
    int64_t j = 0;
    for (; j < n && count < k; j++) keep(val, idx, &count, k, scalar(x, j, bf), j);
    for (; j + 16 <= n; j += 16) {
        const v16 v = load(x, j, bf);
        if (!any16(v > val[k - 1])) continue; /* strict: an equal logit has a higher index, so it loses */
        for (int l = 0; l < 16; l++)
            if (v[l] > val[k - 1]) keep(val, idx, &count, k, v[l], j + l);
    }
    for (; j < n; j++) {
        const float v = scalar(x, j, bf);
        if (v > val[k - 1]) keep(val, idx, &count, k, v, j);
    }
}

static inline void top_row(const void *x, const int64_t n, const int k, float *logp, int64_t *idx, const int bf) {
    float val[TOP_K_MAX];
    select_row(x, n, k, val, idx, bf);
    const float top = val[0];
    const int64_t nv = n - n % 16;
    v16 acc = {0};
    for (int64_t i = 0; i < nv; i += 16) acc += exp16(load(x, i, bf) - top);
    float total = reduce16(acc);
    for (int64_t i = nv; i < n; i++) total += expf(scalar(x, i, bf) - top);
    const float log_total = logf(total);
    for (int c = 0; c < k; c++) logp[c] = (val[c] - top) - log_total;
}

#define TOP_K(BF)                                                                                        \
    if (k < 1 || k > TOP_K_MAX || k > n) return 1;                                                       \
    _Pragma("omp parallel for schedule(static) num_threads(threads) if (rows >= 2)")                     \
    for (int64_t r = 0; r < rows; r++) top_row(at(x, r * n, BF), n, (int)k, logp + r * k, idx + r * k, BF); \
    return 0;

/* x: rows x n logits; logp, idx: rows x k. Returns 0, or 1 (nothing written) unless 1 <= k <= min(n, 64). */
int bs_top_k(const float *x, int64_t rows, int64_t n, int64_t k, float *logp, int64_t *idx, int threads) {
    TOP_K(0)
}

int bs_top_k_bf16(const uint16_t *x, int64_t rows, int64_t n, int64_t k, float *logp, int64_t *idx, int threads) {
    TOP_K(1)
}

/* The k largest values themselves (no log-softmax), same order: the head of a sampled
 * distribution that the keyed race gives clocks of their own (dflash/sampling.py). x: rows x n
 * fp32; val, idx: rows x k. Returns 0, or 1 (nothing written) unless 1 <= k <= n. */
int bs_top_values(const float *x, int64_t rows, int64_t n, int64_t k, float *val, int64_t *idx, int threads) {
    if (k < 1 || k > n) return 1;
#pragma omp parallel for schedule(static) num_threads(threads) if (rows >= 2)
    for (int64_t r = 0; r < rows; r++) select_row(x + r * n, n, (int)k, val + r * k, idx + r * k, 0);
    return 0;
}

int bs_top_k_max(void) { return TOP_K_MAX; }
