/* The attention inputs of one layer from its fused q/k/v projection: each query and key head
 * through its RMSNorm (Qwen3's q_norm / k_norm, when given) and the rotary embedding
 * (rotate-half convention), the queries written in the attention's [b, kv_heads, groups * q, d]
 * layout and the keys and values straight into their cache slots.
 *
 * Why: PyTorch spent ~15 small operators per layer on this (split, views, neg, cat, two products
 * and a sum per rope, an indexed write per cache), 30-50 us per layer of a decoding step: about
 * 1 ms of a one-token SmolLM2-135M forward and 1.3 ms at 8 rows on 2 cores, where the whole
 * forward is 14-20 ms.
 *
 * Same bits as the PyTorch path it replaces (models/native/llama.py, models/native/draft.py):
 * the norm is norm.c's, and rope computes x * cos and rotate_half(x) * sin as separate products,
 * then their sum, each rounded to the element type as PyTorch's elementwise operators round
 * them (the build's -std=c11 keeps the compiler from fusing them into one multiply-add).
 * Token by token, head by head: batch invariant.
 */
#include "vec.h"

#define MAX_HEAD_DIM 1024

/* one head of d elements x -> y: norm by w (if w) and rope with cos/sin of its token */
static inline void norm_rope(const void *x, const void *w, float eps, const void *cos, const void *sin, void *y,
                             int64_t d, const int bf) {
    float t[MAX_HEAD_DIM];
    const float s = w ? inv_rms(x, d, eps, bf) : 0.0f;
    for (int64_t k = 0; k < d; k++) {
        float v = scalar(x, k, bf);
        if (w && bf) {
            const uint16_t h = to_bf16(v * s);
            v = scalar(&h, 0, 1);
            const uint16_t o = to_bf16(scalar(w, k, 1) * v);
            v = scalar(&o, 0, 1);
        } else if (w) {
            v = (v * s) * scalar(w, k, 0);
        }
        t[k] = v;
    }
    const int64_t half = d / 2;
    for (int64_t k = 0; k < d; k++) {
        const float rotated = k < half ? -t[k + half] : t[k - half];
        const float a = t[k] * scalar(cos, k, bf), b = rotated * scalar(sin, k, bf);
        if (bf) {
            const uint16_t ha = to_bf16(a), hb = to_bf16(b);
            ((uint16_t *)y)[k] = to_bf16(scalar(&ha, 0, 1) + scalar(&hb, 0, 1));
        } else {
            ((float *)y)[k] = a + b;
        }
    }
}

/* qkv [T, width] (row t at qkv + t * width; q heads, then k heads, then v heads, d each);
 * cos, sin [T, d]; qw, kw [d] or NULL (no norm).
 * Queries of tokens q_from..T-1 only: head j of token t goes to
 *   q_out + q_base[t - q_from] + (j / groups) * q_kv_stride + (j % groups) * q_group_stride.
 * Keys and values of every token: kv head j of token t goes to
 *   k_cache (v_cache) + kv_base[t] + j * kv_head_stride.
 * Offsets in elements. Returns 0, or 1 for a head_dim the kernel does not take. */
#define ROPE_KV(BF, T_)                                                                                    \
    if (d > MAX_HEAD_DIM || d % 2) return 1;                                                               \
    _Pragma("omp parallel for schedule(static) num_threads(threads) if (tokens >= 64)")                     \
    for (int64_t t = 0; t < tokens; t++) {                                                                 \
        const T_ *row = (const T_ *)qkv + t * width;                                                       \
        const T_ *c = (const T_ *)cos + t * d, *s = (const T_ *)sin + t * d;                               \
        if (t >= q_from) {                                                                                 \
            T_ *q = (T_ *)q_out + q_base[t - q_from];                                                      \
            for (int64_t j = 0; j < heads; j++)                                                            \
                norm_rope(row + j * d, qw, q_eps, c, s, q + (j / groups) * q_kv_stride +                   \
                          (j % groups) * q_group_stride, d, BF);                                           \
        }                                                                                                  \
        for (int64_t j = 0; j < kv_heads; j++) {                                                           \
            const int64_t off = kv_base[t] + j * kv_head_stride;                                           \
            norm_rope(row + (heads + j) * d, kw, k_eps, c, s, (T_ *)k_cache + off, d, BF);                 \
            memcpy((T_ *)v_cache + off, row + (heads + kv_heads + j) * d, d * sizeof(T_));                 \
        }                                                                                                  \
    }                                                                                                      \
    return 0;

int bs_rope_kv(const float *qkv, int64_t tokens, int64_t width, int64_t heads, int64_t kv_heads, int64_t groups,
               int64_t d, const float *qw, const float *kw, float q_eps, float k_eps, const float *cos,
               const float *sin, int64_t q_from, const int64_t *q_base, float *q_out, int64_t q_kv_stride,
               int64_t q_group_stride, const int64_t *kv_base, float *k_cache, float *v_cache,
               int64_t kv_head_stride, int threads) {
    ROPE_KV(0, float)
}

int bs_rope_kv_bf16(const uint16_t *qkv, int64_t tokens, int64_t width, int64_t heads, int64_t kv_heads,
                    int64_t groups, int64_t d, const uint16_t *qw, const uint16_t *kw, float q_eps, float k_eps,
                    const uint16_t *cos, const uint16_t *sin, int64_t q_from, const int64_t *q_base, uint16_t *q_out,
                    int64_t q_kv_stride, int64_t q_group_stride, const int64_t *kv_base, uint16_t *k_cache,
                    uint16_t *v_cache, int64_t kv_head_stride, int threads) {
    ROPE_KV(1, uint16_t)
}
