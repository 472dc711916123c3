/* The keyed randomness of dflash/sampling.py in C: a position's key (`keyed`: splitmix64 of the
 * request's seed and the output position), a slot's uniform under a key (`slot_uniforms`), with
 * the bits of the Python functions (unsigned 64-bit products wrap as Python's masked ones do), and
 * a race's entrant. */
#ifndef BLOCKSPEC_KEYED_H
#define BLOCKSPEC_KEYED_H
#include <math.h>
#include <stdint.h>

#define RACE_HEAD 32 /* dflash/sampling.py's RACE_HEAD: tokens with clocks of their own */
#define KEYED_GOLDEN 0x9E3779B97F4A7C15ull
#define KEYED_POSITION 0xD1B54A32D192ED03ull

static inline uint64_t keyed_mix(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* `keyed(seed, position)`, seed as its 64-bit residue */
static inline uint64_t keyed_position(uint64_t seed, int64_t position) {
    return keyed_mix(seed * KEYED_GOLDEN + (uint64_t)(position + 1) * KEYED_POSITION);
}

/* the uniform in (0, 1) of (key, slot): the top 53 bits of the mix, + 0.5, times 2^-53 */
static inline double keyed_uniform(uint64_t key, int64_t slot) {
    return ((double)(keyed_mix(key + (uint64_t)slot * KEYED_GOLDEN) >> 11) + 0.5) * 0x1p-53;
}

/* One entrant of a keyed race (dflash/sampling.py's `RowRandom.sample`): token id with probability
 * p finishes at -log(u) / p (float64), u its uniform under the position's key; *pick becomes it
 * where it finishes strictly first so far (*best its time). p = 0 never finishes. */
static inline void keyed_race(double *best, int64_t *pick, uint64_t key, int64_t id, float p) {
    if (!(p > 0.0f)) return;
    const double arrival = -log(keyed_uniform(key, id)) / (double)p;
    if (arrival < *best) *best = arrival, *pick = id;
}

#endif
