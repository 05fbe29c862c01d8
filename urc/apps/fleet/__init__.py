"""Fleet replay: a trace through N urc replicas behind a KV-event router, with a shared L3.

``urc fleet`` (:mod:`urc.apps.fleet.cli`) answers the questions a fleet raises that a single
replay cannot: how much cache-aware routing gains over round-robin, what a shared L3 adds,
how the hit rate falls as replicas are added, how stale the router's view is.

The parts are real: each replica is urc's async service over its own cache
(:mod:`~urc.apps.fleet.replica`), publishing its KV events on its own loopback ZMQ endpoint in
SGLang's wire format; the router (:mod:`~urc.apps.fleet.subscriber`,
:mod:`~urc.apps.fleet.index`, :mod:`~urc.apps.fleet.policy`) knows only what those events told
it and recovers lost batches through each replica's replay socket; the L3 is a real store
shared by all replicas (:mod:`~urc.apps.fleet.store`).  :mod:`~urc.apps.fleet.run` runs one
configuration, :mod:`~urc.apps.fleet.sweep` a table over N and policies with the one-big-cache
bound and the random-routing floor, :mod:`~urc.apps.fleet.report` the figures.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# name -> the module that defines it (imported on first use: ``urc fleet --help`` and its
# usage errors import neither torch nor the cache)
_EXPORTS: dict[str, str] = {
    "BOUND": "urc.apps.fleet.report",
    "FLOOR": "urc.apps.fleet.report",
    "FleetConfig": "urc.apps.fleet.run",
    "FleetRun": "urc.apps.fleet.report",
    "FleetSweep": "urc.apps.fleet.report",
    "L3Kind": "urc.apps.fleet.store",
    "Router": "urc.apps.fleet.policy",
    "RouterPolicy": "urc.apps.fleet.policy",
    "RoutingParams": "urc.apps.fleet.policy",
    "SharedStoreConfig": "urc.apps.fleet.store",
    "run_fleet": "urc.apps.fleet.run",
    "run_sweep": "urc.apps.fleet.sweep",
}

__all__ = [
    "BOUND",
    "FLOOR",
    "FleetConfig",
    "FleetRun",
    "FleetSweep",
    "L3Kind",
    "Router",
    "RouterPolicy",
    "RoutingParams",
    "SharedStoreConfig",
    "run_fleet",
    "run_sweep",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])


if TYPE_CHECKING:
    from urc.apps.fleet.policy import Router, RouterPolicy, RoutingParams
    from urc.apps.fleet.report import BOUND, FLOOR, FleetRun, FleetSweep
    from urc.apps.fleet.run import FleetConfig, run_fleet
    from urc.apps.fleet.store import L3Kind, SharedStoreConfig
    from urc.apps.fleet.sweep import run_sweep
