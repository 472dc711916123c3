"""What a step costs: seconds per step by batch-size bucket and verify width, calibrated and then
corrected by the steps that run (`CostModel`), and the helpers that read it."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

FIRST_TIMING_CAP = 2.0  # a size's first real timing counts for at most this many times its estimate


def bucket(batch: int) -> int:
    """Batch sizes share calibrations and measurements by power-of-two bucket (each size priced
    at its own row count: `CostModel.row_scale`)."""
    size = 1
    while size < batch:
        size *= 2
    return size


def buckets_up_to(max_batch: int) -> list[int]:
    """Every batch-size bucket a batch of at most `max_batch` rows can fall in."""
    return sorted({bucket(b) for b in range(1, max_batch + 1)})


@dataclass
class CostModel:
    """Seconds per step by (batch bucket, block size): calibrated, then corrected by real steps,
    and scaled from the bucket's row count to each batch size's (`row_scale`).

    A calibration runs on a short throwaway context, so its shape can be off at serving time
    (attention over a long context adds cost per verified token; other work on the machine adds
    cost per step). Real steps therefore override it: each block size that has run keeps its own
    moving average, and a block size that has not run yet is estimated from its calibrated cost
    times the measured/calibrated ratio of the nearest block sizes that have (interpolated), so
    one step's surprise never leaks into plain decoding's cost as a whole. A slower repeat
    measurement is averaged in, a faster one replaces the estimate (see `observe`). A repeat
    measurement of a block size that drifted (longer contexts, machine load) moves the others'
    averages by a damped share of the drift, since such drift hits every block size alike.
    Measurements belong to the intra-op thread count they ran at (`use_threads`): the count
    follows the cores other processes leave free (cpu/threads.py), and 1 thread costs more than 2
    do, unevenly across sizes, so each count keeps its own over the shared calibration.
    The tables derived from all that (`table`, `draft_table`, `least_table`, `row_scale`) are
    kept until `set`, `observe` or `use_threads` changes what they read: a step reads them
    several times (its choice, a lookup option, a trim), and they change once per step at most
    (so their fields change only through those methods).
    """

    max_block: int
    smoothing: float = 0.2
    calibrated: dict[int, list[float]] = field(default_factory=dict)
    measured: dict[int, dict[int, float]] = field(default_factory=dict)  # at `threads` threads
    drafting: dict[int, list[float]] = field(default_factory=dict)  # calibrated draft passes alone
    threads: int = 0  # the thread count `measured` belongs to (0: not told yet)
    other_threads: dict[int, dict[int, dict[int, float]]] = field(default_factory=dict)  # the other counts'
    # (threads, bucket) -> {drafted width: seconds}: real steps' draft passes with their proposals
    # (`observe_draft`), at the bucket's row count
    drafts_seen: dict[tuple[int, int], dict[int, float]] = field(default_factory=dict)
    # (what, batch size) -> a derived table, until the next change (`_changed`); callers get copies
    _kept: dict[tuple[str, int], list[float] | None] = field(default_factory=dict, init=False, repr=False,
                                                             compare=False)
    # ("scale", batch size): `row_scale`; ("shares", bucket): `_draft_shares`; until the next
    # calibration (they read calibrations only)
    _scales: dict[tuple[str, int], list[float] | None] = field(default_factory=dict, init=False, repr=False,
                                                               compare=False)

    def __post_init__(self) -> None:
        if self.max_block < 1:
            raise ValueError(f"max_block must be >= 1, got {self.max_block}")
        if not 0 < self.smoothing <= 1:
            raise ValueError(f"smoothing must be in (0, 1], got {self.smoothing}")

    def known(self, batch: int) -> bool:
        return bucket(batch) in self.calibrated

    def set(self, batch: int, costs: list[float], drafting: list[float] | None = None) -> None:
        """Stores a calibration (seconds for block sizes 1..max_block; `drafting`: the draft
        pass's part of each, if timed) and forgets measurements."""
        for name, values in (("costs", costs), ("drafting costs", drafting)):
            if values is not None and len(values) != self.max_block:
                raise ValueError(f"need {self.max_block} {name}, got {len(values)}")
        self._changed()
        self._scales.clear()
        self.calibrated[bucket(batch)] = list(costs)
        for table in (self.measured, *self.other_threads.values()):
            table.pop(bucket(batch), None)
        for key in [k for k in self.drafts_seen if k[1] == bucket(batch)]:
            del self.drafts_seen[key]
        if drafting is None:
            self.drafting.pop(bucket(batch), None)
        else:
            self.drafting[bucket(batch)] = list(drafting)

    def use_threads(self, threads: int) -> bool:
        """Switches to the measurements taken at `threads` threads (the first count told keeps
        what was measured before); True when the count changed."""
        if threads == self.threads or threads < 1:
            return False
        self._changed()
        if self.threads:
            self.other_threads[self.threads] = self.measured
            self.measured = self.other_threads.pop(threads, {})
        self.threads = threads
        return True

    def _changed(self) -> None:
        """Forgets the derived tables: what they read is about to change."""
        self._kept.clear()

    def draft_table(self, batch: int) -> list[float] | None:
        """Estimated seconds of the draft pass alone (with its proposals) at block sizes
        1..max_block (0 at 1); None when it was not timed. A width whose draft passes real steps
        timed (`observe_draft`) keeps its own measurement; any other, its calibrated share of
        the step's current estimate times the measured/estimated ratios of the nearest measured
        widths (interpolated as `table`'s). Measured because a calibrated share is off wherever
        the calibration's dummy context drafts unlike real text (flat sampled drafts cost the
        proposals several times what real text's do), and an inflated share feeds on itself: a
        lookup step books its time plus the share into the drafting sizes' costs
        (`AdaptiveBlock._step_lookup`), which raises the share's base (docs/DESIGN.md section 12)."""
        key = ("draft", batch)
        if key not in self._kept:
            drafts = self._draft_bucket(bucket(batch))
            self._kept[key] = None if drafts is None else self._scaled(batch, drafts)
        kept = self._kept[key]
        return None if kept is None else list(kept)

    def _draft_bucket(self, b: int) -> list[float] | None:
        """`draft_table` at bucket b's own row count (read only)."""
        shares = self._draft_shares(b)
        if shares is None:
            return None
        estimate = [t * share for t, share in zip(self._bucket_table(b), shares)]
        return _measured_over(estimate, self.drafts_seen.get((self.threads, b), {}))

    def _draft_shares(self, b: int) -> list[float] | None:
        """Bucket b's draft passes' calibrated shares of its steps, kept until the next calibration."""
        key = ("shares", b)
        if key not in self._scales:
            cal, base = self.drafting.get(b), self.calibrated.get(b)
            self._scales[key] = None if cal is None else [c / t if t > 0 else 0.0 for c, t in zip(cal, base)]
        return self._scales[key]

    def table(self, batch: int) -> list[float]:
        """Estimated seconds of a step at block sizes 1..max_block. Not forced non-decreasing: on
        a CPU a larger block can really cost less (4 rows take MKL's fast path, 3 do not), and
        raising 4 to 3's cost had priced the best block out (docs/DESIGN.md section 12)."""
        return list(self._table(batch))

    def _table(self, batch: int) -> list[float]:
        """`table`, kept: read only."""
        key = ("table", batch)
        kept = self._kept.get(key)
        if kept is None:
            kept = self._kept[key] = self._scaled(batch, self._bucket_table(bucket(batch)))
        return kept

    def _bucket_table(self, b: int) -> list[float]:
        """`table` at bucket b's own row count, kept (read only): its measurements, or its
        calibration scaled like the nearest measured block sizes'."""
        key = ("bucket", b)
        kept = self._kept.get(key)
        if kept is not None:
            return kept
        kept = self._kept[key] = _measured_over(self.calibrated[b], self.measured.get(b, {}))
        return kept

    def row_scale(self, batch: int) -> list[float] | None:
        """Per block size, what a step of `batch` rows costs over one of its bucket's row count:
        the calibrations of the bucket and the one below, interpolated linearly in rows, at most
        1 (fewer rows never cost more); None at a bucket's own size, or where the bucket below
        was not calibrated. A bucket's measurements are kept at its own row count, so a step of
        5 rows neither prices 8 rows' steps as 5 rows' nor the other way round: pooled, a
        drafting step measured while a batch of 8 shrank priced drafting at 8 rows too low."""
        scale = self._row_scale(batch)
        return None if scale is None else list(scale)

    def _row_scale(self, batch: int) -> list[float] | None:
        """`row_scale`, kept: read only."""
        key = ("scale", batch)
        if key in self._scales:
            return self._scales[key]
        b = bucket(batch)
        scale = None
        if batch != b and b // 2 in self.calibrated and b in self.calibrated:
            t = (batch - b // 2) / (b - b // 2)
            scale = [min(1.0, (lo + t * (hi - lo)) / hi) if hi > 0 else 1.0
                     for lo, hi in zip(self.calibrated[b // 2], self.calibrated[b])]
        self._scales[key] = scale
        return scale

    def _scaled(self, batch: int, costs: list[float]) -> list[float]:
        """Bucket-row-count `costs` scaled to `batch` rows (`row_scale`)."""
        scale = self._row_scale(batch)
        return costs if scale is None else [c * s for c, s in zip(costs, scale)]

    def cost(self, batch: int, block: int) -> float:
        return self._table(batch)[block - 1]

    def least_table(self, batch: int) -> list[float]:
        """`table`, each drafting size at most its calibration scaled as plain decoding's cost
        moved: what it costs unless outside load slowed its own last steps. Its measurements
        only move with plain decoding's damped, so a burst that priced drafting out would
        otherwise keep it out (only a drafting step re-measures it)."""
        key = ("least", batch)
        kept = self._kept.get(key)
        if kept is None:
            out = self._bucket_table(bucket(batch))
            base = self.calibrated[bucket(batch)]
            drift = out[0] / base[0] if base[0] > 0 else 1.0
            least = out[:1] + [min(t, c * drift) for t, c in zip(out[1:], base[1:])]
            kept = self._kept[key] = self._scaled(batch, least)
        return list(kept)

    def drafting_measured(self, batch: int) -> bool:
        """Whether a real step of a drafting size (2 or more) was measured in `batch`'s bucket
        at the current thread count (else its drafting costs are the calibration's guess)."""
        return any(n > 1 for n in self.measured.get(bucket(batch), {}))

    def observe(self, batch: int, block: int, seconds: float) -> None:
        """Adds the measured time of one real step."""
        b = bucket(batch)
        if b not in self.calibrated or seconds <= 0:
            return
        scale = self._row_scale(batch)
        if scale is not None and scale[block - 1] > 0:
            seconds /= scale[block - 1]  # kept at the bucket's row count
        seen = self.measured.setdefault(b, {})
        old = seen.get(block)
        if old is None:
            # A first timing far above the estimate is more likely a burst of outside load than
            # the size's cost; believed whole, it would price this size (and, through the
            # interpolation of unmeasured sizes, its neighbours) out until it happened to run
            # again, which it then would not (seen at concurrency 16: docs/DESIGN.md section 12).
            first = min(seconds, FIRST_TIMING_CAP * self._bucket_table(b)[block - 1])
            self._changed()
            seen[block] = first
            return
        # A faster step is believed at once: outside load only ever slows steps, and an estimate
        # too low corrects itself (that size gets chosen, and measured), one too high never does.
        new = seconds if seconds < old else (1 - self.smoothing) * old + self.smoothing * seconds
        drift = 1 + 0.25 * (new / old - 1)
        self._changed()
        for n in seen:
            seen[n] = new if n == block else seen[n] * drift

    def observe_draft(self, batch: int, width: int, seconds: float) -> None:
        """Adds the measured time of one real step's draft pass and proposals at `width` drafted
        positions (the root included), as `observe` adds a step's: a first timing capped at
        FIRST_TIMING_CAP times its estimate, a faster one believed at once, a slower one averaged
        in. Only where the calibration timed draft passes (`draft_table` is not None)."""
        b = bucket(batch)
        if b not in self.calibrated or b not in self.drafting or seconds <= 0 or not 2 <= width <= self.max_block:
            return
        scale = self._row_scale(batch)
        if scale is not None and scale[width - 1] > 0:
            seconds /= scale[width - 1]  # kept at the bucket's row count
        seen = self.drafts_seen.setdefault((self.threads, b), {})
        old = seen.get(width)
        if old is None:
            estimate = self._draft_bucket(b)[width - 1]
            new = min(seconds, FIRST_TIMING_CAP * estimate) if estimate > 0 else seconds
        else:
            new = seconds if seconds < old else (1 - self.smoothing) * old + self.smoothing * seconds
        self._changed()
        seen[width] = new


def at_least(tree: list[float], chain: list[float]) -> list[float]:
    """Tree step costs by width, each at least the chain step's of that width (its draft's
    catch-up included where `chain` prices one). A tree step of w nodes runs the chain step's
    draft pass and a verify pass of as many tokens, plus its own host work, so it never costs
    less; but its table is calibrated apart from the chain's and corrected only where trees
    run, so outside load at either time can price a width below the chain's, and trees would
    then win on price instead of on the tokens they add."""
    return [max(t, c) for t, c in zip(tree, chain)]


def _measured_over(base: list[float], seen: dict[int, float]) -> list[float]:
    """Per block size 1..len(base): its measurement in `seen` where there is one, else its `base`
    estimate times the measured/estimated ratios of the nearest measured sizes, interpolated
    (`_interpolation`)."""
    ratios = {n: t / base[n - 1] for n, t in seen.items() if base[n - 1] > 0}
    if not ratios:
        return [seen.get(n, c) for n, c in enumerate(base, 1)]
    between = _interpolation(tuple(sorted(ratios)), len(base))
    return [seen[n] if n in seen else c * (ratios[lo] + t * (ratios[hi] - ratios[lo]))
            for n, c, (lo, hi, t) in zip(range(1, len(base) + 1), base, between)]


@functools.lru_cache(maxsize=256)
def _interpolation(sizes: tuple[int, ...], max_block: int) -> tuple[tuple[int, int, float], ...]:
    """How measured/calibrated ratios, measured at `sizes` (at least one), are interpolated
    linearly at block sizes 1..max_block (flat beyond the ends): for each, the measured sizes
    (lo, hi) it lies between and its weight t on hi, the ratio r(lo) + t * (r(hi) - r(lo));
    (m, m, 0.0) at a measured size m or beyond the ends, where the ratio is m's own (r + 0.0 *
    0.0 is r). Cached: the measured sizes rarely change, their ratios at every step."""
    out = []
    for n in range(1, max_block + 1):
        lower = [m for m in sizes if m <= n]
        upper = [m for m in sizes if m >= n]
        lo = max(lower) if lower else min(upper)
        hi = min(upper) if upper else max(lower)
        out.append((lo, hi, 0.0 if lo == hi else (n - lo) / (hi - lo)))
    return tuple(out)


def cost_at(values: list[float], x: float) -> float:
    """values[n - 1] at a fractional block size x in [1, len(values)], linearly interpolated."""
    lo = min(int(x), len(values))
    if lo >= len(values):
        return values[-1]
    t = x - lo
    return values[lo - 1] + t * (values[lo] - values[lo - 1])


def interpolate(points: dict[int, float], max_block: int) -> list[float]:
    """Piecewise-linear costs for 1..max_block from measured points."""
    xs = sorted(points)
    out = []
    for n in range(1, max_block + 1):
        hi = next(x for x in xs if x >= n)
        lo = max(x for x in xs if x <= n)
        t = 0.0 if hi == lo else (n - lo) / (hi - lo)
        out.append(points[lo] + t * (points[hi] - points[lo]))
    return out
