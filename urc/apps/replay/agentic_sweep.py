"""The agentic eviction table: policies x device capacities on a set of agent sessions.

``python -m urc.apps.replay.agentic_sweep SESSIONS`` replays the sessions
(:mod:`urc.apps.workloads.agentic`: a directory or ``.tar.xz`` of session files) once per
policy and capacity, device tier only, one request at a time in arrival order (a cache
simulation: no request holds memory while another is served), prompts only, and prints a
Markdown table: token hit rate, prompt tokens recomputed per request (p50, p99), the replay's
wall time, and for each online policy the share of the LRU -> Belady gap it closes.

Capacities and token counts are in tokens (the replay counts 64-token blocks; see the
workload module).  ``--subset k/n`` replays every n-th session from the k-th (tune on one
half, check on the other); ``--concurrency`` is the mean number of sessions running.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import anyio

from urc.apps.replay.config import ReplayConfig
from urc.apps.replay.driver import run_replay
from urc.apps.replay.options import Capacity
from urc.apps.replay.source import agentic_workload, summarize
from urc.eviction_policy import EvictionPolicy

__all__ = [
    "TLRU_NEXT_PROMPT_TOKENS",
    "TLRU_THRESHOLD_TOKENS",
    "SweepRow",
    "main",
    "parse_tokens",
    "sweep",
    "table",
]

# TLRU's parameters for the table, in tokens (SGLang's defaults, 0 and 0, make it LRU): a
# conversation keeps its history minus 4096 tokens plus a 1024-token next prompt.
TLRU_THRESHOLD_TOKENS = 4096
TLRU_NEXT_PROMPT_TOKENS = 1024


@dataclass(frozen=True, slots=True)
class SweepRow:
    """One replay: policy, capacity (tokens), hit rate, recomputed tokens, wall seconds."""

    policy: str
    capacity_tokens: int
    hit_rate: float
    recomputed_p50: int
    recomputed_p99: int
    wall_s: float
    check_ok: bool


def parse_tokens(text: str) -> int:
    """``"512k"``, ``"1M"``, ``"1.5M"``, ``"65536"`` -> tokens."""
    t = text.strip().upper()
    scale = {"K": 1 << 10, "M": 1 << 20}.get(t[-1:], 1)
    if scale != 1:
        t = t[:-1]
    return round(float(t) * scale)


def _config(
    sessions: Path,
    policy: EvictionPolicy,
    blocks: int,
    concurrency: float,
    subset: tuple[int, int] | None,
    seed: int,
    block: int,
) -> ReplayConfig:
    return ReplayConfig(
        trace=sessions,
        page_size=1,
        chunk_size=1 << 20,
        concurrency=1,
        prefill_only=True,
        device_tokens=Capacity(tokens=blocks),
        host_tokens=Capacity(tokens=0),
        eviction_policy=policy,
        session_concurrency=concurrency,
        session_subset=subset,
        seed=seed,
        tlru_threshold=-(-TLRU_THRESHOLD_TOKENS // block),
        tlru_next_prompt_estimate=-(-TLRU_NEXT_PROMPT_TOKENS // block),
    )


def sweep(
    sessions: Path,
    policies: list[EvictionPolicy],
    capacities: list[int],
    *,
    concurrency: float = 100.0,
    subset: tuple[int, int] | None = None,
    seed: int = 0,
    echo: bool = True,
) -> list[SweepRow]:
    """Replay every (capacity, policy); ``echo`` prints each row to stderr as it lands."""
    probe = _config(sessions, EvictionPolicy.LRU, 1, concurrency, subset, seed, 1)
    block = agentic_workload(probe).block_size or 1
    summary = anyio.run(summarize, probe)  # one first pass serves every replay
    rows = []
    for cap in capacities:
        for policy in policies:
            blocks = max(1, cap // block)
            cfg = _config(sessions, policy, blocks, concurrency, subset, seed, block)
            rep = anyio.run(partial(run_replay, cfg, summary=summary))
            row = SweepRow(
                policy.value,
                cap,
                rep.hit_rate,
                rep.recomputed_p50 * block,
                rep.recomputed_p99 * block,
                rep.wall_time_s,
                rep.check_ok,
            )
            rows.append(row)
            if echo:
                print(row, file=sys.stderr, flush=True)
    return rows


def _size(tokens: int) -> str:
    return f"{tokens / (1 << 20):g}M" if tokens >= 1 << 19 else f"{tokens / 1024:g}k"


def table(rows: list[SweepRow]) -> str:
    """The Markdown table of ``rows`` (a gap column where LRU and Belady both ran)."""
    by = {(r.policy, r.capacity_tokens): r for r in rows}
    out = [
        "| capacity | policy | hit rate | recomputed p50 | recomputed p99 | wall s "
        "| share of LRU->Belady gap |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lru = by.get(("lru", r.capacity_tokens))
        opt = by.get(("belady", r.capacity_tokens))
        share = ""
        if lru is not None and opt is not None and r.policy != "belady":
            gap = opt.hit_rate - lru.hit_rate
            share = f"{(r.hit_rate - lru.hit_rate) / gap:+.0%}" if gap > 0 else "n/a"
        ok = "" if r.check_ok else " (check FAILED)"
        out.append(
            f"| {_size(r.capacity_tokens)} | {r.policy}{ok} | {r.hit_rate:.4f} "
            f"| {r.recomputed_p50:,} | {r.recomputed_p99:,} | {r.wall_s:.1f} | {share} |"
        )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("sessions", type=Path, help="a directory or .tar.xz of session files")
    ap.add_argument("--capacities", default="0.5M,1M,2M,4M", help="device tokens, comma list")
    ap.add_argument(
        "--policies",
        default="lru,tlru,slru,session-aware,belady",
        help="eviction policies, comma list",
    )
    ap.add_argument("--concurrency", type=float, default=100.0, help="mean sessions running")
    ap.add_argument("--subset", default=None, help="k/n: every n-th session from the k-th")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    subset = None
    if args.subset:
        k, n = args.subset.split("/")
        subset = (int(k), int(n))
    rows = sweep(
        args.sessions,
        [EvictionPolicy(p) for p in args.policies.split(",")],
        [parse_tokens(c) for c in args.capacities.split(",")],
        concurrency=args.concurrency,
        subset=subset,
        seed=args.seed,
    )
    print(table(rows))
    return 0 if all(r.check_ok for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
