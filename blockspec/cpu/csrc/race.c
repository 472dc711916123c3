/* The keyed race of dflash/sparse_probs.py's `sample_pairs` over nucleus pairs: each position's
 * token drawn from its (id, probability) pairs with the clocks of its output position's key, the
 * race of `RowRandom.sample` over the vocabulary-wide row the pairs stand for.
 *
 * Why: every sampled step draws the target's token at each verified position (plain decoding's
 * one, a keyed row's every verified one), and on the host the race was a key per position in
 * Python, a tensor of uniforms, list conversions and a loop (~60 us of a ~3 ms plain step).
 */
#include <stdint.h>

#include "keyed.h"


/* ids, probs: rows x k pairs (rows = groups x per; probability 0: padding), group g's position
 * j = r % per keyed by seeds[g] (its 64-bit residue) at output position starts[g] + j. Writes
 * drawn[rows]. Returns 0, or 1 where some position has more than RACE_HEAD tokens of mass > 0
 * (the caller's race then draws its tail; drawn is then unspecified). */
int bs_pairs_race(const int64_t *ids, const float *probs, int64_t groups, int64_t per, int64_t k,
                  const uint64_t *seeds, const int64_t *starts, int64_t *drawn) {
    for (int64_t r = 0; r < groups * per; r++) {
        const int64_t *row_ids = ids + r * k;
        const float *row_p = probs + r * k;
        int64_t mass = 0;
        for (int64_t j = 0; j < k; j++) mass += row_p[j] > 0.0f;
        if (mass > RACE_HEAD) return 1;
        const int64_t g = r / per;
        const uint64_t key = keyed_position(seeds[g], starts[g] + r % per);
        double best = INFINITY;
        int64_t pick = row_ids[0];
        for (int64_t j = 0; j < k; j++) keyed_race(&best, &pick, key, row_ids[j], row_p[j]);
        drawn[r] = pick;
    }
    return 0;
}
