/* The keyed uniforms of dflash/sampling.py (`slot_uniforms`) and the keys of output positions
 * (`RowRandom.keys`), through keyed.h: what a sampled step's draws and the standard rule's tests
 * read, a few dozen per verified or drafted position.
 *
 * Why: in PyTorch the same integer steps are a dozen elementwise operations on small tensors, each
 * paying its dispatch, and the keys a Python loop per position; here one loop. Unsigned 64-bit
 * products and shifts are PyTorch's wrapping int64 products and masked shifts, and the conversion
 * is exact up to the one rounding of + 0.5 (IEEE double, nearest even, as PyTorch's), so every
 * uniform has PyTorch's bits (tested).
 */
#include "keyed.h"

/* out[i * k + j] = the uniform of (keys[i], slot), slot = slots[i * k + j] (per_key) or slots[j]. */
int bs_slot_uniforms(const int64_t *keys, const int64_t *slots, int64_t n, int64_t k, int per_key, double *out) {
    for (int64_t i = 0; i < n; i++) {
        const uint64_t key = (uint64_t)keys[i];
        const int64_t *s = per_key ? slots + i * k : slots;
        for (int64_t j = 0; j < k; j++) out[i * k + j] = keyed_uniform(key, s[j]);
    }
    return 0;
}

/* out[r * n + j] = the key of row r's output position starts[r] + j under seeds[r] (its 64-bit
 * residue), as a bit pattern. */
int bs_position_keys(const uint64_t *seeds, const int64_t *starts, int64_t rows, int64_t n, int64_t *out) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t j = 0; j < n; j++) out[r * n + j] = (int64_t)keyed_position(seeds[r], starts[r] + j);
    return 0;
}
