"""Cluster, shard and file sizes as a bounded multiset (the distinct sizes and how many hold each), and the
lognormal cluster sizes a plan assumes. Up to EXACT_ITEMS clusters each has its own size; beyond, quantile bins
stand for them, so a plan at k = 10^11 or N = 10^15 holds a few thousand numbers, and every figure the planner
takes from sizes (steps, leftover pairs, files, the largest) is a sum or an extreme over them."""
from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist

import numpy as np

EXACT_ITEMS = 65_536
"""Up to this many clusters the sizes are each cluster's own (every k the docs and the tests plan); beyond,
TAIL_ITEMS clusters at each end keep their own size (the largest and smallest are exact) and the others fall in
bins cut at QUANTILE_BINS equal cluster counts and QUANTILE_BINS equal size ratios, each bin's rows split evenly
over its clusters: figures within 0.5% of one size per cluster (tests/test_plan_hostile.py)."""
TAIL_ITEMS = 1024
QUANTILE_BINS = 4096


@dataclass(frozen=True, eq=False)
class SizeCounts:
    """A multiset of sizes (rows per cluster, shard or file): `counts[i]` items hold `sizes[i]` rows."""

    sizes: np.ndarray   # int64, ascending, distinct
    counts: np.ndarray  # int64, each > 0

    @classmethod
    def of(cls, values) -> SizeCounts:
        """From one size per item (a list or array), or a SizeCounts as it is."""
        if isinstance(values, SizeCounts):
            return values
        sizes, counts = np.unique(np.asarray(values, dtype=np.int64).ravel(), return_counts=True)
        return cls(sizes, counts.astype(np.int64))

    @classmethod
    def from_pairs(cls, sizes, counts) -> SizeCounts:
        """From (size, how many) pairs, in any order, repeats summed; sizes held by no item left out."""
        sizes, counts = np.asarray(sizes, dtype=np.int64), np.asarray(counts, dtype=np.int64)
        keep = counts > 0
        distinct, where = np.unique(sizes[keep], return_inverse=True)
        merged = np.zeros(len(distinct), dtype=np.int64)
        np.add.at(merged, where, counts[keep])
        return cls(distinct, merged)

    @property
    def items(self) -> int:
        return int(self.counts.sum())

    @property
    def total(self) -> int:
        return self.sum_of(self.sizes)

    @property
    def largest(self) -> int:
        return int(self.sizes[-1]) if len(self.sizes) else 0

    @property
    def smallest(self) -> int:
        return int(self.sizes[0]) if len(self.sizes) else 0

    def sum_of(self, per_size: np.ndarray) -> int:
        """Sum over the items of an integer figure given per distinct size."""
        return int((np.asarray(per_size, dtype=np.int64) * self.counts).sum())

    def median(self) -> float:
        """np.median of the items: the middle one, or the mean of the two middle ones."""
        n = self.items
        if not n:
            return 0.0
        ends = np.cumsum(self.counts)
        at = self.sizes[np.searchsorted(ends, [(n - 1) // 2, n // 2], side="right")]
        return float(at.mean())

    def where(self, mask: np.ndarray) -> SizeCounts:
        return SizeCounts(self.sizes[mask], self.counts[mask])

    def map(self, per_size: np.ndarray) -> SizeCounts:
        """Each item's size replaced by a figure given per distinct size."""
        return SizeCounts.from_pairs(per_size, self.counts)

    def with_item(self, size: int) -> SizeCounts:
        return SizeCounts.from_pairs(np.append(self.sizes, size), np.append(self.counts, 1))

    def largest_grown(self, rows: int) -> SizeCounts:
        """One of the largest items given `rows` more."""
        counts = self.counts.copy()
        counts[-1] -= 1
        return SizeCounts.from_pairs(np.append(self.sizes, self.largest + rows), np.append(counts, 1))

    def imbalance_factor(self) -> float:
        """faiss's k x sum(n^2) / N^2 (1 = equal sizes)."""
        n = float(self.total)
        return float(self.items * (self.sizes.astype(np.float64) ** 2 * self.counts).sum() / (n * n)) if n else 1.0

    def tolist(self) -> list[int]:
        """One size per item, ascending: only for a multiset of at most EXACT_ITEMS items."""
        if self.items > EXACT_ITEMS:
            raise ValueError(f"{self.items:,} items are more than the {EXACT_ITEMS:,} a list is made of")
        return np.repeat(self.sizes, self.counts).tolist()


def equal_split(rows: np.ndarray, items: np.ndarray) -> SizeCounts:
    """Bins of `items` items holding `rows` rows, each split as evenly as whole rows allow."""
    rows, items = np.asarray(rows, dtype=np.int64), np.asarray(items, dtype=np.int64)
    low, extra = np.divmod(rows, np.maximum(items, 1))
    return SizeCounts.from_pairs(np.concatenate([low, low + 1]), np.concatenate([items - extra, extra]))


def _z(numerator: float, k: int) -> float:
    """The standard normal quantile at numerator / k, from the nearer tail (precise at k = 10^11)."""
    if 2 * numerator <= k:
        return NormalDist().inv_cdf(numerator / k)
    return -NormalDist().inv_cdf((k - numerator) / k)


def _normal_mass(lo: float, hi: float) -> float:
    """P(lo < Z < hi), from the nearer tail."""
    if lo > 0:
        return 0.5 * (math.erfc(lo / math.sqrt(2)) - math.erfc(hi / math.sqrt(2)))
    return 0.5 * (math.erfc(-hi / math.sqrt(2)) - math.erfc(-lo / math.sqrt(2)))


def lognormal_sizes(rows: int, k: int, imbalance: float) -> SizeCounts:
    """k cluster sizes summing to `rows` whose imbalance factor k sum(n^2)/N^2 is `imbalance`: lognormal
    quantiles, since exp(sigma^2) is a lognormal's E[n^2]/E[n]^2. The rounding rest goes to the largest."""
    sigma = math.sqrt(math.log(max(1.0, imbalance)))
    if k <= EXACT_ITEMS:
        z = np.array([NormalDist().inv_cdf((i + 0.5) / k) for i in range(k)])
        weights = np.exp(sigma * z)
        sizes = np.floor(rows * weights / weights.sum()).astype(np.int64)
        sizes[np.argsort(-weights)[:rows - int(sizes.sum())]] += 1
        return SizeCounts.of(sizes)
    # Ranks [lo, hi) of a bin; the tails one cluster each, the middle cut at equal counts and at equal z.
    middle = np.linspace(TAIL_ITEMS, k - TAIL_ITEMS, QUANTILE_BINS + 1)
    z_edges = np.linspace(_z(TAIL_ITEMS, k), _z(k - TAIL_ITEMS, k), QUANTILE_BINS + 1)
    by_z = [k * 0.5 * math.erfc(-z / math.sqrt(2)) if z <= 0 else k - k * 0.5 * math.erfc(z / math.sqrt(2))
            for z in z_edges]
    edges = np.unique(np.concatenate([np.arange(TAIL_ITEMS + 1), np.arange(k - TAIL_ITEMS, k + 1),
                                      np.clip(np.rint(middle), TAIL_ITEMS, k - TAIL_ITEMS),
                                      np.clip(np.rint(by_z), TAIL_ITEMS, k - TAIL_ITEMS)]).astype(np.int64))
    lo, hi = edges[:-1], edges[1:]
    scale = math.exp(sigma * sigma / 2)
    weights = np.array([math.exp(sigma * _z(a + 0.5, k)) if b - a == 1 else  # the midpoint rule, as above
                        k * scale * _normal_mass(_z(a, k) - sigma, _z(b, k) - sigma) for a, b in zip(lo, hi)])
    bin_rows = np.floor(rows * (weights / weights.sum())).astype(np.int64)
    rest = rows - int(bin_rows.sum())  # a few rows either way (float rounding): the largest clusters take them
    bin_rows[len(bin_rows) - abs(rest):] += int(np.sign(rest))
    return equal_split(np.maximum(bin_rows, 0), hi - lo)


def scaled_sizes(measured: SizeCounts, rows: int) -> SizeCounts:
    """A run's cluster sizes scaled to `rows`; the rounding rest goes to its largest cluster."""
    sizes = np.floor(measured.sizes.astype(np.float64) * rows / measured.total).astype(np.int64)
    scaled = measured.map(sizes)
    return scaled.largest_grown(rows - scaled.total) if rows != scaled.total else scaled


def expected_uniform_unused(strata: SizeCounts, batch: int, block_rows: int = 1) -> int:
    """The mean over seeds of train/schedule.unused_pairs with cluster_weighting=uniform: each of an epoch's P steps
    draws one of the E strata holding a full batch, so a stratum of s rows (f full batches) is drawn
    D ~ Binomial(P, 1/E) times. D <= f leaves s - D x batch rows out. Beyond f, a stratum's order is its whole
    blocks of block_rows permuted afresh each pass, its partial block (p rows) last: p rows are never drawn, and
    each of the r other rows pass one left out survives a full pass with probability r / (s - p), t more draws
    with 1 - t x batch / (s - p)."""
    full = strata.sizes // batch
    eligible = full > 0
    unused = strata.where(~eligible).total
    steps, drawn = strata.sum_of(full), int(strata.counts[eligible].sum())
    if not drawn:
        return unused
    draws, weights = _binomial_points(steps, 1.0 / drawn)
    d = draws[None, :]
    total = 0.0
    for lo in range(0, int(eligible.sum()), 512):  # bounded temporaries: 512 sizes x the points at a time
        s = strata.sizes[eligible][lo:lo + 512, None].astype(np.float64)
        f = full[eligible][lo:lo + 512, None].astype(np.float64)
        count = strata.counts[eligible][lo:lo + 512].astype(np.float64)
        partial = s % block_rows
        whole, left = s - partial, s - partial - f * batch
        passes, more = np.divmod(np.maximum(d - f, 0.0), f)
        beyond = partial + left * (left / whole) ** passes * np.maximum(0.0, 1 - more * batch / whole)
        total += float(count @ (np.where(d <= f, s - d * batch, beyond) @ weights))
    return unused + int(round(total))


def _binomial_points(n: int, p: float) -> tuple[np.ndarray, np.ndarray]:
    """(values, probabilities) standing for Binomial(n, p): its exact pmf around the mode where it is narrow, else
    256 quantiles of the normal approximation."""
    if p >= 1.0:
        return np.array([float(n)]), np.array([1.0])
    mean, sd = n * p, math.sqrt(n * p * (1 - p))
    if sd > 10:
        z = np.array([NormalDist().inv_cdf((j + 0.5) / 256) for j in range(256)])
        return np.clip(np.floor(mean + sd * z + 0.5), 0, n), np.full(256, 1 / 256)
    mode = min(n, int((n + 1) * p))
    lo, hi = max(0, mode - int(10 * sd) - 10), min(n, mode + int(10 * sd) + 10)
    # pmf(d + 1) / pmf(d) = (n - d) / (d + 1) x p / (1 - p), from the mode outwards (no huge factorials)
    up = np.arange(mode, hi, dtype=np.float64)
    down = np.arange(mode - 1, lo - 1, -1, dtype=np.float64)
    odds = math.log(p) - math.log1p(-p)
    log_up = np.concatenate([[0.0], np.cumsum(np.log(n - up) - np.log(up + 1) + odds)])
    log_down = np.cumsum(np.log(down + 1) - np.log(n - down) - odds)
    values = np.concatenate([down[::-1], np.arange(mode, hi + 1, dtype=np.float64)])
    log_pmf = np.concatenate([log_down[::-1], log_up])
    pmf = np.exp(log_pmf - log_pmf.max())
    return values, pmf / pmf.sum()
