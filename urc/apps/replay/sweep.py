"""``urc replay --sweep``: the hit rate against device capacity, the curve cache sizes are
picked from.

:func:`run_sweep` makes the workload's first pass once and replays it once per device
capacity (every other setting as configured: ``host_tokens=0`` gives the curve of the device
tier alone, what ``urc replay --sweep`` runs unless ``--host-tokens`` is given; a host tier
gives a HiCache curve, whose points all include the same host capacity).
:class:`SweepResult` prints a table and an ASCII chart (always) and writes a PNG when
matplotlib is importable (it is not a dependency).  Deterministic runs give the same curve
every time.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from urc.apps.replay.config import ReplayConfig
from urc.apps.replay.driver import run_replay
from urc.apps.replay.options import DEFAULT_SWEEP, Capacity
from urc.apps.replay.report import IDEAL_SCOPE, ReplayReport
from urc.apps.replay.source import EmptyWorkloadError, summarize
from urc.node import Tier

__all__ = ["DEFAULT_SWEEP", "SweepPoint", "SweepResult", "run_sweep"]

_BAR_WIDTH = 50


@dataclass(frozen=True, slots=True)
class SweepPoint:
    """One replay of a sweep: the capacity asked for and what it measured."""

    capacity: Capacity
    report: ReplayReport

    @property
    def device_tokens(self) -> int:
        return self.report.device_tokens

    @property
    def hit_rate(self) -> float:
        return self.report.hit_rate


@dataclass(frozen=True, slots=True)
class SweepResult:
    """The points of a sweep, in the order the capacities were given."""

    source: str
    unique_tokens: int
    ideal_hit_rate: float
    points: tuple[SweepPoint, ...]

    @property
    def ok(self) -> bool:
        """Every replay passed its invariant check and served at least one request."""
        return all(p.report.check_ok and not p.report.served_nothing for p in self.points)

    def to_dict(self) -> dict[str, Any]:
        """The ``--json`` document: the curve, then each point's full report."""
        return {
            "source": self.source,
            "unique_tokens": self.unique_tokens,
            "ideal_hit_rate": self.ideal_hit_rate,
            "ideal_scope": IDEAL_SCOPE,
            "curve": [
                {
                    "capacity": str(p.capacity),
                    "device_tokens": p.device_tokens,
                    "hit_rate": p.hit_rate,
                    "device_hit_rate": p.report.tier_hit_rate(Tier.DEVICE),
                    "host_hit_rate": p.report.tier_hit_rate(Tier.HOST),
                    "rejected": p.report.requests_rejected,
                }
                for p in self.points
            ],
            "reports": [p.report.to_dict() for p in self.points],
        }

    def format(self) -> str:
        """A table and an ASCII chart of hit rate against device capacity."""
        first = self.points[0].report if self.points else None
        host = (
            f"host {first.host_tokens:,} tokens ({first.write_policy})"
            if first is not None and first.host_tokens
            else "no host tier: the device tier alone; --host-tokens adds one"
        )
        lines = [
            f"urc replay --sweep: {self.source}",
            f"  hit rate against device capacity ({host}); unique prompt tokens "
            f"{self.unique_tokens:,}; ideal {self.ideal_hit_rate:.2%} ({IDEAL_SCOPE})",
            "",
            f"  {'capacity':>9} {'device tokens':>14} {'hit rate':>9} {'device':>8} "
            f"{'host':>8} {'rejected':>9}",
        ]
        for p in self.points:
            r = p.report
            lines.append(
                f"  {p.capacity!s:>9} {p.device_tokens:>14,} {p.hit_rate:>9.2%} "
                f"{r.tier_hit_rate(Tier.DEVICE):>8.2%} {r.tier_hit_rate(Tier.HOST):>8.2%} "
                f"{r.requests_rejected:>9,}"
            )
        lines.append("")
        lines.extend(self.ascii_chart())
        return "\n".join(lines)

    def ascii_chart(self) -> list[str]:
        """One bar per capacity, scaled to the ideal (``|`` marks the ideal)."""
        top = max([self.ideal_hit_rate, *(p.hit_rate for p in self.points)]) or 1.0
        ideal_col = round(self.ideal_hit_rate / top * _BAR_WIDTH)
        lines = [f"  {'device tokens':>14}  hit rate (0 .. {top:.1%}; '|' = ideal)"]
        for p in self.points:
            n = round(p.hit_rate / top * _BAR_WIDTH)
            bar = ["#"] * n + [" "] * (_BAR_WIDTH + 1 - n)
            if bar[ideal_col] == " ":
                bar[ideal_col] = "|"
            lines.append(f"  {p.device_tokens:>14,}  {''.join(bar)} {p.hit_rate:6.2%}")
        return lines

    def write_png(self, path: Path) -> str:
        """Save the curve as a PNG if matplotlib is importable; returns what happened."""
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            return f"matplotlib is not installed: no PNG written to {path} (see the chart)"
        fig, ax = plt.subplots(figsize=(7, 4.5))
        xs = [p.device_tokens for p in self.points]
        ax.plot(xs, [p.hit_rate for p in self.points], marker="o", label="hit rate")
        ax.axhline(self.ideal_hit_rate, linestyle="--", color="grey", label="ideal")
        ax.set_xscale("log")
        ax.set_xlabel("device capacity (tokens)")
        ax.set_ylabel("prompt-token hit rate")
        ax.set_title(Path(self.source).name)
        ax.legend()
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        return f"plot written to {path}"


async def run_sweep(
    config: ReplayConfig, capacities: Sequence[Capacity], *, progress: bool = False
) -> SweepResult:
    """Replay ``config`` once per device capacity in ``capacities`` (see the module doc).

    Raises what :func:`~urc.apps.replay.run_replay` raises."""
    summary = await summarize(config, progress=progress)
    if summary.requests == 0:
        raise EmptyWorkloadError(f"{config.source_name}: the workload holds no request")
    points = []
    for i, cap in enumerate(capacities):
        if progress:
            print(f"sweep {i + 1}/{len(capacities)}: device {cap}", file=sys.stderr)
        report = await run_replay(
            replace(config, device_tokens=cap), progress=progress, summary=summary
        )
        points.append(SweepPoint(cap, report))
    return SweepResult(
        config.source_name, summary.unique_tokens, summary.ideal_hit_rate, tuple(points)
    )
