/* The attention inputs of one layer from its fused q/k/v projection: each query and key head
 * through its RMSNorm (Qwen3's q_norm / k_norm, when given) and the rotary embedding
 * (rotate-half convention), the queries written in the attention's [b, kv_heads, groups * q, d]
 * layout and the keys and values straight into their cache slots.
 *
 * Why: PyTorch spent ~15 small operators per layer on this (split, views, neg, cat, two products
 * and a sum per rope, an indexed write per cache), a few percent of a decoding step (BENCHMARKS.md, "Kernel measurements").
 *
 * Same bits as the PyTorch path it replaces (targets/native/llama.py, dflash/static_drafter.py):
 * the norm is norm.c's, and rope computes x * cos and rotate_half(x) * sin as separate products,
 * then their sum, each rounded to the element type as PyTorch's elementwise operators round
 * them (the build's -std=c11 keeps the compiler from fusing them into one multiply-add).
 * Token by token, head by head: batch invariant.
 */
#include "vec.h"
#include "kernels.h"

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
 * Queries of tokens q_from..T-1 only, token t at (q_rows, q_cols)[t - q_from] of a [batch, q_len]
 * block: its head j goes to q_out[row][j / groups][(j % groups) * q_len + col] of a
 * [batch, kv_heads, groups * q_len, d] tensor.
 * Keys and values of every token: kv head j of token t goes to slot kv_slots[t] of row kv_rows[t]
 * of caches [cache_rows, kv_heads, cache_slots, d] with the given strides (elements).
 * Returns 0; 1 for a head_dim the kernel does not take; 2 when a place lies outside its tensor
 * (checked before anything is written). */
#define ROPE_KV(BF, T_)                                                                                    \
    if (d > MAX_HEAD_DIM || d % 2) return 1;                                                               \
    for (int64_t t = 0; t < tokens; t++) {                                                                 \
        if (kv_rows[t] < 0 || kv_rows[t] >= cache_rows || kv_slots[t] < 0 || kv_slots[t] >= cache_slots)   \
            return 2;                                                                                      \
        if (t >= q_from && (q_rows[t - q_from] < 0 || q_rows[t - q_from] >= batch ||                       \
                            q_cols[t - q_from] < 0 || q_cols[t - q_from] >= q_len))                        \
            return 2;                                                                                      \
    }                                                                                                      \
    const int64_t q_group = q_len * d, q_kv = groups * q_group, q_row = kv_heads * q_kv;                  \
    _Pragma("omp parallel for schedule(static) num_threads(threads) if (tokens >= 64)")                     \
    for (int64_t t = 0; t < tokens; t++) {                                                                 \
        const T_ *row = (const T_ *)qkv + t * width;                                                       \
        const T_ *c = (const T_ *)cos + t * d, *s = (const T_ *)sin + t * d;                               \
        if (t >= q_from) {                                                                                 \
            T_ *q = (T_ *)q_out + q_rows[t - q_from] * q_row + q_cols[t - q_from] * d;                     \
            for (int64_t j = 0; j < heads; j++)                                                            \
                norm_rope(row + j * d, qw, q_eps, c, s, q + (j / groups) * q_kv + (j % groups) * q_group,  \
                          d, BF);                                                                          \
        }                                                                                                  \
        const int64_t base = kv_rows[t] * stride_row + kv_slots[t] * stride_slot;                          \
        for (int64_t j = 0; j < kv_heads; j++) {                                                           \
            const int64_t off = base + j * stride_head;                                                    \
            norm_rope(row + (heads + j) * d, kw, k_eps, c, s, (T_ *)k_cache + off, d, BF);                 \
            memcpy((T_ *)v_cache + off, row + (heads + kv_heads + j) * d, d * sizeof(T_));                 \
        }                                                                                                  \
    }                                                                                                      \
    return 0;

int bs_rope_kv(ROPE_KV_ARGS(float)) { ROPE_KV(0, float) }

int bs_rope_kv_bf16(ROPE_KV_ARGS(uint16_t)) { ROPE_KV(1, uint16_t) }
