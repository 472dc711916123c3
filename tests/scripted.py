"""Test doubles for the drafter: they propose the target's true greedy continuation, with errors.

They exercise every path of the decoding loop (full acceptance, rejections at any position, stop
tokens and length limits inside a block, rows joining and leaving) that a random drafter almost
never reaches. The real drafter's numerics are tested separately against the reference package.

A double runs where a real drafter runs: `DecodeBatch` wraps it in a `StaticDrafter`, whose call
is the module's forward over the production draft cache. So a double keeps no cache of its own:
like a real drafter it knows its rows only by what a draft pass receives, the target's features
of each row's context. `ScriptedRows` recognises each row from them (see there).
"""

from __future__ import annotations

import torch

from blockspec.dflash.drafter import DFlashDrafter, new_drafter_for_target
from blockspec.dflash.sampling import keyed
from blockspec.targets.hf import HFTarget
from blockspec.targets.slots import EMPTY


class ScriptedRows:
    """The scripted sequences (prompt + continuation) and their target features [U, n, L*H]; a
    batch row of a draft pass is the sequence whose feature at the row's last context position is
    nearest the row's own (the features of a position are a function of the whole prefix, so rows
    with different prefixes differ by far more than the rounding between targets and batches).
    Rows with the same prefix have the same greedy continuation, so a tie picks either."""

    def __init__(self, model, prompts: list[list[int]], continuations: list[list[int]], layer_ids: tuple[int, ...],
                 target=None) -> None:
        target = HFTarget(model) if target is None else target
        scripts = list(dict.fromkeys((tuple(p) + tuple(c), len(p)) for p, c in zip(prompts, continuations)))
        self.seqs = [list(seq) for seq, _ in scripts]
        self.starts = [start for _, start in scripts]  # where each continuation begins
        longest = max(len(s) for s in self.seqs)
        feats = []
        with torch.no_grad():
            for seq in self.seqs:
                n = len(seq)
                _, f = target.forward(torch.tensor([seq], device=target.device), torch.arange(n, device=target.device)[None],
                                      target.new_cache(1), layer_ids)
                feats.append(torch.nn.functional.pad(f[0].double().cpu(), (0, 0, 0, longest - n)))
        self.feats = torch.stack(feats)  # [U, longest, L*H]
        self.lengths = torch.tensor([len(s) for s in self.seqs])

    def identify(self, ctx_features: torch.Tensor, ctx_positions: torch.Tensor) -> list[int | None]:
        """The script of each batch row [b] (None: a row with no context in this pass, or past the
        end of every script) from its newest context feature."""
        found: list[int | None] = []
        for feats, positions in zip(ctx_features, ctx_positions):
            real = (positions != EMPTY).nonzero()
            if len(real) == 0:
                found.append(None)
                continue
            col = int(real[-1, 0])
            j = int(positions[col])
            dist = (self.feats[:, min(j, self.feats.shape[1] - 1)] - feats[col].double().cpu()).abs().sum(dim=-1)
            dist[self.lengths <= j] = float("inf")
            found.append(None if bool(torch.isinf(dist).all()) else int(dist.argmin()))
        return found


class _ScriptedBase(DFlashDrafter):
    """A DFlashDrafter whose forward returns logits [b, q, V] that peak at `propose`'s tokens;
    `logits` passes them through, so the production proposal code (argmax, confidence, sampling)
    reads them as it reads a real drafter's."""

    def __init__(self, model, prompts, continuations, *, block_size: int, mask_token_id: int, target=None,
                 **drafter_kwargs) -> None:
        base = new_drafter_for_target(model.config, mask_token_id=mask_token_id, block_size=block_size,
                                      **drafter_kwargs)
        super().__init__(base.cfg)
        self.vocab = model.config.vocab_size
        self.scripts = ScriptedRows(model, prompts, continuations, self.target_layer_ids, target)

    def propose(self, seq: list[int] | None, start: int, positions: list[int]) -> list[int]:
        raise NotImplementedError

    def forward(self, ctx_features, ctx_positions, block_embeds, block_positions, cache=None, attn_mask=None):
        b, q, _ = block_embeds.shape
        logits = torch.zeros(b, q, self.vocab, dtype=torch.float64)
        for i, u in enumerate(self.scripts.identify(ctx_features, ctx_positions)):
            seq, start = (None, 0) if u is None else (self.scripts.seqs[u], self.scripts.starts[u])
            for k, token in enumerate(self.propose(seq, start, block_positions[i].tolist())):
                logits[i, k, token] = 10.0
        return logits

    def logits(self, hidden, head):
        return hidden


