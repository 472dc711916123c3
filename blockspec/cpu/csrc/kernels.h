/* The kernels one kernel file calls in another (layers.c runs the others in its loop); rope.c's
 * parameter list is spelled once, here. */
#ifndef BLOCKSPEC_KERNELS_H
#define BLOCKSPEC_KERNELS_H
#include <stdint.h>

int bs_rows_matmul(const float *x, const float *w, const float *bias, float *y, int64_t n, int64_t in,
                   int64_t out, int threads);
int bs_rows_matmul_res(const float *x, const float *w, const float *bias, const float *res, float *y, int64_t n,
                       int64_t in, int64_t out, int threads);
int bs_rows_matmul_q4(const float *x, const uint8_t *qs, const float *sc, const float *bias, const float *res,
                      float *y, int64_t n, int64_t in, int64_t out, int threads);
int bs_rows_matmul_q8(const float *x, const uint8_t *qs, const float *sc, const float *bias, const float *res,
                      float *y, int64_t n, int64_t in, int64_t out, int threads);
int bs_rows_matmul_bf16(const uint16_t *x, const uint16_t *w, const float *bias, float *y, int64_t n, int64_t in,
                        int64_t out, int threads);
int bs_rows_matmul_q4_bf16(const uint16_t *x, const uint8_t *qs, const float *sc, const float *bias, float *y,
                           int64_t n, int64_t in, int64_t out, int threads);
int bs_rows_matmul_q8_bf16(const uint16_t *x, const uint8_t *qs, const float *sc, const float *bias, float *y,
                           int64_t n, int64_t in, int64_t out, int threads);
int bs_int8_matmul_q4(const float *x, const uint8_t *qs, const uint16_t *wd, const uint16_t *wm, const float *bias,
                      const float *res, float *y, int64_t n, int64_t in, int64_t out, int threads);
int bs_int8_matmul_q8(const float *x, const uint8_t *qs, const uint16_t *wd, const uint16_t *wm, const float *bias,
                      const float *res, float *y, int64_t n, int64_t in, int64_t out, int threads);
int bs_rms_norm(const float *x, const float *w, float *y, int64_t rows, int64_t n, float eps, int threads);
int bs_rms_norm_bf16(const uint16_t *x, const uint16_t *w, uint16_t *y, int64_t rows, int64_t n, float eps,
                     int threads);
#define ROPE_KV_ARGS(T_)                                                                                 \
    const T_ *qkv, int64_t tokens, int64_t width, int64_t heads, int64_t kv_heads, int64_t groups, int64_t d,  \
        const T_ *qw, const T_ *kw, float q_eps, float k_eps, const T_ *cos, const T_ *sin, int64_t q_from,    \
        const int64_t *q_rows, const int64_t *q_cols, int64_t batch, int64_t q_len, T_ *q_out,                \
        const int64_t *kv_rows, const int64_t *kv_slots, T_ *k_cache, T_ *v_cache, int64_t cache_rows,         \
        int64_t cache_slots, int64_t stride_row, int64_t stride_head, int64_t stride_slot, int threads
int bs_rope_kv(ROPE_KV_ARGS(float));
int bs_rope_kv_bf16(ROPE_KV_ARGS(uint16_t));
int bs_attention(const float *q, const float *k, const float *v, float *out, const int64_t *visible,
                 const int64_t *start, const int64_t *tree, int64_t b, int64_t kvh, int64_t g, int64_t n, int64_t d,
                 int64_t sb, int64_t sh, int64_t horizon, int64_t tw, float scale, int threads);
int bs_attention_bf16(const uint16_t *q, const uint16_t *k, const uint16_t *v, float *out, const int64_t *visible,
                      const int64_t *start, const int64_t *tree, int64_t b, int64_t kvh, int64_t g, int64_t n,
                      int64_t d, int64_t sb, int64_t sh, int64_t horizon, int64_t tw, float scale, int threads);

#endif
