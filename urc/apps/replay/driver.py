"""The serving loop of ``urc replay``: requests through the async service, the way a server would.

For each request, in workload order, with up to ``concurrency`` in flight (one task each):

1. take a ``req_to_token`` row (``svc.alloc_req_row``);
2. ``match_req(load_back=...)``: locks the device hit on the request's behalf (Mamba:
   copy-on-write of the matched state); if the match continues on host and a host tier runs,
   the same call loads that span back to device and moves the lock to the longer hit (one
   command pair: the match, then the commit after the copy).  With an L3 store, pages past
   the host hit are prefetched to host and loaded the same way (``svc.load_back_req``);
3. prefill the uncached tail in chunks of ``chunk_size`` tokens on the chunk grid (Mamba: a
   chunk also ends at the match's ``mamba_branching_seqlen``, so a state is checkpointed where
   the cached prefix branches): ``svc.alloc`` the chunk's slots (the service evicts when
   full), write them into the request's row (``svc.write_req_slots``),
   ``cache_unfinished_req(chunked=True)`` (as SGLang's scheduler does between chunks: no hit
   counted on the request's own earlier chunks).  The last prompt chunk allocates the output
   tokens' slots too (one allocation keeps the row's pages contiguous; decode then needs no
   cache call);
4. decode: the output token ids are deterministic (``OUTPUT_TOKEN_BASE + (index << 24) + i``,
   never equal to a prompt token), then ``cache_finished_req``.  With ``prefill_only`` the
   request finishes right after its last prompt chunk and only prompts are cached.

Memory: if an allocation fails even after eviction (every evictable token is gone and the rest
is locked by requests in flight), the request waits for another request to finish and retries,
like a server's admission queue.  When every other request in flight is waiting too (or none
is), waiting could deadlock, so the request is rejected instead: it gives back what it holds
(``cache_finished_req(is_insert=False)``; chunks it already cached stay cached) and counts as
rejected.  Nothing crashes on memory pressure.

Determinism: the loop never looks at a clock to decide anything (paced arrivals aside), the
HiCache controller copies inside the event loop unless ``ReplayConfig.realtime``, and the
trace is read without threads, so the order of every command is a function of the config.

Latencies are measured in the client around each await (queueing in the actor included).
After the run the service is closed (background work stopped, pins released) and the core's
``sanity_check`` and pool conservation check run on it.
"""

from __future__ import annotations

import math
import sys
from array import array
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from contextlib import AsyncExitStack, aclosing, suppress
from dataclasses import asdict
from functools import partial
from time import perf_counter
from typing import TypeVar

import anyio
import anyio.lowlevel
from prometheus_client import CollectorRegistry
from tqdm import tqdm

import hicache
from hicache.config import HiCacheConfig, StorageConfig
from hicache.controller import HiCacheController
from hicache.storage.file import FileStorage
from hicache.storage_worker import StorageWorker
from metrics.exporter import CacheMetrics
from metrics.http import MetricsServer, MetricsServerConfig
from metrics.kv_events import KVPublisherMetrics
from urc.apps.replay.belady import NextUseTable, build_next_use
from urc.apps.replay.config import ModelProfile, ReplayConfig
from urc.apps.replay.report import TIERS, LatencyRecorder, ReplayReport
from urc.apps.replay.source import (
    EmptyWorkloadError,
    WorkloadSummary,
    agentic_workload,
    aiter_requests,
    summarize,
)
from urc.apps.workloads import TraceRequest
from urc.cache import UnifiedRadixCache, build_cache
from urc.errors import ConfigError, OutOfMemoryError, ServiceError
from urc.eviction_policy import EvictionPolicy
from urc.key import RadixKey
from urc.node import ComponentType, Tier
from urc.req import Req
from urc.reuse_hint import ReuseHint, StopReason
from urc.service import (
    AsyncUnifiedRadixCache,
    BackgroundWorker,
    KVEventPublisher,
    LoadBackPolicy,
    TraceHook,
)
from urc.specs import MambaSpec

