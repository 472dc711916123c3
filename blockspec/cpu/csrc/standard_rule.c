/* The standard rule of speculative sampling over nucleus pairs (dflash/verify.py,
 * `verify_standard` with p and q as pairs): per row, keep proposal x while u * q(x) < p(x), and
 * draw the bonus from the normalised residual max(0, p - q) at the first rejection, or from p
 * after the last verified proposal. The uniforms are the keyed ones of each position's key
 * (keyed.h, the slots ACCEPT_SLOT and BONUS_SLOT of dflash/sampling.py).
 *
 * Why: a verified position's nucleus is a handful of tokens, and on the host the rule was list
 * conversions and Python loops over them (~0.1 ms a sampled step of a lone row). The arithmetic
 * is `_verify_pairs`'s: the test in float64, the residual in float32, the inverse CDF's running
 * sum in float64 rounded to float32 at each entry, the draw's target float32(u) * total kept
 * below the total, so the same accepted and bonus (tested).
 */
#include <math.h>
#include <stdint.h>

#include "keyed.h"

#define ACCEPT_SLOT (-1)
#define BONUS_SLOT (-2)

/* the probability of token among pairs ids/probs[0..k) (0 where it is not among them) */
static float pair_prob(const int64_t *ids, const float *probs, int64_t k, int64_t token) {
    for (int64_t j = 0; j < k; j++)
        if (ids[j] == token && probs[j] > 0.0f) return probs[j];
    return 0.0f;
}

/* `sample_from` of weights w[0..k) (float32, some > 0) with uniform u */
static int64_t inverse_cdf(const float *w, int64_t k, double u) {
    float cdf[k > 0 ? k : 1];
    double run = 0.0;
    for (int64_t j = 0; j < k; j++) run += w[j], cdf[j] = (float)run;
    const float total = cdf[k - 1];
    const float below = nextafterf(total, 0.0f);
    float target = (float)u * total;
    if (target > below) target = below;
    int64_t idx = 0;
    while (idx < k && cdf[idx] <= target) idx++; /* the first entry past the target */
    return idx < k - 1 ? idx : k - 1;
}

/* proposals: b x m (m >= 1); p_ids, p_probs: b x (m + 1) x k, the target's pairs; q_ids, q_probs:
 * b x m x kq, the draft's (any order; padding has probability 0); keys: b x (m + 1), each
 * position's key; limit: b (row r verifies its first limit[r] proposals) or NULL. Writes
 * accepted[b] and bonus[b]. Returns 0, 1 where k exceeds the scratch this keeps. */
int bs_standard_rule(const int64_t *proposals, int64_t b, int64_t m, const int64_t *p_ids, const float *p_probs,
                     int64_t k, const int64_t *q_ids, const float *q_probs, int64_t kq, const int64_t *keys,
                     const int64_t *limit, int64_t *accepted, int64_t *bonus) {
    if (k > 4096 || m < 1) return 1;
    float residual[k > 0 ? k : 1];
    for (int64_t r = 0; r < b; r++) {
        const int64_t lim = limit ? limit[r] : m;
        const int64_t *row_keys = keys + r * (m + 1);
        int64_t a = 0;
        while (a < (lim < m ? lim : m)) {
            const int64_t x = proposals[r * m + a];
            const int64_t *pi = p_ids + (r * (m + 1) + a) * k;
            const float p_x = pair_prob(pi, p_probs + (r * (m + 1) + a) * k, k, x);
            const float q_x = pair_prob(q_ids + (r * m + a) * kq, q_probs + (r * m + a) * kq, kq, x);
            if (!(keyed_uniform((uint64_t)row_keys[a], ACCEPT_SLOT) * (double)q_x < (double)p_x)) break;
            a++;
        }
        accepted[r] = a;
        const int64_t *ids_at = p_ids + (r * (m + 1) + a) * k;
        const float *p_at = p_probs + (r * (m + 1) + a) * k;
        const float *w = p_at;
        if (a < lim) { /* rejected: the residual against q at that position */
            const int64_t j = a < m - 1 ? a : m - 1;
            const int64_t *qi = q_ids + (r * m + j) * kq;
            const float *qp = q_probs + (r * m + j) * kq;
            int any = 0;
            for (int64_t t = 0; t < k; t++) {
                const float d = p_at[t] - pair_prob(qi, qp, kq, ids_at[t]);
                residual[t] = d > 0.0f ? d : 0.0f;
                any |= residual[t] > 0.0f;
            }
            /* p == q at a rejection is impossible but for rounding: p itself is then the residual's limit */
            if (any) w = residual;
        }
        bonus[r] = ids_at[inverse_cdf(w, k, keyed_uniform((uint64_t)row_keys[a], BONUS_SLOT))];
    }
    return 0;
}
