"""The DFlash speculative decoding loop for a batch of token-id prompts (docs/DESIGN.md section 4).

`DecodeBatch` is the one step implementation: rows join (prefill + first token), every `step`
drafts, verifies and commits for the whole batch, finished rows leave. The engine
(blockspec/engine) drives it: rows join and leave between steps. Each row accepts its own
number of tokens per step: the Hugging Face adapter's caches keep per-slot positions (targets/slots.py), native caches index slots by position (targets/native/
cache.py), so nothing is padded to a common length or recomputed. Block size 1 skips the drafter
and is plain autoregressive decoding through the same code. With a LookupConfig, a row whose last
tokens occurred before proposes what followed them instead of its drafted tokens (dflash/lookup.py).

Cache protocol used here (HFCache, DraftCache, native StaticCache): `reject(keep [b, q])` after a
verification, `compact(ratio)`, `select_rows(rows)`; to take joining rows `merge(other)`
(optionally `spawn(k)` to prefill new rows in place); native caches also have `reserve(n)`.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
from torch import nn

from blockspec.errors import ConfigError
from blockspec.dflash.drafter import DFlashDrafter, DraftContextCache
from blockspec.dflash.feature_queue import FeatureQueue
from blockspec.dflash.static_drafter import StaticDrafter
from blockspec.targets.slots import EMPTY
from blockspec.targets.base import Target, TargetCache, greedy_forward, greedy_forward_tree
from blockspec.dflash.logit_bias import apply_logit_bias
from blockspec.dflash.lookup import LookupConfig, TokenIndex
from blockspec.dflash.sampling import RowRandom, probabilities
from blockspec.dflash.sparse_probs import SparseProbs, draw, shaped
from blockspec.dflash.verify import accept_greedy, verify_standard_keyed
from blockspec.dflash.proposers import (BatchDraft, BatchProposal, BatchProposer, DFlash2WalkProposer,
                                        DFlashBlockProposer, Distributions, LookupOverride)
from blockspec.dflash.proposers.lookup_override import splice
from blockspec.dflash.token_tree import TokenTree
from blockspec.dflash.tree_step import TREE_TOP_K, gather_path, pack_trees, path_stats, propose_tree, tree_offers
from blockspec.dflash.tree_verify import TreeAcceptance, keyed_draws, walk
from blockspec.dflash.constraint import RowMasks, cut_block, first_masks, follow, masked
from blockspec.cpu.argmax import greedy_ids
from blockspec.cpu.linear import project
from blockspec.dflash.results import TokenLogprob
from blockspec.dflash.row import Row
from blockspec.dflash.trim import Shape, Trim

# A batch that keeps decoding plainly queues a column of features per row and step
# (`FeatureQueue`), and a busy one never empties to drop them: the queue lets go of what rows that
# left held, but rows that live long keep theirs. Past this many bytes queued `retire` folds the
# queue into the draft cache (`fold_queue`): the work the next draft pass would have done, done
# early, so memory stays bounded. Folding is work lost when the rows leave without drafting again,
# as most rows of a large batch on a CPU do, so the bound is memory's, not the backlog's
# (BENCHMARKS.md, "Concurrency 8 and 16"); the policy prices the backlog into drafting instead.
FOLD_BYTES = 128 << 20


@dataclass(frozen=True)
class NodeTrial:
    """A proposed node of a tree step whose parent was accepted: batch row, depth, rank among its
    siblings, the drafter's probability of it given its parent (None: not a drafted node, such as
    a lookup branch's), and whether the walk went on through it."""

    row: int
    depth: int
    rank: int
    p: float | None
    accepted: bool


