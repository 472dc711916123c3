"""Adaptive block size: pick the block that maximises expected committed tokens per second.

Cost side: the wall time of one step verifying n tokens at batch size b, first calibrated (a
target forward of n tokens plus, for n > 1, a draft pass, timed on a throwaway cache per
batch-size bucket, for every bucket up to the engine's max_batch before the first request runs,
so no calibration lands in the middle of serving; the sizes in interleaved rounds, the fastest
timing of each, so a burst of outside load cannot price some sizes out), then tracked with the
measured time of every real step, per intra-op thread count (cpu/threads.py moves it with the
machine's load).
Gain side: each row's expected tokens for block n,
    E(n) = 1 + sum_{k=1}^{n-1} prod_{j<k} a_j,
from per-position conditional acceptance rates a_j (the row's own counts shrunk towards the
batch-wide rates), capped by the row's remaining tokens. A row that will propose an n-gram lookup
continuation of m tokens next (DecodeBatch.lookup_plan) takes lookup's own per-position rates for
those m proposals instead, and expects nothing beyond them.
Block 1 (plain decoding, no draft pass) is always a candidate, so a weak drafter, a hard prompt
or a large batch falls back to plain decoding instead of losing to it. While block 1 wins, a
small probe block (4 tokens for a lone row, 2 for a batch) runs now and then (backing off
exponentially, and never costing more than PROBE_SHARE of the plain decoding time since the
last probe) to notice when drafting pays again; a probe whose draft pass caught up on the plain
steps' context runs once more, and that repeat's time is what drafting gets priced by. A batch of
three rows or more drafts only where drafting is expected to beat plain decoding by
BATCH_DRAFT_MARGIN, and probes only while it comes within BATCH_PROBE_MARGIN of that (by its
calibration until a real step has measured drafting at its size); where it may not even probe,
its next plain steps skip the choice (PLAIN_HOLD). The other
way round, while drafting wins, a plain step runs first and then now and then (also backing off)
in each batch-size bucket:
otherwise plain decoding's cost would only ever be the calibration's guess scaled like the
drafting sizes, and the calibration's short context hides
what a long context adds per verified token (at concurrency 16 that guess let block 3 run at a
loss). For the same reason the drafting sizes next to the chosen one are run now and then
(alternately, backing off, per bucket): a size is only re-measured when it runs, so one slow step
(outside load) could otherwise price a better size out for good. The per-position rates are
shared by all widths, since a trained drafter's first positions are accepted about as often in a
narrow block as in a wide one (stage-3 SmolLM2 drafter, GSM8K-64: k=1..3 0.52/0.27/0.13 at
block 4, 0.51/0.26/0.12 at block 16).
For a lone row, the averages only decide whether to draft and roughly how much: a drafting step
drafts wider than that while the wider draft pass is nearly free (`widen`: batch 1 on a CPU), then
verifies as many of the drafted tokens as the drafts' own confidences make worth it (`trimmer`:
a confident draft runs long, a doubtful one short, a hopeless one as a plain step). Without
timed draft passes it drafts the chosen width, so a short block costs what a fixed short block
costs. A lone row with an n-gram lookup continuation can also verify it without any draft
pass (a drafting step would overwrite its drafts with the continuation anyway), when that beats
every drafting size; with `ragged`, so can the rows of a batch, each its own share. None of this
changes the output: which tokens get verified is decided from the drafts alone, and verification
is exact for any length.
Where the batch verifies token trees (DecodeBatch.trees), a tree step is priced as the chain
step of its width times the calibrated tree / chain ratio, times a factor its own steps correct
(`tree_table`; never below the chain's cost: `at_least`), and each step whose chain drafts
verifies a chain or a tree, whichever is expected to commit more tokens per second: a trimmed
step from its drafts (each row's best-first nodes, `TreeOffer`; offered less often while its
offers end as chains, OFFER_BACKOFF), a batch's from mean rates. Both price proposals by the
acceptance observed by depth and rank (dflash/node_acceptance.py), since a drafter's
probabilities of its lower-ranked choices promise far more than they are accepted.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from operator import add

import torch

from blockspec.dflash.batch import DecodeBatch
from blockspec.dflash.row import Row
from blockspec.dflash.trim import Shape, TreeOffer, Trim
from blockspec.dflash.node_acceptance import RANKS, NodeAcceptance, best_tree_expectations
from blockspec.dflash.policy.calibration import calibrate
from blockspec.dflash.policy.costs import CostModel, at_least, bucket, buckets_up_to, cost_at
from blockspec.dflash.policy.expectation import (RULES, Acceptance, acceptance_counts, count_growth, expected_by_block,
                                                 split_lengths, tree_expected_by_width)

MAX_INTERVAL = 256  # steps: the longest back-off of both checks (a probe, a plain step)
FIRST_TIMING_CAP = 2.0  # a size's first real timing counts for at most this many times its estimate
WIDEN_SHARE = 0.05  # a step drafts past its chosen block while that costs at most this share of it
# A probe costs what its draft pass and its longer verify add to a plain step, plus the drafter's
# catch-up on the context the plain steps left behind: every row's prompt and output since the
# last draft pass, all at once (32 fresh rows of SmolLM2 prompts: ~3,500 context tokens). Probes
# after a doubling count of plain steps alone cost many short requests more than their drafting
# gained (measured: docs/DESIGN.md section 12). So the next probe waits until the plain steps since
# the last one took 1 / PROBE_SHARE times its extra cost.
PROBE_SHARE = 0.05
# Once a real step has measured what drafting costs at a batch's size, a batch of several rows
# probes only while its best drafting size is expected to commit at least (1 - BATCH_PROBE_MARGIN)
# times plain decoding's tokens per second. Its expectation sums its rows', so one row's easier
# stretch moves it little, and each probe's draft pass catches up on every row's context: at
# concurrency 8 on a CPU, where drafting was expected at about 0.8 of plain decoding, the probes
# alone cost about 3% of the run and never found drafting paying (BENCHMARKS.md, "What a plain
# step carries"). Until then a batch of fewer than MARGIN_ROWS rows probes as a lone row always
# does (a lone row's acceptance swings with its text), since only a real step corrects a
# calibration that outside load priced wrong; a larger one goes by its calibration (timed in
# interleaved rounds, the fastest of each size), since its probes' block-2 steps commit one or two
# tokens a row: rows that finish together then finish apart, and every later join prefills fewer
# prompts and every leave moves a row's cache (concurrency 8, GSM8K: 11 probes cost 3%, 2.5% of it
# in the joins). Drafting is priced by `CostModel.least_table`, so that steps slowed by a burst of
# load do not stop the probes that would measure them again.
BATCH_PROBE_MARGIN = 0.1
# A batch of several rows drafts only where its best drafting size is expected to commit at least
# (1 + BATCH_DRAFT_MARGIN) times plain decoding's tokens per second. Picking the best of noisy
# estimates favours the sizes whose estimates came out low (the winner's curse), and a batch's
# step costs are known to about 10%, while the gain a drafting step can offer a batch on a CPU
# is a few per cent: at concurrency 8 the chosen block-2 steps were expected to gain 3-7% and
# lost 8-10% against plain steps (BENCHMARKS.md, "Concurrency 8 and 16"). A lone row's gains
# are several times that margin, and two rows' still paid (+5% at concurrency 2, where the
# margin forwent them), so batches of fewer than MARGIN_ROWS rows keep the plain comparison.
BATCH_DRAFT_MARGIN = 0.1
MARGIN_ROWS = 3
# Where a batch of several rows found even drafting's least costs short of what it has to beat
# (so it neither drafts nor probes), its next PLAIN_HOLD - 1 steps are plain without the choice
# being worked out again, while it keeps its number of rows; each hold that follows the last
# doubles, up to MAX_PLAIN_HOLD steps. Nothing a plain step does moves the acceptance rates, and
# the costs and the drafter's backlog move a step's worth; the full choice (expected tokens and
# lookup plans of every row, the cost tables) costs about 0.2 ms at 8 rows, 3% of a plain step
# there, and a batch of 8 rows at concurrency 8 replaces a row every 16 steps or so, each new
# row one of several whose mean decides.
PLAIN_HOLD = 8
MAX_PLAIN_HOLD = 64
# Widening and trimming run for batches of at most this many rows (trimming also for larger ones
# with AdaptiveBlock(ragged=True): a length per row). Where a batch verifies one length for all its
# rows, their confidences average out, and a wider draft costs more per step: with them batches
# of 8 rows ran slower, while a lone row gained (docs/DESIGN.md section 12).
TRIM_MAX_ROWS = 1
# A trimmed step is offered trees (its drafter's top choices read back and ranked, for its trim to
# price) while their mean promise comes within this share of the chain's, and every
# TREE_OFFER_EVERY drafting steps regardless, so a run of doubtful drafts can still find them
# paying; otherwise it is a chain step with none of that work.
TREE_OFFER_MARGIN = 0.1
TREE_OFFER_EVERY = 16
# A trimmed step offered trees takes its tree where it promises more than its chain; after
# TREE_CHECK_EVERY trimmed drafting steps without a tree or a check, the next is a check: offered
# trees whatever the back-off (OFFER_BACKOFF), it takes its tree where it comes within
# TREE_OFFER_MARGIN of its chain. A tree step is what corrects the tree costs (`tree_table`), so
# an estimate that came out too high (a tree calibrated on a dummy draft, a slow tree step)
# would otherwise keep trees out. At most one step in this many gives up at most that margin.
TREE_CHECK_EVERY = 32
# Offering trees costs a trimmed step ~0.1 ms of host work (the drafter's top choices read back
# and ranked, both shapes priced: 2-3% of a step at batch 1 on a CPU), whichever it verifies. So
# each offer answered with a chain doubles the drafting steps until the next (up to this many),
# and one whose tree wins brings them back to every step: where trees rarely pay, a runner that
# may verify them costs what one of chains alone does.
OFFER_BACKOFF = 32
TREE_FACTOR_BOUND = 1.5  # a tree step's time moves its cost factor (`_observe_tree`) by at most this ratio
GAINS_EVERY = 32  # steps between recomputations of the tree gains (`_tree_gains`: ~60 us each)
# A ragged step's padding (the slots past a row's length, up to the longest row) skips the matmuls,
# rope, the K/V writes and (the CPU kernel) attention; what is left of it (norms, unpacking) costs
# little: a ragged step cost about what a uniform block of the same tokens does (measured:
# docs/DESIGN.md section 12).
PAD_SHARE = 0.05


def _tokens_at(expected: list[list[float]], lengths: int | list[int]) -> float:
    """The rows' expected tokens at their verify lengths (one for all, or one per row)."""
    each = lengths if isinstance(lengths, list) else [lengths] * len(expected)
    return sum(e[n - 1] for e, n in zip(expected, each))


