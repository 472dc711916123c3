"""Frozen, validated configuration objects shared across components.

Each dataclass checks itself in `__post_init__`, so an invalid value fails where it was written,
with a message naming the argument and the accepted range.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from blockspec.errors import ConfigError

MAX_BLOCK_SIZE = 64
# The largest token tree a step may verify (SpecConfig.tree_nodes): one verify pass's nodes.
MAX_TREE_NODES = 256
# The largest token tree `blockspec.load`, the command line and the server verify per step unless
# told otherwise (0: chains only): the adaptive policy then verifies a tree only in steps where it
# expects one to pay better than the chain, and with trees it measured level with or ahead of
# chains without them (BENCHMARKS.md, token trees). Targets that cannot verify trees keep chains.
DEFAULT_TREE_NODES = 15


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


MAX_TOP_LOGPROBS = 20  # alternatives per token a request may ask for
MAX_LOGIT_BIAS = 100.0  # OpenAI's bound on one logit_bias value (-100 bans a token, 100 forces it)
SAMPLING_RULES = ("auto", "keyed", "standard")  # SamplingParams.sampling_rule


@dataclass(frozen=True)
class LookupConfig:
    """min_ngram: the fewest trailing tokens (the last committed one included) that must match
    an earlier occurrence before its continuation is proposed; max_ngram: the longest match
    looked for (longer matches win; among equal ones the latest).

    The defaults come from held-out prompts (SmolLM2-135M with its shipped drafter, adaptive
    blocks, batch 1): min_ngram 2 committed more tokens per second than 3 on maths questions and
    code stubs, 1 fewer; max_ngram 6 gained nothing over 4 (docs/DESIGN.md section 12)."""

    min_ngram: int = 2
    max_ngram: int = 4

    def __post_init__(self) -> None:
        if not isinstance(self.min_ngram, int) or self.min_ngram < 1:
            raise ConfigError(f"lookup min_ngram must be an integer >= 1, got {self.min_ngram!r}")
        if not isinstance(self.max_ngram, int) or self.max_ngram < self.min_ngram:
            raise ConfigError(f"lookup max_ngram must be an integer >= min_ngram ({self.min_ngram}), "
                              f"got {self.max_ngram!r}")


@dataclass(frozen=True)
class SamplingParams:
    """How one request turns logits into tokens, and when it stops.

    temperature == 0 means greedy. top_k == 0 and top_p == 1 disable those filters. `seed` makes
    sampling reproducible per request (None: drawn from the global generator): the same seed
    gives the same tokens whatever the batch, block size, policy or lookup. `logprobs` k: also
    return each generated token's log-probability under the target's unshaped distribution and
    its k most likely alternatives (None: off). `prompt_logprobs` k: the same for every prompt
    token but the first (which nothing predicts); with it, max_new_tokens may be 0 (scoring only).
    `logit_bias`: (token id, value) pairs added to the target's logits before sampling, at every
    position (a dict is accepted too); logprobs stay those of the unbiased distribution.

    `sampling_rule` says how a sampled request's proposals are verified (`rule`; both are
    lossless, dflash/verify.py): "keyed" keeps a proposal when it equals the target's own keyed
    draw, so a seed fixes the text whatever the block size; "standard" keeps it with probability
    min(1, p/q), which accepts more, but its text depends on what was proposed; "auto" (default):
    keyed with a seed, standard without one.
    """

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()
    sampling_rule: str = "auto"

    def __post_init__(self) -> None:
        _require(
            self.sampling_rule in SAMPLING_RULES,
            f"sampling_rule must be one of {', '.join(SAMPLING_RULES)}, got {self.sampling_rule!r}",
        )
        _require(
            self.prompt_logprobs is None or (isinstance(self.prompt_logprobs, int)
                                             and not isinstance(self.prompt_logprobs, bool)
                                             and 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS),
            f"prompt_logprobs must be None or an integer in [0, {MAX_TOP_LOGPROBS}], got {self.prompt_logprobs!r}",
        )
        least = 0 if self.prompt_logprobs is not None else 1  # 0 new tokens: the prompt's scores alone
        _require(
            isinstance(self.max_new_tokens, int) and self.max_new_tokens >= least,
            f"max_new_tokens must be an integer >= {least}"
            f"{'' if least == 0 else ' (0 only with prompt_logprobs)'}, got {self.max_new_tokens!r}",
        )
        object.__setattr__(self, "logit_bias", _logit_bias(self.logit_bias))
        _require(
            isinstance(self.temperature, (int, float))
            and math.isfinite(self.temperature)
            and 0.0 <= self.temperature <= 100.0,
            f"temperature must be a number in [0, 100] (0 = greedy), got {self.temperature!r}",
        )
        _require(
            isinstance(self.top_p, (int, float)) and 0.0 < self.top_p <= 1.0,
            f"top_p must be in (0, 1] (1 = off), got {self.top_p!r}",
        )
        _require(
            isinstance(self.top_k, int) and self.top_k >= 0,
            f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}",
        )
        _require(
            self.seed is None or (isinstance(self.seed, int) and 0 <= self.seed < 2**63),
            f"seed must be None or an integer in [0, 2**63), got {self.seed!r}",
        )
        _require(
            self.logprobs is None or (isinstance(self.logprobs, int) and not isinstance(self.logprobs, bool)
                                      and 0 <= self.logprobs <= MAX_TOP_LOGPROBS),
            f"logprobs must be None or an integer in [0, {MAX_TOP_LOGPROBS}], got {self.logprobs!r}",
        )
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        _require(
            all(isinstance(s, str) and s for s in self.stop),
            f"stop must be non-empty strings, got {self.stop!r}",
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def plain_argmax(self) -> bool:
        """Greedy on the target's own logits, nothing else asked: the argmax alone decides."""
        return self.greedy and self.logprobs is None and not self.logit_bias

    @property
    def rule(self) -> str:
        """The verification rule this request gets: "greedy", "keyed" or "standard"."""
        return self.rule_for(constrained=False)

    def rule_for(self, constrained: bool) -> str:
        """`rule` for a row whose output a grammar constrains (`constrained`) or not. A grammar
        cut ends a block at a proposal the target could never accept; the keyed rule stays exact
        under such a cut, the standard rule would owe that position a residual draw, so a
        constrained row takes the keyed one."""
        if self.greedy:
            return "greedy"
        if self.sampling_rule == "auto":
            rule = "keyed" if self.seed is not None else "standard"
        else:
            rule = self.sampling_rule
        return "keyed" if constrained else rule

    def with_(self, **changes: object) -> SamplingParams:
        """A copy with some fields changed (validated again)."""
        return replace(self, **changes)


