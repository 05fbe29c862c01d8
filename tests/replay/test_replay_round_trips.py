"""What a request of ``urc replay`` costs in actor round trips: a host hit is one command
pair (the match that starts the load-back, the commit that re-matches), counted from every
command the actor applied (the service's trace hook), per request."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

import anyio
import pytest
from trace_paths import conversation_trace, requires_conversation_trace

from urc.apps.replay import Capacity, ReplayConfig, run_replay
from urc.node import Tier
from urc.service._commands import Command, CommandKind, MatchOutcome

# The commands a request sends before it prefills: its row, then its match (with a host hit,
# the load-back's commit too).
MATCH_PHASE = {CommandKind.MATCH_REQ, CommandKind.FINISH_REQ_LOAD}


async def _per_request(config: ReplayConfig) -> tuple[dict[str, list[Any]], Any]:
    """Every command of each request (by ``rid``), with the match outcomes, and the report."""
    seen: dict[str, list[tuple[CommandKind, Any]]] = defaultdict(list)

    def trace(cmd: Command, result: Any, error: BaseException | None) -> None:
        req = getattr(cmd, "req", None)
        if req is not None:
            seen[req.rid].append((cmd.kind, result))

    with anyio.fail_after(120):
        report = await run_replay(config, trace=trace)
    return seen, report


def _config(trace: Path | None) -> ReplayConfig:
    return ReplayConfig(
        trace=trace,
        num_requests=300,
        device_tokens=Capacity(fraction=0.05),
        host_tokens=Capacity(fraction=1.0),
        concurrency=8,
    )


async def _check_one_pair_per_host_hit(config: ReplayConfig) -> None:
    seen, report = await _per_request(config)
    host_hits = 0
    loaded = 0
    for rid, commands in seen.items():
        kinds = [k for k, _ in commands]
        assert kinds[0] is CommandKind.ALLOC_REQ_ROW, rid
        match = [k for k in kinds if k in MATCH_PHASE]
        assert kinds[1 : 1 + len(match)] == match, f"{rid}: the match is not one sequence"
        assert match in (
            [CommandKind.MATCH_REQ],
            [CommandKind.MATCH_REQ, CommandKind.FINISH_REQ_LOAD],
        )
        assert CommandKind.CALL not in kinds, f"{rid}: the driver went around the API"
        if len(match) == 2:
            commit = commands[2][1]
            assert isinstance(commit, MatchOutcome)
            host_hits += commit.host_loaded_len > 0
            loaded += commit.host_loaded_len
    assert host_hits > 0, "the workload was meant to hit the host tier"
    assert report.hit_tokens[Tier.HOST] == loaded
    assert report.check_ok, report.check_error


@pytest.mark.asyncio
async def test_a_synthetic_host_hit_costs_one_round_trip_pair() -> None:
    await _check_one_pair_per_host_hit(_config(None))


@requires_conversation_trace
@pytest.mark.asyncio
async def test_a_conversation_trace_host_hit_costs_one_round_trip_pair() -> None:
    await _check_one_pair_per_host_hit(_config(conversation_trace()))
