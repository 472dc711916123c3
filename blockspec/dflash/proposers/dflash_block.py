"""A DFlash drafter's block proposals: each position's proposal read off its own draft
distribution, the positions independent of each other.

Greedy (every row at temperature 0): the draft argmax, whose top-k's first column is the same
token (the same tie rule: cpu/top_k.py), so a step offered trees reads its chain from the top-k
its trees grow from. A row under a grammar (dflash/constraint.py) takes the best tokens its grammar
allows instead, read off its logits in the same one head pass per row. Sampled (any row sampling): each row draws from its shaped draft
distribution with the draws the target's own sample takes at that output position
(dflash/sampling.py; a row of the standard rule from the sharpened one it is tested against), and
its tree grows from the same shaped distribution, where its draws go.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from blockspec.cpu.argmax import argmax_and_peak
from blockspec.cpu.top_k import top_logprobs
from blockspec.dflash import sampling
from blockspec.dflash.constraint import argmax_masked, sample_masked
from blockspec.dflash.drafter import DFlashDrafter
from blockspec.dflash.proposers.base import PositionDistributions
from blockspec.dflash.proposers.batched import BatchDraft, BatchProposal
from blockspec.dflash.sampling import RowRandom, sharpened
from blockspec.dflash.sparse_probs import SparseProbs, nucleus_draws


@dataclass(frozen=True, eq=False)
class DFlashBlockProposer:
    """`drafter`'s block (one without a candidate selector); `sampled`: some row samples."""

    drafter: DFlashDrafter
    sampled: bool

    def propose(self, draft: BatchDraft) -> BatchProposal:
        return self._sampled(draft) if self.sampled else self._greedy(draft)

    def _greedy(self, draft: BatchDraft) -> BatchProposal:
        hidden, head = draft.hidden, draft.head
        ids = conf = dists = None
        # DecodeBatch offers no tree to a batch with a constrained row (batch.py), so a tree
        # step's proposals are its top-k's alone, masked by no grammar
        if draft.tree_top_k:
            top, top_ids = self.drafter.top_logprobs(hidden, head, draft.tree_top_k)  # [b, D, k], descending
            dists = PositionDistributions.batch(top_ids, top)
            if draft.chain:  # the argmax and its softmax peak
                ids = top_ids[..., 0]
                conf = top[..., 0].exp() if draft.confidence else None  # [b, D]
            return BatchProposal(ids, conf, None, dists)
        rows = [i for i, c in enumerate(draft.constraints) if c is not None]
        if not rows:
            return BatchProposal(*self._argmax(hidden, head, draft.last, draft.confidence))
        # each row's head runs once: the free rows' in the greedy kernel, the constrained rows'
        # where their grammar masks the logits
        b, depth = hidden.shape[:2]
        index = torch.tensor(rows, device=hidden.device)
        masked_ids, masked_conf = self._argmax_masked(draft, rows, index)
        if len(rows) == b:
            return BatchProposal(masked_ids, masked_conf)
        taken = set(rows)
        free = torch.tensor([i for i in range(b) if i not in taken], device=hidden.device)
        free_ids, free_conf = self._argmax(hidden[free], head, None if draft.last is None else draft.last[free],
                                           draft.confidence)
        ids = torch.empty(b, depth, dtype=free_ids.dtype, device=free_ids.device)  # [b, D]
        ids[free], ids[index] = free_ids, masked_ids.to(ids.device)
        if draft.confidence:
            conf = torch.empty(b, depth, dtype=free_conf.dtype, device=free_conf.device)  # [b, D]
            conf[free], conf[index] = free_conf, masked_conf.to(conf.device)
        return BatchProposal(ids, conf)

    def _argmax(self, hidden: torch.Tensor, head: object, last: torch.Tensor | None,
                confidence: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The draft argmax [b, D] of hidden [b, D, H], and its softmax peak [b, D] where
        `confidence` (else None), by the drafter's greedy kernel."""
        if confidence:
            return self.drafter.greedy_with_confidence(hidden, head, last)
        return self.drafter.greedy_tokens(hidden, head, last), None

    def _sampled(self, draft: BatchDraft) -> BatchProposal:
        # the step's one head pass: the draft vocabulary's logits alone [b, D, Vd] (support: their
        # ids), or the whole vocabulary's [b, D, V] (support None)
        logits, support = self.drafter.draft_logits(draft.hidden, draft.head)
        pairs = _draft_pairs(draft, logits, support)
        if pairs is not None:
            return _sampled_pairs(draft, *pairs)
        probs = draft.probs(logits, support)  # [b, D, V]: each row's shaped draft distribution
        dists = None
        if draft.tree_top_k:
            dists = PositionDistributions.batch(*_tree_top(draft, logits, support, probs))
        if not draft.chain:
            return BatchProposal(None, None, None, dists)
        drawn = _standard_sharpened(draft, probs)  # [b, D, V]: what each row draws from
        # drawn with the draws the target's own sample at each position takes (dflash/sampling.py)
        ids = draft.random.sample(drawn, list(draft.starts))  # [b, D]
        conf = draft_confidence(probs) if draft.confidence else None  # the request's q: a trim prices by its peaks
        _mask_sampled(draft, probs, ids)
        return BatchProposal(ids, conf, drawn if draft.keep_q else None, dists)

    def _argmax_masked(self, draft: BatchDraft, rows: list[int],
                       index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The proposals [m, D] of constrained rows `rows` (`index` on the hidden states' device):
        the best tokens their grammar allows, so fewer blocks are cut at a proposal the target
        could never accept; and where the step wants confidence, the peak [m, D] of their
        unmasked draft distribution, the figure the greedy kernel gives a free row."""
        logits, support = self.drafter.greedy_logits(draft.hidden[index], draft.head)  # [m, D, Vd or V]
        conf = argmax_and_peak(logits)[1] if draft.confidence else None
        if support is not None:  # the full vocabulary in the head's dtype, as `drafter.logits` gives it
            logits = sampling.spread(logits.to(draft.head.weight.dtype), support, draft.vocab)  # [m, D, V]
        return argmax_masked(logits, rows, list(draft.constraints)), conf


def _tree_top(draft: BatchDraft, logits: torch.Tensor, support: torch.Tensor | None,
              probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The ids [b, D, k] and log-probabilities [b, D, k] (descending) each row's tree grows
    from: a sampled row's k most likely tokens under its shaped draft distribution probs [b, D,
    V], where its own draws go; a greedy row's under its draft distribution, as a greedy step's
    (`DFlashDrafter.top_logprobs`). logits [b, D, Vd] of the tokens `support` [Vd], or [b, D, V]
    with support None. Temperature, top-k and top-p keep the logits' order and cut their tail,
    so a sampled row's k most likely tokens are its k largest logits, with probability 0 (log
    -inf) past its nucleus: read off the draft vocabulary's logits and k gathered probabilities
    instead of a pass over the whole vocabulary."""
    k = min(draft.tree_top_k, logits.shape[-1])
    top, index = top_logprobs(logits, k)  # [b, D, k], descending; the greedy rows' log-probabilities
    ids = index if support is None else support[index]
    sampled = (draft.temperature > 0)[:, None, None]  # [b, 1, 1]
    if not bool(sampled.any()):
        return ids, top
    shaped = probs.gather(-1, ids).log()  # [b, D, k]
    # a nucleus cut between equal logits may keep the later of them: sort so each row's column
    # order stays the ranking its tree is grown by (stable: the logits' order where equal)
    shaped, order = shaped.sort(dim=-1, descending=True, stable=True)
    return torch.where(sampled, ids.gather(-1, order), ids), torch.where(sampled, shaped, top)


def _draft_pairs(draft: BatchDraft, logits: torch.Tensor, support: torch.Tensor | None
                 ) -> tuple[SparseProbs, torch.Tensor, torch.Tensor] | None:
    """Each row's shaped draft distribution as its nucleus's pairs (dflash/sparse_probs.py) over
    the target's vocabulary, from logits [b, D, Vd] of the tokens `support` (or [b, D, V]), with
    each position's keyed draw [b, D] and peak [b, D] (`sparse_probs.nucleus_draws`), where the
    batch is the chat clients' usual one (every row temperature and top-p, no grammar, drafts from
    the request's own q); else None, and the vocabulary-wide rows serve. The pairs have the bits
    of `BatchDraft.probs`'s entries, so the draws, peaks and trees read off them are the same."""
    if any(c is not None for c in draft.constraints) or not all(k <= 0 or k >= draft.vocab for k in draft.top_k.tolist()):
        return None
    if "standard" in draft.rules and sampling.STANDARD_DRAFT_FACTOR != 1.0:
        return None
    # top-k is off for every row (checked against the whole vocabulary above, as `BatchDraft.probs`
    # reads it)
    return nucleus_draws(logits, support, draft.vocab, draft.temperature, draft.top_p, draft.random, draft.starts)


def _sampled_pairs(draft: BatchDraft, pairs: SparseProbs, drawn: torch.Tensor, peaks: torch.Tensor) -> BatchProposal:
    """`DFlashBlockProposer._sampled` over each row's nucleus pairs [b, D, k], their keyed draws
    drawn [b, D] and peaks [b, D]: the same keyed draws, peaks and tree rankings as over the
    vocabulary-wide rows, and the standard rule's q as the pairs (dflash/verify.py reads them
    alone)."""
    dists = None
    if draft.tree_top_k:
        # the nucleus's ids ascend, so a stable sort ranks equal probabilities by the lower id
        probs, order = pairs.probs.sort(dim=-1, descending=True, stable=True)  # [b, D, k]
        k = min(draft.tree_top_k, probs.shape[-1])
        dists = PositionDistributions.batch(pairs.ids.gather(-1, order[..., :k]), probs[..., :k].log())
    if not draft.chain:
        return BatchProposal(None, None, None, dists)
    conf = peaks if draft.confidence else None  # the peaks, as `draft_confidence`
    return BatchProposal(drawn, conf, pairs if draft.keep_q else None, dists)


def draft_confidence(draft_probs: torch.Tensor) -> torch.Tensor:
    """The peak of each draft distribution [b, n, V] -> [b, n]: what a sampled step's verify
    length is chosen by (see dflash/batch.py `Trim`; not the sampled proposals' own
    probabilities)."""
    return draft_probs.amax(dim=-1)  # values alone: `max` also finds the index, several times slower


def _standard_sharpened(draft: BatchDraft, draft_probs: torch.Tensor) -> torch.Tensor:
    """draft_probs [b, n, V] with the standard rule's rows sharpened (`sampling.sharpened`):
    their proposals come from it, and the rule tests them against it. Other rows keep theirs
    (a keyed row's coupling with the target's draw is that of the request's q; a constrained
    row redraws from the request's q masked by its grammar, `_mask_sampled`)."""
    rows = [i for i, (rule, c) in enumerate(zip(draft.rules, draft.constraints)) if rule == "standard" and c is None]
    if not rows or sampling.STANDARD_DRAFT_FACTOR == 1.0:
        return draft_probs
    if len(rows) == draft_probs.shape[0]:
        return sharpened(draft_probs)
    index = torch.tensor(rows, device=draft_probs.device)
    return draft_probs.index_copy(0, index, sharpened(draft_probs[index]))


def _mask_sampled(draft: BatchDraft, draft_probs: torch.Tensor, ids: torch.Tensor) -> None:
    """Redraws the proposals ids [b, D] of sampled constrained rows from their draft
    distributions draft_probs [b, D, V] masked by their grammar (in place), so none breaks it."""
    rows = [i for i, (c, rule) in enumerate(zip(draft.constraints, draft.rules)) if c is not None and rule != "greedy"]
    if not rows:
        return
    random = RowRandom([draft.random.seeds[i] for i in rows])
    drawn = sample_masked(draft_probs, rows, list(draft.constraints), list(draft.starts), random.sample)
    ids[torch.tensor(rows, device=ids.device)] = drawn.to(ids.device)