__all__ = ["OUTPUT_TOKEN_BASE", "MetricsHook", "output_token_ids", "run_replay"]

T = TypeVar("T")

OUTPUT_TOKEN_BASE = 1 << 40
"""Generated token ids start here: above every prompt token id (trace ids are < 2**31)."""

# Called with the /metrics URL once the endpoint and the service are up.
MetricsHook = Callable[[str], Awaitable[None]]


def output_token_ids(index: int, length: int) -> list[int]:
    """The deterministic output token ids of request ``index``."""
    base = OUTPUT_TOKEN_BASE + (index << 24)
    return list(range(base, base + length))


_STOPS = {s.value: s for s in StopReason}


def _hint(tr: TraceRequest) -> ReuseHint | None:
    """What a server would know when ``tr`` finishes (workloads with sessions only): its
    session (and a sub-agent's parent), its stop reason, and the finish on the trace's
    clock."""
    if tr.session_id is None:
        return None
    stop = _STOPS.get(tr.stop or "", StopReason.OTHER)
    # The replay serves a request at its arrival (no model time passes in the cache's
    # order of events), so that is when it finishes on the cache's clock.
    return ReuseHint(tr.session_id, stop, None, tr.timestamp_ms / 1000, tr.parent_session_id)


# ---------------------------------------------------------------------- memory admission
class _MemoryGate:
    """Requests that could not get memory wait here for another request to finish."""

    __slots__ = ("_event", "active", "waiting")

    def __init__(self) -> None:
        self.active = 0  # requests holding a row
        self.waiting = 0
        self._event = anyio.Event()

    def released(self) -> None:
        """A request finished or gave up: memory may be free; wake every waiter."""
        self._event.set()
        self._event = anyio.Event()

    async def wait(self) -> bool:
        """Wait for the next release; ``False`` (at once) when no other request could
        release anything (every other one in flight waits too)."""
        if self.waiting + 1 >= self.active:
            return False
        self.waiting += 1
        try:
            await self._event.wait()
        finally:
            self.waiting -= 1
        return True


