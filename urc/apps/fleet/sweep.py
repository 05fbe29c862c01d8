"""A sweep: fleet runs over replica counts and policies, with the two references per N.

For each N the workload is laid out once (agentic sessions arrive at
``session_concurrency_per_replica * N`` sessions on average: a fleet N times larger serves N
times the sessions) and replayed through:

* each policy on N replicas of the configured capacity;
* ``floor``: N replicas with random routing;
* ``bound``: one replica with N times the device and host capacity (the same shared L3):
  every request finds every prefix the fleet has seen, as one perfectly shared cache would.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from urc.apps.fleet.policy import RouterPolicy
from urc.apps.fleet.report import BOUND, FLOOR, FleetRun, FleetSweep
from urc.apps.fleet.run import FleetConfig, run_fleet
from urc.apps.replay.options import Capacity
from urc.apps.replay.source import agentic_workload, summarize

__all__ = ["echo_run", "run_sweep"]


def _scaled(capacity: Capacity, n: int) -> Capacity:
    if capacity.tokens is not None:
        return Capacity(tokens=capacity.tokens * n)
    assert capacity.fraction is not None, "a capacity is tokens or a fraction"
    return Capacity(fraction=capacity.fraction * n)


async def run_sweep(
    base: FleetConfig,
    replica_counts: Sequence[int],
    policies: Sequence[RouterPolicy],
    *,
    session_concurrency_per_replica: float,
    references: bool = True,
    echo: Callable[[FleetRun], None] | None = None,
) -> FleetSweep:
    """Every (N, policy) run plus, with ``references``, ``floor`` and ``bound`` per N;
    ``echo`` sees each run as it lands.  ``base`` gives everything else (its ``replicas``
    and ``policy`` are replaced)."""
    runs: list[FleetRun] = []
    notes: list[str] = []
    for n in replica_counts:
        replay = dataclasses.replace(
            base.replay, session_concurrency=session_concurrency_per_replica * n
        )
        summary = await summarize(replay)
        plan: list[FleetConfig] = []
        if references:
            plan.append(
                dataclasses.replace(
                    base,
                    replay=dataclasses.replace(
                        replay,
                        device_tokens=_scaled(replay.device_tokens, n),
                        host_tokens=_scaled(replay.host_tokens, n),
                    ),
                    replicas=1,
                    policy=RouterPolicy.ROUND_ROBIN,
                    label=BOUND,
                    fleet=n,
                )
            )
            if RouterPolicy.RANDOM not in policies:
                plan.append(
                    dataclasses.replace(
                        base, replay=replay, replicas=n, policy=RouterPolicy.RANDOM, label=FLOOR
                    )
                )
        plan.extend(
            dataclasses.replace(base, replay=replay, replicas=n, policy=p, label=None)
            for p in policies
        )
        for cfg in plan:
            run = await run_fleet(cfg, summary)
            runs.append(run)
            if echo is not None:
                echo(run)
        if replay.agentic:
            wl = agentic_workload(replay)
            notes.append(
                f"N={n}: {wl.sessions} sessions, {wl.requests:,} requests, Poisson arrivals at "
                f"{replay.session_concurrency:g} sessions on average; one cache token per "
                f"{wl.block_size}-token block"
            )
        else:
            notes.append(f"N={n}: {summary.requests:,} requests")
    source = str(base.replay.trace) if base.replay.trace else base.replay.workload.value
    return FleetSweep(Path(source).name if base.replay.trace else source, tuple(notes), tuple(runs))


def echo_run(run: FleetRun) -> None:
    """Print one run's headline to stderr (progress for long sweeps)."""
    print(
        f"urc fleet: N={run.fleet} {run.label}: hit {run.hit_rate:.4f} "
        f"(device {run.tier_rate('device'):.4f}, host {run.tier_rate('host'):.4f}, "
        f"L3 {run.tier_rate('storage'):.4f}), load max/mean {run.request_skew:.2f} req "
        f"{run.token_skew:.2f} tok, pred exact {run.exact_share:.1%}, "
        + (
            f"L3 {run.l3_pages_written} pages written, {run.l3_failures} failures, "
            if run.l3 != "none"
            else ""
        )
        + f"{run.wall_s:.1f} s",
        file=sys.stderr,
        flush=True,
    )
