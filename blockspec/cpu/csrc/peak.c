/* The argmax of each row of logits and the softmax probability at it: a draft head's greedy
 * proposals and the confidences an adaptive step trims its verify by (dflash/drafter.py,
 * argmax_and_peak); or, with conf NULL, the argmax alone (kernels.argmax: a batch's greedy
 * drafts and the target's greedy check). fp32 rows (bs_argmax_peak) or bf16 rows (bs_argmax_peak_bf16, widened
 * exactly).
 *
 * Why: PyTorch took four passes and a copy for it (widen, max with indices, subtract and exp in
 * place, sum), about as much time as the draft head's product (BENCHMARKS.md, "Kernel measurements"). Here it is two passes over
 * each row: the maximum with its first index, then the sum of e^(x - max) (exp16 of vec.h).
 *
 * Ties go to the lowest index, as torch.argmax. NaN logits are never the maximum (PyTorch would
 * return one); a draft with NaN logits proposes garbage either way, and verification stays exact.
 */
#include <math.h>

#include "vec.h"

static inline void peak_row(const void *x, int64_t n, int64_t *idx, float *conf, const int bf) {
    const int64_t nv = n - n % 16;
    float top = -INFINITY;
    int64_t at_top = 0;
    if (nv > 0) {
        v16 m = load(x, 0, bf);
        i16 mi = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}; /* each lane's index of m */
        i16 k16 = mi;
        for (int64_t k = 16; k < nv; k += 16) {
            k16 += 16;
            const v16 v = load(x, k, bf);
            const i16 gt = v > m; /* strict: a lane keeps its first maximum */
            m = select16(gt, v, m);
            mi = (gt & k16) | (~gt & mi);
        }
        for (int l = 0; l < 16; l++)
            if (m[l] > top || (m[l] == top && mi[l] < at_top)) top = m[l], at_top = mi[l];
    }
    for (int64_t k = nv; k < n; k++) { /* indices past every vector lane: strict keeps the first */
        const float v = scalar(x, k, bf);
        if (v > top) top = v, at_top = k;
    }
    *idx = at_top;
    if (!conf) return; /* the argmax alone: a batch's greedy drafts, the target's greedy check */
    v16 acc = {0};
    for (int64_t k = 0; k < nv; k += 16) acc += exp16(load(x, k, bf) - top);
    float total = reduce16(acc);
    for (int64_t k = nv; k < n; k++) total += expf(scalar(x, k, bf) - top);
    *conf = 1.0f / total;
}

#define ARGMAX_PEAK(BF)                                                                                \
    _Pragma("omp parallel for schedule(static) num_threads(threads) if (rows >= 2)")                   \
    for (int64_t r = 0; r < rows; r++) peak_row(at(x, r * n, BF), n, idx + r, conf ? conf + r : 0, BF); \
    return 0;

/* Returns 0. x: rows x n logits; idx, conf: one per row (conf NULL: the argmax alone, one pass). */
int bs_argmax_peak(const float *x, int64_t rows, int64_t n, int64_t *idx, float *conf, int threads) {
    ARGMAX_PEAK(0)
}

int bs_argmax_peak_bf16(const uint16_t *x, int64_t rows, int64_t n, int64_t *idx, float *conf, int threads) {
    ARGMAX_PEAK(1)
}
