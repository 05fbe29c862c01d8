"""The result of a replay: counts, hit rates by tier, cache events, client-side op latencies.

:class:`ReplayReport` is what :func:`urc.apps.replay.run_replay` returns;
:meth:`ReplayReport.to_dict` is the ``--json`` document (stable keys, plain JSON types) and
:meth:`ReplayReport.format` the text the command prints.

Hit tokens are counted by the client, per request, at admission: ``device`` is the prefix the
first match found on device, ``host`` what loading the host hit back added to it (HiCache),
``storage`` what a prefetch from the L3 store (``--l3-dir``) added past the host hit.  Hit
rates are over the prompt tokens of every request (served or rejected).  The core's own
counters (``cache.stats().hit_tokens``) count every match, including the ones the load-back
path makes internally, so they are reported separately as ``core_match_hit_tokens``.

The ideal hit rate (:data:`IDEAL_SCOPE`) is that of an unbounded full-attention prefix cache
that starts empty and caches prompts only, at the replay's page size: a Mamba or SWA model
stays below it (its states or window KV are not kept everywhere), and a run over an L3 store
that earlier runs filled can exceed it.

Everything that depends on the machine's speed is under ``"timings"`` in :meth:`to_dict`;
the rest of the document is a function of the config alone when ``deterministic`` is true.
"""

from __future__ import annotations

import math
from array import array
from dataclasses import dataclass, field
from typing import Any

from urc.node import Tier

__all__ = ["IDEAL_SCOPE", "TIERS", "LatencyRecorder", "LatencySummary", "ReplayReport"]

TIERS = tuple(Tier)


def _name(tier: Tier) -> str:
    """A tier's key in the JSON report ("device", "host", "storage")."""
    return tier.name.lower()


IDEAL_SCOPE = "unbounded full-attention cache, empty at start, prompts only"


@dataclass(frozen=True, slots=True)
class LatencySummary:
    """Latency percentiles of one operation kind, in microseconds (nearest-rank)."""

    count: int
    p50_us: float
    p99_us: float
    max_us: float
    mean_us: float

    def to_dict(self) -> dict[str, float | int]:
        return {
            "count": self.count,
            "p50_us": round(self.p50_us, 1),
            "p99_us": round(self.p99_us, 1),
            "max_us": round(self.max_us, 1),
            "mean_us": round(self.mean_us, 1),
        }


