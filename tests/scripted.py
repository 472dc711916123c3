"""A test double for the drafter: proposes the target's true greedy continuation, with errors.

It exercises every path of the decoding loop (full acceptance, rejections at any position, stop
tokens and length limits inside a block) that a random drafter almost never reaches. The real
drafter's numerics are tested separately against the reference package.
"""

from __future__ import annotations

import torch

from blockspec.dflash.drafter import DFlashDrafter, DraftCache, new_drafter_for_target


class _RowCache(DraftCache):
    """Remembers which original request each batch row is, across retirements."""

    def __init__(self, num_layers: int, batch: int) -> None:
        super().__init__(num_layers, batch)
        self.row_ids = list(range(batch))

    def select_rows(self, rows: torch.Tensor) -> None:
        super().select_rows(rows)
        self.row_ids = [self.row_ids[i] for i in rows.tolist()]

    def spawn(self, batch: int) -> _RowCache:
        return _RowCache(len(self.keys), batch)


class ScriptedDrafter(DFlashDrafter):
    """Proposes `continuations[row][pos - prompt_len]`, wrong with probability `error_rate`."""

    def __init__(self, hf_config, prompts: list[list[int]], continuations: list[list[int]],
                 error_rate: float = 0.2, seed: int = 0, block_size: int = 16) -> None:
        base = new_drafter_for_target(hf_config, mask_token_id=hf_config.vocab_size - 1, block_size=block_size)
        super().__init__(base.cfg)
        self.prompts = prompts
        self.continuations = continuations
        self.error_rate = error_rate
        self.gen = torch.Generator().manual_seed(seed)
        self.vocab = hf_config.vocab_size

    def new_cache(self, batch: int) -> DraftCache:
        self._cache = _RowCache(self.cfg.num_hidden_layers, batch)
        return self._cache

    def forward(self, ctx_features, ctx_positions, block_embeds, block_positions, cache=None, attn_mask=None):
        b, q, _ = block_embeds.shape
        logits = torch.zeros(b, q, self.vocab, dtype=torch.float64)
        for i, row in enumerate(cache.row_ids):
            for k in range(q):
                offset = int(block_positions[i, k]) - len(self.prompts[row])
                cont = self.continuations[row]
                token = cont[offset] if 0 <= offset < len(cont) else 0
                if torch.rand(1, generator=self.gen).item() < self.error_rate:
                    token = int(torch.randint(0, self.vocab, (1,), generator=self.gen))
                logits[i, k, token] = 10.0
        return logits

    def logits(self, hidden, head):
        return hidden


class PrefixDrafter(ScriptedDrafter):
    """Right for a random number of leading proposals each step (0 to all of them), then wrong:
    every step keeps a random part of its block, so the target rolls back mid-block most steps."""

    def forward(self, ctx_features, ctx_positions, block_embeds, block_positions, cache=None, attn_mask=None):
        b, q, _ = block_embeds.shape
        logits = torch.zeros(b, q, self.vocab, dtype=torch.float64)
        for i, row in enumerate(cache.row_ids):
            right = int(torch.randint(0, q, (1,), generator=self.gen))  # proposals 1..right are right
            cont = self.continuations[row]
            for k in range(q):
                offset = int(block_positions[i, k]) - len(self.prompts[row])
                token = cont[offset] if 0 <= offset < len(cont) else 0
                if k > right:
                    token = (token + 1) % self.vocab
                logits[i, k, token] = 10.0
        return logits
