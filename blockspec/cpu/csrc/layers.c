/* A native model's decoder layers for one forward of a few tokens, in one call.
 *
 * Why: each layer is about ten kernel calls (two norms, four products, the q/k/v placement,
 * attention, the activation, the head permute), and from Python each costs a few microseconds
 * of argument checks and ctypes conversion beyond the kernel itself, a large part of a one-token
 * forward of a small model (BENCHMARKS.md, "Kernel measurements").
 * Here the loop over layers runs in C and calls the same kernels with the same
 * arguments in the same order (cpu/program.py prepares them), so every output has
 * the bits of the Python loops: targets/native/llama.py's, and the drafter's (dflash/drafter.py)
 * over its static pass (dflash/static_drafter.py).
 *
 * The drafter's pass is the same loop with a context: the first `ctx` rows of each layer's q/k/v
 * projection are the drafter's projected target features (the same for every layer, and
 * without queries), the block's tokens follow. bf16 models (a bf16 target,
 * the bf16 drafter beside an fp32 target) round where PyTorch's bf16 tensors round: each
 * product and the attention's output once to bf16, then the residual sum.
 *
 * bs_silu_mul(_bf16) is the MLP's activation, silu(gate) * up, for both paths: the Python loops
 * call it too on the CPU, so the two cannot differ by PyTorch's own exp.
 */
#include "vec.h"
#include "kernels.h"

/* silu(g) per lane, g * e / (1 + e) with e = e^-|g| (g >= 0: g / (1 + e)), so e never
 * overflows; exp16 is vec.h's (relative error ~1e-7). Lane by lane: batch invariant. */
static inline v16 silu16(v16 g) {
    const i16 neg = g < 0;
    const v16 e = exp16(select16(neg, g, -g));
    return select16(neg, g * e, g) / (1.0f + e);
}

/* gate_up [rows, 2 * inter] (gate, then up, per row) -> y [rows, inter] = silu(gate) * up; bf16:
 * silu(gate) rounded to bf16, then the product rounded, as PyTorch's bf16 operators round. */
static inline void silu_mul(const void *gate_up, void *y, int64_t rows, int64_t inter, int threads, const int bf) {
    _Pragma("omp parallel for schedule(static) num_threads(threads) if (rows * inter >= 65536)")
    for (int64_t r = 0; r < rows; r++) {
        const int64_t g0 = r * 2 * inter, u0 = g0 + inter;
        for (int64_t k = 0; k < inter; k += 16) {
            const int64_t lanes = inter - k < 16 ? inter - k : 16;
            v16 g, u;
            if (lanes == 16) {
                g = load(gate_up, g0 + k, bf), u = load(gate_up, u0 + k, bf);
            } else { /* the tail through the same lanes, padded */
                float gt[16] = {0}, ut[16] = {0};
                for (int64_t l = 0; l < lanes; l++)
                    gt[l] = scalar(gate_up, g0 + k + l, bf), ut[l] = scalar(gate_up, u0 + k + l, bf);
                g = load16(gt), u = load16(ut);
            }
            const v16 s = silu16(g);
            float o[16];
            if (!bf) {
                const v16 p = s * u;
                memcpy(o, &p, sizeof p);
                memcpy((float *)y + r * inter + k, o, (size_t)lanes * sizeof(float));
            } else {
                memcpy(o, &s, sizeof s);
                for (int64_t l = 0; l < lanes; l++) {
                    const uint16_t h = to_bf16(o[l]);
                    ((uint16_t *)y)[r * inter + k + l] = to_bf16(scalar(&h, 0, 1) * u[l]);
                }
            }
        }
    }
}

/* Returns 0. */
int bs_silu_mul(const float *gate_up, float *y, int64_t rows, int64_t inter, int threads) {
    silu_mul(gate_up, y, rows, inter, threads, 0);
    return 0;
}

int bs_silu_mul_bf16(const uint16_t *gate_up, uint16_t *y, int64_t rows, int64_t inter, int threads) {
    silu_mul(gate_up, y, rows, inter, threads, 1);
    return 0;
}

