/* A native Llama-family target's decoder layers for one forward of a few fp32 tokens, in one call.
 *
 * Why: each layer is about ten kernel calls (two norms, four products, the q/k/v placement,
 * attention, the activation, the head permute), and from Python each costs a few microseconds
 * of argument checks and ctypes conversion beyond the kernel itself: ~1.3 ms of a 6.3 ms
 * one-token SmolLM2-135M forward on 2 cores, where the kernels take ~4.8 (BENCHMARKS.md, session
 * 30). Here the loop over layers runs in C and calls the same kernels with the same arguments
 * in the same order (models/native/program.py prepares them), so every output has the bits of
 * the Python loop in models/native/llama.py.
 *
 * bs_silu_mul is the MLP's activation, silu(gate) * up, for both paths: the Python loop calls it
 * too on the CPU, so the two cannot differ by PyTorch's own exp.
 */
#include "vec.h"

int bs_rows_matmul(const float *x, const float *w, const float *bias, float *y, int64_t n, int64_t in,
                   int64_t out, int threads);
int bs_rows_matmul_res(const float *x, const float *w, const float *bias, const float *res, float *y, int64_t n,
                       int64_t in, int64_t out, int threads);
int bs_rows_matmul_q4(const float *x, const uint8_t *qs, const float *sc, const float *bias, const float *res,
                      float *y, int64_t n, int64_t in, int64_t out, int threads);
int bs_rows_matmul_q8(const float *x, const uint8_t *qs, const float *sc, const float *bias, const float *res,
                      float *y, int64_t n, int64_t in, int64_t out, int threads);
int bs_rms_norm(const float *x, const float *w, float *y, int64_t rows, int64_t n, float eps, int threads);
int bs_rope_kv(const float *qkv, int64_t tokens, int64_t width, int64_t heads, int64_t kv_heads, int64_t groups,
               int64_t d, const float *qw, const float *kw, float q_eps, float k_eps, const float *cos,
               const float *sin, int64_t q_from, const int64_t *q_rows, const int64_t *q_cols, int64_t batch,
               int64_t q_len, float *q_out, const int64_t *kv_rows, const int64_t *kv_slots, float *k_cache,
               float *v_cache, int64_t cache_rows, int64_t cache_slots, int64_t stride_row, int64_t stride_head,
               int64_t stride_slot, int threads);
int bs_attention(const float *q, const float *k, const float *v, float *out, const int64_t *visible, int64_t b,
                 int64_t kvh, int64_t g, int64_t n, int64_t d, int64_t sb, int64_t sh, int64_t horizon, float scale,
                 int threads);

/* silu(g) * u per lane, g * e / (1 + e) with e = e^-|g| (g >= 0: g / (1 + e)), so e never
 * overflows; exp16 is vec.h's (relative error ~1e-7). Lane by lane: batch invariant. */
static inline v16 silu_mul16(v16 g, v16 u) {
    const i16 neg = g < 0;
    const v16 e = exp16(select16(neg, g, -g));
    const v16 s = select16(neg, g * e, g) / (1.0f + e);
    return s * u;
}

/* gate_up [rows, 2 * inter] (gate, then up, per row) -> y [rows, inter] = silu(gate) * up. Returns 0. */
int bs_silu_mul(const float *gate_up, float *y, int64_t rows, int64_t inter, int threads) {
    _Pragma("omp parallel for schedule(static) num_threads(threads) if (rows * inter >= 65536)")
    for (int64_t r = 0; r < rows; r++) {
        const float *g = gate_up + r * 2 * inter, *u = g + inter;
        float *o = y + r * inter;
        int64_t k = 0;
        for (; k + 16 <= inter; k += 16) {
            const v16 v = silu_mul16(load16(g + k), load16(u + k));
            memcpy(o + k, &v, sizeof v);
        }
        if (k < inter) { /* the tail through the same lanes, padded */
            float gt[16] = {0}, ut[16] = {0};
            memcpy(gt, g + k, (size_t)(inter - k) * sizeof(float));
            memcpy(ut, u + k, (size_t)(inter - k) * sizeof(float));
            const v16 v = silu_mul16(load16(gt), load16(ut));
            memcpy(o + k, &v, (size_t)(inter - k) * sizeof(float));
        }
    }
    return 0;
}

/* One product, described by 4 int64: kind (0: fp32 weight, 4 / 8: packed, rows.c), the weight or
 * packed bytes, the packed scales, the bias (0: none). res may be null. Returns rows.c's code. */
static int product(const int64_t *p, const float *x, const float *res, float *y, int64_t n, int64_t in,
                   int64_t out, int threads) {
    const void *w = (const void *)(intptr_t)p[1];
    const float *sc = (const float *)(intptr_t)p[2], *bias = (const float *)(intptr_t)p[3];
    switch (p[0]) {
    case 0:
        return res ? bs_rows_matmul_res(x, (const float *)w, bias, res, y, n, in, out, threads)
                   : bs_rows_matmul(x, (const float *)w, bias, y, n, in, out, threads);
    case 4: return bs_rows_matmul_q4(x, (const uint8_t *)w, sc, bias, res, y, n, in, out, threads);
    case 8: return bs_rows_matmul_q8(x, (const uint8_t *)w, sc, bias, res, y, n, in, out, threads);
    default: return 3;
    }
}

