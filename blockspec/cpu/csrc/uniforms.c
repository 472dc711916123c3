/* The keyed uniforms of dflash/sampling.py (`slot_uniforms`): splitmix64 of key + slot * golden,
 * its top 53 bits as (bits + 0.5) * 2^-53 in (0, 1). What a sampled step's draws and the standard
 * rule's tests read, a few dozen per verified or drafted position.
 *
 * Why: in PyTorch the same integer steps are a dozen elementwise operations on small tensors, each
 * paying its dispatch; here one loop. Unsigned 64-bit products and shifts are PyTorch's wrapping
 * int64 products and masked shifts, and the conversion is exact up to the one rounding of + 0.5
 * (IEEE double, nearest even, as PyTorch's), so every uniform has PyTorch's bits (tested).
 */
#include <stdint.h>

#define GOLDEN 0x9E3779B97F4A7C15ull
#define MIX1 0xBF58476D1CE4E5B9ull
#define MIX2 0x94D049BB133111EBull

/* out[i * k + j] = the uniform of (keys[i], slot), slot = slots[i * k + j] (per_key) or slots[j]. */
int bs_slot_uniforms(const int64_t *keys, const int64_t *slots, int64_t n, int64_t k, int per_key, double *out) {
    for (int64_t i = 0; i < n; i++) {
        const uint64_t key = (uint64_t)keys[i];
        const int64_t *s = per_key ? slots + i * k : slots;
        for (int64_t j = 0; j < k; j++) {
            uint64_t z = key + (uint64_t)s[j] * GOLDEN;
            z = (z ^ (z >> 30)) * MIX1;
            z = (z ^ (z >> 27)) * MIX2;
            z ^= z >> 31;
            out[i * k + j] = ((double)(z >> 11) + 0.5) * 0x1p-53;
        }
    }
    return 0;
}
