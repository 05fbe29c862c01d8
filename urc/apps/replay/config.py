"""What a replay runs: the workload, the model profile, capacities and the serving loop's knobs.

:class:`ReplayConfig` is frozen and validated on construction by
:func:`urc.apps.replay.options.check_options` (an :class:`~urc.apps.replay.options.OptionError`, a
:class:`~urc.errors.ConfigError`, names the bad field), the rules ``urc replay`` checks its
flags with before importing torch.  :meth:`ReplayConfig.cache_config` turns it into the core's
:class:`~urc.config.CacheConfig` once the workload's first pass (:mod:`urc.apps.replay.source`)
has told it how many unique tokens there are and how long the longest request is.

Capacities (:class:`~urc.apps.replay.options.Capacity`) are a token count or a fraction of the
workload's unique prompt tokens (see :mod:`urc.apps.replay.options`).

Defaults (device and host 0.25 each, write-back, chunks of :data:`DEFAULT_CHUNK_SIZE`) keep
the conversation trace (145M prompt tokens, 91M unique) within 0.4 points of its ideal hit
rate in about 1.1 GB: a cached token costs ~19 bytes (a key pointer in the tree, an int64
slot index, a 2-byte KV row), on device or on host.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from hicache.config import StorageBackupPolicy
from urc.apps.replay.options import (
    DEFAULT_CHUNK_SIZE,
    DEFAULT_SEED,
    DEFAULT_SESSION_CONCURRENCY,
    DEFAULT_WINDOW,
    Capacity,
    ModelProfile,
    check_options,
)
from urc.apps.workloads import DEFAULT_BLOCK_SIZE, WorkloadKind
from urc.apps.workloads.agentic import AgenticConfig, is_session_archive
from urc.config import CacheConfig
from urc.eviction_policy import EvictionPolicy, NextUseOracle
from urc.host_protocol import WritePolicy
from urc.node import ComponentType
from urc.pools.kv_pool import KVShape
from urc.specs import ComponentSpec, MambaSpec, SlidingWindowSpec

__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "REPLAY_KV_SHAPE",
    "Capacity",
    "ModelProfile",
    "ReplayConfig",
]

# Tiny KV rows: the replay measures the cache, not memory bandwidth.  2 bytes a token (K and
# V, one uint8 each) keep the conversation trace's pools (tens of millions of tokens) small.
REPLAY_KV_SHAPE = KVShape(num_layers=1, num_heads=1, head_dim=1, dtype=torch.uint8)


def _default_device() -> Capacity:
    return Capacity(fraction=0.25)


def _default_host() -> Capacity:
    return Capacity(fraction=0.25)


@dataclass(frozen=True, slots=True)
class ReplayConfig:
    """Everything ``urc replay`` runs (see the module docstring and ``urc replay --help``).

    Workload: ``trace`` (a Mooncake-format file, ``block_size`` tokens per hash id) or the
    built-in ``workload`` (seeded by ``seed``); ``num_requests`` caps a trace, or sizes a
    synthetic workload (``None``: its default, 2000).

    Cache: ``model`` picks the components (``window`` and ``swa_tokens`` for SWA: ``None``
    sizes the SWA pool like the Full one; ``mamba_states`` for Mamba: ``None`` sizes the
    pool from the device tokens), ``device_tokens`` / ``host_tokens`` the Full KV pools (host
    0: no host tier), ``write_policy`` the HiCache backup policy (default ``WRITE_BACK``: a
    device leaf is copied to host when it is evicted, so device plus host behave like one
    cache of their combined size; write-through copies a node only after its first hit),
    ``eviction_policy`` the device and host eviction order (``BELADY``: the offline optimum,
    from the whole workload read up front), ``partial_leaf_eviction`` takes only the pages an
    eviction needs from a victim leaf, ``page_size`` the tree's page.
    ``l3_dir`` adds the L3 storage tier (HiCache's
    :class:`~hicache.storage_worker.StorageWorker` on a local-file store in that directory;
    full-attention models only), written per ``l3_backup``.

    Serving loop: ``concurrency`` requests in flight, prefill in chunks of ``chunk_size``
    tokens (a multiple of ``page_size``), ``prefill_only`` caches only the prompts, ``speed``
    > 0 paces arrivals at ``timestamp / speed`` (0: as fast as possible).

    Agentic sessions: a ``trace`` that is a directory or a tar archive of session files
    (:mod:`urc.apps.workloads.agentic`: one cache token per block, sessions arriving as a
    Poisson process at ``session_concurrency`` sessions on average, shuffled by ``seed``;
    ``session_subset=(k, n)`` keeps every n-th session from the k-th; ``share_prefix``
    shares the tools and system prompt between sessions of the same agent).  Each finished
    request is cached with its :class:`~urc.reuse_hint.ReuseHint` (session, stop reason,
    finish time on the trace's clock).  ``eviction_params`` are the policy's parameters as
    given (``CacheConfig.eviction_params``: its strategy's keyword arguments; token counts
    in the replay's tokens).

    Determinism: with ``realtime=False`` (the default) host-tier copies run inside the event
    loop and the trace is read without worker threads, so the same config gives the same
    report (timings aside) on every run.  ``realtime=True`` copies in worker threads and
    reads the trace with aiofiles, like a server: backups then race evictions and hit rates
    vary slightly from run to run.  Pacing (``speed > 0``) and the L3 tier (file I/O in
    threads) are never deterministic.
    """

    trace: Path | None = None
    workload: WorkloadKind = WorkloadKind.MULTI_TURN_CHAT
    num_requests: int | None = None
    seed: int = DEFAULT_SEED
    block_size: int = DEFAULT_BLOCK_SIZE
    model: ModelProfile = ModelProfile.FULL
    window: int = DEFAULT_WINDOW
    swa_tokens: Capacity | None = None
    mamba_states: int | None = None
    device_tokens: Capacity = field(default_factory=_default_device)
    host_tokens: Capacity = field(default_factory=_default_host)
    write_policy: WritePolicy = WritePolicy.WRITE_BACK  # DEFAULT_WRITE_POLICY (a test pins it)
    eviction_policy: EvictionPolicy = EvictionPolicy.LRU
    partial_leaf_eviction: bool = False
    l3_dir: Path | None = None
    l3_backup: StorageBackupPolicy = StorageBackupPolicy.ON_HOST_EVICTION  # DEFAULT_L3_BACKUP
    page_size: int = 16
    chunk_size: int = DEFAULT_CHUNK_SIZE
    concurrency: int = 8
    prefill_only: bool = False
    speed: float = 0.0
    realtime: bool = False
    kv_shape: KVShape = REPLAY_KV_SHAPE
    session_concurrency: float = DEFAULT_SESSION_CONCURRENCY
    session_subset: tuple[int, int] | None = None
    share_prefix: bool = True
    eviction_params: Mapping[str, Any] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        check_options(
            model=self.model,
            num_requests=self.num_requests,
            block_size=self.block_size,
            window=self.window,
            swa_tokens=self.swa_tokens,
            mamba_states=self.mamba_states,
            device_tokens=self.device_tokens,
            host_tokens=self.host_tokens,
            l3_dir=self.l3_dir,
            page_size=self.page_size,
            chunk_size=self.chunk_size,
            concurrency=self.concurrency,
            speed=self.speed,
        )

    @property
    def source_name(self) -> str:
        """The workload, as the report names it."""
        return str(self.trace) if self.trace is not None else self.workload.value

    @property
    def agentic(self) -> bool:
        """Whether ``trace`` is a set of agentic session files (not a Mooncake trace)."""
        return self.trace is not None and is_session_archive(self.trace)

    def agentic_config(self) -> AgenticConfig:
        """How :mod:`urc.apps.workloads.agentic` lays the sessions out for this replay."""
        assert self.trace is not None, "agentic_config needs a trace"
        return AgenticConfig(
            self.trace,
            concurrency=self.session_concurrency,
            seed=self.seed,
            share_prefix=self.share_prefix,
            subset=self.session_subset,
        )

    @property
    def deterministic(self) -> bool:
        """Whether the same config gives the same report (see the class docstring)."""
        return not self.realtime and self.speed == 0 and self.l3_dir is None

    def swa_pool_tokens(
        self, device_tokens: int, unique_tokens: int, tokens_per_unit: int = 1
    ) -> int | None:
        """The SWA pool size (whole pages, cache units) for a Full pool of ``device_tokens``;
        ``None`` when the model has no SWA component (``tokens_per_unit``: see
        :meth:`Capacity.resolve`)."""
        if self.model is not ModelProfile.SWA:
            return None
        if self.swa_tokens is None:
            return device_tokens
        pages = self.swa_tokens.resolve(unique_tokens, self.page_size, tokens_per_unit)
        return max(self.page_size, pages)

    def cache_config(
        self,
        device_tokens: int,
        max_request_tokens: int,
        swa_tokens: int | None = None,
        next_use: NextUseOracle | None = None,
    ) -> CacheConfig:
        """The core's config for a device pool of ``device_tokens`` (whole pages) and
        requests of at most ``max_request_tokens`` tokens (prompt plus output);
        ``swa_tokens`` sizes the SWA pool (``None``: like the Full pool); ``next_use`` is
        the workload's future (required by, and only by, the belady policy)."""
        ps = self.page_size
        model = self.model
        specs: list[ComponentSpec] = []
        if model is ModelProfile.SWA:
            # Default: the Full pool's size, so SWA never runs out before Full.
            specs.append(SlidingWindowSpec(self.window, swa_tokens or device_tokens))
        elif model is ModelProfile.MAMBA:
            # Default: one state per prefill chunk the device pool could hold, plus a live
            # state and a fork for every request in flight.
            states = self.mamba_states or max(
                4 * self.concurrency, device_tokens // self.chunk_size + 2 * self.concurrency
            )
            specs.append(MambaSpec(states, chunk_size=max(64, ps)))
        return CacheConfig(
            components=(ComponentType.FULL, *specs),
            page_size=ps,
            kv_size=device_tokens,
            max_num_reqs=self.concurrency,
            max_context_len=max(ps, -(-(max_request_tokens + ps) // ps) * ps),
            kv_shape=self.kv_shape,
            eviction_policy=self.eviction_policy,
            partial_leaf_eviction=self.partial_leaf_eviction,
            eviction_params=self.eviction_params,
            next_use=next_use,
        )
