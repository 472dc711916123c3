"""Temperature / top-k / top-p -> probabilities, and seeded per-request randomness.

The same `probabilities` shapes both the target's p and the drafter's q, so their draws at one
output position couple. Every draw is a function of (request seed, output position, token id)
alone (`RowRandom`), so a seed gives the same text whatever the batch, block size or policy.
"""

from __future__ import annotations

import torch

from blockspec.cpu import kernels


def probabilities(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
    support: torch.Tensor | None = None, vocab: int = 0,
) -> torch.Tensor:
    """logits [b, n, V] with per-row temperature/top_k/top_p [b] -> probabilities [b, n, V] (fp32).

    Rows with temperature 0 get a one-hot on the argmax (greedy). top_k 0 and top_p 1 are off.
    `support` [m] (ascending token ids < vocab): logits [b, n, m] are those tokens' alone (a
    draft vocabulary's), every other one -inf; the probabilities [b, n, vocab] are the same bits
    as those of the logits spread over the vocabulary, which the chat clients' usual request
    (temperature and top-p) never builds.
    """
    logits = logits.float()
    v = vocab if support is not None else logits.shape[-1]
    # chat clients' usual request (temperature and top-p, no top-k, no greedy row): the kernel's
    # passes, no V-wide copies, one test of the rows' settings (what the general path below does
    # for such rows, without its other small operations)
    if bool(((temperature > 0) & (top_p < 1) & ((top_k <= 0) | (top_k >= v))).all()):
        probs = _nucleus_kernel(logits, temperature.float(), top_p, support, vocab)
        if probs is not None:
            return probs
    if support is not None:
        logits = spread(logits, support, vocab)
    b, n, v = logits.shape
    greedy = temperature <= 0
    temp = torch.where(greedy, torch.ones_like(temperature), temperature).float()  # [b]
    k = torch.where(top_k > 0, top_k.clamp(max=v), torch.full_like(top_k, v))
    nucleus = top_p < 1
    top_k_on = bool((k < v).any())
    # greedy rows beside top-p ones: the kernel's passes for all, the greedy rows' replaced below
    probs = None if top_k_on or not bool(nucleus.all()) else _nucleus_kernel(logits, temp, top_p)
    if probs is None:
        scaled = logits / temp[:, None, None]
        if top_k_on:
            kth = torch.topk(scaled, int(k.max()), dim=-1).values  # [b, n, kmax]
            threshold = kth.gather(-1, (k - 1)[:, None, None].expand(b, n, 1))
            scaled = scaled.masked_fill(scaled < threshold, float("-inf"))
        probs = torch.softmax(scaled, dim=-1)
        if bool(nucleus.any()):
            if bool(nucleus.all()):
                probs = _top_p(probs, top_p)
            else:  # rows with top_p 1 keep every token, whatever their batch-mates ask (probs is softmax's own)
                probs[nucleus] = _top_p(probs[nucleus], top_p[nucleus])
    if bool(greedy.any()):
        onehot = _one_hot(logits.argmax(dim=-1), v)
        probs = torch.where(greedy[:, None, None], onehot, probs)
    return probs


# Rows of the standard rule draw their chain proposals from their draft distribution sharpened
# to this fraction of its temperature (`sharpened`). The rule accepts sum min(p, q); where the
# drafter's q is flatter than the target's p a sharper q overlaps p more. Any q is lossless as
# long as the rule tests each proposal against the q it was drawn from. 1 (the request's own q)
# until a measurement shows a sharper one pays end to end: `python -m blockspec.bench.sampletau`
# finds the expected gain on the shipped drafter small (BENCHMARKS.md; docs/DESIGN.md section 6).
# Keyed rows always keep the request's q: their text does not depend on the drafts.
STANDARD_DRAFT_FACTOR = 1.0