# ---------------------------------------------------------------------- the loop
class _ServingLoop:
    def __init__(
        self,
        config: ReplayConfig,
        svc: AsyncUnifiedRadixCache,
        controller: HiCacheController | None,
        storage: StorageWorker | None,
        device_tokens: int,
        bar: tqdm[None],
        next_use: NextUseTable | None = None,
    ) -> None:
        self.config = config
        self.next_use = next_use  # Belady's view of the future: told which request is next
        self.svc = svc
        self.controller = controller
        self.storage = storage
        self.device_tokens = device_tokens
        self.bar = bar
        self.mamba = config.model is ModelProfile.MAMBA
        self.swa = config.model is ModelProfile.SWA
        self.gate = _MemoryGate()
        self.latency = LatencyRecorder()
        self.hits = dict.fromkeys(TIERS, 0)
        self.requests = self.done = self.rejected = 0
        self.input_tokens = self.output_tokens = 0
        self.oom_waits = 0
        self.recomputed = array("q")  # per request: prompt tokens not served from a cache

    async def run(self, requests: AsyncGenerator[TraceRequest, None]) -> None:
        sem = anyio.Semaphore(self.config.concurrency)
        speed = self.config.speed
        async with anyio.create_task_group() as tg, aclosing(requests):
            start = anyio.current_time()
            async for tr in requests:
                if speed > 0:
                    await anyio.sleep_until(start + tr.timestamp_ms / 1000.0 / speed)
                await sem.acquire()
                if self.next_use is not None:
                    self.next_use.advance(tr.index)
                tg.start_soon(self._serve, tr, sem, name=f"urc-replay-{tr.index}")

    async def _timed(self, kind: str, aw: Awaitable[T]) -> T:
        t0 = perf_counter()
        result = await aw
        self.latency.add(kind, perf_counter() - t0)
        return result

    async def _serve(self, tr: TraceRequest, sem: anyio.Semaphore) -> None:
        try:
            await self._serve_one(tr)
        finally:
            sem.release()
            self.gate.released()
            bar = self.bar
            bar.update(1)
            if self.requests % 64 == 0 and self.input_tokens:
                bar.set_postfix_str(
                    f"hit {sum(self.hits.values()) / self.input_tokens:.1%}", refresh=False
                )

    async def _serve_one(self, tr: TraceRequest) -> None:
        svc = self.svc
        req = Req(f"r{tr.index}", list(tr.input_ids), extra_key=tr.namespace)
        await self._timed("alloc_row", svc.alloc_req_row(req))
        self.gate.active += 1
        try:
            ok = await self._run(req, tr)
        except BaseException:
            # Cancelled, or the service failed: hand back what the request still holds.
            with anyio.CancelScope(shield=True):
                if req.req_pool_idx is not None:
                    with suppress(ServiceError):
                        await svc.cache_finished_req(req, is_insert=False)
            raise
        finally:
            self.gate.active -= 1
        if ok:
            self.done += 1
        else:
            self.rejected += 1

    async def _with_memory(self, kind: str, op: Callable[[], Awaitable[T]]) -> T | None:
        """``await op()``, waiting for other requests to free memory while it raises
        OutOfMemoryError; ``None`` when no wait can help (the request is rejected)."""
        controller = self.controller
        spins = 0
        while True:
            t0 = perf_counter()
            try:
                result = await op()
            except OutOfMemoryError:
                self.oom_waits += 1
                if await self.gate.wait():
                    continue
                if controller is not None and controller.in_flight and spins < 1000:
                    # Transfers pin nodes while they copy; they finish within milliseconds.
                    # (Deterministic runs copy in the loop: a checkpoint lets the commit run.)
                    spins += 1
                    if self.config.realtime:
                        await anyio.sleep(0.001)
                    else:
                        await anyio.lowlevel.checkpoint()
                    continue
                return None
            self.latency.add(kind, perf_counter() - t0)
            return result

    async def _run(self, req: Req, tr: TraceRequest) -> bool:
        """Serve one request; ``False`` if it was rejected for lack of memory."""
        svc = self.svc
        config = self.config
        n_in = tr.input_length
        self.requests += 1
        self.input_tokens += n_in
        controller = self.controller
        storage = self.storage
        # One command pair: the match starts loading a host hit back, the commit re-matches.
        m = await self._timed(
            "match_req",
            svc.match_req(req, cow_mamba=self.mamba, load_back=controller is not None),
        )
        hits = self.hits
        hits_before = sum(hits.values())
        hits[Tier.HOST] += m.host_loaded_len
        device_hit = m.prefix_len - m.host_loaded_len
        if storage is not None and m.prefix_len + m.host_hit_length + config.page_size <= n_in:
            # Pages past the host hit may be in L3: bring them to host, then to device.
            key = RadixKey(req.origin_input_ids, req.extra_key)
            from_storage = await self._timed("storage_prefetch", storage.prefetch(svc, key))
            if from_storage > 0:
                m2 = await self._timed("load_back", svc.load_back_req(req, cow_mamba=self.mamba))
                # The longer hit is what the prefetch brought from L3 first; anything else
                # newly on host counts as host, what a concurrent request inserted as device.
                from_l3 = min(m2.host_loaded_len, from_storage)
                hits[Tier.STORAGE] += from_l3
                hits[Tier.HOST] += m2.host_loaded_len - from_l3
                device_hit += m2.prefix_len - m.prefix_len - m2.host_loaded_len
        hits[Tier.DEVICE] += device_hit
        self.recomputed.append(n_in - (sum(hits.values()) - hits_before))
        if self.mamba and req.mamba_pool_idx is None:
            got = await self._with_memory("alloc_mamba_state", partial(svc.alloc_req_mamba, req))
            if got is None:
                return await self._reject(req)

        out_len = 0 if config.prefill_only else tr.output_length
        chunk = config.chunk_size
        branch = req.mamba_branching_seqlen if self.mamba else None
        pos = req.cache_protected_len
        prefilled = False
        while True:
            end = min(n_in, (pos // chunk + 1) * chunk)
            if branch is not None and pos < branch < end:
                end = branch
            last = end >= n_in
            need = end - pos + (out_len if last else 0)
            if need > 0:
                if need > self.device_tokens:
                    return await self._reject(req)
                slots = await self._with_memory("alloc", partial(svc.alloc, need))
                if slots is None:
                    return await self._reject(req)
                await self._timed("write_row", svc.write_req_slots(req, slots, end))
                prefilled = prefilled or end > pos
            pos = end
            if last:
                break
            await self._timed("cache_unfinished_req", svc.cache_unfinished_req(req, chunked=True))

        if not config.prefill_only:
            if prefilled:
                # Prefill done: the prompt becomes matchable while the request decodes.
                await self._timed("cache_unfinished_req", svc.cache_unfinished_req(req))
            req.output_ids = output_token_ids(tr.index, out_len)
            req.kv_committed_len = n_in + out_len
            if self.swa and out_len:
                await self._timed("swa_slide_window", svc.slide_req_window(req, n_in + out_len))
            self.output_tokens += out_len
        await self._timed("cache_finished_req", svc.cache_finished_req(req, hint=_hint(tr)))
        return True

    async def _reject(self, req: Req) -> bool:
        await self._timed("abort", self.svc.cache_finished_req(req, is_insert=False))
        return False


# ---------------------------------------------------------------------- entry point
def _percentile(values: array[int], q: float) -> int:
    """Nearest-rank percentile ``q`` of ``values`` (0 when empty)."""
    if not values:
        return 0
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def _agentic_notes(config: ReplayConfig) -> list[str]:
    """What an agentic replay assumed (``urc.apps.workloads.agentic``), for its report."""
    wl = agentic_workload(config)
    return [
        f"agentic sessions: {wl.sessions} sessions, {wl.flows} flows (sub-agents are their "
        f"own), {wl.requests:,} requests; one cache token per {wl.block_size}-token block: "
        f"the token counts of this report are blocks (capacities given as token counts were "
        f"divided by {wl.block_size}; --window and --chunk-size count blocks); a prompt's last "
        "partial block is left out",
        f"arrivals: Poisson, {config.session_concurrency:g} sessions running on average "
        f"(mean session {wl.mean_session_s:,.0f} s), order and gaps seeded by {config.seed}; "
        "recorded think and model times kept",
        "tools+system prefix "
        + ("shared by sessions of the same agent" if config.share_prefix else "not shared")
        + "; each finished request cached with its session, stop reason and finish time",
    ]


def _check(cache: UnifiedRadixCache) -> str | None:
    try:
        cache.sanity_check()
        cache.check_pools()
        assert cache.protected_size() == 0, f"{cache.protected_size()} tokens still locked"
    except AssertionError as exc:
        return str(exc) or repr(exc)
    return None


async def _flush_storage(storage: StorageWorker, progress: bool) -> tuple[float, int]:
    """Let queued L3 writes land (so a later run with the same ``--l3-dir`` sees them),
    showing pages written while it waits; returns the seconds it took and the writes it
    dropped at its deadline."""
    t0 = perf_counter()
    written0 = storage.stats.pages_written
    with tqdm(
        unit="page",
        file=sys.stderr,
        disable=not progress,
        mininterval=0.5,
        desc="L3 flush (queued writes)",
    ) as bar:
        async with anyio.create_task_group() as tg:

            async def show() -> None:
                while True:
                    await anyio.sleep(0.5)
                    bar.n = storage.stats.pages_written - written0
                    bar.refresh()

            tg.start_soon(show)
            dropped = await storage.flush()
            tg.cancel_scope.cancel()
        bar.n = storage.stats.pages_written - written0
    return perf_counter() - t0, dropped


async def run_replay(
    config: ReplayConfig,
    *,
    progress: bool = False,
    metrics_port: int | None = None,
    on_metrics: MetricsHook | None = None,
    summary: WorkloadSummary | None = None,
    trace: TraceHook | None = None,
    kv_publisher: KVEventPublisher | None = None,
) -> ReplayReport:
    """Replay ``config``'s workload through a fresh cache and service; returns the report.

    ``progress`` shows tqdm bars on stderr (the replay, then the L3 flush).  ``metrics_port``
    (0: any free port) serves ``/metrics`` on 127.0.0.1 for the duration of the run;
    ``on_metrics`` is awaited with its URL once the endpoint and the service are up.
    ``summary``: a first pass already made (a sweep reuses one).  ``trace``: the service's
    test hook (every command the actor applies, with its result).  ``kv_publisher``: publish
    the cache's KV events for the run (read its ``stats`` afterwards; with ``metrics_port`` its
    counters are served too).

    Raises :class:`~urc.apps.replay.source.EmptyWorkloadError` (no request to replay),
    :class:`~urc.apps.workloads.TraceFormatError` (malformed trace), ``OSError`` (unreadable
    trace) and :class:`~urc.errors.ConfigError` (sizes that cannot be built).
    """
    t_setup = perf_counter()
    if summary is None:
        summary = await summarize(config, progress=progress)
    if summary.requests == 0:
        raise EmptyWorkloadError(f"{config.source_name}: the workload holds no request")
    ps = config.page_size
    # Capacities are prompt tokens; an agentic replay caches one token per block.
    unit = (agentic_workload(config).block_size or 1) if config.agentic else 1
    device = max(ps, config.device_tokens.resolve(summary.unique_tokens, ps, unit))
    host = config.host_tokens.resolve(summary.unique_tokens, ps, unit)
    swa_pool = config.swa_pool_tokens(device, summary.unique_tokens, unit)
    # Belady (measurement only) reads the whole workload first: it knows every next use.
    belady = config.eviction_policy is EvictionPolicy.BELADY
    future = (
        await build_next_use(config, requests=summary.requests, progress=progress)
        if belady
        else None
    )
    cache = build_cache(
        config.cache_config(device, summary.max_request_tokens, swa_pool, next_use=future)
    )

    registry = CollectorRegistry(auto_describe=True)
    metrics = CacheMetrics(registry) if metrics_port is not None else None
    if metrics is not None and kv_publisher is not None:
        KVPublisherMetrics(registry, kv_publisher)
    controller: HiCacheController | None = None
    storage: StorageWorker | None = None
    store: FileStorage | None = None
    workers: Sequence[BackgroundWorker] = ()
    if config.l3_dir is not None and host <= 0:
        raise ConfigError("the L3 storage tier needs the host tier (host_tokens > 0)")
    if host > 0:
        if config.l3_dir is not None:
            store = await FileStorage.open(config.l3_dir)
        hc = hicache.attach(
            cache,
            HiCacheConfig(write_policy=config.write_policy, host_ratio=host / device),
            store,
            storage_config=StorageConfig(backup_policy=config.l3_backup),
            observer=metrics,
            copy_in_thread=config.realtime,
        )
        host = hc.tier.host_capacity(ComponentType.FULL)
        controller, storage, workers = hc.controller, hc.storage, hc.workers
    if kv_publisher is not None:
        workers = (*workers, kv_publisher)

    bar = tqdm(
        total=summary.requests,
        unit="req",
        file=sys.stderr,
        disable=not progress,
        dynamic_ncols=True,
        mininterval=0.5,
        desc="replay",
    )
    flush_time = 0.0
    flush_dropped = 0
    with bar:
        async with AsyncExitStack() as stack:
            url: str | None = None
            if metrics_port is not None:
                server = MetricsServer(registry, MetricsServerConfig(port=metrics_port))
                await stack.enter_async_context(server)
                url = server.url
            if store is not None:
                stack.push_async_callback(store.close)  # closed after the service
            svc = AsyncUnifiedRadixCache(
                cache,
                observer=metrics,
                workers=workers,
                load_back=LoadBackPolicy(copy_in_thread=config.realtime),
                trace=trace,
            )
            await stack.enter_async_context(svc)
            if url is not None and on_metrics is not None:
                await on_metrics(url)
            loop = _ServingLoop(config, svc, controller, storage, device, bar, future)
            setup_time = perf_counter() - t_setup
            t0 = perf_counter()
            await loop.run(aiter_requests(config))
            wall = perf_counter() - t0
            bar.close()
            if storage is not None:
                flush_time, flush_dropped = await _flush_storage(storage, progress)
        # Closed: the service first (background work drained, pins released), then /metrics.

    error = _check(cache)
    stats = cache.stats()
    notes = []
    warnings = []
    if loop.oom_waits:
        notes.append(f"{loop.oom_waits} allocations found no memory and waited or gave up")
    if loop.rejected:
        what = "every request was" if loop.done == 0 else f"{loop.rejected:,} requests were"
        warnings.append(
            f"{what} rejected: the device pool cannot hold the requests in flight "
            "(raise --device-tokens or lower --concurrency)"
        )
    if flush_dropped and storage is not None:
        warnings.append(
            f"the L3 flush hit its {storage.config.flush_timeout_s:g} s deadline and dropped "
            f"{flush_dropped:,} queued writes: a later run over the same directory finds "
            "fewer pages"
        )
    hit_total = sum(loop.hits.values())
    if storage is not None and hit_total > summary.ideal_hit_tokens:
        notes.append(
            "the hit rate is above the cold-start ideal: pages an earlier run left in the L3 "
            "store were hits"
        )
    if config.agentic:
        notes.extend(_agentic_notes(config))
    if config.model is not ModelProfile.FULL:
        notes.append(
            f"the ideal is the full-attention one; a {config.model.value} model hits only "
            "where its component data survives, so it stays below it"
        )
    return ReplayReport(
        source=config.source_name,
        model=config.model.value,
        page_size=ps,
        chunk_size=config.chunk_size,
        concurrency=config.concurrency,
        prefill_only=config.prefill_only,
        write_policy=config.write_policy.value if controller is not None else None,
        eviction_policy=config.eviction_policy.value
        + ("+partial" if config.partial_leaf_eviction else ""),
        l3=f"{config.l3_dir} ({config.l3_backup.value})" if storage is not None else None,
        device_tokens=device,
        host_tokens=host,
        token_unit=unit,
        swa_window=config.window if config.model is ModelProfile.SWA else None,
        swa_tokens=swa_pool,
        mamba_states=(
            cache.config.spec(MambaSpec).size if config.model is ModelProfile.MAMBA else None
        ),
        deterministic=config.deterministic,
        unique_tokens=summary.unique_tokens,
        ideal_hit_rate=summary.ideal_hit_rate,
        requests_total=loop.requests,
        requests_done=loop.done,
        requests_rejected=loop.rejected,
        input_tokens=loop.input_tokens,
        output_tokens=loop.output_tokens,
        hit_tokens=dict(loop.hits),
        evicted={
            f"{ct.name.lower()}/{tier.name.lower()}": n for (ct, tier), n in stats.evicted.items()
        },
        backed_up_tokens=stats.backed_up_tokens,
        loaded_back_tokens=stats.loaded_back_tokens,
        core_match_hit_tokens=dict(stats.hit_tokens),
        storage_stats=asdict(storage.stats) if storage is not None else {},
        latency=loop.latency.summary(),
        setup_time_s=setup_time,
        wall_time_s=wall,
        flush_time_s=flush_time,
        total_time_s=perf_counter() - t_setup,
        check_ok=error is None,
        check_error=error,
        recomputed_p50=_percentile(loop.recomputed, 0.5),
        recomputed_p99=_percentile(loop.recomputed, 0.99),
        notes=tuple(notes),
        warnings=tuple(warnings),
    )