def _truth(seq: list[int] | None, start: int, pos: int) -> int:
    return seq[pos] if seq is not None and start <= pos < len(seq) else 0


class ScriptedDrafter(_ScriptedBase):
    """Proposes each row's scripted continuation, each token wrong with probability `error_rate`."""

    def __init__(self, model, prompts: list[list[int]], continuations: list[list[int]],
                 error_rate: float = 0.2, seed: int = 0, block_size: int = 16) -> None:
        super().__init__(model, prompts, continuations, block_size=block_size,
                         mask_token_id=model.config.vocab_size - 1)
        self.error_rate = error_rate
        self.gen = torch.Generator().manual_seed(seed)

    def propose(self, seq, start, positions):
        out = []
        for pos in positions:
            token = _truth(seq, start, pos)
            if torch.rand(1, generator=self.gen).item() < self.error_rate:
                token = int(torch.randint(0, self.vocab, (1,), generator=self.gen))
            out.append(token)
        return out


class PrefixDrafter(ScriptedDrafter):
    """Right for a random number of leading proposals each step (0 to all of them), then wrong:
    every step keeps a random part of its block, so the target rolls back mid-block most steps."""

    def propose(self, seq, start, positions):
        right = int(torch.randint(0, len(positions), (1,), generator=self.gen))  # proposals 1..right are right
        return [_truth(seq, start, pos) if k <= right else (_truth(seq, start, pos) + 1) % self.vocab
                for k, pos in enumerate(positions)]


class OracleDrafter(_ScriptedBase):
    """Proposes each request's true greedy continuation, wrong where (position + k) is a multiple
    of `wrong_every`: the same proposals however rows join and leave the engine's batch."""

    def __init__(self, model, target, prompts: list[list[int]], truths: list[list[int]], wrong_every: int = 5) -> None:
        super().__init__(model, prompts, truths, block_size=16, mask_token_id=47, target=target, num_layers=1,
                         dtype=torch.float64)
        self.wrong_every = wrong_every

    def propose(self, seq, start, positions):
        out = []
        for k, pos in enumerate(positions):
            token = seq[pos] if seq is not None and pos < len(seq) else 0
            out.append((token + 1) % self.vocab if (pos + k) % self.wrong_every == 0 else token)
        return out


class RankedDrafter(_ScriptedBase):
    """Ranks the true token at each proposal 1st, 2nd, 3rd or nowhere among three near-equal
    choices (logits 10, 9.9, 9.8), by a hash of (position, k, seed): a chain of first choices is
    mostly rejected early, while a tree that holds the second and third choices accepts through
    non-first children, and partial acceptance happens at every depth and every branch.
    `received` records every draft pass's context (features, positions) for tests of what the
    drafter is fed."""

    RANKS = 4  # ranks 0..2: the truth is that choice; 3: it is none of them

    def __init__(self, model, prompts, continuations, *, seed: int = 0, block_size: int = 16,
                 target=None, absent_share: int = 1) -> None:
        super().__init__(model, prompts, continuations, block_size=block_size,
                         mask_token_id=model.config.vocab_size - 1, target=target)
        self.seed = seed
        self.absent_share = absent_share  # of every 3 + absent_share proposals, this many lack the truth
        self.received: list[tuple[torch.Tensor, torch.Tensor]] = []

    def rank(self, pos: int, k: int) -> int:
        return min(keyed(self.seed, pos * 64 + k) % (3 + self.absent_share), 3)

    def forward(self, ctx_features, ctx_positions, block_embeds, block_positions, cache=None, attn_mask=None):
        self.received.append((ctx_features.detach().double().cpu().clone(), ctx_positions.detach().cpu().clone()))
        b, q, _ = block_embeds.shape
        logits = torch.zeros(b, q, self.vocab, dtype=torch.float64)
        for i, u in enumerate(self.scripts.identify(ctx_features, ctx_positions)):
            seq, start = (None, 0) if u is None else (self.scripts.seqs[u], self.scripts.starts[u])
            for k, pos in enumerate(block_positions[i].tolist()):
                truth = _truth(seq, start, pos)
                wrong = [(truth + 1 + j * 5) % (self.vocab - 1) for j in range(3)]  # never the truth, never MASK
                r = self.rank(pos, k)
                choices = wrong[:r] + [truth] + wrong[r:2] if r < 3 else wrong
                for value, token in zip((10.0, 9.9, 9.8), choices):
                    logits[i, k, token] = value
        return logits
