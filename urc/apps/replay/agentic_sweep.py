"""The agentic eviction table: policies x device capacities on a set of agent sessions.

``python -m urc.apps.replay.agentic_sweep SESSIONS`` replays the sessions
(:mod:`urc.apps.workloads.agentic`: a directory or ``.tar.xz`` of session files) once per
policy and capacity, device tier only, one request at a time in arrival order (a cache
simulation: no request holds memory while another is served), prompts only, and prints a
Markdown table: token hit rate, prompt tokens recomputed per request (p50, p99), the replay's
wall time, and for each online policy the share of the LRU -> Belady gap it closes.

Capacities and token counts are in tokens, as everywhere (the replay counts 64-token blocks
and divides a capacity by the block size; see the workload module).  ``--subset k/n`` replays
every n-th session from the k-th (tune on one half, check on the other); ``--concurrency`` is
the mean number of sessions running.

Usage errors are one line naming the flag, exit status 2, before torch or the sessions are
loaded (as ``urc replay``'s).
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

from urc.apps.replay.arguments import Parser
from urc.apps.replay.options import EVICTION_POLICY_VALUES, Capacity

if TYPE_CHECKING:
    from urc.apps.replay.config import ReplayConfig
    from urc.eviction_policy import EvictionPolicy

__all__ = [
    "TLRU_NEXT_PROMPT_TOKENS",
    "TLRU_THRESHOLD_TOKENS",
    "SweepRow",
    "build_parser",
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
    """``"512k"``, ``"1M"``, ``"1.5M"``, ``"65536"`` -> tokens (``k`` is 1024, ``M`` 1024**2).

    Raises ``ValueError`` naming ``text`` unless it is a token count above 0."""
    t = text.strip().upper()
    scale = {"K": 1 << 10, "M": 1 << 20}.get(t[-1:], 1)
    if scale != 1:
        t = t[:-1]
    try:
        value = float(t) * scale
    except ValueError:
        raise ValueError(f"not a token count (65536, 512k, 1.5M): {text!r}") from None
    if not (math.isfinite(value) and round(value) > 0):
        raise ValueError(f"a capacity must be at least 1 token, got {text!r}")
    return round(value)


def _config(
    sessions: Path,
    policy: EvictionPolicy,
    tokens: int,
    concurrency: float,
    subset: tuple[int, int] | None,
    seed: int,
    block: int,
) -> ReplayConfig:
    from urc.apps.replay.config import ReplayConfig
    from urc.eviction_policy import EvictionPolicy

    return ReplayConfig(
        trace=sessions,
        page_size=1,
        chunk_size=1 << 20,
        concurrency=1,
        prefill_only=True,
        device_tokens=Capacity(tokens=tokens),  # divided by the block size
        host_tokens=Capacity(tokens=0),
        eviction_policy=policy,
        session_concurrency=concurrency,
        session_subset=subset,
        seed=seed,
        eviction_params=(
            {
                "threshold": -(-TLRU_THRESHOLD_TOKENS // block),
                "next_prompt_estimate": -(-TLRU_NEXT_PROMPT_TOKENS // block),
            }
            if policy is EvictionPolicy.TLRU
            else {}
        ),
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
    import anyio

    from urc.apps.replay.driver import run_replay
    from urc.apps.replay.source import agentic_workload, summarize
    from urc.eviction_policy import EvictionPolicy

    probe = _config(sessions, EvictionPolicy.LRU, 1, concurrency, subset, seed, 1)
    block = agentic_workload(probe).block_size or 1
    summary = anyio.run(summarize, probe)  # one first pass serves every replay
    rows = []
    for cap in capacities:
        for policy in policies:
            cfg = _config(sessions, policy, cap, concurrency, subset, seed, block)
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


def _capacities(text: str) -> list[int]:
    try:
        caps = [parse_tokens(c) for c in text.split(",") if c.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if not caps:
        raise argparse.ArgumentTypeError("give at least one capacity")
    return caps


def _policies(text: str) -> list[str]:
    names = [p.strip() for p in text.split(",") if p.strip()]
    unknown = [p for p in names if p not in EVICTION_POLICY_VALUES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown policy {', '.join(map(repr, unknown)) or repr(text)} "
            f"(choose from {', '.join(EVICTION_POLICY_VALUES)})"
        )
    return names


def _subset(text: str) -> tuple[int, int]:
    k, sep, n = text.partition("/")
    if not (sep and k.strip().isdigit() and n.strip().isdigit()) or not 0 <= int(k) < int(n):
        raise argparse.ArgumentTypeError(f"must be k/n with 0 <= k < n, got {text!r}")
    return int(k), int(n)


def _concurrency(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The command line's parser (imports neither torch nor the sessions)."""
    ap = Parser(
        prog="python -m urc.apps.replay.agentic_sweep",
        description=(__doc__ or "").splitlines()[0],
    )
    ap.add_argument(
        "sessions", metavar="SESSIONS", type=Path, help="a directory or .tar.xz of session files"
    )
    ap.add_argument(
        "--capacities",
        type=_capacities,
        default="0.5M,1M,2M,4M",
        help="device capacities in tokens, comma list (k = 1024, M = 1024**2)",
    )
    ap.add_argument(
        "--policies",
        type=_policies,
        default="lru,tlru,slru,session-aware,return-time,belady",
        help="eviction policies, comma list",
    )
    ap.add_argument("--concurrency", type=_concurrency, default=100.0, help="mean sessions running")
    ap.add_argument(
        "--subset", type=_subset, default=None, help="k/n: every n-th session from the k-th"
    )
    ap.add_argument("--seed", type=int, default=0)
    return ap


def _sessions_problem(path: Path) -> str | None:
    from urc.apps.workloads.agentic import is_session_archive  # asyncio, no torch

    if not path.exists():
        return f"{path}: no such file or directory"
    if not is_session_archive(path):
        return f"{path} is not a directory or a tar archive of session files"
    if path.is_dir() and not any(path.glob("*.json")):
        return f"{path} is a directory without session files (*.json)"
    return None


def main(argv: Sequence[str] | None = None) -> int:
    """Parse, check (usage errors: one line, exit 2), then run; returns the exit status."""
    ap = build_parser()
    args = ap.parse_args(argv)
    if (problem := _sessions_problem(args.sessions)) is not None:
        ap.error(f"argument SESSIONS: {problem}")
    from urc.eviction_policy import EvictionPolicy

    rows = sweep(
        args.sessions,
        [EvictionPolicy(p) for p in args.policies],
        args.capacities,
        concurrency=args.concurrency,
        subset=args.subset,
        seed=args.seed,
    )
    print(table(rows))
    return 0 if all(r.check_ok for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