def draft_margin(rows: int) -> float:
    """By how much a batch of `rows` rows needs drafting to beat plain decoding (BATCH_DRAFT_MARGIN)."""
    return BATCH_DRAFT_MARGIN if rows >= MARGIN_ROWS else 0.0



class AdaptiveBlock:
    """Chooses each step's block size for a DecodeBatch (see the module docstring)."""

    def __init__(self, max_block: int, *, prior: float = 0.5, probe_block: int = 4, batch_probe_block: int = 2,
                 probe_every: int = 8,
                 plain_every: int = 16, challenge_every: int = 16, costs: CostModel | None = None,
                 ragged: bool = False, thread_count: Callable[[], int] = torch.get_num_threads,
                 sampled_costs: CostModel | None = None, tree_costs: CostModel | None = None,
                 sampled_tree_costs: CostModel | None = None) -> None:
        self.max_block = max_block
        # Batches of several rows verify a length per row (`trimmer`) where the target packs
        # padding. Opt-in: on a CPU its gain stayed within run-to-run noise (docs/DESIGN.md
        # section 12); padded attention eats much of what the better-chosen tokens save.
        self.ragged = ragged
        # Steps of greedy batches (`costs`) and of batches with a sampled row (`sampled_costs`)
        # are priced apart: a sampled step computes the target's whole logits, shapes and draws.
        self.costs = costs or CostModel(max_block)
        self.sampled_costs = sampled_costs or CostModel(max_block)
        # Token-tree steps (DecodeBatch.trees) cost more than chain steps of the same width: a
        # tree step also ranks the drafter's top choices, packs the trees and moves the
        # accepted path's keys and values, and what that costs changes with the code, so it is
        # calibrated and its steps correct it (`tree_table`), never assumed.
        self.tree_costs = tree_costs or CostModel(max_block)
        self.sampled_tree_costs = sampled_tree_costs or CostModel(max_block)
        self._model = self.costs  # the one the batch being stepped uses (`choose`)
        self._tree_model = self.tree_costs  # likewise, for its tree steps
        # (id of a tree model, bucket) -> what its tree steps have really cost over `tree_table`'s
        # estimate without it (`_observe_tree`)
        self._tree_factor: dict[tuple[int, int], float] = {}
        self.tree_choice = False  # the step being chosen verifies trees, or a trimmed one is offered them (`choose`)
        self._unoffered = 0  # trimmed drafting steps since trees were last offered
        self._untried = 0  # trimmed drafting steps since a tree step or a check (TREE_CHECK_EVERY)
        self._offer_every = 1  # a trimmed drafting step is offered trees once this many are due (OFFER_BACKOFF)
        self._tree_won = False  # the last trim's tree promised more than its chain
        self._chosen = 0  # steps chosen so far
        self._gains: dict[tuple[str, int], tuple[int, list[float]]] = {}  # `_tree_gains`, with when computed
        self._offered = False  # the batch being stepped may verify trees (`choose`)
        # Acceptance by (depth, rank) per verification rule, what trees (and, where trees are
        # on, the chains beside them) are priced by (dflash/node_acceptance.py).
        self.nodes: dict[str, NodeAcceptance] = {}
        self._trial_conf: list[list[float]] | None = None  # the confidences of the last trimmed step
        self.tree_steps = 0  # steps run as trees
        # Acceptance per verification rule (SamplingParams.rule): rows of different rules share
        # a batch, and the standard rule accepts more sampled proposals than the keyed one.
        self.acceptance: dict[str, Acceptance] = {}
        self.prior = prior
        self.probe_block = min(probe_block, max_block)
        # A probe of several rows verifies fewer tokens: at 16 rows a 4-token probe committed
        # fewer tokens per second than a 2-token one, which came closer to a plain step's
        # (docs/DESIGN.md section 12).
        self.batch_probe_block = min(batch_probe_block, max_block)
        self.base_probe_every = probe_every
        self.probe_every = probe_every
        self.plain_streak = 0
        self.plain_spent = 0.0  # seconds of steps without a draft pass since the last probe
        self.probe_extra = 0.0  # what the last probe cost beyond a plain step (seconds)
        self._probing = False  # the step being chosen is a probe
        self._confirm: int | None = None  # the block of a probe whose time was left out: run again
        self._confirming = False  # the step being chosen repeats a probe
        self._thread_count = thread_count
        self.last_choice = 1
        # (plain steps left, rows, its length) of the running PLAIN_HOLD, kept through the next
        # full choice (which doubles it if it holds again at as many rows)
        self._hold: tuple[int, int, int] | None = None
        self.base_plain_every = plain_every
        self.plain_checks: dict[int, tuple[int, int]] = {}  # bucket -> (drafting steps since, interval)
        self.base_challenge_every = challenge_every
        # (bucket, tree steps) -> (since, interval, turn, best)
        self.challenges: dict[tuple[int, bool], tuple[int, int, int, int]] = {}
        self.used: Counter[int] = Counter()  # steps run at each block size (tokens verified)
        self.forced = False  # the last choice was a check (probe, plain step, neighbour), not the best
        self._drafted: int | None = None  # the width the last trimmed step drafted
        # A step of lookup proposals alone (no draft pass) when it beats every drafting size and
        # plain decoding: per row verify lengths, or None. Its ragged steps' measured / estimated
        # seconds (a uniform one is measured like any step of its size).
        self.lookup_step: list[int] | None = None
        self.lookup_ratio = 1.0
        self.lookup_steps = 0  # steps run that way
        self._lookup_estimate = 0.0
        # Seconds a draft pass takes per context token it catches up on (DecodeBatch.draft_backlog),
        # learned from the steps that caught up (`step`; 0 until one has). A batch of several rows
        # whose drafter is behind prices each drafting size with it (`choose`): left out, a
        # batch of 8 drafted after runs of plain steps at about 2.4x a plain step's cost where its
        # estimate said 2.1x. A lone row's choices leave it out (its backlog is small).
        self.catch_up = 0.0
        # `expected` runs at every step, yet a run of plain steps moves none of what it reads: no
        # acceptance count changes without a verified proposal. So `priors` are kept until
        # `record` changes the batch-wide counts of their kind (`_recorded`: [drafted, looked
        # up]), and each row's expectations (`_row_expected`: drafted, and looked up at full
        # length, which every lookup plan's length reads a prefix of) until the counts of that
        # kind, the row's own or the batch's, or its cap change.
        self._recorded = [0, 0]
        self._priors: dict[bool, tuple[tuple, dict[str, list[float]]]] = {}
        # (id(row), looked up) -> (row, (counts' generation, prior, cap), its counts, its tries, E)
        self._rows_expected: dict[tuple[int, bool], tuple[Row, tuple, list[int], list[int], list[float]]] = {}

    def _acceptance(self, rule: str) -> Acceptance:
        if rule not in self.acceptance:
            self.acceptance[rule] = Acceptance.empty(max(0, self.max_block - 1))
        return self.acceptance[rule]

    def node_acceptance(self, rule: str) -> NodeAcceptance:
        """The acceptance by (depth, rank) of `rule`'s rows."""
        return self.nodes.setdefault(rule, NodeAcceptance())

    def global_rates(self, *, lookup: bool = False, rule: str = "greedy") -> list[float]:
        """Batch-wide per-position acceptance rates of `rule`'s rows, shrunk towards the prior."""
        weight = 8.0
        counts = self._acceptance(rule)
        accepted, tries = (counts.lookup_accepted, counts.lookup_tries) if lookup else (counts.accepted, counts.tries)
        return [(a + weight * self.prior) / (t + weight) for a, t in zip(accepted, tries)]

    def priors(self, *, lookup: bool = False) -> dict[str, list[float]]:
        """`global_rates` of every verification rule, what each row's own rates shrink towards
        (kept until `record` moves the counts; callers only read it)."""
        key = (self._recorded[lookup], self.prior)
        kept = self._priors.get(lookup)
        if kept is not None and kept[0] == key:
            return kept[1]
        priors = {rule: self.global_rates(lookup=lookup, rule=rule) for rule in RULES}
        self._priors[lookup] = (key, priors)
        return priors

    def record(self, rows: list[Row], before: list[tuple[list[int], ...]], trials: list | None = None,
               confidences: list[list[float]] | None = None) -> None:
        """Adds the acceptance counted in the last step to the batch-wide rates of each row's rule.
        `trials`: a tree step's node trials (DecodeBatch.node_trials), booked by (depth, rank);
        without them the step verified chains, whose proposals are rank-0 trials (with their
        drafter probabilities where `confidences`, the trimmed step's, were read back)."""
        drafted = looked = False  # whether the counts of each kind moved
        for i, (r, (acc0, tries0, lacc0, ltries0)) in enumerate(zip(rows, before)):
            rule = r.params.rule
            counts = self._acceptance(rule)
            positions = len(counts.tries)
            # what the step added at each position, of each kind (the row's counts only grow)
            accepted = count_growth(r.stats.accepted_by_position, acc0, positions)
            tried = count_growth(r.tries, tries0, positions)
            lookup_accepted = count_growth(r.stats.lookup_accepted_by_position, lacc0, positions)
            lookup_tried = count_growth(r.lookup_tries, ltries0, positions)
            counts.accepted[:] = map(add, counts.accepted, accepted)
            counts.tries[:] = map(add, counts.tries, tried)
            counts.lookup_accepted[:] = map(add, counts.lookup_accepted, lookup_accepted)
            counts.lookup_tries[:] = map(add, counts.lookup_tries, lookup_tried)
            drafted = drafted or any(accepted) or any(tried)
            looked = looked or any(lookup_accepted) or any(lookup_tried)
            if trials is None and any(tried):
                nodes = self.node_acceptance(rule)
                conf = confidences[i] if confidences is not None else []
                for k, (a, t) in enumerate(zip(accepted, tried)):
                    if t > 0:
                        nodes.observe(k + 1, 0, conf[k] if k < len(conf) else None, a > 0)
        for t in trials or ():
            self.node_acceptance(rows[t.row].params.rule).observe(t.depth, t.rank, t.p, t.accepted)
        self._recorded[0] += drafted
        self._recorded[1] += looked

    def expected(self, rows: list[Row], plan: list[list[int]] | None = None) -> list[float]:
        """Expected committed tokens of the whole batch for block sizes 1..max_block. A row with
        a lookup continuation of m ids (`plan`) expects from lookup's rates up to m proposals and
        nothing after them (drafted proposals behind a lookup prefix rarely fit it)."""
        if len(self._rows_expected) > 4 * len(rows) + 64:  # forget rows that left
            self._rows_expected = {key: e for r in rows for key in ((id(r), False), (id(r), True))
                                   if (e := self._rows_expected.get(key)) is not None}
        each = [self._row_expected(r, len(plan[i]) if plan else 0) for i, r in enumerate(rows)]
        if not each:
            return [0.0] * self.max_block
        # summed in row order from the first row's (0.0 + x is x, so as from zeros)
        totals = list(each[0])
        for e in each[1:]:
            totals = list(map(add, totals, e))
        return totals

    def _row_expected(self, r: Row, m: int) -> list[float]:
        """One row's [E(1), ..., E(max_block)] with a lookup continuation of m ids (0: none;
        read only). The drafted expectation, and the looked-up one of every lookup proposal, are
        kept while nothing they read changes: the batch-wide counts of their kind, the row's own
        (they only grow with verified proposals), and its remaining tokens where they cap E (E
        never exceeds max_block). A plan of m ids reads the looked-up one's first m + 1 values,
        flat after them: the same sums in the same order, capped alike, as from its m rates."""
        lookup = m > 0
        if not isinstance(r, Row):  # a stand-in whose rates may come from anything: computed afresh
            return expected_by_block(self._row_rates(r, m), self.max_block, r.remaining)
        acc = r.stats.lookup_accepted_by_position if lookup else r.stats.accepted_by_position
        tries = r.lookup_tries if lookup else r.tries
        key = (self._recorded[lookup], self.prior, min(r.remaining, self.max_block))
        kept = self._rows_expected.get((id(r), lookup))
        # the row's counts compared as lists (copies kept): cheaper than keying on tuples of them
        if kept is not None and kept[0] is r and kept[1] == key and kept[2] == acc and kept[3] == tries:
            out = kept[4]
        else:
            out = expected_by_block(self._row_rates(r, self.max_block - 1 if lookup else 0), self.max_block,
                                    r.remaining)
            self._rows_expected[(id(r), lookup)] = (r, key, list(acc), list(tries), out)
        if not lookup:
            return out
        m = min(m, self.max_block - 1)
        return out[:m + 1] + [out[m]] * (self.max_block - 1 - m)

    def _row_rates(self, r: Row, m: int) -> list[float]:
        """The rates a row's expectation reads: lookup's for its m looked-up proposals, else the
        drafter's."""
        return r.acceptance_rates(self.priors(lookup=True), lookup=True)[:m] if m else r.acceptance_rates(self.priors())

    def tree_expected(self, rows: list[Row], plan: list[list[int]] | None, tree_nodes: int) -> list[float]:
        """Expected committed tokens of the whole batch for tree steps of 1..max_block nodes
        (the root included; at most tree_nodes proposed), before the drafts exist: each row's
        chain expectation (`expected`) times the gain of the best tree over the chain of the
        same size under its rule's acceptance by (depth, rank) (`NodeAcceptance.mean_rate`). A
        row with a lookup continuation expects what its chain does (its branch is lookup's)."""
        chain = [self._row_expected(r, len(plan[i]) if plan else 0) for i, r in enumerate(rows)]
        budget = min(self.max_block - 1, tree_nodes)
        # only the rows without a lookup continuation read a tree's gain
        gains = {rule: self._tree_gains(rule, budget)
                 for rule in {r.params.rule for i, r in enumerate(rows) if not (plan and plan[i])}}
        totals = [0.0] * self.max_block
        for i, r in enumerate(rows):
            rule = r.params.rule
            looked = bool(plan and plan[i])
            for j in range(self.max_block):
                n = min(j, budget)  # proposed nodes: a wider step verifies tree_nodes of them
                totals[j] += chain[i][n] if looked else min(chain[i][n] * gains[rule][n], max(1, r.remaining))
        return totals

    def _tree_gains(self, rule: str, budget: int) -> list[float]:
        """[G(0), ..., G(budget)]: the best tree's expected tokens over the chain's, of 0..budget
        proposed nodes, under `rule`'s mean acceptance by (depth, rank). Recomputed every
        GAINS_EVERY steps: the rates move slowly, and this is the policy's dearest arithmetic."""
        key = (rule, budget)
        stamp, gains = self._gains.get(key, (-GAINS_EVERY, []))
        if self._chosen - stamp < GAINS_EVERY:
            return gains
        first, nodes, depth = self.priors()[rule], self.node_acceptance(rule), self.max_block - 1
        tree = best_tree_expectations(lambda d, k: nodes.mean_rate(d, k, first[d - 1]), budget, depth, RANKS)
        line = best_tree_expectations(lambda d, k: nodes.mean_rate(d, 0, first[d - 1]), budget, depth, 1)
        gains = [t / c for t, c in zip(tree, line)]
        self._gains[key] = (self._chosen, gains)
        return gains

    def costs_for(self, batch: DecodeBatch) -> CostModel:
        """The step costs of `batch`: greedy ones, or sampled ones where a row samples."""
        return self.costs if batch.argmax_only else self.sampled_costs

    def tree_costs_for(self, batch: DecodeBatch) -> CostModel:
        """The tree step calibrations of `batch` (see `costs_for`, `tree_table`)."""
        return self.tree_costs if batch.argmax_only else self.sampled_tree_costs

    def tree_table(self, batch_size: int, chain: list[float]) -> list[float]:
        """Estimated seconds of a tree step of 1..max_block nodes for the batch being stepped,
        from its chain steps' current estimates `chain` (the same widths): each times what the
        calibration found a tree of that width to cost over a chain (divided by the same ratio
        of their plain steps, which are the same work: what changed between the two
        calibrations drops out), times one factor that the tree steps correct
        (`_observe_tree`). Priced so, trees follow whatever moves the chains' costs (longer
        contexts, outside load, the thread count) though they run in few steps, and one slow
        tree step cannot price a width out for good. Tracked per width apart from the chains',
        tree costs read 0.9-1.25 of the chain's at the same width from step noise alone, and
        trees were taken, or left, for that noise rather than their tokens (BENCHMARKS.md,
        "Trees against chains under the policy at batch 1")."""
        b = bucket(batch_size)
        ratios = self._tree_ratios(b)
        if ratios is None:
            return list(chain)
        factor = self._tree_factor.get((id(self._tree_model), b), 1.0)
        return [c * r * factor for c, r in zip(chain, ratios)]

    def _tree_ratios(self, b: int) -> list[float] | None:
        """Per width, bucket b's calibrated tree / chain cost over the same ratio of their plain
        steps (`tree_table`); None where either is not calibrated."""
        trees, chains = self._tree_model.calibrated.get(b), self._model.calibrated.get(b)
        if trees is None or chains is None:
            return None
        plain = chains[0] / trees[0] if trees[0] > 0 and chains[0] > 0 else 1.0
        return [(t / cc if cc > 0 else 1.0) * plain for t, cc in zip(trees, chains)]

    def _observe_tree(self, batch_size: int, size: int, seconds: float) -> None:
        """Corrects the tree steps' factor (`tree_table`) by one tree step of `size` nodes that
        took `seconds`: its ratio to the estimate without the factor, bounded against a burst
        of outside load, averaged in."""
        b = bucket(batch_size)
        ratios = self._tree_ratios(b)
        estimate = self._model.cost(batch_size, size) * (1.0 if ratios is None else ratios[size - 1])
        if estimate <= 0 or seconds <= 0:
            return
        key = (id(self._tree_model), b)
        ratio = min(TREE_FACTOR_BOUND, max(1 / TREE_FACTOR_BOUND, seconds / estimate))
        s = self._model.smoothing
        self._tree_factor[key] = (1 - s) * self._tree_factor.get(key, 1.0) + s * ratio

    @staticmethod
    def offers_trees(batch: DecodeBatch) -> bool:
        """Whether `batch`'s drafting steps may verify token trees (see DecodeBatch.trees)."""
        return getattr(batch, "trees", False) is True and all(r.constraint is None for r in batch.rows)

    def calibrate_all(self, batch: DecodeBatch, max_batch: int, *, sampled: bool = True) -> None:
        """Calibrates every batch-size bucket up to `max_batch` that is not known yet, greedy
        steps and (with `sampled`) sampled ones."""
        if self.max_block <= 1 or batch.drafter is None:
            return
        models = [(self.costs, False, False), (self.sampled_costs, True, False)][: 2 if sampled else 1]
        if getattr(batch, "trees", False) is True:
            models += [(self.tree_costs, False, True), (self.sampled_tree_costs, True, True)][: 2 if sampled else 1]
        for model, sampled_steps, tree in models:
            for size in buckets_up_to(max_batch):
                if not model.known(size):
                    model.set(size, *calibrate(batch, size, self.max_block, confidence=self._trims(batch, size),
                                               sampled=sampled_steps, tree=tree))

    def choose(self, batch: DecodeBatch) -> int:
        """The block size for the next step of `batch` (calibrating its batch size if new); 1
        also where a step of lookup proposals alone is chosen (`lookup_step` says so), and of a
        step that verifies token trees (`tree_choice`; a lone row's trim decides for itself)."""
        b = len(batch.rows)
        if self._take_hold(batch):
            return 1
        self.lookup_step = None
        self._offered = self.tree_choice = False
        self._chosen += 1
        if self.max_block <= 1 or batch.drafter is None:
            return 1
        hold, self._hold = self._hold, None
        threads = self._thread_count()
        if any([m.use_threads(threads) for m in (self.costs, self.sampled_costs, self.tree_costs,
                                                 self.sampled_tree_costs)]):
            self._recheck()
        model = self._model = self.costs_for(batch)
        if not model.known(b):
            model.set(b, *calibrate(batch, bucket(b), self.max_block, confidence=self._trims(batch, bucket(b)),
                                    sampled=model is self.sampled_costs))
        costs = model.table(b)
        behind = getattr(batch, "draft_backlog", 0) if b > 1 else 0
        if behind and self.catch_up > 0:  # the next draft pass also reads the backlog
            costs = costs[:1] + [c + self.catch_up * behind for c in costs[1:]]
        plan = batch.lookup_plan()
        expected = self.expected(batch.rows, plan)
        rates = [tokens / cost for tokens, cost in zip(expected, costs)]
        best = planned = rates.index(max(rates)) + 1  # the smallest of the best
        tree = False
        self._offered = self.offers_trees(batch)
        # A step verifies a tree only where its chain drafts (below), so while plain decoding
        # wins, as in most steps of a batch of several rows, no tree is priced: the tree
        # expectations of every row cost a plain step more than the rest of its choice.
        trims = self._trims(batch, b)
        # a trimmed step whose offers have been answered with chains waits its turn (`_offer_every`)
        if self._offered and best > 1 and (not trims or self._unoffered + 1 >= self._offer_every
                                           or self._untried + 1 >= TREE_CHECK_EVERY):
            tree_model = self._tree_model = self.tree_costs_for(batch)
            if not tree_model.known(b):
                tree_model.set(b, *calibrate(batch, bucket(b), self.max_block, confidence=self._trims(batch, bucket(b)),
                                             sampled=tree_model is self.sampled_tree_costs, tree=True))
            tree_costs = at_least(self.tree_table(b, costs), costs)
            tree_rates = [tokens / cost for tokens, cost in
                          zip(self.tree_expected(batch.rows, plan, batch.tree_nodes), tree_costs)]
            tree_best = tree_rates.index(max(tree_rates[1:]), 1) + 1  # the smallest drafting one of the best
            # A step drafts where its chain pays: trees priced by these mean rates (before the
            # drafts exist) promised more than they accepted where chains did not pay (a trimmed
            # step's trim then answered with a chain, a batch's 3-wide trees took second choices
            # rarely), and such steps paid a draft pass that plain decoding would not have.
            if tree_rates[tree_best - 1] > rates[best - 1] and best > 1:
                # a trimmed step drafts no narrower than its chain would: its trim may answer with that chain
                best = planned = max(best, tree_best) if trims else tree_best
                tree = True
                rates = [max(c, t) for c, t in zip(rates, tree_rates)]
            elif trims:  # its trim decides from the drafts in hand
                tree = (tree_rates[tree_best - 1] >= (1 - TREE_OFFER_MARGIN) * rates[best - 1]
                        or self._unoffered + 1 >= TREE_OFFER_EVERY)
        if best > 1 and rates[best - 1] < (1 + draft_margin(b)) * rates[0]:
            best = planned = 1
            tree = False
        lookup = self._lookup_option(batch, plan, rates[best - 1])
        self._probing = self._confirming = False
        confirm, self._confirm = self._confirm, None
        if (best == 1 or lookup is not None) and confirm is not None:
            # The probe's draft pass caught up on the plain steps' context, so its time said
            # nothing about what drafting costs (`step` leaves it out): without this repeat, costs
            # calibrated or measured under outside load that priced drafting out stayed for good
            # (the demo beside a busy process: plain in 150 of 154 steps).
            best, lookup, tree = confirm, None, False
            self._probing = self._confirming = True
        elif best == 1 or lookup is not None:  # the drafter sits this step out
            self.plain_streak += 1
            gate = (b <= 1 or (b < MARGIN_ROWS and not model.drafting_measured(b))
                    or self.probe_may_pay(b, [e / c for e, c in zip(expected, model.least_table(b))]))
            if not gate and lookup is None:
                steps = min(2 * hold[2], MAX_PLAIN_HOLD) if hold is not None and hold[1] == b else PLAIN_HOLD
                self._hold = (steps - 1, b, steps)
            if (self.plain_streak >= self.probe_every and self.plain_spent * PROBE_SHARE >= self.probe_extra
                    and gate):
                self.plain_streak = 0
                self.plain_spent = 0.0
                self.probe_every = min(self.probe_every * 2, MAX_INTERVAL)
                best, lookup = min(self.probe_block if b <= 1 else self.batch_probe_block, self.max_block), None
                self._probing, tree = True, False
            elif lookup is not None:
                best = planned = 1
        else:
            self.plain_streak = 0
            self.probe_every = self.base_probe_every
            self.plain_spent = self.probe_extra = 0.0  # the drafter is caught up: probes are cheap again
            best = self._check_plain(bucket(b), best)
            if best > 1:
                best = self._challenge((bucket(b), tree), best)
        self.tree_choice = tree and best > 1 and lookup is None
        if self._offered and best > 1 and lookup is None and trims:
            self._unoffered = 0 if self.tree_choice else self._unoffered + 1
        self.lookup_step = lookup
        self.last_choice = best
        self.forced = best != planned
        return best

    def _take_hold(self, batch: DecodeBatch, spare: int = 0) -> bool:
        """Takes one plain step of a hold (PLAIN_HOLD) for `batch`, where more than `spare` of its
        steps are left; what a held choice sets. False (the hold as it was) where there is none, or
        it was for another number of rows, or too few steps are left."""
        hold, rows = self._hold, len(batch.rows)
        if hold is None or hold[1] != rows or hold[0] <= spare or self.max_block <= 1 or batch.drafter is None:
            return False
        self._hold = (hold[0] - 1, rows, hold[2])
        self.plain_streak += 1
        self._probing = self._confirming = False
        self.last_choice, self.forced = 1, False
        self.lookup_step = None
        self._offered = self.tree_choice = False
        self._chosen += 1
        return True

    @staticmethod
    def probe_may_pay(rows: int, rates: list[float]) -> bool:
        """Whether a batch of `rows` rows whose block sizes 1..n are expected to commit at most
        `rates` tokens per second may probe (see BATCH_PROBE_MARGIN): within the margin of what
        drafting has to beat (`draft_margin` above plain decoding); always for a lone row."""
        return (rows <= 1 or len(rates) < 2
                or max(rates[1:]) >= (1 - BATCH_PROBE_MARGIN) * (1 + draft_margin(rows)) * rates[0])

    def _lookup_option(self, batch: DecodeBatch, plan: list[list[int]], to_beat: float) -> list[int] | None:
        """Per row verify lengths of a step without a draft pass, where the rows with an n-gram
        lookup continuation verify (part of) it and the others one token, when that is expected
        to commit more tokens per second than `to_beat`; else None. Such a step costs the verify
        part of a drafting step of the same mean length (its padding priced as in `trimmer`),
        times what such ragged steps have really cost against that estimate so far
        (`lookup_ratio`). For a lone row, and with `ragged` for batches whose target packs
        padding: elsewhere the lookup proposals ride in drafting steps. They gained for a lone
        row; at concurrency 8 such steps committed fewer tokens per second than plain steps
        (padded attention and elementwise work cost more per extra token than the estimate;
        docs/DESIGN.md section 12)."""
        rows = batch.rows
        b = len(rows)
        if not any(plan) or (b > 1 and not self._ragged(batch)):
            return None
        drafts = self._model.draft_table(b) or [0.0] * self.max_block
        verify = [t - dr for t, dr in zip(self._model.table(b), drafts)]
        # a looked-up continuation's own m + 1 values (capped alike)
        expected = [self._row_expected(r, len(cont))[:1 + len(cont)] if cont else [1.0] for r, cont in zip(rows, plan)]
        lengths, rate = split_lengths(expected, 0.0, verify, PAD_SHARE)
        if max(lengths) == 1:
            return None
        uniform = min(lengths) == max(lengths)
        if not uniform:
            rate /= self.lookup_ratio
        if rate <= to_beat:
            return None
        total = sum(lengths)
        packed = cost_at(verify, total / b)
        self._lookup_estimate = packed + PAD_SHARE * (verify[max(lengths) - 1] - packed)
        return lengths

    def widen(self, batch_size: int, block: int) -> int:
        """How wide a step whose best block is `block` drafts: wider while the extra drafting
        costs at most WIDEN_SHARE of the step, as the drafts' own confidences then choose how
        many tokens to verify (`trimmer`). At batch 1 on a CPU a 16-wide draft costs little more
        than a 4-wide one (docs/DESIGN.md section 12). `step` widens lone rows only (TRIM_MAX_ROWS).
        Without timed draft passes, `block` itself."""
        drafts = self._model.draft_table(batch_size)
        if drafts is None or block < 2:
            return block
        budget = WIDEN_SHARE * self._model.cost(batch_size, block)
        return max(w for w in range(block, self.max_block + 1) if drafts[w - 1] - drafts[block - 1] <= budget)

    def trimmer(self, batch: DecodeBatch) -> Trim:
        """The verify length of a drafted step, chosen like the block size but from each row's
        drafts: a proposal's draft probability stands for its chance of acceptance (on held-out
        GSM8K the stage-7 drafter's first proposal with probability 0.2-0.3 was accepted 30% of
        the time, 0.5-0.6: 51%, 0.9-1: 97%), lookup proposals keep lookup's rates. A sampled
        row reads the peaks of its draft distributions instead, calibrated by the acceptance seen
        at such peaks (`_chain_rates`). The draft is paid by then, so only the verify part of each
        size's cost differs.

        With `ragged`, a batch of rows whose target skips padding (`DecodeBatch.skips_padding`)
        gets a length per row: the proposals most likely to be accepted, across all rows, until
        one more costs more than it is expected to commit. The cost of T verified tokens is that of a uniform
        block of T / rows tokens (interpolated), since the matmuls cost by rows, plus PAD_SHARE of
        what padding every row to the longest would add. Otherwise every row verifies the one
        length the sum of their expectations makes best.

        Where the step offers token trees (`TreeOffer`s), chains and trees are both priced, each
        by its own costs (the tree steps' verify part from `tree_costs`), and the step verifies
        whichever is expected to commit more tokens per second (a `Shape`). The chain is priced
        as without trees (so its steps choose what they would), the tree's lower-ranked nodes
        by their acceptance observed beside the first choices' (`NodeAcceptance.relative_rate`),
        since a drafter's probabilities of its lower-ranked choices promise far more than they
        are accepted."""
        rows = list(batch.rows)
        b = len(rows)
        table = self._model.table(b)
        drafts = self._model.draft_table(b) or [0.0] * self.max_block
        verify = [t - dr for t, dr in zip(table, drafts)]  # the verify part of each uniform size
        lookup_priors = self.priors(lookup=True)
        ragged = b > 1 and self._ragged(batch)
        self._trial_conf = None

        def lengths(expected: list[list[float]], sunk: float, costs: list[float]) -> tuple[int | list[int], float]:
            if not ragged:
                width = len(expected[0])
                totals = [sum(e[j] for e in expected) for j in range(width)]
                n = max(range(1, width + 1), key=lambda n: (totals[n - 1] / (sunk + costs[n - 1]), -n))
                return n, totals[n - 1] / (sunk + costs[n - 1])
            return split_lengths(expected, sunk, costs, PAD_SHARE)

        def trim(confidence: list[list[float]], looked: list[int], offers: list[TreeOffer] | None = None
                 ) -> int | list[int] | Shape:
            width = len(confidence[0]) + 1 if confidence else 1
            self._drafted = width
            sunk = drafts[width - 1]
            if offers is not None or any(r.params.rule != "greedy" for r in rows):  # booked by (depth, band)
                self._trial_conf = confidence
            if offers is not None:
                nodes = [self.node_acceptance(r.params.rule) for r in rows]
            lookup_rates = [r.acceptance_rates(lookup_priors, lookup=True)[:m] if m else [] for r, m in zip(rows, looked)]
            # the chain priced as without trees, so its step chooses what it would alone: a greedy
            # row's drafts by their probabilities, a sampled row's by the acceptance observed at
            # their peaks (the peaks alone promise less than such rows accept)
            chains = [self._chain_rates(r, c) for r, c in zip(rows, confidence)]
            expected = [expected_by_block(lr or conf, width, r.remaining)
                        for r, conf, lr in zip(rows, chains, lookup_rates)]
            chain, chain_rate = lengths(expected, sunk, verify)
            if offers is None:
                return chain
            # a tree step drafts as its chain does: the rest of its cost is its verify
            tree_verify = at_least([t - dr for t, dr in zip(self.tree_table(b, table), drafts)], verify)
            trees = [tree_expected_by_width(offer, n, width, r.remaining, lr)
                     for r, offer, n, lr in zip(rows, offers, nodes, lookup_rates)]
            tree, tree_rate = lengths(trees, sunk, tree_verify)
            # The chain's width as priced above, the tree's in the drafter's units; which of the
            # two runs, by every node's observed chance (`NodeAcceptance.rate`, first choices
            # included): the two promise within a few per cent of each other where trees are
            # taken, and the drafter's own word was off by as much (first choices of trimmed chain
            # steps committed 5% more than it said, the tree steps' 2% less).
            chain_cal = [expected_by_block(lr or [n.rate(k + 1, 0, c) for k, c in enumerate(conf)], width, r.remaining)
                         for r, conf, lr, n in zip(rows, confidence, lookup_rates, nodes)]
            tree_cal = [tree_expected_by_width(offer, n, width, r.remaining, lr, calibrated=True)
                        for r, offer, n, lr in zip(rows, offers, nodes, lookup_rates)]
            chain_rate *= _tokens_at(chain_cal, chain) / _tokens_at(expected, chain)
            tree_rate *= _tokens_at(tree_cal, tree) / _tokens_at(trees, tree)
            self._tree_won = tree_rate > chain_rate
            if self._tree_won or (self._untried + 1 >= TREE_CHECK_EVERY
                                  and tree_rate >= (1 - TREE_OFFER_MARGIN) * chain_rate):
                return Shape(tree, True)
            return Shape(chain, False)

        return trim

    def _chain_rates(self, row: Row, confidence: list[float]) -> list[float]:
        """What a trimmed chain step prices a row's proposals by: a greedy row its drafts' own
        probabilities (a fair estimate of their acceptance), a sampled row the peaks of its draft
        distributions calibrated by the acceptance observed at such peaks before
        (`NodeAcceptance.rate`, its first choices by depth and band): a sampled proposal is
        accepted with the overlap of the target's and the drafter's distributions, which the
        peak alone does not give (BENCHMARKS.md, sampled decoding)."""
        if row.params.rule == "greedy":
            return confidence
        nodes = self.node_acceptance(row.params.rule)
        return [nodes.rate(k + 1, 0, c) for k, c in enumerate(confidence)]

    def _recheck(self) -> None:
        """The thread count changed (other processes took or left cores): probe, check plain
        decoding and the neighbouring sizes soon again instead of after a long back-off."""
        self.probe_every = self.base_probe_every
        self.plain_spent = self.probe_extra = 0.0
        self.plain_checks.clear()
        self.challenges.clear()

    def _ragged(self, batch: DecodeBatch) -> bool:
        return self.ragged and batch.skips_padding

    def _trims(self, batch: DecodeBatch, rows: int) -> bool:
        """Whether drafting steps of `rows` rows get trimmed (so read back confidences)."""
        return rows <= TRIM_MAX_ROWS or self._ragged(batch)

    def _challenge(self, key: tuple[int, bool], best: int) -> int:
        """`best`, or a drafting size next to it (best + 1 and best - 1 in turn) when one is due
        a fresh measurement; a new best restarts the back-off."""
        since, every, turn, last = self.challenges.get(key, (0, self.base_challenge_every, 0, best))
        if best != last:
            since, every = 0, self.base_challenge_every
        if since + 1 < every:
            self.challenges[key] = (since + 1, every, turn, best)
            return best
        self.challenges[key] = (0, min(every * 2, MAX_INTERVAL), turn + 1, best)
        neighbours = [n for n in (best + 1, best - 1) if 2 <= n <= self.max_block]
        return neighbours[turn % len(neighbours)] if neighbours else best

    def _check_plain(self, key: int, best: int) -> int:
        """`best`, or 1 when plain decoding's real cost in this bucket is due a measurement."""
        if key not in self.plain_checks:
            self.plain_checks[key] = (0, self.base_plain_every)
            return 1
        since, every = self.plain_checks[key]
        if since + 1 >= every:
            self.plain_checks[key] = (0, min(every * 2, MAX_INTERVAL))
            return 1
        self.plain_checks[key] = (since + 1, every)
        return best

    def step(self, batch: DecodeBatch) -> int:
        """Chooses, runs and measures one step; returns the block size used (tokens verified).
        The policy's own choices for a lone row draft wider (`widen`) and verify what their
        drafts make worth it (`trimmer`); its checks run the size they check, whole.

        A held plain step (PLAIN_HOLD), all but a hold's last, is stepped and timed for the probes'
        budget alone: nothing reads the cost model before the hold ends, and the last held step
        measures plain decoding as every other step does. At concurrency 8 that bookkeeping had
        made the DFlash runner's plain ticks ~15 us dearer than plain decoding's (BENCHMARKS.md,
        "What a plain step carries")."""
        if self._take_hold(batch, spare=1):
            t0 = time.perf_counter()
            used = batch.step(1)
            self._note_time(len(batch.rows), used, time.perf_counter() - t0)
            self.used[used] += 1
            return used
        block = self.choose(batch)
        b = len(batch.rows)
        if self.lookup_step is not None:
            return self._step_lookup(batch, self.lookup_step)
        trim = None
        if block > 1 and not self.forced and self._trims(batch, b):
            # Wider drafts pay for a lone row only: a batch's widest row sets the padding of all.
            block, trim = self.widen(b, block) if b <= TRIM_MAX_ROWS else block, self.trimmer(batch)
        self._drafted = None  # set by `trim` (a step clipped to one token by its rows' limits drafts nothing)
        self._trial_conf = None
        self._tree_won = False
        offered = trim is not None and self.tree_choice
        # a plain step proposes nothing, so no acceptance count moves (most steps of a large batch)
        before = acceptance_counts(batch.rows) if block > 1 else None
        rows = list(batch.rows) if block > 1 else []  # `record`'s, as they were before the step
        backlog = getattr(batch, "draft_backlog", 0) if block > 1 else 0
        t0 = time.perf_counter()
        used = batch.step(block, trim, tree=self.tree_choice) if self._offered else batch.step(block, trim)
        seconds = time.perf_counter() - t0
        tree = getattr(batch, "tree_step", False) is True
        model = self._model
        timing = getattr(batch, "draft_timing", None)
        if timing is not None and not batch.caught_up:  # a draft pass that caught up costs more than its width
            model.observe_draft(b, *timing)
        self.tree_steps += tree
        if offered:  # offers answered with chains come less often, until a tree wins again
            self._offer_every = 1 if self._tree_won else min(2 * self._offer_every, OFFER_BACKOFF)
        if trim is not None and self._offered:  # a check offers once, whatever its trim answered
            checked = offered and self._untried + 1 >= TREE_CHECK_EVERY
            self._untried = 0 if tree or checked else self._untried + 1
        # A ragged step costs what a uniform one of its mean length does (the matmuls cost by rows).
        size = used if trim is None else max(1, min(self.max_block, round(batch.verified / b)))
        if self._drafted not in (None, size) and (drafts := model.draft_table(b)) is not None:
            seconds += drafts[size - 1] - drafts[self._drafted - 1]  # priced as if it had drafted only `size`
        if batch.caught_up and backlog > 0 and not tree:
            self._learn_catch_up((seconds - model.cost(b, size)) / backlog)
        if not batch.caught_up:
            # A draft pass that also read joined prompts or a run of plain steps' context costs
            # more than its size does. Believed, it priced drafting out: a fresh engine at
            # concurrency 8 then ran many steps plain (docs/DESIGN.md section 12), and the probes,
            # each catching up on the whole run, kept confirming it.
            if tree:
                self._observe_tree(b, size, seconds)
            else:
                model.observe(b, size, seconds)
        elif self._probing and not self._confirming and used > 1:
            self._confirm = block  # measured on the next step instead (`choose`)
        self._note_time(b, used, seconds)
        self.used[used] += 1
        if before is not None:
            self.record(rows, before, batch.node_trials if tree else None, self._trial_conf)
        return used

    def _learn_catch_up(self, per_token: float) -> None:
        """Adds one caught-up step's extra seconds per backlog token to `catch_up`: a lower one
        is believed at once (outside load only slows a step), a higher one averaged in."""
        per_token = max(0.0, per_token)
        s = self.costs.smoothing
        first = self.catch_up == 0.0
        self.catch_up = per_token if first or per_token < self.catch_up else (1 - s) * self.catch_up + s * per_token

    def _note_time(self, batch_size: int, used: int, seconds: float) -> None:
        """Books a step's time against the probe budget (PROBE_SHARE)."""
        if self._probing:  # a probe, or its repeat: together they are what probing costs
            extra = max(0.0, seconds - self._model.cost(batch_size, 1))
            self.probe_extra = self.probe_extra + extra if self._confirming else extra
            self._probing = self._confirming = False
        elif used == 1 or self.lookup_step is not None:
            self.plain_spent += seconds

    def _step_lookup(self, batch: DecodeBatch, lengths: list[int]) -> int:
        """Runs and measures a step of lookup proposals alone (see `_lookup_option`)."""
        b = len(batch.rows)
        estimate = self._lookup_estimate
        before = acceptance_counts(batch.rows)
        t0 = time.perf_counter()
        used = batch.step_lookup(lengths)
        seconds = time.perf_counter() - t0
        self.lookup_steps += 1
        self._note_time(b, used, seconds)
        if batch.verified == b * used:  # uniform: what a drafting step of this size costs, less its draft
            drafts = self._model.draft_table(b)
            self._model.observe(b, used, seconds + (drafts[used - 1] if drafts is not None else 0.0))
        elif estimate > 0:
            ratio = min(4.0, max(0.25, seconds / estimate))
            s = self._model.smoothing
            self.lookup_ratio = ratio if ratio < self.lookup_ratio else (1 - s) * self.lookup_ratio + s * ratio
        self.used[used] += 1
        self.record(batch.rows, before)
        return used
