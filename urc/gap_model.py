"""Reuse gaps learned online: :class:`GapHistogram`, the distribution the return-time policy
(``urc.return_time_eviction``) predicts from.

A gap is the time from a finished request until a later request extends its prompt (the
cached path is used again).  The histogram counts observed gaps on log-spaced bins (1 s,
2 s, 4 s, ... up to the horizon) plus one count for paths not reused within the horizon
("never").  From it, :meth:`GapHistogram.predict` answers: a path not reused although
``edges[j]`` seconds have passed, when is it used next?  The ``q``-quantile of the gap given
that it is at least ``edges[j]``, never counted as infinitely late; ``None`` when that
quantile is "never" (a late path is probably gone).  Cost: O(bins) per prediction and O(1)
per count; the bins are a constant (about a dozen).
"""

from __future__ import annotations

import math

__all__ = ["GapHistogram", "gap_edges", "predict_gap"]


def gap_edges(horizon_s: float, ratio: float = 2.0) -> tuple[float, ...]:
    """Bin edges ``0, 1, ratio, ratio**2, ...`` seconds, the last one ``horizon_s`` (> 1)."""
    edges = [0.0]
    e = 1.0
    while e < horizon_s * (1 - 1e-9):
        edges.append(e)
        e *= ratio
    edges.append(float(horizon_s))
    return tuple(edges)


class GapHistogram:
    """Counts of reuse gaps on ``edges`` (see the module docstring), with a prior.

    ``prior_gap_s``/``prior_weight``: pseudo-counts at a typical gap (``None``: at
    "never"), so that predictions are sensible before the first observation.  Counts are
    halved when they pass ``2 ** 16`` in all, so the model follows a workload that drifts.
    """

    __slots__ = ("_cache", "_log_ratio", "counts", "edges", "never", "total")

    def __init__(
        self, edges: tuple[float, ...], prior_gap_s: float | None, prior_weight: float = 2.0
    ) -> None:
        self.edges = edges
        self._log_ratio = math.log(edges[2]) if len(edges) > 3 else 1.0
        self.counts = [0.0] * (len(edges) - 1)
        self.never = 0.0
        self.total = 0.0
        self._cache: dict[tuple[int, float], float | None] = {}
        if prior_gap_s is None or prior_gap_s >= edges[-1]:
            self.never += prior_weight
        else:
            self.counts[self.bin_of(prior_gap_s)] += prior_weight
        self.total += prior_weight

    @property
    def bins(self) -> int:
        return len(self.counts)

    def bin_of(self, age_s: float) -> int:
        """The bin ``age_s`` falls in (``bins`` at or past the horizon; 0 below zero)."""
        if age_s < 1.0:
            return 0
        if age_s >= self.edges[-1]:
            return len(self.counts)
        j = min(int(math.log(age_s) / self._log_ratio) + 1, len(self.counts) - 1)
        # Float rounding at an edge: step to the bin whose edges hold ``age_s``.
        edges = self.edges
        while j > 1 and age_s < edges[j]:
            j -= 1
        while j < len(self.counts) - 1 and age_s >= edges[j + 1]:
            j += 1
        return j

    def add(self, gap_s: float) -> None:
        """Count one observed gap (one at or past the horizon counts as never)."""
        j = self.bin_of(gap_s)
        if j >= len(self.counts):
            self.never += 1.0
        else:
            self.counts[j] += 1.0
        self._counted()

    def add_never(self) -> None:
        """Count one path not reused within the horizon."""
        self.never += 1.0
        self._counted()

    def _counted(self) -> None:
        self.total += 1.0
        self._cache.clear()
        if self.total > 65536.0:
            self.counts = [c / 2 for c in self.counts]
            self.never /= 2
            self.total /= 2

    def predict(self, j: int, q: float) -> float | None:
        """The ``q``-quantile of the gap given it is at least ``edges[j]`` (linear within a
        bin), or ``None`` when that quantile is past the horizon (never)."""
        got = self._cache.get((j, q), self)
        if got is not self:
            return got  # type: ignore[return-value]
        result = predict_gap(self.edges, self.counts, self.never, j, q)
        self._cache[(j, q)] = result
        return result


def predict_gap(
    edges: tuple[float, ...], counts: list[float], never: float, j: int, q: float
) -> float | None:
    """:meth:`GapHistogram.predict` on raw ``counts`` (one per bin of ``edges``) and a
    ``never`` count."""
    if j >= len(counts):
        return None
    target = q * (sum(counts[j:]) + never)
    acc = 0.0
    for i in range(j, len(counts)):
        c = counts[i]
        if c > 0 and acc + c >= target:
            lo, hi = edges[i], edges[i + 1]
            return lo + (target - acc) / c * (hi - lo)
        acc += c
    return None
