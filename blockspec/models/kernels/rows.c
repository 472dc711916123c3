/* y[n, out] = x[n, in] . w[out, in]^T (+ bias[out]) in fp32, for a few rows n (decoding).
 *
 * Built at first use by blockspec/models/rowmatmul.py (gcc or clang, -O3 -march=native -fopenmp).
 * Written with GCC vector extensions so the compiler picks the widest vector unit it has.
 *
 * Why: a decoding step multiplies a handful of rows by every weight matrix; the run time is the
 * time to stream the weights from memory once. Each weight row is read once per call and
 * multiplied into up to eight rows' partial sums held in registers.
 *
 * Every output element is accumulated the same way whatever n, the row grouping or the thread
 * split: 16-wide partial sums over `in` in order, one fixed reduction tree, then the scalar
 * tail, then the bias. So a row gets the same bits alone or beside others (batch invariance).
 */
#include <stdint.h>
#include <string.h>

typedef float v16 __attribute__((vector_size(64)));
typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));

static inline v16 load16(const float *p) {
    v16 v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline float reduce16(v16 a) {
    v8 b = __builtin_shufflevector(a, a, 0, 1, 2, 3, 4, 5, 6, 7) + __builtin_shufflevector(a, a, 8, 9, 10, 11, 12, 13, 14, 15);
    v4 c = __builtin_shufflevector(b, b, 0, 1, 2, 3) + __builtin_shufflevector(b, b, 4, 5, 6, 7);
    return (c[0] + c[2]) + (c[1] + c[3]);
}

/* MR rows (MR <= 8) of x (row stride in) times one weight row w -> y[r * ldy] */
static inline __attribute__((always_inline)) void tile(const float *x, const float *w, const float *bias, float *y,
                                                       int64_t in, int64_t ldy, const int MR) {
    const int64_t kv = in & ~(int64_t)15;
    v16 acc[8];
#pragma GCC unroll 8
    for (int r = 0; r < MR; r++) acc[r] = (v16){0};
    for (int64_t k = 0; k < kv; k += 16) {
        const v16 wv = load16(w + k);
#pragma GCC unroll 8
        for (int r = 0; r < MR; r++) acc[r] += wv * load16(x + r * in + k);
    }
#pragma GCC unroll 8
    for (int r = 0; r < MR; r++) {
        float s = reduce16(acc[r]);
        for (int64_t k = kv; k < in; k++) s += w[k] * x[r * in + k];
        y[r * ldy] = bias ? s + *bias : s;
    }
}

/* one output column for all n rows, eight rows at a time */
static void column(const float *x, const float *w, const float *bias, float *y, int64_t n, int64_t in, int64_t ldy) {
    int64_t r = 0;
    for (; r + 8 <= n; r += 8) tile(x + r * in, w, bias, y + r * ldy, in, ldy, 8);
    x += r * in;
    y += r * ldy;
    switch (n - r) {
    case 7: tile(x, w, bias, y, in, ldy, 7); break;
    case 6: tile(x, w, bias, y, in, ldy, 6); break;
    case 5: tile(x, w, bias, y, in, ldy, 5); break;
    case 4: tile(x, w, bias, y, in, ldy, 4); break;
    case 3: tile(x, w, bias, y, in, ldy, 3); break;
    case 2: tile(x, w, bias, y, in, ldy, 2); break;
    case 1: tile(x, w, bias, y, in, ldy, 1); break;
    }
}

/* Returns 0. The output columns are split evenly between `threads` OpenMP threads (the caller
 * passes PyTorch's count: the OpenMP default of a thread PyTorch did not configure may differ). */
int bs_rows_matmul(const float *x, const float *w, const float *bias, float *y, int64_t n, int64_t in,
                   int64_t out, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t j = 0; j < out; j++)
        column(x, w + j * in, bias ? bias + j : 0, y + j, n, in, out);
    return 0;
}