def sharpened(probs: torch.Tensor, factor: float | None = None) -> torch.Tensor:
    """probs [..., V] at `factor` times their temperature on the same support: probs ** (1 /
    factor), renormalised (zeros stay zero; a one-hot stays itself). factor None:
    STANDARD_DRAFT_FACTOR; 1: probs unchanged."""
    f = STANDARD_DRAFT_FACTOR if factor is None else factor
    if not f > 0:
        raise ValueError(f"a sharpening factor must be > 0, got {f}")
    if f == 1.0:
        return probs
    # divided by each row's peak first, so the power cannot underflow the whole row to zero
    out = (probs / probs.amax(dim=-1, keepdim=True)).pow_(1.0 / f)
    return out.div_(out.sum(dim=-1, keepdim=True))


def spread(logits: torch.Tensor, support: torch.Tensor, vocab: int) -> torch.Tensor:
    """logits [.., m] of the tokens `support` [m] -> [.., vocab], -inf elsewhere."""
    full = logits.new_full((*logits.shape[:-1], vocab), float("-inf"))
    return full.index_copy_(-1, support, logits)


def _nucleus_kernel(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor,
                    support: torch.Tensor | None = None, vocab: int = 0) -> torch.Tensor | None:
    """`probabilities` of fp32 logits [b, n, V] (or of `support`'s tokens [b, n, m], as there) at
    temperature [b] > 0 with top_p [b] < 1 and no top-k, through `cpu/csrc/nucleus.c` (positions
    whose nucleus the kernel's candidates do not hold go through `_top_p`); None where the
    kernel does not run (no compiler, not the CPU)."""
    b, n, m = logits.shape
    flat = logits.reshape(b * n, m)
    per_position = lambda x: x.float()[:, None].expand(b, n).reshape(b * n)  # noqa: E731  [b] -> [b*n]
    out = kernels.nucleus(flat, per_position(1.0 / temperature), per_position(top_p), support, vocab)
    if out is None:
        return None
    probs, done = out  # [b*n, V], [b*n]
    if not bool(done.all()):
        rest = (~done).nonzero()[:, 0]
        rows = flat[rest] if support is None else spread(flat[rest], support, vocab)
        scaled = rows / per_position(temperature)[rest][:, None]
        probs[rest] = _top_p(torch.softmax(scaled, dim=-1)[:, None], per_position(top_p)[rest])[:, 0]
    return probs.reshape(b, n, -1)


NUCLEUS_HEAD = 64  # tokens sorted first per position by `_top_p` (x8 until the nucleus fits)


