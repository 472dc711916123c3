/* RMSNorm of rows of n elements, as Hugging Face's Llama-family models compute it: statistics in
 * fp32, then y = w * (x * rsqrt(mean(x^2) + eps)), the product by w in the model's dtype.
 * fp32 (bs_rms_norm) or bf16 rows and weights (bs_rms_norm_bf16, the normalised row rounded to
 * bf16 before the product, and the product rounded again, as bf16 tensors compute it).
 *
 * Why: PyTorch's CPU rms_norm runs as about ten small operators; a decoding step of a 30-layer
 * target calls it 61 times, a draft pass 14 times (BENCHMARKS.md, "Kernel measurements").
 *
 * Each row is computed alone, in a fixed order (16-wide partial sums of squares over the row, the
 * fixed reduction tree of vec.h, then the tail), so a row gets the same bits whatever the other
 * rows or the thread split: batch invariant, like the products and the attention.
 */
#include "vec.h"

#define RMS_NORM(BF)                                                                                   \
    _Pragma("omp parallel for schedule(static) num_threads(threads) if (rows >= 64)")                  \
    for (int64_t r = 0; r < rows; r++) {                                                               \
        const void *xr = at(x, r * n, BF);                                                             \
        const float s = inv_rms(xr, n, eps, BF);                                                       \
        for (int64_t k = 0; k < n; k++) {                                                              \
            if (BF) {                                                                                  \
                const uint16_t h = to_bf16(scalar(xr, k, 1) * s); /* rounded, as a bf16 tensor */      \
                const float t = scalar(&h, 0, 1);                                                      \
                ((uint16_t *)y)[r * n + k] = to_bf16(scalar(w, k, 1) * t);                             \
            } else {                                                                                   \
                ((float *)y)[r * n + k] = (scalar(xr, k, 0) * s) * scalar(w, k, 0);                    \
            }                                                                                          \
        }                                                                                              \
    }                                                                                                  \
    return 0;

/* x, y [rows, n] and w [n], fp32. Returns 0. */
int bs_rms_norm(const float *x, const float *w, float *y, int64_t rows, int64_t n, float eps, int threads) {
    RMS_NORM(0)
}

/* x, y [rows, n] and w [n], bf16 bit patterns. Returns 0. */
int bs_rms_norm_bf16(const uint16_t *x, const uint16_t *w, uint16_t *y, int64_t rows, int64_t n, float eps,
                     int threads) {
    RMS_NORM(1)
}