/* Per layer, LAYER_FIELDS int64 in `lw`: input norm, post-attention norm, q norm, k norm (0:
 * none), then the products q/k/v, o, gate/up, down (4 each, as `product`). */
#define LAYER_FIELDS 20

/* x [tokens, hidden]: the embeddings in, the last layer's output (before the final norm) out;
 * xb: scratch like x (the residual stream alternates between the two, so no product writes
 * its own input). kv [layers, 2]: each layer's K and V cache (the batch's first row). Tokens are the [batch, q_len] block in row-major order; cos, sin, q_rows,
 * q_cols, kv_rows, kv_slots and the cache geometry as bs_rope_kv takes them, visible, horizon and
 * scale as bs_attention. Scratch: y [tokens, hidden], qkv [tokens, (heads + 2 kv_heads) d],
 * q and att [batch, kv_heads, groups * q_len, d], o_in [tokens, heads d], gate_up
 * [tokens, 2 inter], act [tokens, inter]. capture [layers]: a column offset into features
 * [tokens, feat_width] where that layer's output goes, or -1.
 * Returns 0; otherwise the first failing kernel's code plus 10 * (which step failed) (then the
 * caller runs its own loop: every step here can be repeated, the K/V writes included). */
int bs_layers(float *x, float *xb, int64_t tokens, int64_t hidden, int64_t layers, const int64_t *lw,
              const int64_t *kv, int64_t heads, int64_t kv_heads, int64_t d, float eps, float q_eps, float k_eps,
              const float *cos, const float *sin, const int64_t *q_rows, const int64_t *q_cols, int64_t batch, int64_t q_len,
              const int64_t *kv_rows, const int64_t *kv_slots, int64_t cache_rows, int64_t cache_slots,
              int64_t stride_row, int64_t stride_head, int64_t stride_slot, const int64_t *visible, int64_t horizon,
              float scale, int64_t inter, float *y, float *qkv, float *q, float *att, float *o_in, float *gate_up,
              float *act, const int64_t *capture, float *features, int64_t feat_width, int threads) {
    const int64_t groups = heads / kv_heads, width = (heads + 2 * kv_heads) * d, hd = heads * d;
    for (int64_t i = 0; i < layers; i++) {
        const int64_t *l = lw + i * LAYER_FIELDS;
        const float *in_norm = (const float *)(intptr_t)l[0], *post_norm = (const float *)(intptr_t)l[1];
        const float *qw = (const float *)(intptr_t)l[2], *kw = (const float *)(intptr_t)l[3];
        float *k_cache = (float *)(intptr_t)kv[2 * i], *v_cache = (float *)(intptr_t)kv[2 * i + 1];
        int rc;
        bs_rms_norm(x, in_norm, y, tokens, hidden, eps, threads);
        if ((rc = product(l + 4, y, 0, qkv, tokens, hidden, width, threads))) return 10 + rc;
        if ((rc = bs_rope_kv(qkv, tokens, width, heads, kv_heads, groups, d, qw, kw, q_eps, k_eps, cos, sin, 0, q_rows,
                             q_cols, batch, q_len, q, kv_rows, kv_slots, k_cache, v_cache, cache_rows, cache_slots,
                             stride_row, stride_head, stride_slot, threads)))
            return 20 + rc;
        if ((rc = bs_attention(q, k_cache, v_cache, att, visible, batch, kv_heads, groups, q_len, d, stride_row,
                               stride_head, horizon, scale, threads)))
            return 31;
        /* [batch, kv_heads, groups, q_len, d] -> [batch, q_len, heads d], PyTorch's permute */
        for (int64_t b = 0; b < batch; b++)
            for (int64_t kv = 0; kv < kv_heads; kv++)
                for (int64_t g = 0; g < groups; g++)
                    for (int64_t c = 0; c < q_len; c++)
                        memcpy(o_in + (b * q_len + c) * hd + (kv * groups + g) * d,
                               att + (((b * kv_heads + kv) * groups + g) * q_len + c) * d, (size_t)d * sizeof(float));
        if ((rc = product(l + 8, o_in, x, xb, tokens, hd, hidden, threads))) return 40 + rc;
        bs_rms_norm(xb, post_norm, y, tokens, hidden, eps, threads);
        if ((rc = product(l + 12, y, 0, gate_up, tokens, hidden, 2 * inter, threads))) return 50 + rc;
        bs_silu_mul(gate_up, act, tokens, inter, threads);
        if ((rc = product(l + 16, act, xb, x, tokens, inter, hidden, threads))) return 60 + rc;
        if (capture[i] >= 0)
            for (int64_t t = 0; t < tokens; t++)
                memcpy(features + t * feat_width + capture[i], x + t * hidden, (size_t)hidden * sizeof(float));
    }
    return 0;
}
