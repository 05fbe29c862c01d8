"""``urc replay``: run the cache on a request workload the way a serving loop would.

:func:`run_replay` drives an :class:`~urc.service.AsyncUnifiedRadixCache` (with the HiCache
host tier and its background worker) through a Mooncake trace or a built-in synthetic
workload and returns a :class:`ReplayReport`; ``urc replay`` (:mod:`urc.cli`) is its command
line.  See :mod:`urc.replay.driver` for what the loop does per request.  :func:`run_sweep`
(:mod:`urc.replay.sweep`) replays once per device capacity (``urc replay --sweep``);
``python -m urc.replay.chunk_bench`` measures the cost of chunked prefill against prompt
length.

The names below are imported on first use (PEP 562): :mod:`urc.replay.options`, which the
command line parses and checks its flags with, imports neither torch nor the cache.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# name -> the module that defines it
_EXPORTS: dict[str, str] = {
    "DEFAULT_CHUNK_SIZE": "urc.replay.options",
    "DEFAULT_SWEEP": "urc.replay.options",
    "Capacity": "urc.replay.options",
    "ModelProfile": "urc.replay.options",
    "OptionError": "urc.replay.options",
    "REPLAY_KV_SHAPE": "urc.replay.config",
    "ReplayConfig": "urc.replay.config",
    "OUTPUT_TOKEN_BASE": "urc.replay.driver",
    "output_token_ids": "urc.replay.driver",
    "run_replay": "urc.replay.driver",
    "IDEAL_SCOPE": "urc.replay.report",
    "LatencySummary": "urc.replay.report",
    "ReplayReport": "urc.replay.report",
    "EmptyWorkloadError": "urc.replay.source",
    "WorkloadSummary": "urc.replay.source",
    "summarize": "urc.replay.source",
    "SweepPoint": "urc.replay.sweep",
    "SweepResult": "urc.replay.sweep",
    "run_sweep": "urc.replay.sweep",
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
    from urc.replay.config import REPLAY_KV_SHAPE, ReplayConfig
    from urc.replay.driver import OUTPUT_TOKEN_BASE, output_token_ids, run_replay
    from urc.replay.options import (
        DEFAULT_CHUNK_SIZE,
        DEFAULT_SWEEP,
        Capacity,
        ModelProfile,
        OptionError,
    )
    from urc.replay.report import IDEAL_SCOPE, LatencySummary, ReplayReport
    from urc.replay.source import EmptyWorkloadError, WorkloadSummary, summarize
    from urc.replay.sweep import SweepPoint, SweepResult, run_sweep