def _rank(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile ``q`` (0..1) of a sorted, non-empty list."""
    i = max(0, math.ceil(q * len(sorted_values)) - 1)
    return sorted_values[i]


class LatencyRecorder:
    """Per-kind latency samples (seconds) measured by the client around each await."""

    __slots__ = ("_samples",)

    def __init__(self) -> None:
        self._samples: dict[str, array[float]] = {}

    def add(self, kind: str, seconds: float) -> None:
        s = self._samples.get(kind)
        if s is None:
            s = self._samples[kind] = array("d")
        s.append(seconds)

    def summary(self) -> dict[str, LatencySummary]:
        out: dict[str, LatencySummary] = {}
        for kind, s in self._samples.items():
            v = sorted(s)
            us = 1e6
            out[kind] = LatencySummary(
                len(v), _rank(v, 0.50) * us, _rank(v, 0.99) * us, v[-1] * us, sum(v) / len(v) * us
            )
        return out


@dataclass(frozen=True, slots=True)
class ReplayReport:
    """Everything a replay measured (see the module docstring)."""

    source: str
    model: str
    page_size: int
    chunk_size: int
    concurrency: int
    prefill_only: bool
    write_policy: str | None
    eviction_policy: str
    l3: str | None
    device_tokens: int
    host_tokens: int
    swa_window: int | None
    swa_tokens: int | None
    mamba_states: int | None
    deterministic: bool
    unique_tokens: int
    ideal_hit_rate: float
    requests_total: int
    requests_done: int
    requests_rejected: int
    input_tokens: int
    output_tokens: int
    hit_tokens: dict[Tier, int]
    evicted: dict[str, int]
    backed_up_tokens: int
    loaded_back_tokens: int
    core_match_hit_tokens: dict[Tier, int]
    storage_stats: dict[str, int]
    latency: dict[str, LatencySummary]
    setup_time_s: float
    wall_time_s: float
    flush_time_s: float
    total_time_s: float
    check_ok: bool
    check_error: str | None = None
    # Per request, prompt tokens no tier served (recomputed), nearest-rank percentiles.
    recomputed_p50: int = 0
    recomputed_p99: int = 0
    notes: tuple[str, ...] = field(default_factory=tuple)
    warnings: tuple[str, ...] = field(default_factory=tuple)
    # From ``urc``'s main to the start of setup: imports of torch, the cache, the service
    # (set by the command line; ``None`` for a run_replay call).
    startup_time_s: float | None = None
    # Prompt tokens per cache token: 1, or an agentic replay's block size (its token counts
    # are blocks; its capacities were given in tokens and divided by this).
    token_unit: int = 1

    @property
    def served_nothing(self) -> bool:
        """No request was served (every one was rejected for lack of memory)."""
        return self.requests_done == 0

    @property
    def hit_rate(self) -> float:
        """Prompt tokens served from any tier over all prompt tokens."""
        return sum(self.hit_tokens.values()) / self.input_tokens if self.input_tokens else 0.0

    def tier_hit_rate(self, tier: Tier) -> float:
        return self.hit_tokens.get(tier, 0) / self.input_tokens if self.input_tokens else 0.0

    def to_dict(self) -> dict[str, Any]:
        """The machine-readable report (what ``--json`` writes; every field is described in
        the README's "The JSON report" section, which tests/test_readme.py keeps complete)."""
        return {
            "source": self.source,
            "config": {
                "model": self.model,
                "page_size": self.page_size,
                "chunk_size": self.chunk_size,
                "concurrency": self.concurrency,
                "prefill_only": self.prefill_only,
                "write_policy": self.write_policy,
                "eviction_policy": self.eviction_policy,
                "device_tokens": self.device_tokens,
                "host_tokens": self.host_tokens,
                "token_unit": self.token_unit,
                "swa_window": self.swa_window,
                "swa_tokens": self.swa_tokens,
                "mamba_states": self.mamba_states,
                "l3": self.l3,
                "deterministic": self.deterministic,
            },
            "workload": {
                "unique_tokens": self.unique_tokens,
                "ideal_hit_rate": self.ideal_hit_rate,
                "ideal_scope": IDEAL_SCOPE,
            },
            "requests": {
                "total": self.requests_total,
                "done": self.requests_done,
                "rejected": self.requests_rejected,
            },
            "tokens": {
                "input": self.input_tokens,
                "output": self.output_tokens,
                "hit": {_name(t): self.hit_tokens.get(t, 0) for t in TIERS},
            },
            "hit_rate": {
                "overall": self.hit_rate,
                **{_name(t): self.tier_hit_rate(t) for t in TIERS},
            },
            "recomputed_per_request": {"p50": self.recomputed_p50, "p99": self.recomputed_p99},
            "evicted": dict(self.evicted),
            "backed_up_tokens": self.backed_up_tokens,
            "loaded_back_tokens": self.loaded_back_tokens,
            "core_match_hit_tokens": {_name(t): n for t, n in self.core_match_hit_tokens.items()},
            "storage": dict(self.storage_stats),
            "check": {"ok": self.check_ok, "error": self.check_error},
            "warnings": list(self.warnings),
            "notes": list(self.notes),
            "timings": {
                "startup_s": self.startup_time_s,
                "setup_s": self.setup_time_s,
                "replay_s": self.wall_time_s,
                "flush_s": self.flush_time_s,
                "total_s": self.total_time_s,
                "latency_us": {k: v.to_dict() for k, v in self.latency.items()},
            },
        }

    def _size(self, units: int) -> str:
        """A pool size in the report's units, and in tokens when those are blocks."""
        if self.token_unit == 1:
            return f"{units:,} tokens"
        return f"{units:,} blocks of {self.token_unit} tokens ({units * self.token_unit:,} tokens)"

    def format(self) -> str:
        """The human-readable report."""
        pct = "{:6.2%}".format
        host = self._size(self.host_tokens) if self.host_tokens else "off"
        model = self.model
        if self.swa_window is not None:
            model += f" (window {self.swa_window:,}, SWA pool {self.swa_tokens:,} tokens)"
        if self.mamba_states is not None:
            model += f" ({self.mamba_states:,} state slots)"
        lines = [
            f"urc replay: {self.source}",
            f"  model {model}, page {self.page_size}, chunk {self.chunk_size}, "
            f"concurrency {self.concurrency}" + (", prefill-only" if self.prefill_only else ""),
            f"  device {self._size(self.device_tokens)} ({self.eviction_policy}), host {host}"
            + (f" ({self.write_policy})" if self.write_policy else "")
            + (f", L3 {self.l3}" if self.l3 else "")
            + f"; unique prompt tokens {self.unique_tokens:,}"
            + ("" if self.deterministic else "; not deterministic"),
            f"requests   {self.requests_total:,} ({self.requests_done:,} done, "
            f"{self.requests_rejected:,} rejected)",
            f"tokens     input {self.input_tokens:,}, output {self.output_tokens:,}",
            f"hit rate   {pct(self.hit_rate)}  (device {pct(self.tier_hit_rate(Tier.DEVICE))}, "
            f"host {pct(self.tier_hit_rate(Tier.HOST))}, "
            f"storage {pct(self.tier_hit_rate(Tier.STORAGE))})",
            f"ideal      {pct(self.ideal_hit_rate)}  ({IDEAL_SCOPE})",
            f"recomputed per request: p50 {self.recomputed_p50:,}, p99 "
            f"{self.recomputed_p99:,} prompt tokens",
            *(
                [
                    f"host tier  +{self.tier_hit_rate(Tier.HOST) * 100:.2f} points of hit rate "
                    f"(prompt tokens loaded back from host instead of recomputed)"
                ]
                if self.host_tokens
                else []
            ),
            "evicted    "
            + (", ".join(f"{k} {v:,}" for k, v in sorted(self.evicted.items())) or "none"),
            f"backed up  {self.backed_up_tokens:,} tokens, loaded back "
            f"{self.loaded_back_tokens:,} tokens",
            *(
                ["L3         " + ", ".join(f"{k} {v:,}" for k, v in self.storage_stats.items())]
                if self.storage_stats
                else []
            ),
            "latency    (us, call to reply)        count       p50       p99       max",
        ]
        for kind, s in self.latency.items():
            lines.append(
                f"  {kind:<28} {s.count:>9,} {s.p50_us:>9.1f} {s.p99_us:>9.1f} {s.max_us:>9.1f}"
            )
        if self.concurrency > 1 and self.latency:
            lines += [
                f"           each call waits behind the commands of the other "
                f"{self.concurrency - 1} requests in flight,",
                "           so the rows measure that queue; --concurrency 1 gives each "
                "command's own cost",
            ]
        startup = (
            f"start-up (imports) {self.startup_time_s:.2f} s + "
            if self.startup_time_s is not None
            else ""
        )
        total = self.total_time_s + (self.startup_time_s or 0.0)
        flush = f" + L3 flush {self.flush_time_s:.2f} s" if self.l3 else ""
        lines.append(
            f"wall time  {self.wall_time_s:.2f} s replay (total {total:.2f} s: "
            f"{startup}setup {self.setup_time_s:.2f} s + replay{flush})"
        )
        check = "ok" if self.check_ok else f"FAILED: {self.check_error}"
        lines.append(f"check      sanity_check + pool conservation: {check}")
        lines.extend(f"WARNING    {w}" for w in self.warnings)
        lines.extend(f"note       {n}" for n in self.notes)
        return "\n".join(lines)