def _logit_bias(value: object) -> tuple[tuple[int, float], ...]:
    """logit_bias as sorted (token id, value) pairs; a dict or pairs in, ConfigError for bad ones.
    Token ids are checked against the vocabulary where the target is known (the server, the engine)."""
    items = value.items() if isinstance(value, dict) else value
    try:
        pairs = [(t, v) for t, v in items]
    except (TypeError, ValueError):
        raise ConfigError(f"logit_bias must map token ids to numbers, got {value!r:.60}") from None
    out = {}
    for t, v in pairs:
        _require(isinstance(t, int) and not isinstance(t, bool) and t >= 0,
                 f"logit_bias keys must be token ids (integers >= 0), got {t!r:.40}")
        _require(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
                 and -MAX_LOGIT_BIAS <= v <= MAX_LOGIT_BIAS,
                 f"logit_bias values must be numbers in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {v!r:.40}")
        out[int(t)] = float(v)
    return tuple(sorted(out.items()))


@dataclass(frozen=True)
class SpecConfig:
    """How requests are decoded: the largest block, the adaptive policy, lookup. block_size 1 is
    plain autoregressive decoding. The Python API, the command line and the server all take one."""

    block_size: int = 16
    # Compact a batch's KV slots once this fraction of them holds rejected tokens (ragged batches).
    compact_ratio: float = 0.25
    # Choose each step's block size (up to block_size) from measured step costs and acceptance
    # (dflash/policy/); the output is the same for any choice.
    adaptive: bool = False
    # Propose a row's n-gram lookup continuation instead of the drafted block where its last
    # tokens occurred before (dflash/lookup.py); None drafts every proposal.
    lookup: LookupConfig | None = None
    # With adaptive: rows of a batch verify lengths of their own, chosen from their drafts'
    # confidences, and rows with lookup continuations may verify them with no draft pass
    # (AdaptiveBlock(ragged=True); native targets on a CPU). Opt-in: its gain at concurrency 8 and
    # 16 stayed within run-to-run spread of the default (docs/DESIGN.md section 12).
    ragged_verify: bool = False
    # The most proposed nodes a drafting step verifies as a token tree (docs/DESIGN.md section
    # 5.3): each step spends its verify width best-first over the drafter's top choices at every
    # depth, capped here. 0: chains only. Targets that cannot verify trees in one pass (recurrent
    # layers) keep chains whatever this says. `blockspec.load` and the command line default to
    # DEFAULT_TREE_NODES.
    tree_nodes: int = 0

    def __post_init__(self) -> None:
        _require(
            self.lookup is None or isinstance(self.lookup, LookupConfig),
            f"lookup must be None or a LookupConfig, got {type(self.lookup).__name__}",
        )
        _require(
            isinstance(self.block_size, int) and 1 <= self.block_size <= MAX_BLOCK_SIZE,
            f"block_size must be an integer in [1, {MAX_BLOCK_SIZE}], got {self.block_size!r}",
        )
        _require(
            0.0 < self.compact_ratio <= 1.0,
            f"compact_ratio must be in (0, 1], got {self.compact_ratio!r}",
        )
        _require(isinstance(self.adaptive, bool), f"adaptive must be True or False, got {self.adaptive!r}")
        _require(
            isinstance(self.ragged_verify, bool), f"ragged_verify must be True or False, got {self.ragged_verify!r}"
        )
        _require(
            isinstance(self.tree_nodes, int) and not isinstance(self.tree_nodes, bool)
            and 0 <= self.tree_nodes <= MAX_TREE_NODES,
            f"tree_nodes must be an integer in [0, {MAX_TREE_NODES}] (0: chains only), got {self.tree_nodes!r}",
        )