def _top_p(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """The nucleus filter of probs [b, n, V] by top_p [b] (< 1): per position, the most probable
    tokens in descending order until the mass before one reaches top_p (at least the top token),
    renormalised. Only the head of each distribution is sorted (torch.topk): once the mass of
    the first k tokens reaches top_p no later token can be kept, so the result is the full sort's
    (the same prefix sums, the same tokens, ties aside). A position whose head falls short looks
    further (x8) alone, so one flat distribution does not sort every position's wider head. A
    full sort of a vocabulary's probabilities at every verified position made sampled DFlash
    slower than plain decoding (docs/DESIGN.md section 12)."""
    b, n, v = probs.shape
    flat = probs.reshape(b * n, v)
    want = top_p.float()[:, None].expand(b, n).reshape(b * n)  # [b*n]
    out = torch.zeros_like(flat)
    todo = torch.arange(b * n, device=probs.device)
    k = min(v, NUCLEUS_HEAD)
    while todo.numel():
        whole = todo.numel() == b * n
        rows, p = (flat, want) if whole else (flat[todo], want[todo])
        head, order = rows.topk(k, dim=-1)  # [r, k], descending
        mass = head.cumsum(dim=-1)
        done = (mass[:, -1] >= p) | (k == v)  # the head holds the whole nucleus
        keep = mass - head < p[:, None]  # the mass before each token
        filtered = torch.zeros_like(rows).scatter_(-1, order, head * keep)
        if bool(done.all()):
            if whole:
                out = filtered
            else:
                out[todo] = filtered
            break
        out[todo[done]] = filtered[done]
        todo = todo[~done]
        k = min(v, k * 8)  # a flat distribution (high temperature): look further
    return out.div_(out.sum(dim=-1, keepdim=True)).reshape(b, n, v)


def _one_hot(index: torch.Tensor, v: int) -> torch.Tensor:
    return torch.zeros(*index.shape, v, dtype=torch.float32, device=index.device).scatter_(
        -1, index[..., None], 1.0
    )


def sample_from(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: probs [..., V] (need not sum to 1), uniforms [...] in [0, 1) -> ids."""
    cdf = probs.cumsum(dim=-1)
    total = cdf[..., -1]
    # a uniform that rounds up to the total would land past the last token with mass, on a
    # zero-probability tail token: keep the target strictly below the total
    target = torch.minimum(uniforms.to(cdf.dtype) * total, torch.nextafter(total, torch.zeros_like(total)))
    idx = torch.searchsorted(cdf, target[..., None], right=True)[..., 0]
    return idx.clamp_(max=probs.shape[-1] - 1)


MASK64 = 2**64 - 1
RACE_HEAD = 32  # tokens per position that race with their own clocks in `RowRandom.sample`
# `RowRandom.uniforms` slots of the standard rule (dflash/verify.py): negative, so no token id
# (the race's clocks) nor the tail's slots (V, V + 1) share them.
ACCEPT_SLOT, BONUS_SLOT = -1, -2


def keyed(seed: int, position: int) -> int:
    """A 64-bit random word that is a function of (seed, position) alone (splitmix64 of both)."""
    z = (seed * 0x9E3779B97F4A7C15 + (position + 1) * 0xD1B54A32D192ED03) & MASK64
    for shift, mult in ((30, 0xBF58476D1CE4E5B9), (27, 0x94D049BB133111EB)):
        z = ((z ^ (z >> shift)) * mult) & MASK64
    return z ^ (z >> 31)


def _signed(x: int) -> int:
    return x - 2**64 if x >= 2**63 else x


_GOLDEN, _M1, _M2 = (_signed(c) for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB))


def slot_uniforms(keys: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Uniforms in (0, 1), float64, one per (key, slot): splitmix64 of key + slot, elementwise on
    int64 bit patterns (products wrap, shifts are made logical by masking). keys [...] broadcast
    against slots [..., k]. On a CPU with the kernel, `cpu/csrc/uniforms.c` (the same bits)."""
    if slots.dim() == 1 or slots.shape[:-1] == keys.shape:
        fast = kernels.slot_uniforms(keys, slots)
        if fast is not None:
            return fast
    z = keys[..., None] + slots * _GOLDEN
    z = (z ^ ((z >> 30) & ((1 << 34) - 1))) * _M1
    z = (z ^ ((z >> 27) & ((1 << 37) - 1))) * _M2
    z = z ^ ((z >> 31) & ((1 << 33) - 1))
    return ((z >> 11) & ((1 << 53) - 1)).double().add_(0.5).mul_(2.0**-53)


class RowRandom:
    """Each row's random draws as a function of its request's seed and the output position alone
    (`keyed`), never of how many draws came before: what a request samples does not depend on
    its batch mates, the block size, the drafts or how many positions a step verified.

    `sample` draws by an exponential race (Gumbel-max): token i at a position finishes at
    E_i / p_i with E_i ~ Exp(1) fixed by (seed, position, i), and the first to finish is drawn,
    exactly with probability p_i. A drafter's q at the same position races with the same clocks,
    so its sample equals the target's whenever the two distributions allow it (the coupling that
    speculative decoding then accepts, dflash/batch.py).
    """

    def __init__(self, seeds: list[int | None]) -> None:
        self.seeds = [self._resolve(s) for s in seeds]

    @staticmethod
    def _resolve(seed: int | None) -> int:
        return int(torch.randint(0, 2**62, (1,)).item()) if seed is None else int(seed)

    def keys(self, starts: list[int], n: int) -> torch.Tensor:
        """[b, n] int64 keys of row r's output positions starts[r] .. starts[r] + n - 1."""
        fast = kernels.position_keys(self.seeds, starts, n)  # the same bits (cpu/csrc/uniforms.c)
        if fast is not None:
            return fast
        return torch.tensor([[_signed(keyed(s, p + j)) for j in range(n)] for s, p in zip(self.seeds, starts)],
                            dtype=torch.int64).reshape(len(self.seeds), n)

    def sample(self, probs: torch.Tensor, starts: list[int]) -> torch.Tensor:
        """Ids [b, n] drawn from probs [b, n, V] (need not sum to 1), row r's position j with the
        clocks of output position starts[r] + j.

        Only the RACE_HEAD most probable tokens get clocks of their own; the rest (the tail, mass
        m) are one competitor whose clock is Exp(m) (the first of independent Exp(p_i) clocks
        finishes at Exp(sum p_i), and it is token i with probability p_i / m), so a finishing
        tail is resolved by inverse-CDF sampling within it. Exact for any distribution; the clocks
        of a token are the same in every distribution that has it in its head."""
        b, n, v = probs.shape
        d = probs.device
        keys = self.keys(starts, n).to(d)  # [b, n]
        k = min(RACE_HEAD, v)
        fast = kernels.top_values(probs, k)  # one pass over each row on a CPU (cpu/csrc/topk.c)
        head, idx = fast if fast is not None else probs.topk(k, dim=-1)  # [b, n, k]
        arrival = -torch.log(slot_uniforms(keys, idx)) / head.double()  # [b, n, k]; p = 0: never (inf)
        first = arrival.argmin(dim=-1)  # [b, n]
        ids = idx.gather(-1, first[..., None])[..., 0]
        if k == v or not bool((head[..., -1] > 0).any()):  # the head holds every token of mass > 0
            return ids
        tail = probs.scatter(-1, idx, 0.0)  # [b, n, V]
        mass = tail.sum(dim=-1, dtype=torch.float64)  # [b, n]
        reserved = torch.tensor([v, v + 1], dtype=torch.int64, device=d)  # the tail's clock and pick
        u = slot_uniforms(keys, reserved)  # [b, n, 2]
        tail_first = -torch.log(u[..., 0]) / mass  # mass 0: inf, never first
        wins = tail_first < arrival.gather(-1, first[..., None])[..., 0]  # [b, n]
        if bool(wins.any()):
            ids = torch.where(wins, sample_from(tail, u[..., 1]), ids)
        return ids

    def race(self, probs: torch.Tensor, ids: torch.Tensor, positions: list[int]) -> torch.Tensor:
        """The index [b] into probs [b, k] of the winner of a race among the k tokens `ids` [b, k]
        (probs zero elsewhere; need not sum to 1), row r with the clocks of output position
        positions[r]: the token `sample` draws from the same distribution spread over the vocabulary
        whenever the token is in its head."""
        keys = self.keys(positions, 1).to(probs.device)[:, 0]  # [b]
        arrival = -torch.log(slot_uniforms(keys, ids)) / probs.double()  # [b, k]; p = 0: never (inf)
        return arrival.argmin(dim=-1)

    def uniforms(self, starts: list[int], n: int, slots: tuple[int, ...]) -> torch.Tensor:
        """[b, n, len(slots)] float64 uniforms in (0, 1) of row r's output positions starts[r] ..
        starts[r] + n - 1, one per use `slot` (ACCEPT_SLOT, BONUS_SLOT): keyed like the race's
        clocks, on slots no token id takes, so independent of the tokens any race draws there."""
        keys = self.keys(starts, n)  # [b, n]
        return slot_uniforms(keys, torch.tensor(slots, dtype=torch.int64))

    def subset(self, rows: list[int]) -> RowRandom:
        """The draws of some rows (in that order)."""
        out = RowRandom([])
        out.seeds = [self.seeds[i] for i in rows]
        return out

    def select_rows(self, rows: list[int]) -> None:
        self.seeds = [self.seeds[i] for i in rows]

    def extend(self, other: RowRandom) -> None:
        self.seeds.extend(other.seeds)
