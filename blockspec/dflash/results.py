"""What a request gets back: its tokens, why it ended, its statistics, its tokens' logprobs."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class RequestStats:
    """Per-request statistics. tau counts committed tokens per decode step (accepted + 1)."""

    prompt_tokens: int = 0
    acceptance_lengths: list[int] = field(default_factory=list)
    accepted_by_position: list[int] = field(default_factory=list)
    prefill_s: float = 0.0
    decode_s: float = 0.0
    block_size: int = 1
    # Steps that proposed an n-gram lookup continuation, and how often its proposal k was
    # accepted; accepted_by_position counts the drafter's proposals only.
    lookup_steps: int = 0
    lookup_accepted_by_position: list[int] = field(default_factory=list)
    # How proposals were verified (SamplingParams.rule): "greedy", "keyed" or "standard"; a
    # sampled row's tree steps accept by the target's keyed draws whatever its rule.
    sampling_rule: str = "greedy"
    # Steps that verified a token tree (accepted_by_position counts what their first-choice chain
    # would have accepted), and per rank among siblings how many accepted nodes had it (0: the
    # drafter's first choice).
    tree_steps: int = 0
    accepted_by_rank: list[int] = field(default_factory=list)

    @property
    def steps(self) -> int:
        return len(self.acceptance_lengths)

    @property
    def mean_tau(self) -> float:
        return sum(self.acceptance_lengths) / max(1, len(self.acceptance_lengths))

    def tokens_per_s(self, generated: int) -> float:
        total = self.prefill_s + self.decode_s
        return generated / total if total > 0 else 0.0

    def as_dict(self, generated: int) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "generated_tokens": generated,
            "block_size": self.block_size,
            "sampling_rule": self.sampling_rule,
            "steps": self.steps,
            "mean_tau": round(self.mean_tau, 4),
            "acceptance_lengths": list(self.acceptance_lengths),
            "accepted_by_position": list(self.accepted_by_position),
            "lookup_steps": self.lookup_steps,
            "lookup_accepted_by_position": list(self.lookup_accepted_by_position),
            "tree_steps": self.tree_steps,
            "accepted_by_rank": list(self.accepted_by_rank),
            "prefill_s": round(self.prefill_s, 6),
            "decode_s": round(self.decode_s, 6),
            "tokens_per_s": round(self.tokens_per_s(generated), 3),
        }


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log-probability under the target's own distribution (log-softmax of
    its logits: before temperature, top-k and top-p) and the `top` most likely (id, logprob)."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class GenerationResult:
    """Generated token ids (stop token included when one ended the request) and statistics."""

    token_ids: list[int]
    finish_reason: str  # "stop" | "length"
    stats: RequestStats
    # With capture_layer_ids: target features [prompt + generated, L*H] (CPU, float32), the last
    # row zero (the last token is never fed to the target); what training uses as context.
    features: torch.Tensor | None = None
