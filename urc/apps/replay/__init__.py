"""``urc replay``: run the cache on a request workload the way a serving loop would.

:func:`run_replay` drives an :class:`~urc.service.AsyncUnifiedRadixCache` (with the HiCache
host tier and its background worker) through a Mooncake trace or a built-in synthetic
workload and returns a :class:`ReplayReport`; ``urc replay`` (:mod:`urc.apps.cli`) is its command
line.  See :mod:`urc.apps.replay.driver` for what the loop does per request.  :func:`run_sweep`
(:mod:`urc.apps.replay.sweep`) replays once per device capacity (``urc replay --sweep``);
``python -m urc.apps.bench.chunk`` measures the cost of chunked prefill against prompt
length.
"""

from urc.apps.replay.config import (
    DEFAULT_CHUNK_SIZE,
    REPLAY_KV_SHAPE,
    Capacity,
    ModelProfile,
    ReplayConfig,
)
from urc.apps.replay.driver import OUTPUT_TOKEN_BASE, output_token_ids, run_replay
from urc.apps.replay.report import IDEAL_SCOPE, LatencySummary, ReplayReport
from urc.apps.replay.source import EmptyWorkloadError, WorkloadSummary, summarize
from urc.apps.replay.sweep import DEFAULT_SWEEP, SweepPoint, SweepResult, run_sweep

__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "DEFAULT_SWEEP",
    "IDEAL_SCOPE",
    "OUTPUT_TOKEN_BASE",
    "REPLAY_KV_SHAPE",
    "Capacity",
    "EmptyWorkloadError",
    "LatencySummary",
    "ModelProfile",
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