/* One product, described by PRODUCT_FIELDS int64: kind (0: the weight, 4 / 8: its packed copy,
 * rows.c; 20 / 24: an integer product of 4- / 8-bit weights, int8.c, fp32 only), the packed bytes,
 * the packed scales (int8: the blocks' d, fp16), the bias (fp32, 0: none), the weight (the model's
 * dtype; int8: the blocks' m of 4-bit weights, fp16). y = x . w^T + bias (+ res, may be null), in the model's dtype: fp32 straight
 * from the kernel (the residual in the same call); bf16 through acc (fp32 scratch), the product
 * rounded to bf16, then res + product rounded again. A bf16 product of more than packed_max rows
 * reads the weight, not the packed copy (cpu/packed_weights.py). Returns rows.c's code. */
#define PRODUCT_FIELDS 5
static int product(const int64_t *p, const void *x, const void *res, void *y, float *acc, int64_t n, int64_t in,
                   int64_t out, int64_t packed_max, int threads, const int bf) {
    const uint8_t *qs = (const uint8_t *)(intptr_t)p[1];
    const float *sc = (const float *)(intptr_t)p[2], *bias = (const float *)(intptr_t)p[3];
    const void *w = (const void *)(intptr_t)p[4];
    int rc;
    if (!bf) {
        const float *r = (const float *)res;
        switch (p[0]) {
        case 0:
            return r ? bs_rows_matmul_res(x, w, bias, r, y, n, in, out, threads)
                     : bs_rows_matmul(x, w, bias, y, n, in, out, threads);
        case 4: return bs_rows_matmul_q4(x, qs, sc, bias, r, y, n, in, out, threads);
        case 8: return bs_rows_matmul_q8(x, qs, sc, bias, r, y, n, in, out, threads);
        case 20: return bs_int8_matmul_q4(x, qs, (const uint16_t *)sc, (const uint16_t *)w, bias, r, y, n, in, out, threads);
        case 24: return bs_int8_matmul_q8(x, qs, (const uint16_t *)sc, 0, bias, r, y, n, in, out, threads);
        default: return 3;
        }
    }
    if (p[0] == 4 && n <= packed_max) rc = bs_rows_matmul_q4_bf16(x, qs, sc, bias, acc, n, in, out, threads);
    else if (p[0] == 8 && n <= packed_max) rc = bs_rows_matmul_q8_bf16(x, qs, sc, bias, acc, n, in, out, threads);
    else rc = bs_rows_matmul_bf16(x, w, bias, acc, n, in, out, threads);
    if (rc) return rc;
    uint16_t *o = (uint16_t *)y;
    const uint16_t *r = (const uint16_t *)res;
    for (int64_t i = 0; i < n * out; i++) {
        const uint16_t h = to_bf16(acc[i]);
        o[i] = r ? to_bf16(scalar(r, i, 1) + scalar(&h, 0, 1)) : h;
    }
    return 0;
}

/* Per layer, LAYER_FIELDS int64 in `lw`: input norm, post-attention norm, q norm, k norm (0:
 * none; the model's dtype), then the products q/k/v, o, gate/up, down (as `product`). */
#define LAYER_FIELDS (4 + 4 * PRODUCT_FIELDS)

/* dims, in order */
enum { D_CTX, D_TOKENS, D_HIDDEN, D_LAYERS, D_HEADS, D_KV_HEADS, D_HEAD_DIM, D_INTER, D_BATCH, D_Q_LEN,
       D_CACHE_ROWS, D_CACHE_SLOTS, D_STRIDE_ROW, D_STRIDE_HEAD, D_STRIDE_SLOT, D_HORIZON, D_FEAT_WIDTH,
       D_PACKED_MAX, D_TREE_WIDTH, D_COUNT };

