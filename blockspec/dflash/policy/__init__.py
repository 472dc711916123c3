"""The adaptive policy: each step's verify width, chain or tree, from what steps cost and what
they are expected to commit (the whole picture: `adaptive`'s docstring).

- `costs`: seconds per step by batch bucket and width (`CostModel`);
- `expectation`: acceptance counts per rule and expected tokens by width;
- `calibration`: a step's cost timed on throwaway caches before serving;
- `adaptive`: `AdaptiveBlock`, the choice itself, its checks and its tuning constants.
"""

from blockspec.dflash.policy.adaptive import AdaptiveBlock, draft_margin
from blockspec.dflash.policy.calibration import calibrate, calibration_sizes, time_sizes
from blockspec.dflash.policy.costs import CostModel, at_least, bucket, buckets_up_to, cost_at, interpolate
from blockspec.dflash.policy.expectation import (RULES, Acceptance, acceptance_counts, count_growth, expected_by_block,
                                                 expected_tokens, split_lengths, tree_expected_by_width)

__all__ = ["RULES", "Acceptance", "AdaptiveBlock", "CostModel", "acceptance_counts", "at_least", "bucket",
           "buckets_up_to", "calibrate", "calibration_sizes", "cost_at", "count_growth", "draft_margin",
           "expected_by_block", "expected_tokens", "interpolate", "split_lengths", "time_sizes",
           "tree_expected_by_width"]
