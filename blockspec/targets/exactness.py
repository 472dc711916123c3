"""A target's self-check: verifying a block, rejecting part of it and going on must give what
one token at a time gives. Run when a target loads, so a model whose state the adapter does not
roll back correctly is refused instead of decoded approximately."""

from __future__ import annotations

import torch

from blockspec.errors import ConfigError
from blockspec.targets.base import Target
from blockspec.targets.slots import EMPTY

# How far the winner of one path may trail the other's winner, as a share of the position's logit
# range, before the two count as different: kernels that take a block at once round differently
# from one token at a time, which may swap near-ties but never a clear winner.
TOLERANCE = {torch.float64: 1e-6, torch.float32: 1e-3, torch.bfloat16: 5e-2, torch.float16: 5e-2}


@torch.inference_mode()
def check_exact(target: Target, *, seed: int = 0, block: int = 4) -> None:
    """Raises ConfigError unless, for two rows of different prompt lengths, a verify pass over
    `block` tokens, a rejection of its tail (a different number per row) and a pass over the next
    tokens give the greedy tokens of single-token steps over the same tokens."""
    g = torch.Generator().manual_seed(seed)
    vocab = target.info.vocab_size
    lengths, kept, more = (5, 8), (2, 3), 3
    prompts = [torch.randint(0, vocab, (n,), generator=g) for n in lengths]
    blocks = torch.randint(0, vocab, (2, block), generator=g)
    nexts = torch.randint(0, vocab, (2, more), generator=g)
    batched = _batched(target, prompts, blocks, kept, nexts)
    for row in range(2):
        single = _single(target, prompts[row], blocks[row], kept[row], nexts[row])
        for what, got, want in zip(("the verified block", "the tokens after the rejection"), batched[row], single):
            _compare(target, got, want, what)


def _batched(target: Target, prompts: list[torch.Tensor], blocks: torch.Tensor, kept: tuple[int, ...],
             nexts: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    d = target.device
    longest = max(len(p) for p in prompts)
    ids = torch.zeros(2, longest, dtype=torch.long)
    pos = torch.full((2, longest), EMPTY, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, longest - len(p):] = p
        pos[i, longest - len(p):] = torch.arange(len(p))
    cache = target.new_cache(2)
    target.forward(ids.to(d), pos.to(d), cache)
    cur = torch.tensor([len(p) for p in prompts])
    q = blocks.shape[1]
    verify, _ = target.forward(blocks.to(d), (cur[:, None] + torch.arange(q)).to(d), cache)  # [2, q, V]
    cache.reject((torch.arange(q)[None] < torch.tensor(kept)[:, None]).to(d))
    cur = cur + torch.tensor(kept)
    after, _ = target.forward(nexts.to(d), (cur[:, None] + torch.arange(nexts.shape[1])).to(d), cache)
    return [(verify[i], after[i]) for i in range(2)]


def _single(target: Target, prompt: torch.Tensor, block: torch.Tensor, kept: int,
            nexts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of each block token and of each next token, one token per forward."""
    d = target.device

    def steps(tokens: torch.Tensor) -> torch.Tensor:
        cache = target.new_cache(1)
        target.forward(prompt[None].to(d), torch.arange(len(prompt))[None].to(d), cache)
        out = []
        for j, t in enumerate(tokens.tolist()):
            logits, _ = target.forward(torch.tensor([[t]], device=d), torch.tensor([[len(prompt) + j]], device=d), cache)
            out.append(logits[0, -1])
        return torch.stack(out)

    after = steps(torch.cat([block[:kept], nexts]))[kept:]
    return steps(block), after


def _compare(target: Target, got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    rel = TOLERANCE.get(target.dtype, 1e-3)
    got, want = got.double(), want.double()
    for k in range(got.shape[0]):
        a, b = int(got[k].argmax()), int(want[k].argmax())
        spread = float(want[k].max() - want[k].min())
        if a != b and float(want[k, b] - want[k, a]) > rel * spread:
            raise ConfigError(
                f"{target.info.model_type} cannot be decoded exactly: {what} (position {k}) differ from one-token "
                "steps beyond rounding; this architecture keeps a state blockspec does not roll back. Use a "
                "supported target (see the README's table)"
            )