/* bf: 0 fp32, 1 bf16 (every tensor below but att and acc in that dtype). dims: the D_* values;
 * scal: rms eps, q-norm eps, k-norm eps, attention scale.
 * x [tokens, hidden]: the block's inputs in, the last layer's output (before the final norm)
 * out; xb: scratch like x (the residual stream alternates between the two, so no product
 * writes its own input). kin [ctx + tokens, hidden]: its first ctx rows hold the context (the
 * drafter's; ctx = 0 for a target), the rest is scratch. kv [layers, 2]: each layer's K and V
 * cache (the batch's first row). The tokens are the [batch, q_len] block in row-major order;
 * cos, sin [ctx + tokens, d], q_rows, q_cols [tokens], kv_rows, kv_slots [ctx + tokens] and the
 * cache geometry as bs_rope_kv takes them (queries from token ctx on), visible, start (null, or
 * each query's first key), tree (null, or a token tree's keys: [batch, q_len, 1 + tree width]), horizon
 * and scale as bs_attention. Scratch: qkv [ctx + tokens, (heads + 2 kv_heads) d], q [batch, kv_heads,
 * groups * q_len, d], att (fp32) like q, o_in [tokens, heads d], gate_up [tokens, 2 inter], act
 * [tokens, inter], acc (fp32, bf16 only) as large as the largest product's output.
 * capture [layers]: a column offset into features [tokens, feat_width] for that layer's output,
 * or -1. Returns 0; otherwise the failing kernel's code plus 10 * (which step failed) (the
 * caller then runs its own loop: every step here can be repeated, the K/V writes included). */
static inline int layers_loop(void *x, void *xb, const int64_t *dims, const float *scal, const int64_t *lw,
                              const int64_t *kv, const void *cos, const void *sin, const int64_t *q_rows,
                              const int64_t *q_cols, const int64_t *kv_rows, const int64_t *kv_slots,
                              const int64_t *visible, const int64_t *start, const int64_t *tree, void *kin,
                              void *qkv, void *q, float *att,
                              void *o_in,
                              void *gate_up, void *act, float *acc, const int64_t *capture, void *features,
                              int threads, const int bf) {
    const int64_t ctx = dims[D_CTX], tokens = dims[D_TOKENS], hidden = dims[D_HIDDEN], heads = dims[D_HEADS];
    const int64_t kv_heads = dims[D_KV_HEADS], d = dims[D_HEAD_DIM], inter = dims[D_INTER], batch = dims[D_BATCH];
    const int64_t q_len = dims[D_Q_LEN], packed_max = dims[D_PACKED_MAX], fw = dims[D_FEAT_WIDTH];
    const int64_t groups = heads / kv_heads, width = (heads + 2 * kv_heads) * d, hd = heads * d;
    const size_t es = bf ? sizeof(uint16_t) : sizeof(float);
    const float eps = scal[0], q_eps = scal[1], k_eps = scal[2], scale = scal[3];
    char *y = (char *)kin + ctx * hidden * es; /* the block's rows of kin */
    for (int64_t i = 0; i < dims[D_LAYERS]; i++) {
        const int64_t *l = lw + i * LAYER_FIELDS;
        const void *in_norm = (const void *)(intptr_t)l[0], *post_norm = (const void *)(intptr_t)l[1];
        const void *qw = (const void *)(intptr_t)l[2], *kw = (const void *)(intptr_t)l[3];
        void *k_cache = (void *)(intptr_t)kv[2 * i], *v_cache = (void *)(intptr_t)kv[2 * i + 1];
        int rc;
        if (bf) bs_rms_norm_bf16(x, in_norm, (uint16_t *)y, tokens, hidden, eps, threads);
        else bs_rms_norm(x, in_norm, (float *)y, tokens, hidden, eps, threads);
        if ((rc = product(l + 4, kin, 0, qkv, acc, ctx + tokens, hidden, width, packed_max, threads, bf)))
            return 10 + rc;
        rc = bf ? bs_rope_kv_bf16(qkv, ctx + tokens, width, heads, kv_heads, groups, d, qw, kw, q_eps, k_eps, cos, sin,
                                  ctx, q_rows, q_cols, batch, q_len, q, kv_rows, kv_slots, k_cache, v_cache,
                                  dims[D_CACHE_ROWS], dims[D_CACHE_SLOTS], dims[D_STRIDE_ROW], dims[D_STRIDE_HEAD],
                                  dims[D_STRIDE_SLOT], threads)
                : bs_rope_kv(qkv, ctx + tokens, width, heads, kv_heads, groups, d, qw, kw, q_eps, k_eps, cos, sin, ctx,
                             q_rows, q_cols, batch, q_len, q, kv_rows, kv_slots, k_cache, v_cache, dims[D_CACHE_ROWS],
                             dims[D_CACHE_SLOTS], dims[D_STRIDE_ROW], dims[D_STRIDE_HEAD], dims[D_STRIDE_SLOT],
                             threads);
        if (rc) return 20 + rc;
        rc = bf ? bs_attention_bf16(q, k_cache, v_cache, att, visible, start, tree, batch, kv_heads, groups, q_len,
                                    d, dims[D_STRIDE_ROW], dims[D_STRIDE_HEAD], dims[D_HORIZON], dims[D_TREE_WIDTH],
                                    scale, threads)
                : bs_attention(q, k_cache, v_cache, att, visible, start, tree, batch, kv_heads, groups, q_len, d,
                               dims[D_STRIDE_ROW], dims[D_STRIDE_HEAD], dims[D_HORIZON], dims[D_TREE_WIDTH], scale,
                               threads);
        if (rc) return 31;
        /* [batch, kv_heads, groups, q_len, d] -> [batch, q_len, heads d], PyTorch's permute (bf16:
         * the attention's output rounded to bf16 first, as the Python loop casts it) */
        for (int64_t b = 0; b < batch; b++)
            for (int64_t kh = 0; kh < kv_heads; kh++)
                for (int64_t g = 0; g < groups; g++)
                    for (int64_t c = 0; c < q_len; c++) {
                        const float *src = att + (((b * kv_heads + kh) * groups + g) * q_len + c) * d;
                        const int64_t at = (b * q_len + c) * hd + (kh * groups + g) * d;
                        if (bf)
                            for (int64_t k = 0; k < d; k++) ((uint16_t *)o_in)[at + k] = to_bf16(src[k]);
                        else
                            memcpy((float *)o_in + at, src, (size_t)d * sizeof(float));
                    }
        if ((rc = product(l + 4 + PRODUCT_FIELDS, o_in, x, xb, acc, tokens, hd, hidden, packed_max, threads, bf)))
            return 40 + rc;
        if (bf) bs_rms_norm_bf16(xb, post_norm, (uint16_t *)y, tokens, hidden, eps, threads);
        else bs_rms_norm(xb, post_norm, (float *)y, tokens, hidden, eps, threads);
        if ((rc = product(l + 4 + 2 * PRODUCT_FIELDS, y, 0, gate_up, acc, tokens, hidden, 2 * inter, packed_max,
                          threads, bf)))
            return 50 + rc;
        silu_mul(gate_up, act, tokens, inter, threads, bf);
        if ((rc = product(l + 4 + 3 * PRODUCT_FIELDS, act, xb, x, acc, tokens, inter, hidden, packed_max, threads,
                          bf)))
            return 60 + rc;
        if (capture[i] >= 0)
            for (int64_t t = 0; t < tokens; t++)
                memcpy((char *)features + (t * fw + capture[i]) * es, (char *)x + t * hidden * es,
                       (size_t)hidden * es);
    }
    return 0;
}

