"""Pairs of live servers (default cache, urc) and the checks every live case makes.

``ServerPool.pair(config)`` starts a default-cache and a urc server of one configuration side
by side and keeps them for every case that asks for the same configuration; a pair of
another configuration replaces it (at most two servers run at once).  ``run_both`` sends a
workload to both at once; ``finish_case`` reads their leak reports and KV events into the
:class:`Comparison` and reports it; ``assert_same`` checks it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from live_server import Comparison, GenResult, LiveServer, ServerConfig
from side_env import SideEnv

__all__ = [
    "CHECKOUT",
    "ServerPair",
    "ServerPool",
    "assert_same",
    "event_counts",
    "finish_case",
    "run_both",
]

CHECKOUT = Path(__file__).resolve().parent.parent.parent


@dataclass
class ServerPair:
    """A default-cache and a urc server of one configuration, started side by side."""

    config: ServerConfig
    default: LiveServer
    urc: LiveServer
    # KV events each published before the first case (its start-up and warm-up request)
    startup_events: dict[str, list[tuple[str, int]]] = field(default_factory=dict)

    def stop(self) -> None:
        self.default.stop()
        self.urc.stop()


class ServerPool:
    """Keeps the one pair of the configuration the cases ask for now."""

    def __init__(self, side: SideEnv, scratch: Path) -> None:
        self.side = side
        self.scratch = scratch
        self.current: ServerPair | None = None
        self.cpu_used = 0.0  # CPU seconds of the servers stopped so far
        self.started = 0

    def pair(self, config: ServerConfig) -> ServerPair:
        if self.current is not None and self.current.config == config:
            return self.current
        self.close()
        configs = (config.with_backend("default"), config.with_backend("urc"))
        with ThreadPoolExecutor(2) as pool:
            futures = [
                pool.submit(LiveServer, self.side, c, CHECKOUT, self.scratch) for c in configs
            ]
            started = [f.exception() or f.result() for f in futures]
        failed = [s for s in started if isinstance(s, BaseException)]
        if failed:
            for s in started:
                if isinstance(s, LiveServer):
                    s.stop()
            raise failed[0]
        default, urc = started
        self.started += 2
        assert isinstance(default, LiveServer) and isinstance(urc, LiveServer)
        pair = ServerPair(config, default, urc)
        if config.kv_events:
            pair.startup_events = {"default": default.take_events(), "urc": urc.take_events()}
        self.current = pair
        return pair

    def close(self) -> None:
        if self.current is not None:
            self.current.stop()
            self.cpu_used += self.current.default.cpu_used + self.current.urc.cpu_used
            self.current = None


def event_counts(events: list[tuple[str, int]]) -> dict[str, int]:
    counts: Counter[str] = Counter()
    for kind, blocks in events:
        counts[kind] += 1
        counts[f"{kind} blocks"] += blocks
    return dict(sorted(counts.items()))


def finish_case(
    pair: ServerPair, cmp: Comparison, report: Callable[[str], None]
) -> tuple[dict[str, int], dict[str, int]]:
    """Settle both servers, add leak reports and KV event counts to ``cmp``, report it."""
    for server in (pair.default, pair.urc):
        server.settle()
    leaks = (pair.default.leak_reports(), pair.urc.leak_reports())
    cmp.extra["leak reports"] = (len(leaks[0]), len(leaks[1]))
    counts: tuple[dict[str, int], dict[str, int]] = ({}, {})
    if pair.config.kv_events:
        counts = (
            event_counts(pair.default.take_events()),
            event_counts(pair.urc.take_events()),
        )
        cmp.extra["events"] = counts
    report(f"[{pair.config.label}] {cmp.summary()}")
    if cmp.requests_ok != (len(cmp.default), len(cmp.urc)):
        # a failed request is explained by the server's own log, not by the client's error
        for server in (pair.default, pair.urc):
            report(f"[{pair.config.label}] {server.config.backend} log: {server.last_error()}")
    assert leaks == ([], []), f"leak reports: {leaks}"
    return counts


def run_both(
    pair: ServerPair, run: Callable[[LiveServer], list[GenResult]]
) -> tuple[list[GenResult], list[GenResult]]:
    """``run`` against both servers at once (each server is one scheduler process)."""
    if pair.config.kv_events:  # a case counts its own events, whatever the last one left
        pair.default.take_events()
        pair.urc.take_events()
    with ThreadPoolExecutor(2) as pool:
        default, urc = pool.submit(run, pair.default), pool.submit(run, pair.urc)
        return default.result(), urc.result()


def assert_same(cmp: Comparison, *, cached: bool = True) -> None:
    d_ok, u_ok = cmp.requests_ok
    assert d_ok == u_ok == len(cmp.default), cmp.mismatches()
    assert cmp.outputs_equal, cmp.mismatches()
    if cached:
        assert cmp.cached_equal, cmp.mismatches()
