/* DFlash 2's grouped dynamic convolution inside a draft block (dflash/conv.py), one side of it:
 *
 *     y_t[c] = sum_j (base[j, c] + delta_t[j, c / group]) * x_{t-j}[c],   t - j in t's block
 *
 * in fp32 whatever the element type, each term and sum in the order the PyTorch operators of
 * BlockConv._convolve take them (coefficient = base + delta, then x * coefficient per tap, tap 0
 * first, added in tap order), so the bits are theirs (ISO C: no fused multiply-adds); a bf16
 * result is rounded once, as `.to(bfloat16)` rounds it.
 *
 * Why: those are about eight small PyTorch operators per side, four sides per draft layer, mostly
 * dispatch (the arithmetic is ~10k multiply-adds; BENCHMARKS.md, "Kernel measurements").
 */
#include "vec.h"

#define BLOCK_CONV(BF)                                                                                 \
    const int64_t group = hidden / groups;                                                             \
    _Pragma("omp parallel for schedule(static) num_threads(threads) if (rows * hidden >= 262144)")    \
    for (int64_t r = 0; r < rows; r++) {                                                               \
        const int64_t pos = r % block_len; /* taps reaching back further leave the block */            \
        const void *dr = at(delta, r * delta_stride, BF);                                              \
        for (int64_t g = 0; g < groups; g++) {                                                         \
            const float d0 = scalar(dr, g, BF);                                                        \
            for (int64_t c = g * group; c < (g + 1) * group; c++) {                                    \
                float acc = scalar(x, r * hidden + c, BF) * (scalar(base, c, BF) + d0);                \
                for (int64_t j = 1; j < taps && j <= pos; j++)                                         \
                    acc = acc + scalar(x, (r - j) * hidden + c, BF) *                                  \
                                    (scalar(base, j * hidden + c, BF) + scalar(dr, j * groups + g, BF)); \
                if (BF) ((uint16_t *)y)[r * hidden + c] = to_bf16(acc);                                \
                else ((float *)y)[r * hidden + c] = acc;                                               \
            }                                                                                          \
        }                                                                                              \
    }                                                                                                  \
    return 0;

/* x, y [rows, hidden] (rows: blocks of block_len laid end to end), base [taps, hidden], delta
 * rows of taps * groups values delta_stride apart; fp32. Returns 0. */
int bs_block_conv(const float *x, const float *base, const float *delta, float *y, int64_t rows, int64_t hidden,
                  int64_t taps, int64_t groups, int64_t delta_stride, int64_t block_len, int threads) {
    BLOCK_CONV(0)
}

/* The same on bf16 bit patterns. Returns 0. */
int bs_block_conv_bf16(const uint16_t *x, const uint16_t *base, const uint16_t *delta, uint16_t *y, int64_t rows,
                       int64_t hidden, int64_t taps, int64_t groups, int64_t delta_stride, int64_t block_len,
                       int threads) {
    BLOCK_CONV(1)
}
