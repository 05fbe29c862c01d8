"""``urc replay``: run the cache on a request workload the way a serving loop would.

:func:`run_replay` drives an :class:`~urc.service.AsyncUnifiedRadixCache` (with the HiCache
host tier and its background worker) through a Mooncake trace or a built-in synthetic
workload and returns a :class:`ReplayReport`; ``urc replay`` (:mod:`urc.cli`) is its command
line.  See :mod:`urc.replay.driver` for what the loop does per request.
"""

from urc.replay.config import (
    DEFAULT_CHUNK_SIZE,
    REPLAY_KV_SHAPE,
    Capacity,
    ModelProfile,
    ReplayConfig,
)
from urc.replay.driver import OUTPUT_TOKEN_BASE, output_token_ids, run_replay
from urc.replay.report import IDEAL_SCOPE, LatencySummary, ReplayReport
from urc.replay.source import EmptyWorkloadError, WorkloadSummary, summarize

__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "IDEAL_SCOPE",
    "OUTPUT_TOKEN_BASE",
    "REPLAY_KV_SHAPE",
    "Capacity",
    "EmptyWorkloadError",
    "LatencySummary",
    "ModelProfile",
    "ReplayConfig",
    "ReplayReport",
    "WorkloadSummary",
    "output_token_ids",
    "run_replay",
    "summarize",
]