#define LAYERS_ARGS(T_)                                                                                   \
    T_ *x, T_ *xb, const int64_t *dims, const float *scal, const int64_t *lw, const int64_t *kv, const T_ *cos, \
        const T_ *sin, const int64_t *q_rows, const int64_t *q_cols, const int64_t *kv_rows,                 \
        const int64_t *kv_slots, const int64_t *visible, const int64_t *start, const int64_t *tree, T_ *kin,   \
        T_ *qkv, T_ *q,                                                                                   \
        float *att, T_ *o_in, T_ *gate_up, T_ *act, float *acc, const int64_t *capture, T_ *features,        \
        int threads
#define LAYERS_CALL(BF)                                                                                   \
    if (dims[D_HEADS] % dims[D_KV_HEADS]) return 1;                                                       \
    return layers_loop(x, xb, dims, scal, lw, kv, cos, sin, q_rows, q_cols, kv_rows, kv_slots, visible, start, tree, \
                       kin, qkv, q, att, o_in, gate_up, act, acc, capture, features, threads, BF);

int bs_layers(LAYERS_ARGS(float)) { LAYERS_CALL(0) }

int bs_layers_bf16(LAYERS_ARGS(uint16_t)) { LAYERS_CALL(1) }

/* the number of dims and of int64 per layer the caller fills (cpu/program.py checks) */
int bs_layers_layout(int64_t *out) {
    out[0] = D_COUNT, out[1] = LAYER_FIELDS, out[2] = PRODUCT_FIELDS;
    return 0;
}
