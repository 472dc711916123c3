"""One sequence of a decoding batch: its sampling parameters, stop ids, committed tokens,
acceptance counts and statistics (`Row`, made by `make_row`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from blockspec.config import SamplingParams
from blockspec.dflash.constraint import TokenConstraint
from blockspec.dflash.lookup import TokenIndex
from blockspec.dflash.results import RequestStats, TokenLogprob

RowStopCheck = Callable[[list[int]], int | None]


@dataclass
class Row:
    """One sequence of a DecodeBatch. `key` is the caller's identity for it."""

    key: object
    params: SamplingParams
    stop_ids: frozenset[int]
    stats: RequestStats
    stop_check: RowStopCheck | None = None
    generated: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    new_tokens: list[int] = field(default_factory=list)  # committed by the latest join or step
    # tries[k]: steps in which proposal k (0-based) was verified with proposals 0..k-1 accepted.
    tries: list[int] = field(default_factory=list)
    decode_t0: float = 0.0
    captured: list[torch.Tensor] | None = None  # feature chunks of fed positions (capture mode)
    index: TokenIndex | None = None  # prompt + generated, for n-gram lookup proposals
    lookup_tries: list[int] = field(default_factory=list)  # as `tries`, for lookup proposals
    # With params.logprobs: one entry per generated token, and those of `new_tokens`.
    logprobs: list[TokenLogprob] | None = None
    new_logprobs: list[TokenLogprob] = field(default_factory=list)
    # The grammar the output must match (dflash/constraint.py), at the committed tokens.
    constraint: TokenConstraint | None = None

    @property
    def remaining(self) -> int:
        return self.params.max_new_tokens - len(self.generated)

    def acceptance_rates(self, priors: Mapping[str, list[float]], weight: float = 4.0, *, lookup: bool = False
                         ) -> list[float]:
        """Per-position conditional acceptance estimates of the drafter's proposals (or with
        lookup=True of lookup proposals), shrunk towards the prior of this row's verification
        rule (`priors[rule]`: rows of different rules accept sampled proposals unalike)."""
        prior = priors[self.params.rule]
        acc = self.stats.lookup_accepted_by_position if lookup else self.stats.accepted_by_position
        tries = self.lookup_tries if lookup else self.tries
        return [
            (acc[k] + weight * prior[k]) / (tries[k] + weight) if k < len(tries) else prior[k]
            for k in range(len(prior))
        ]


def _stop_ids(params: SamplingParams, eos: tuple[int, ...]) -> frozenset[int]:
    ids = set(params.stop_token_ids)
    if not params.ignore_eos:
        ids.update(eos)
    return frozenset(ids)


def make_row(key: object, prompt_len: int, params: SamplingParams, eos: tuple[int, ...], max_block: int,
             stop_check: RowStopCheck | None = None, constraint: TokenConstraint | None = None) -> Row:
    """A Row with fresh statistics for a request of `prompt_len` tokens (`constraint`: a fresh
    grammar matcher its output must match)."""
    if params.rule_for(constraint is not None) != params.rule:  # a constrained row stays keyed
        params = params.with_(sampling_rule=params.rule_for(True))
    positions = max(0, max_block - 1)
    stats = RequestStats(prompt_tokens=prompt_len, block_size=max_block, accepted_by_position=[0] * positions,
                         lookup_accepted_by_position=[0] * positions, sampling_rule=params.rule)
    return Row(key, params, _stop_ids(params, eos), stats, stop_check, tries=[0] * positions,
               lookup_tries=[0] * positions, logprobs=[] if params.logprobs is not None else None,
               constraint=constraint)
