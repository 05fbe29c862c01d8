"""What a fleet run measured, and the tables, JSON and plot of a sweep.

Per run (:class:`FleetRun`): the hit rate by tier (prompt tokens served from the replicas'
device and host tiers and from the shared L3, over all prompt tokens), per-replica load
(requests and prompt tokens: max over mean), the router's accuracy (per request, the overlap
its index predicted on the chosen replica against what that replica actually had: exact,
over- and under-predicted shares, and the mean error in prompt shares; and the share exact
when the overlap is read again as the replica starts the request), the event lag
(publish to apply, p50/p99/max), what the subscriber recovered (gaps, batches replayed), and
the L3 pages written and the L3 failures (storage calls that failed plus writes
dropped: a run with failures reads L3 hits as a lower bound, and its row says so), and the
wall time.

A sweep (:class:`FleetSweep`) holds the runs over N and policies with, per N, two
references: ``bound`` (one replica with N times the capacity: what a fleet that shared one
cache perfectly would hit) and ``floor`` (N replicas with random routing).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

__all__ = ["BOUND", "FLOOR", "FleetRun", "FleetSweep"]

BOUND = "bound"
"""The label of the one-cache-of-N-times-the-capacity reference."""
FLOOR = "floor"
"""The label of the N-caches-with-random-routing reference."""


@dataclass(frozen=True, slots=True)
class FleetRun:
    """One run's figures (see the module docstring).  Token counts are cache tokens (for
    agentic sessions one cache token is one ``token_unit``-token block).  ``fleet`` is the N
    the run belongs to; ``replicas`` what it ran (1 for the bound)."""

    label: str
    policy: str
    fleet: int
    replicas: int
    device_tokens: int
    host_tokens: int
    l3: str
    token_unit: int
    requests: int
    input_tokens: int
    hit_tokens: dict[str, int]
    ideal_hit_rate: float
    replica_requests: list[int]
    replica_prompt_tokens: list[int]
    rejected: int
    predicted_tokens: int
    actual_tokens: int
    exact_share: float
    over_share: float
    under_share: float
    mean_abs_error: float
    exact_share_at_serve: float
    lag_ms_p50: float
    lag_ms_p99: float
    lag_ms_max: float
    event_batches: int
    events: int
    gaps: int
    replayed_batches: int
    dropped_batches: int
    lost_batches: int
    l3_pages_written: int
    l3_failures: int
    wall_s: float
    total_s: float
    check_errors: list[str]

    @property
    def hit_rate(self) -> float:
        return sum(self.hit_tokens.values()) / self.input_tokens if self.input_tokens else 0.0

    def tier_rate(self, tier: str) -> float:
        return self.hit_tokens.get(tier, 0) / self.input_tokens if self.input_tokens else 0.0

    @property
    def request_skew(self) -> float:
        """Max over mean requests per replica (1.0: perfectly even)."""
        return _skew(self.replica_requests)

    @property
    def token_skew(self) -> float:
        """Max over mean prompt tokens per replica."""
        return _skew(self.replica_prompt_tokens)

    @property
    def ok(self) -> bool:
        return not self.check_errors

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["hit_rate"] = self.hit_rate
        out["request_skew"] = self.request_skew
        out["token_skew"] = self.token_skew
        return out


def _skew(values: Sequence[int]) -> float:
    mean = sum(values) / len(values) if values else 0.0
    return max(values) / mean if mean > 0 else 1.0


@dataclass(frozen=True, slots=True)
class FleetSweep:
    """Runs over N and policies (references included), with what they ran on."""

    source: str
    notes: tuple[str, ...]
    runs: tuple[FleetRun, ...]

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.runs)

    def bound(self, replicas: int) -> FleetRun | None:
        return next((r for r in self.runs if r.fleet == replicas and r.label == BOUND), None)

    def to_dict(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "notes": list(self.notes),
            "runs": [r.to_dict() for r in self.runs],
        }

    def format(self) -> str:
        """A Markdown table: one row per run, grouped by N."""
        head = (
            "| N | policy | hit | device | host | L3 | of bound | req max/mean "
            "| tok max/mean | pred exact | over | under | mean err | exact at serve "
            "| lag p50/p99 ms | gaps/replayed | wall s |"
        )
        out = [f"workload: {self.source}", *(f"note: {n}" for n in self.notes), "", head]
        out.append("|" + "---|" * 17)
        for r in self.runs:
            bound = self.bound(r.fleet)
            share = f"{r.hit_rate / bound.hit_rate:.3f}" if bound and bound.hit_rate else "-"
            ok = "" if r.ok else " (check FAILED)"
            if r.l3_failures:
                ok += f" ({r.l3_failures} L3 failures)"
            out.append(
                f"| {r.fleet} | {r.label}{ok} | {r.hit_rate:.4f} | {r.tier_rate('device'):.4f} "
                f"| {r.tier_rate('host'):.4f} | {r.tier_rate('storage'):.4f} | {share} "
                f"| {r.request_skew:.2f} | {r.token_skew:.2f} | {r.exact_share:.1%} "
                f"| {r.over_share:.1%} | {r.under_share:.1%} | {r.mean_abs_error:.2%} "
                f"| {r.exact_share_at_serve:.1%} "
                f"| {r.lag_ms_p50:.1f}/{r.lag_ms_p99:.1f} | {r.gaps}/{r.replayed_batches} "
                f"| {r.wall_s:.1f} |"
            )
        return "\n".join(out)

    def write_png(self, path: Path) -> str:
        """Hit rate per policy against N, the references dashed; returns a one-line note."""
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            return f"no plot written to {path}: matplotlib is not installed"
        fig, ax = plt.subplots(figsize=(7, 4.5))
        labels = sorted({r.label for r in self.runs})
        for label in labels:
            pts = sorted((r.fleet, r.hit_rate) for r in self.runs if r.label == label)
            style = "--" if label in (BOUND, FLOOR) else "-"
            ax.plot([p[0] for p in pts], [p[1] for p in pts], style, marker="o", label=label)
        ax.set_xlabel("replicas (N)")
        ax.set_ylabel("prompt-token hit rate (all tiers)")
        ax.set_title(Path(self.source).name)
        ax.grid(True, alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)
        return f"plot written to {path}"
