"""``urc replay``: run the cache on a request workload the way a serving loop would.

:func:`run_replay` drives an :class:`~urc.service.AsyncUnifiedRadixCache` (with the HiCache
host tier and its background worker) through a Mooncake trace or a built-in synthetic
workload and returns a :class:`ReplayReport`; ``urc replay`` (:mod:`urc.apps.cli`) is its command
line.  See :mod:`urc.apps.replay.driver` for what the loop does per request.  :func:`run_sweep`
(:mod:`urc.apps.replay.sweep`) replays once per device capacity (``urc replay --sweep``);
``python -m urc.apps.bench.chunk`` measures the cost of chunked prefill against prompt
length.

The names below are imported on first use (PEP 562): :mod:`urc.apps.replay.options`, which the
command line parses and checks its flags with, imports neither torch nor the cache.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# name -> the module that defines it
_EXPORTS: dict[str, str] = {
    "DEFAULT_CHUNK_SIZE": "urc.apps.replay.options",
    "DEFAULT_SWEEP": "urc.apps.replay.options",
    "Capacity": "urc.apps.replay.options",
    "ModelProfile": "urc.apps.replay.options",
    "OptionError": "urc.apps.replay.options",
    "REPLAY_KV_SHAPE": "urc.apps.replay.config",
    "ReplayConfig": "urc.apps.replay.config",
    "OUTPUT_TOKEN_BASE": "urc.apps.replay.driver",
    "output_token_ids": "urc.apps.replay.driver",
    "run_replay": "urc.apps.replay.driver",
    "IDEAL_SCOPE": "urc.apps.replay.report",
    "LatencySummary": "urc.apps.replay.report",
    "ReplayReport": "urc.apps.replay.report",
    "EmptyWorkloadError": "urc.apps.replay.source",
    "WorkloadSummary": "urc.apps.replay.source",
    "summarize": "urc.apps.replay.source",
    "SweepPoint": "urc.apps.replay.sweep",
    "SweepResult": "urc.apps.replay.sweep",
    "run_sweep": "urc.apps.replay.sweep",
}

__all__ = [
    "Capacity",
    "DEFAULT_CHUNK_SIZE",
    "DEFAULT_SWEEP",
    "EmptyWorkloadError",
    "IDEAL_SCOPE",
    "LatencySummary",
    "ModelProfile",
    "OUTPUT_TOKEN_BASE",
    "OptionError",
    "REPLAY_KV_SHAPE",
    "ReplayConfig",
    "ReplayReport",
    "SweepPoint",
    "SweepResult",
    "WorkloadSummary",
    "output_token_ids",
    "run_replay",
    "run_sweep",
    "summarize",
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
    from urc.apps.replay.config import REPLAY_KV_SHAPE, ReplayConfig
    from urc.apps.replay.driver import OUTPUT_TOKEN_BASE, output_token_ids, run_replay
    from urc.apps.replay.options import (
        DEFAULT_CHUNK_SIZE,
        DEFAULT_SWEEP,
        Capacity,
        ModelProfile,
        OptionError,
    )
    from urc.apps.replay.report import IDEAL_SCOPE, LatencySummary, ReplayReport
    from urc.apps.replay.source import EmptyWorkloadError, WorkloadSummary, summarize
    from urc.apps.replay.sweep import SweepPoint, SweepResult, run_sweep