class DecodeBatch:
    """The rows being decoded together, their caches, and the step that advances them all.

    Invariants: `rows[i]` is batch row i of every cache and per-row tensor; `cur[i]` is the
    number of committed tokens whose K/V are in the target cache (the prompt plus all generated
    tokens but the last), `last[i]` the last generated token (not yet in the cache), and
    `queue` the target features of committed tokens not yet in the draft cache.
    """

    def __init__(
        self,
        target: Target,
        drafter: DFlashDrafter | None,
        *,
        max_block: int,
        compact_ratio: float = 0.25,
        static_draft: bool = True,
        capture_layer_ids: tuple[int, ...] = (),
        lookup: LookupConfig | None = None,
        tree_nodes: int = 0,
    ) -> None:
        if not isinstance(tree_nodes, int) or isinstance(tree_nodes, bool) or tree_nodes < 0:
            raise ConfigError(f"tree_nodes must be an integer >= 0 (0: chains only), got {tree_nodes!r}")
        self.target = target
        self.lookup = lookup
        self.tree_nodes = tree_nodes
        self.drafter = drafter if max_block > 1 else None
        self.max_block = max_block if self.drafter is not None else 1
        self.compact_ratio = compact_ratio
        self.draft = None
        if self.drafter is not None:
            # the target's int8 mode drafts in int8 too where the drafter can (fp32): proposals only
            self.drafter.use_compute(getattr(target, "compute", "exact"))
            self.draft = StaticDrafter(self.drafter) if static_draft else self.drafter
        self.layer_ids = self.drafter.target_layer_ids if self.drafter is not None else tuple(capture_layer_ids)
        if capture_layer_ids and tuple(capture_layer_ids) != tuple(self.layer_ids):
            raise ConfigError(f"capture_layer_ids {tuple(capture_layer_ids)} differ from the drafter's "
                              f"target_layer_ids {tuple(self.layer_ids)}; capture those, or decode without a drafter")
        self.capture = bool(capture_layer_ids)
        self.embed_scale = self.drafter.cfg.input_embedding_scale if self.drafter is not None else 1.0
        self.device = target.device
        self.offsets = torch.arange(max(1, self.max_block), device=self.device)
        self.rows: list[Row] = []
        self.tcache: TargetCache | None = None
        self.dcache: DraftContextCache | None = None
        self._reset()

    def _reset(self) -> None:
        d = self.device
        self.rows = []
        # Caches keep their storage for the next rows (a native cache: an empty window of the
        # same store); the next join spawns from them.
        empty = torch.zeros(0, dtype=torch.long, device=d)
        for cache in (self.tcache, self.dcache):
            if cache is not None:
                cache.select_rows(empty)
        self.random = RowRandom([])
        self.cur = torch.zeros(0, dtype=torch.long, device=d)
        self.cur_host: list[int] = []
        self.last = torch.zeros(0, dtype=torch.long, device=d)
        self.queue = FeatureQueue()  # read by the next draft pass (kept only with a drafter)
        self.draft_top = 0  # positions below this may hold pending context features
        self.temperature = torch.zeros(0, dtype=torch.float32, device=d)
        self.top_k = torch.zeros(0, dtype=torch.long, device=d)
        self.top_p = torch.zeros(0, dtype=torch.float32, device=d)
        self._plan: list[list[int]] | None = None
        self._proposals: BatchProposer | None = None  # `_proposer`: for the rows' rules
        # [b, q-1, V]: the distribution each proposal of the step being verified was drawn from,
        # for rows verified by the standard rule (None when no row is)
        self._draft_q: torch.Tensor | SparseProbs | None = None
        self.verified = 0  # tokens the last step verified, over all rows (a ragged step's padding not counted)
        # The last step verified token trees, and the trials of their nodes (what the adaptive
        # policy calibrates tree pricing by: dflash/node_acceptance.py).
        self.tree_step = False
        self.node_trials: list[NodeTrial] = []
        # Context the drafter has not read yet beyond the last step's: rows that joined (whole
        # prompts) and plain steps run since its last pass. `caught_up`: the last step's draft
        # pass read such a backlog, so its time is not what a step of its size costs.
        self._joined_since_draft = False
        self._plain_since_draft = 0
        self.caught_up = False
        # (drafted positions, seconds) of the last step's draft pass and proposals, timed on a CPU
        # (where the host waits for them; None on an accelerator, and for steps without a draft):
        # what the adaptive policy measures the draft's part of a step by
        self.draft_timing: tuple[int, float] | None = None

    def __len__(self) -> int:
        return len(self.rows)

    @torch.inference_mode()
    def clear(self) -> None:
        """Drops every row (after a failure, or to start over); caches keep their storage."""
        try:
            self._reset()
        except Exception:  # a cache left inconsistent by the failure: start from scratch
            self.tcache = self.dcache = None
            self._reset()

    @torch.inference_mode()
    def release(self) -> None:
        """Drops every row and the caches' storage too (`clear` keeps it for the next rows): an
        idle engine gives back memory sized for its largest batch and longest sequence so far."""
        self.tcache = self.dcache = None
        self._reset()

    @torch.inference_mode()
    def reserve(self, rows: int, tokens: int) -> None:
        """Sizes the caches' storage, while no row runs, for `rows` rows of up to `tokens` tokens
        each (prompt and output), with room for the widest step, so that no join or step within
        that size grows it: a growth copies the whole store into fresh, zero-filled memory in the
        middle of a step. Caches that grow by appending ignore it (the cache protocol's `reserve`)."""
        if self.rows:
            raise ConfigError("reserve() sizes the caches of an idle batch; call it before rows join")
        if rows < 1 or tokens < 1:
            raise ConfigError(f"reserve() needs rows >= 1 and tokens >= 1, got {rows} and {tokens}")
        slots = tokens + max(self.max_block, self.tree_nodes + 1) + 1  # a step writes past the last commit
        if self.tcache is None:
            self.tcache = self.target.new_cache(0)
        self.tcache.spawn(rows).reserve(slots)
        if self.draft is not None:
            if self.dcache is None:
                self.dcache = self.draft.new_cache(0)
            self.dcache.spawn(rows).reserve(slots)

    @property
    def skips_padding(self) -> bool:
        """Whether a ragged step costs what its rows verify in total (the target skips padding in
        its matmuls), rather than what its longest row does."""
        return self.target.skips_padding

    @property
    def trees(self) -> bool:
        """Whether drafting steps verify token trees: tree_nodes > 0 and a target that verifies
        them in one pass (`supports_trees`: attention-only targets; recurrent ones keep chains)."""
        # only an explicit True: a wrapper or double without the attribute verifies chains
        return self.tree_nodes > 0 and self.drafter is not None and getattr(self.target, "supports_trees", False) is True

    @property
    def draft_backlog(self) -> int:
        """Context tokens, over all rows, that the next draft pass would catch up on (what is
        queued where rows joined or more than one plain step ran since the last pass: what makes
        its step `caught_up`); 0 when it reads only what a drafting step leaves behind."""
        if self.drafter is None or not (self._joined_since_draft or self._plain_since_draft > 1):
            return 0
        return self.queue.backlog

    @property
    def all_greedy(self) -> bool:
        return all(r.params.greedy for r in self.rows)

    @property
    def rules(self) -> list[str]:
        """Each row's verification rule (SamplingParams.rule)."""
        return [r.params.rule for r in self.rows]

    def _vocab(self) -> int:
        """The target's output vocabulary (the rows of its head: what its logits span)."""
        return int(self.target.head().weight.shape[0])

    def _wants_q(self) -> bool:
        """Whether the step being built must keep its proposals' draft distributions."""
        return any(r.params.rule == "standard" for r in self.rows)

    @property
    def argmax_only(self) -> bool:
        """Whether a target pass may return argmax ids alone: every row greedy on the target's own
        logits (no logit_bias), none asking for logprobs."""
        return all(r.params.plain_argmax for r in self.rows)

    def _starts(self) -> list[int]:
        """Per row, the output position of the token its next target position predicts: what
        each random draw is keyed by, with the request's seed (dflash/sampling.py)."""
        return [len(r.generated) for r in self.rows]

    # ---- joining -------------------------------------------------------------------------------
    @torch.inference_mode()
    def join(self, prompts: list[list[int]], rows: list[Row]) -> None:
        """Prefills new rows and samples their first token; they take part in the next step.

        If this raises, the batch is unchanged unless the caches were already merged (then the
        caller must treat the whole batch as failed).
        """
        k = len(prompts)
        self._joined_since_draft = True
        if k == 0:
            return
        d = self.device
        longest = max(len(p) for p in prompts)
        ids = torch.zeros(k, longest, dtype=torch.long)
        positions = torch.full((k, longest), EMPTY, dtype=torch.long)
        for i, p in enumerate(prompts):  # left padding: every row's last token is column -1
            ids[i, longest - len(p):] = torch.tensor(p)
            positions[i, longest - len(p):] = torch.arange(len(p))
        ids, positions = ids.to(d), positions.to(d)
        tcache = self.target.new_cache(k) if self.tcache is None else self.tcache.spawn(k)
        tcache.reserve(longest)
        params = [r.params for r in rows]
        random = RowRandom([sp.seed for sp in params])
        temperature = torch.tensor([sp.temperature for sp in params], dtype=torch.float32, device=d)
        top_k = torch.tensor([sp.top_k for sp in params], dtype=torch.long, device=d)
        top_p = torch.tensor([sp.top_p for sp in params], dtype=torch.float32, device=d)
        first_lp: list[list[TokenLogprob]] | None = None
        masks = first_masks([r.constraint for r in rows], self.target.info.vocab_size)
        if all(sp.plain_argmax for sp in params):
            best, feats = self._argmax_pass(ids, positions, tcache, masks, last_logits_only=True)
            first = best[:, -1]  # [k]
        else:
            logits, feats = self.target.forward(ids, positions, tcache, self.layer_ids, last_logits_only=True)
            biased = apply_logit_bias(logits[:, -1:], [sp.logit_bias for sp in params])
            probs = probabilities(_constrained(biased, masks), temperature, top_k, top_p)  # [k, 1, V]
            first = random.sample(probs, [0] * k)[:, 0]  # output position 0
            first_lp = token_logprobs(logits[:, -1:], first[:, None], [sp.logprobs for sp in params])
        dcache = None
        if self.draft is not None:
            dcache = self.draft.new_cache(k) if self.dcache is None else self.dcache.spawn(k)
        first_host = first.tolist()
        # ---- from here on the batch changes
        if not self.rows:
            self.tcache, self.dcache = tcache, dcache
        else:
            self.tcache.merge(tcache)
            if dcache is not None:
                self.dcache.merge(dcache)
        self.random.extend(random)
        self.temperature = torch.cat([self.temperature, temperature])
        self.top_k = torch.cat([self.top_k, top_k])
        self.top_p = torch.cat([self.top_p, top_p])
        lengths = [len(p) for p in prompts]
        self.cur = torch.cat([self.cur, torch.tensor(lengths, device=d)])
        self.cur_host.extend(lengths)
        self.last = torch.cat([self.last, first])
        if self.drafter is not None:
            self.queue.join(feats, positions)
            self.draft_top = max(self.draft_top, longest)
        if self.capture:
            host_feats = feats.float().cpu()
            for i, r in enumerate(rows):
                r.captured = [host_feats[i, longest - lengths[i]:]]
        now = time.perf_counter()
        self._plan = None
        for i, (r, t, p) in enumerate(zip(rows, first_host, prompts)):
            if self.lookup is not None and self.drafter is not None:
                r.index = TokenIndex()
                r.index.extend(p)
            r.decode_t0 = now
            r.new_tokens = []
            self._commit(r, [t], first_lp[i] if first_lp is not None else None)
        self.rows.extend(rows)
        self._proposals = None  # the rows' rules changed

    # ---- one step ----------------------------------------------------------------------------
    def _probs(self, logits: torch.Tensor) -> torch.Tensor | SparseProbs:
        """The target's shaped p of logits [b, n, V]: a nucleus's pairs where it can be (dflash/sparse_probs.py)."""
        return shaped(logits, self.temperature, self.top_k, self.top_p)

    @torch.inference_mode()
    def step(self, block: int, trim: Trim | None = None, tree: bool = True) -> int:
        """Drafts (block > 1), verifies and commits for every row; returns the block size used.

        `trim` (block > 1) sees the drafts' confidences and picks how many tokens of the drafted
        block to verify (see Trim); without it the whole block is verified. Where the batch
        verifies trees (`trees`), `tree=False` makes the step verify chains instead (a trim
        offered trees says which in its `Shape`). The only host synchronisation is the read-back of committed
        tokens (and with `trim`, of confidences).

        A drafting step is a straight line: the draft pass, the proposals of the batch's proposer
        (one head pass: `_proposer`), the trim, then a tree or a chain verified and committed.
        """
        rows = self.rows
        b = len(rows)
        self._draft_q = None
        self.tree_step = False
        self.node_trials = []
        self.draft_timing = None
        remaining = [r.remaining for r in rows]
        q = max(1, min(block, self.max_block, max(remaining)))
        offsets = self.offsets[:q]
        positions = self.cur[:, None] + offsets  # [b, q]
        top = max(self.cur_host) + q
        block_ids = torch.empty(b, q, dtype=torch.long, device=self.device)
        block_ids[:, 0] = self.last
        from_lookup = [0] * b
        lengths = [q] * b  # tokens each row verifies
        # more than one plain step behind: a probe after a run of plain steps catches up on all of them
        self.caught_up = q > 1 and (self._joined_since_draft or self._plain_since_draft > 1)
        if q == 1:
            self._plain_since_draft += 1
        else:
            t0 = time.perf_counter()
            hidden = self._draft_hidden(positions, top)  # [b, q, H]
            # Constrained rows keep chains: their grammar cuts a chain at its first disallowed
            # proposal (`_cut`), which a tree would need per branch.
            trees = self.trees and tree and all(r.constraint is None for r in rows)
            proposal = self._propose(hidden[:, 1:q], trees, trim is not None)
            if self.device.type == "cpu":
                self.draft_timing = (q, time.perf_counter() - t0)
            if proposal.ids is not None:  # a fixed tree step reads only block_ids[:, :1]
                block_ids[:, 1:] = proposal.ids
            from_lookup = list(proposal.looked) or from_lookup
            self._draft_q = proposal.draft_q
            if self._draft_q is not None and any(from_lookup):  # lookup proposals: drafts from a point mass
                self._draft_q = _one_hot_where(self._draft_q, block_ids[:, 1:], from_lookup)
            if trim is not None:
                conf = proposal.confidence.tolist()
                # where trees are offered, the trim prices each row's best nodes against its chain
                chosen = (trim(conf, from_lookup, tree_offers([r.generated[-1] for r in rows], proposal.distributions,
                                                              min(q - 1, self.tree_nodes)))
                          if trees else trim(conf, from_lookup))
                if isinstance(chosen, Shape):
                    trees, chosen = trees and chosen.tree, chosen.lengths
                lengths = [max(1, min(q, int(n))) for n in (chosen if isinstance(chosen, list) else [chosen] * b)]
                if len(lengths) != b:
                    raise ValueError(f"a trim returned {len(lengths)} verify lengths for {b} rows")
            if trees and max(lengths) > 1:
                self._draft_q = None  # a tree step accepts by the target's keyed draws alone
                self.tree_step = True
                return self._verify_tree(proposal.distributions, lengths, top, q - 1)
        lengths, masks = self._cut(block_ids, lengths)
        q = max(lengths)
        if q < block_ids.shape[1]:  # verify only the first q tokens of the drafted block
            block_ids, positions, offsets = block_ids[:, :q].contiguous(), positions[:, :q].contiguous(), offsets[:q]
            if self._draft_q is not None:
                self._draft_q = self._draft_q[:, :q - 1]
        limit, padding, positions = _ragged(lengths, offsets, positions)
        from_lookup = [min(m, n - 1) for m, n in zip(from_lookup, lengths)]
        return self._verify_and_commit(block_ids, positions, offsets, top, from_lookup, lengths, limit, padding,
                                       masks)

    def _draft_hidden(self, positions: torch.Tensor, top: int) -> torch.Tensor:
        """The draft pass of a block at positions [b, q] (the last token, then mask tokens) over
        the context features queued since the last one: the drafter's final states [b, q, H]."""
        self._joined_since_draft, self._plain_since_draft = False, 0
        draft_ids = torch.full(positions.shape, self.drafter.mask_token_id, dtype=torch.long, device=self.device)
        draft_ids[:, 0] = self.last
        embeds = self.target.embed(draft_ids)  # [b, q, H]
        if self.embed_scale != 1.0:
            embeds = embeds * self.embed_scale
        self.dcache.reserve(top, self.draft_top)
        if self.queue:
            ctx_feats, ctx_pos = self.queue.take()  # [b, c, L*H], [b, c]
        else:  # a fold (`fold_queue`) since the last step read everything queued: no new context
            b = positions.shape[0]
            ctx_feats = embeds.new_zeros(b, 0, len(self.layer_ids) * self.target.info.hidden_size)  # [b, 0, L*H]
            ctx_pos = torch.empty(b, 0, dtype=torch.long, device=self.device)
        return self.draft(ctx_feats, ctx_pos, embeds, positions, self.dcache)

    def _proposer(self) -> BatchProposer:
        """The batch's proposer (dflash/proposers/batched.py), chosen once for its drafter and its
        rows' rules (greedy or sampled) and rebuilt only when rows join or leave: a DFlash block or
        a DFlash 2 walk, under the lookup override where lookup is on."""
        if self._proposals is None:
            sampled = not self.all_greedy
            walks = self.drafter.candidate_selector is not None
            inner = (DFlash2WalkProposer(self.drafter, sampled) if walks
                     else DFlashBlockProposer(self.drafter, sampled))
            self._proposals = LookupOverride(inner, walks) if self.lookup is not None else inner
        return self._proposals

    def _propose(self, hidden: torch.Tensor, trees: bool, confidence: bool) -> BatchProposal:
        """The proposals for draft hidden states hidden [b, q-1, H] at block positions 1..q-1:
        with `trees` each row's distributions for its tree, and its chain too where a trim (which
        reads the `confidence`s) may still answer with a chain."""
        lookup = [cont[: hidden.shape[1]] for cont in self.lookup_plan()] if self.lookup is not None else ()
        return self._proposer().propose(BatchDraft(
            hidden, self.target.head(), self.last, self._starts(), self.random, self.temperature, self.top_k,
            self.top_p, self.rules, [r.constraint for r in self.rows], lookup, chain=not trees or confidence,
            confidence=confidence, tree_top_k=min(hidden.shape[1], self.tree_nodes, TREE_TOP_K) if trees else 0))

    def _verify_tree(self, dists: list[Distributions], lengths: list[int], top: int, depth: int) -> int:
        """A step that verifies a token tree per row (section 5.3 of docs/DESIGN.md): row i spends
        lengths[i] - 1 proposed nodes (at most tree_nodes) best-first over its drafter's
        distributions `dists` (depths 1..depth), its lookup continuation as one more branch; one
        `forward_tree` pass; the walk (dflash/tree_verify.py) along the target's own tokens
        (argmax, or keyed draw at the node's output position) picks the path; the cache, the
        drafter's context and everything that reads a step's outputs then follow that path.
        Returns the largest tree's size."""
        rows = self.rows
        d = self.device
        budgets = [max(0, min(n - 1, self.tree_nodes)) for n in lengths]
        plan = self.lookup_plan() if self.lookup is not None else [[] for _ in rows]
        branches = [list(cont[: min(depth, budget)]) for cont, budget in zip(plan, budgets)]
        # a live row's last generated token is `last`: read from the host, not the device
        trees = [propose_tree(r.generated[-1], dist, branch, budget)
                 for r, dist, branch, budget in zip(rows, dists, branches, budgets)]
        if not any(branches) and all(t.is_chain() for t in trees):
            return self._verify_chains(trees, top)
        packed = pack_trees(trees, self.cur_host, d)
        n = packed.ids.shape[1]
        self.verified = sum(len(t) for t in trees)
        self.tcache.reserve(max(self.cur_host) + n)
        if self.argmax_only:  # the target's argmax only: a native target skips most of its head
            tokens, feats = greedy_forward_tree(self.target, packed.ids, packed.positions, packed.ancestors,
                                                self.tcache, self.layer_ids, until_rejected=True)  # [b, n], [b, n, F]
        else:
            logits, feats = self.target.forward_tree(packed.ids, packed.positions, packed.ancestors, self.tcache,
                                                     self.layer_ids)  # [b, n, V], [b, n, F]
            biased = apply_logit_bias(logits, [r.params.logit_bias for r in rows])
            tokens = keyed_draws(self.random, self._probs(biased), [t.depths for t in trees], self._starts())
        walks = [walk(t, h[: len(t)]) for t, h in zip(trees, tokens.tolist())]  # the one sync
        n_host = [min(a.accepted + 1, r.remaining) for a, r in zip(walks, rows)]
        m = max(n_host)
        # [b, m]: each row's committed path nodes (its root first), padded with the root
        path = torch.tensor([list(a.path[:k]) + [0] * (m - k) for a, k in zip(walks, n_host)], device=d)
        keep = [[False] * n for _ in rows]  # the committed path's nodes and the padding (it never took a slot)
        for flags, a, k, t in zip(keep, walks, n_host, trees):
            for node in a.path[:k]:
                flags[node] = True
            flags[len(t):] = [True] * (n - len(t))
        self.tcache.reject(torch.tensor(keep, device=d))
        committed = [a.committed(t)[:k] for a, t, k in zip(walks, trees, n_host)]
        if self.drafter is not None:  # the path's features, in order: what the drafter reads next
            path_feats = gather_path(feats, path)  # [b, m, F]
            at = [[c + j if j < k else EMPTY for j in range(m)] for c, k in zip(self.cur_host, n_host)]
            self.queue.append(path_feats, torch.tensor(at, device=d))  # [b, m]
            self.draft_top = max(self.draft_top, top)
        token_lp = None
        wanted = [r.params.logprobs for r in rows]
        if not self.argmax_only and any(k is not None for k in wanted):
            # the logits at a path node predict the path's next committed token
            path_logits = gather_path(logits, path)  # [b, m, V]
            padded = torch.tensor([c + [0] * (m - len(c)) for c in committed], device=d)
            token_lp = token_logprobs(path_logits, padded, wanted)
        if self.capture:
            host_feats = feats.float().cpu()
            for i, (r, a, k) in enumerate(zip(rows, walks, n_host)):
                r.captured.append(host_feats[i, list(a.path[:k])])
        self.cur_host = [c + k for c, k in zip(self.cur_host, n_host)]
        both = torch.tensor([c[-1] for c in committed] + self.cur_host, device=d)  # [2 b]: one tensor for the two
        self.last, self.cur = both[:len(rows)], both[len(rows):]
        self._plan = None
        for i, (r, tree, a, k, branch) in enumerate(zip(rows, trees, walks, n_host, branches)):
            self._record_tree(r, tree, a, k, committed[i], branch)
            if not branch:  # a lookup branch's nodes are priced by lookup's own rates
                self.node_trials.extend(node_trials(i, tree, a, dists[i]))
            r.new_tokens = []
            self._commit(r, committed[i], token_lp[i][:k] if token_lp is not None and token_lp[i] is not None else None)
        return n

    def _verify_chains(self, trees: list[TokenTree], top: int) -> int:
        """A tree step whose every tree came out a chain (best-first over confident drafts often
        grows one: 36% of the trees of 3 nodes on GSM8K), verified as the chain it is: the same
        tokens and acceptance (the argmax, or every sampled row's keyed draws: a tree step leaves
        no draft q, so no row takes the standard rule), without a tree's packing, slots and path
        moves (about 7% of a 4-token step on a CPU). The policy books it as the chain step it is."""
        self.tree_step = False
        lengths = [len(t) for t in trees]
        q = max(lengths)
        block_ids = torch.tensor([list(t.tokens) + [0] * (q - len(t)) for t in trees], device=self.device)  # [b, q]
        offsets = self.offsets[:q]
        limit, padding, positions = _ragged(lengths, offsets, self.cur[:, None] + offsets)
        return self._verify_and_commit(block_ids, positions, offsets, top, [0] * len(trees), lengths, limit, padding)

    @staticmethod
    def _record_tree(r: Row, tree: TokenTree, acceptance: TreeAcceptance, n: int, committed: list[int],
                     branch: list[int]) -> None:
        """A tree step's statistics for row r: its acceptance length, the rank of each accepted
        node, and per depth tried / accepted by the drafter's first-choice chain, the tree's
        spine: what that chain alone would have accepted, since the walk follows the target's own
        tokens whatever the tree (a row with a lookup branch books them as lookup's, the prefix of
        its continuation that was committed). The policy prices chains by these and trees by
        their gain over the chain (`NodeTrial`s by depth and rank), so the tree's own acceptance
        by depth must not count here, or its siblings' share counted twice."""
        stats = path_stats(tree, acceptance, n)
        r.stats.acceptance_lengths.append(n)
        r.stats.tree_steps += 1
        for rank in stats.ranks:
            r.stats.accepted_by_rank.extend([0] * (rank + 1 - len(r.stats.accepted_by_rank)))
            r.stats.accepted_by_rank[rank] += 1
        if branch:
            r.stats.lookup_steps += 1
            proposals = committed[: stats.accepted]
            matched = next((j for j, (x, y) in enumerate(zip(branch, proposals)) if x != y), min(len(branch), len(proposals)))
            # the continuation's next token was tried where the path left it, or stopped below it
            left = matched < stats.accepted or stats.tried > stats.accepted
            acc, tries = r.stats.lookup_accepted_by_position, r.lookup_tries
            accepted, tried = matched, min(len(branch), matched + int(left))
        else:
            acc, tries = r.stats.accepted_by_position, r.tries
            spine = next((j for j, rank in enumerate(stats.ranks) if rank), len(stats.ranks))
            # the path left the spine at depth spine + 1, where the spine's node was tried and lost
            accepted, tried = (spine, spine + 1) if spine < stats.accepted else (stats.accepted, stats.tried)
        for k in range(min(accepted, len(acc))):
            acc[k] += 1
        for k in range(min(tried, len(tries))):
            tries[k] += 1

    def _cut(self, block_ids: torch.Tensor, lengths: list[int]) -> tuple[list[int], RowMasks | None]:
        """The verify lengths after cutting constrained rows' blocks [b, q] at the first proposal
        their grammar rejects, and those rows' masks (dflash/constraint.py); unchanged and None
        without constrained rows."""
        constraints = [r.constraint for r in self.rows]
        if all(c is None for c in constraints):
            return lengths, None
        return cut_block(constraints, block_ids.tolist(), lengths, self.target.info.vocab_size)

    def _argmax_pass(self, ids: torch.Tensor, positions: torch.Tensor, cache: TargetCache, masks: RowMasks | None,
                     last_logits_only: bool = False, until_rejected: bool = False
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`greedy_forward` for an all-greedy batch: the target's argmax ids [b, q|1] and
        features. Constrained rows (masks) need the argmax of their masked logits: the pass also
        captures the final hidden states and only those rows' logits are computed from them, so
        the other rows keep the argmax-only head. until_rejected: a verify pass (ids past a row's
        first rejected proposal may be -1, `greedy_forward`)."""
        if masks is None:
            return greedy_forward(self.target, ids, positions, cache, self.layer_ids, last_logits_only, until_rejected)
        h, last = self.target.info.hidden_size, self.target.info.num_layers - 1
        layer_ids = self.layer_ids if last in self.layer_ids else (*self.layer_ids, last)
        best, feats = greedy_forward(self.target, ids, positions, cache, layer_ids, last_logits_only, until_rejected)
        at = layer_ids.index(last) * h
        rows = masks.rows.to(best.device)
        hidden = feats[rows, :, at: at + h]  # [m, q, H]: what the LM head reads (after the final norm)
        if last_logits_only:
            hidden = hidden[:, -1:]
        head = self.target.head()
        logits = project(head, hidden.to(head.weight.dtype)) if isinstance(head, nn.Linear) else head(hidden)
        best[rows] = greedy_ids(masked(logits, masks.bits.to(logits.device)))
        if not self.layer_ids:
            return best, None
        return best, feats[..., : len(self.layer_ids) * h]

    @torch.inference_mode()
    def step_lookup(self, lengths: list[int]) -> int:
        """A step without a draft pass: row i verifies lengths[i] tokens, its last token and the
        first lengths[i] - 1 ids of its n-gram lookup continuation (`lookup_plan`; longer lengths
        are cut to it, and 1 is a plain step for that row). Rows of different lengths make a
        ragged step, whose padding the native target leaves out of its matmuls. Returns the
        longest length. Lookup proposals are deterministic, so verification stays exact: greedy
        compares them with the target's argmax, sampled treats them as one-hot drafts."""
        rows = self.rows
        b = len(rows)
        if len(lengths) != b:
            raise ValueError(f"step_lookup got {len(lengths)} verify lengths for {b} rows")
        plan = self.lookup_plan()
        lengths = [max(1, min(int(n), 1 + len(cont), self.max_block)) for n, cont in zip(lengths, plan)]
        q = max(lengths, default=1)
        if q == 1:
            return self.step(1)
        self.tree_step = False  # what the policy books this step by: a chain, with no node trials
        self.node_trials = []
        self.caught_up = False  # no draft pass
        self.draft_timing = None
        offsets = self.offsets[:q]
        positions = self.cur[:, None] + offsets  # [b, q]
        top = max(self.cur_host) + q
        block_ids = self.last[:, None].repeat(1, q)  # [b, q]
        # each row's continuation; past its length it is padding
        block_ids[:, 1:], looked = splice(block_ids[:, 1:], plan)
        if self._wants_q():  # lookup proposals are deterministic: one-hot drafts
            self._draft_q = _one_hot_where(None, block_ids[:, 1:], looked, self._vocab())
        lengths, masks = self._cut(block_ids, lengths)
        q = max(lengths)
        block_ids, positions, offsets = block_ids[:, :q].contiguous(), positions[:, :q].contiguous(), offsets[:q]
        if self._draft_q is not None:
            self._draft_q = self._draft_q[:, :q - 1]
        limit, padding, positions = _ragged(lengths, offsets, positions)
        return self._verify_and_commit(block_ids, positions, offsets, top, [n - 1 for n in lengths], lengths,
                                       limit, padding, masks)

    def _verify_and_commit(self, block_ids: torch.Tensor, positions: torch.Tensor, offsets: torch.Tensor, top: int,
                           from_lookup: list[int], lengths: list[int], limit: torch.Tensor | None,
                           padding: torch.Tensor | None, masks: RowMasks | None = None) -> int:
        """The target's pass over block_ids [b, q] (positions EMPTY at `padding`), acceptance, and
        the commit of every row's accepted tokens and bonus. `masks`: constrained rows' grammar
        masks at each position, applied to the target's logits before its argmax or sample.

        Sampled rows of the keyed rule take the target's own sample at each position (drawn with
        the draws of the request's seed and that output position, dflash/sampling.py) and accept
        a proposal while it equals that sample: each committed token is the one the target alone
        would have sampled there, so the output follows the target's distribution exactly and does
        not depend on what was proposed, by whom, or how many positions a step verified. Rows of
        the standard rule accept by min(1, p/q) against the distributions their proposals were
        drawn from (`_draft_q`; dflash/verify.py), which accepts more but ties the text to the
        proposals. Rows of both rules share a step."""
        rows = self.rows
        b, q = block_ids.shape
        d = self.device
        remaining = [r.remaining for r in rows]
        self.verified = b * q if padding is None else sum(lengths)
        # the attention horizon of the tokens verified (a trimmed block reads fewer slots: those
        # beyond it hold stale keys of rejected tokens)
        self.tcache.reserve(max(self.cur_host) + q)
        proposals = block_ids[:, 1:]
        token_lp = None
        if self.argmax_only:  # the target's argmax only: a native target skips most of its head
            best, feats = self._argmax_pass(block_ids, positions, self.tcache, masks, until_rejected=q > 1)
        else:
            logits, feats = self.target.forward(block_ids, positions, self.tcache, self.layer_ids)
            biased = apply_logit_bias(logits, [r.params.logit_bias for r in rows])  # what plain decoding samples from
            probs = self._probs(_constrained(biased, masks))  # [b, q, V]
        accepted, bonus = (accept_greedy(proposals, best, limit) if self.argmax_only
                           else self._accept_sampled(proposals, probs, limit))
        self._draft_q = None
        # [b, q]: proposals[:accepted] then the bonus; row r commits its first accepted+1.
        committed = torch.cat([proposals, bonus[:, None]], dim=1).scatter(1, accepted[:, None], bonus[:, None])
        if not self.argmax_only:
            token_lp = token_logprobs(logits, committed, [r.params.logprobs for r in rows])
        host = torch.cat([committed, accepted[:, None]], dim=1).tolist()  # the one sync
        n_host = [min(h[-1] + 1, rem) for h, rem in zip(host, remaining)]
        n_new = torch.tensor(n_host, device=d)
        keep = offsets[None] < n_new[:, None]  # [b, q]: block slots 0..n_new-1 stay in the cache
        self.tcache.reject(keep if padding is None else keep | padding)  # padding never took a slot
        if self.drafter is not None:
            # a plain step keeps its one token (n_new >= 1): its positions are the kept ones
            kept_pos = positions if q == 1 else torch.where(keep, positions, torch.full_like(positions, EMPTY))
            self.queue.append(feats, kept_pos)
            self.draft_top = max(self.draft_top, top)
        if self.capture:  # block slots 0..n-1 were fed tokens that stay: their features are final
            host_feats = feats.float().cpu()
            for i, (r, n) in enumerate(zip(rows, n_host)):
                r.captured.append(host_feats[i, :n])
        self.last = committed.gather(1, (n_new - 1)[:, None])[:, 0]
        self.cur = self.cur + n_new
        self.cur_host = [c + n for c, n in zip(self.cur_host, n_host)]
        self._plan = None
        for i, (r, h, n, looked, length) in enumerate(zip(rows, host, n_host, from_lookup, lengths)):
            a = h[-1]
            r.stats.acceptance_lengths.append(n)
            if looked:  # drafted proposals after a lookup prefix are counted nowhere
                r.stats.lookup_steps += 1
                acc, tries, last = r.stats.lookup_accepted_by_position, r.lookup_tries, looked
            else:
                acc, tries, last = r.stats.accepted_by_position, r.tries, length - 1
            for k in range(min(a, last, len(acc))):
                acc[k] += 1
            for k in range(min(a + 1, last, len(tries))):
                tries[k] += 1
            r.new_tokens = []
            self._commit(r, h[:n], token_lp[i][:n] if token_lp is not None and token_lp[i] is not None else None)
        return q

    def _accept_sampled(self, proposals: torch.Tensor, probs: torch.Tensor | SparseProbs, limit: torch.Tensor | None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        """accepted [b], bonus [b] of a step whose target gave probs [b, q, V]: each row by its rule."""
        b, m = proposals.shape
        starts = self._starts()
        standard = [i for i, rule in enumerate(self.rules) if rule == "standard"] if m and self._draft_q is not None else []
        if not standard:
            return accept_greedy(proposals, draw(self.random, probs, starts), limit)  # best [b, q]: the target's own
        keyed = [i for i in range(b) if i not in set(standard)]
        accepted = torch.empty(b, dtype=torch.long, device=proposals.device)
        bonus = torch.empty_like(accepted)
        for rows, rule in ((keyed, "keyed"), (standard, "standard")):
            if not rows:
                continue
            whole = len(rows) == b
            index = None if whole else torch.tensor(rows, device=proposals.device)
            pick = (lambda t: t) if whole else (lambda t: t if t is None else t[index])  # noqa: E731
            random = self.random if whole else self.random.subset(rows)
            row_starts = [starts[i] for i in rows]
            if rule == "keyed":
                a, bo = accept_greedy(pick(proposals), draw(random, pick(probs), row_starts), pick(limit))
            else:
                a, bo = verify_standard_keyed(pick(proposals), pick(probs), pick(self._draft_q),
                                              random.keys(row_starts, m + 1), pick(limit))
            if whole:
                return a, bo
            accepted[index], bonus[index] = a, bo
        return accepted, bonus

    def lookup_plan(self) -> list[list[int]]:
        """Per row, the n-gram lookup continuation (up to max_block - 1 ids) the next step will
        propose in place of drafted ones; [] for rows without one, or when lookup is off."""
        if self._plan is None:
            cfg, width = self.lookup, self.max_block - 1
            self._plan = [r.index.continuation(cfg, width)[1] if r.index is not None and cfg is not None else []
                          for r in self.rows]
        return self._plan

    def _commit(self, r: Row, new: list[int], logprobs: list[TokenLogprob] | None = None) -> None:
        """Appends tokens (and their logprobs), applying stop tokens, stop strings and the length limit."""
        for j, t in enumerate(new):
            if t in r.stop_ids:
                new = new[: j + 1]
                r.finish_reason = "stop"
                break
        start = len(r.generated)
        r.generated.extend(new)
        if r.logprobs is not None:
            r.logprobs.extend((logprobs or [])[: len(new)])
        if r.finish_reason is None and r.stop_check is not None:
            keep = r.stop_check(r.generated)
            if keep is not None:
                del r.generated[keep:]
                r.finish_reason = "stop"
        if r.finish_reason is None and len(r.generated) >= r.params.max_new_tokens:
            r.finish_reason = "length"
        r.new_tokens = r.generated[start:]
        if r.logprobs is not None:
            del r.logprobs[len(r.generated):]
            r.new_logprobs = r.logprobs[start:]
        if r.index is not None and r.finish_reason is None:
            r.index.extend(r.new_tokens)
        if r.constraint is not None and r.finish_reason is None and follow(r.constraint, r.new_tokens):
            r.finish_reason = "stop"  # the grammar is complete: nothing may follow

    # ---- leaving -------------------------------------------------------------------------------
    @torch.inference_mode()
    def retire(self) -> list[Row]:
        """Removes rows with a finish_reason (set one to cancel a row); returns them."""
        done = [i for i, r in enumerate(self.rows) if r.finish_reason is not None]
        gone = [self.rows[i] for i in done]
        if done:
            self._plan = None
            self._proposals = None  # the rows' rules changed
        if len(done) == len(self.rows) and done:
            self._reset()
            return gone
        if done:
            order = _swap_remove_order(len(self.rows), done)
            index = torch.tensor(order, dtype=torch.long, device=self.device)
            self.rows = [self.rows[i] for i in order]
            self.random.select_rows(order)
            self.tcache.select_rows(index)
            if self.dcache is not None:
                self.dcache.select_rows(index)
            self.cur, self.last = self.cur[index], self.last[index]
            self.cur_host = [self.cur_host[i] for i in order]
            if self.drafter is not None:
                self.queue.select_rows(order)  # moves no queued features
            self.temperature, self.top_k, self.top_p = self.temperature[index], self.top_k[index], self.top_p[index]
        if self.rows:
            self.tcache.compact(self.compact_ratio)
            if self.dcache is not None:
                self.dcache.compact(self.compact_ratio)
            if self.queue.nbytes > FOLD_BYTES:
                self.fold_queue()
        return gone

    @torch.inference_mode()
    def fold_queue(self) -> bool:
        """Reads every queued context feature into the draft cache now, as the next draft pass
        would have (a pass whose block is each row's last token, its output dropped); False
        where there is nothing to fold. The next drafting step then reads only what came after."""
        if self.drafter is None or not self.queue or not self.rows:
            return False
        self._draft_hidden(self.cur[:, None], max(self.cur_host) + 1)  # a block of the last token alone
        return True


def node_trials(row: int, tree: TokenTree, acceptance: TreeAcceptance, dist: Distributions) -> list[NodeTrial]:
    """The trials of one row's tree step: every child of a node on the walk's path was tried
    (the target's token there was known), and the one the walk went on through was accepted.
    Each with its depth, its rank among its siblings and its drafter probability under `dist`."""
    out = []
    path = acceptance.path
    for j, node in enumerate(path):
        children = tree.children(node)
        if not children:
            continue
        depth = tree.depths[node] + 1
        ids, logps = dist.children(depth, tree.tokens[node]) if depth <= dist.max_depth else ([], [])
        lp = dict(zip(ids, logps))
        for rank, (token, child) in enumerate(children.items()):
            p = math.exp(lp[token]) if token in lp else None
            out.append(NodeTrial(row, depth, rank, p, j + 1 < len(path) and path[j + 1] == child))
    return out


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, wanted: list[int | None]
              ) -> list[list[TokenLogprob] | None] | None:
    """Per row, the TokenLogprob of tokens [b, n] under logits [b, n, V] with the `wanted[r]`
    most likely alternatives (None: that row did not ask; None overall when no row did)."""
    rows = [i for i, k in enumerate(wanted) if k is not None]
    if not rows:
        return None
    index = torch.tensor(rows, device=logits.device)
    lp = torch.log_softmax(logits[index].float(), dim=-1)  # [m, n, V]
    chosen = lp.gather(-1, tokens[index][..., None])[..., 0].tolist()  # [m, n]
    k = max(wanted[i] for i in rows)
    top_v, top_i = (lp.topk(k, dim=-1) if k else (lp[..., :0], lp[..., :0].long()))  # [m, n, k]
    top_v, top_i = top_v.tolist(), top_i.tolist()
    out: list[list[TokenLogprob] | None] = [None] * len(wanted)
    for j, i in enumerate(rows):
        n_top = wanted[i]
        out[i] = [TokenLogprob(chosen[j][t], tuple(zip(top_i[j][t][:n_top], top_v[j][t][:n_top])))
                  for t in range(len(chosen[j]))]
    return out


def _constrained(logits: torch.Tensor, masks: RowMasks | None) -> torch.Tensor:
    """logits [b, n, V] with each constrained row's disallowed tokens at -inf (a copy), or
    logits itself without masks."""
    if masks is None:
        return logits
    out = logits.clone()
    rows = masks.rows.to(logits.device)
    out[rows] = masked(logits[rows], masks.bits[:, : logits.shape[1]].to(logits.device))
    return out


def _ragged(lengths: list[int], offsets: torch.Tensor, positions: torch.Tensor
            ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
    """For rows verifying `lengths` tokens of a block of len(offsets): the proposals each verifies
    (limit [b]), the padding past them [b, q] and positions EMPTY there; (None, None, positions)
    when every row verifies the whole block."""
    if min(lengths) == len(offsets):
        return None, None, positions
    limit = torch.tensor(lengths, device=positions.device) - 1
    padding = offsets[None] > limit[:, None]  # [b, q]
    return limit, padding, positions.masked_fill(padding, EMPTY)


def _one_hot_where(q: torch.Tensor | SparseProbs | None, proposals: torch.Tensor, looked: list[int],
                   vocab: int | None = None) -> torch.Tensor | SparseProbs:
    """q [b, n, V] (or its pairs) with each row's first looked[r] positions replaced by one-hots
    on its proposals [b, n] (deterministic proposals: drawn from a point mass); q None: those
    point masses alone, as pairs [b, n, 1] over `vocab` tokens (zero elsewhere)."""
    n = proposals.shape[1]
    d = proposals.device
    mask = (torch.arange(n, device=d)[None] < torch.tensor(looked, device=d)[:, None])[..., None]  # [b, n, 1]
    if q is None:  # a lookup step's: one pair a position, not a vocabulary-wide row
        return SparseProbs(torch.where(mask, proposals[..., None], 0), mask.to(torch.float32), vocab)
    if isinstance(q, SparseProbs):
        first = torch.arange(q.ids.shape[-1], device=d) == 0  # [k]: the one pair kept
        ids = torch.where(mask, torch.where(first, proposals[..., None], 0), q.ids)
        probs = torch.where(mask, first.to(q.probs.dtype).expand_as(q.probs), q.probs)
        return SparseProbs(ids, probs, q.vocab)
    onehot = torch.zeros_like(q).scatter_(-1, proposals[..., None], 1.0)
    return torch.where(mask, onehot, q)


def captured_features(r: Row) -> torch.Tensor | None:
    """[prompt + generated, L*H]: the fed positions' features (cut where a stop ended the row
    inside a block), then a zero row for the last token, which was never fed."""
    if r.captured is None:
        return None
    total = r.stats.prompt_tokens + len(r.generated)
    fed = torch.cat(r.captured)[: total - 1]
    return torch.cat([fed, fed.new_zeros(1, fed.shape[1])])


def _swap_remove_order(n: int, removed: list[int]) -> list[int]:
    """Row order after removing rows: survivors beyond the new size fill the holes, so at most
    len(removed) rows move (new row i = old row order[i])."""
    gone = set(removed)
    size = n - len(gone)
    holes = [i for i in range(size) if i in gone]
    movers = [i for i in range(size, n) if i not in gone]
    order = list(range(size))
    for hole, src in zip(holes, movers):
        order[hole] = src
    return order
