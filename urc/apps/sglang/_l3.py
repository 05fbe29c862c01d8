"""urc's L3 storage tier (:class:`~hicache.storage_worker.StorageWorker`) inside SGLang's
scheduler, with urc as the tree (``--hicache-storage-backend`` with
``--radix-cache-backend urc``).

The storage worker is asynchronous and expects an actor that owns the tree
(``svc.call(fn)`` runs ``fn(cache)`` there).  Inside SGLang the tree's owner is the
scheduler thread, so:

- the worker runs on an event loop in a daemon thread of its own (:class:`_LoopThread`):
  store reads and writes, page packing and waits never run on the scheduler thread;
- :class:`SchedulerActor` is its ``svc``: each ``call`` is queued, and the scheduler thread
  runs the queued calls whenever SGLang gives the tree a turn
  (:meth:`SchedulerStorage.run_calls`, from ``check_hicache_events`` and
  ``check_prefetch_progress``) -- short tree steps (reserve host slots, pin, insert the
  fetched pages as host-only nodes, unpin);
- the cache's tier events (a host copy landed: a write-through put is due; a host leaf is
  evicted: its pages are staged for a put) reach the worker's writer on its own loop
  (:class:`_ThreadHop`), the scheduler thread waiting only for the event to be recorded.

Pages are SGLang's: SGLang's page hashes named as its ``HiCacheFile`` names them
(``KeyScheme.SGLANG``), holding SGLang's page payload, so a default SGLang replica and a
urc replica share one directory (``file``) or one Mooncake store.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import os
import queue
import threading
import time
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar, cast

import anyio
from anyio.from_thread import BlockingPortal

from hicache.config import PrefetchStopPolicy, StorageConfig
from hicache.host_tier import HostMemoryTier
from hicache.storage.base import StorageBackend
from hicache.storage.keys import KeyScheme
from hicache.storage.sglang_keys import SGLangNaming
from hicache.storage_worker import StorageWorker
from urc.cache import UnifiedRadixCache
from urc.errors import ConfigError, InvalidInputError
from urc.host_protocol import TierEvents
from urc.key import RadixKey
from urc.node import TreeNode

#: ``--hicache-storage-backend`` values urc serves as the tree.
STORAGE_BACKENDS = ("file", "mooncake", "dynamic")

__all__ = [
    "STORAGE_BACKENDS",
    "SchedulerActor",
    "SchedulerStorage",
    "attach_storage",
    "open_store",
    "parse_extra_config",
    "storage_config",
]

_log = logging.getLogger(__name__)
_T = TypeVar("_T")


class SchedulerActor:
    """The ``svc`` a :class:`~hicache.storage_worker.StorageWorker` runs against, with
    SGLang's scheduler thread as the actor: :meth:`call` (on the worker's loop) queues
    ``fn`` and waits; :meth:`run_calls` (on the scheduler thread) runs what is queued."""

    def __init__(self, cache: UnifiedRadixCache) -> None:
        self.cache = cache
        self._calls: queue.SimpleQueue[
            tuple[Callable[[UnifiedRadixCache], Any], concurrent.futures.Future[Any] | None]
        ] = queue.SimpleQueue()

    async def call(
        self,
        fn: Callable[[UnifiedRadixCache], _T],
        *,
        undo: Callable[[UnifiedRadixCache, _T], None] | None = None,
    ) -> _T:
        """Run ``fn(cache)`` on the scheduler thread at its next turn; returns its result.
        A caller cancelled after ``fn`` ran gets ``undo(cache, result)`` run there too."""
        fut: concurrent.futures.Future[_T] = concurrent.futures.Future()
        self._calls.put((fn, fut))
        try:
            return await asyncio.wrap_future(fut)
        except BaseException:
            if undo is not None:

                def then_undo(f: concurrent.futures.Future[_T]) -> None:
                    if not f.cancelled() and f.exception() is None:
                        result = f.result()
                        self._calls.put((lambda cache: undo(cache, result), None))

                fut.add_done_callback(then_undo)
            raise

    def run_calls(self) -> int:
        """Run every queued call, in order, on this (the scheduler) thread; returns how
        many ran.  A call's exception goes to its caller."""
        n = 0
        while True:
            try:
                fn, fut = self._calls.get_nowait()
            except queue.Empty:
                return n
            if fut is not None and not fut.set_running_or_notify_cancel():
                continue  # its caller was cancelled before it ran
            n += 1
            try:
                result = fn(self.cache)
            except BaseException as e:  # the caller's to handle
                if fut is None:
                    _log.exception("urc L3: an undo failed on the scheduler thread")
                else:
                    fut.set_exception(e)
            else:
                if fut is not None:
                    fut.set_result(result)


class _LoopThread:
    """An event loop in a daemon thread, reached through a blocking portal."""

    def __init__(self) -> None:
        ready: queue.SimpleQueue[BlockingPortal] = queue.SimpleQueue()

        async def serve() -> None:
            async with BlockingPortal() as portal:
                ready.put(portal)
                await portal.sleep_until_stopped()

        self.thread = threading.Thread(target=anyio.run, args=(serve,), name="urc-l3", daemon=True)
        self.thread.start()
        self.portal = ready.get(timeout=30)

    def stop(self) -> None:
        self.portal.call(self.portal.stop, True)
        self.thread.join(timeout=30)


class _ThreadHop(TierEvents):
    """Deliver the cache's tier events to ``target`` on the worker's loop, the scheduler
    thread waiting until each is recorded (a host eviction's pages are staged before the
    slots are freed)."""

    def __init__(self, target: TierEvents, portal: BlockingPortal) -> None:
        self.target = target
        self.portal = portal

    def _hop(self, fn: Callable[..., None], *args: Any) -> None:
        async def run() -> None:
            fn(*args)

        self.portal.call(run)

    def backup_due(self) -> None:
        self._hop(self.target.backup_due)

    def host_committed(self, node: TreeNode) -> None:
        self._hop(self.target.host_committed, node)

    def host_evicted(self, node: TreeNode) -> None:
        self._hop(self.target.host_evicted, node)


class _Prefetch:
    """One request's prefetch in flight: its task's future and its ``BEST_EFFORT`` stop."""

    __slots__ = ("future", "stop")

    def __init__(self, future: concurrent.futures.Future[int], stop: anyio.Event) -> None:
        self.future = future
        self.stop = stop


class SchedulerStorage:
    """An L3 store attached to urc's tree inside SGLang's scheduler (see the module
    docstring).  Built and driven on the scheduler thread; :meth:`close` detaches it."""

    def __init__(
        self,
        cache: UnifiedRadixCache,
        tier: HostMemoryTier,
        open_backend: Callable[[], Awaitable[StorageBackend]],
        config: StorageConfig,
        backend_type: str,
    ) -> None:
        self.cache = cache
        self.backend_type = backend_type
        self.actor = SchedulerActor(cache)
        self._loop = _LoopThread()
        portal = self._loop.portal
        try:
            self.store = portal.call(open_backend)
            self.worker = StorageWorker(cache, tier, self.store, config, attached=False)
        except BaseException:
            self._loop.stop()
            raise
        self.worker.attach(cache)
        # The writer's events hop to its loop (it keeps anyio state there).
        cache.unsubscribe(self.worker.writer)
        self._hop = _ThreadHop(self.worker.writer, portal)
        cache.subscribe(self._hop)
        # The actor stands in for the service (the ``svc`` the worker's coroutines take).
        self._svc: Any = cast(Any, self.actor)
        self._writes = portal.start_task_soon(self.worker.run, self._svc)
        #: Prefetches in flight or finished and not yet popped, by request attempt.
        self.prefetches: dict[Any, _Prefetch] = {}

    @property
    def config(self) -> StorageConfig:
        return self.worker.config

    # ------------------------------------------------------------------ scheduler turns
    def run_calls(self) -> int:
        """Run the tree steps the worker queued (see :class:`SchedulerActor`)."""
        return self.actor.run_calls()

    def pending_writes(self) -> int:
        """Backups queued or being written (SGLang's ``ongoing_backup``)."""
        return self.worker.writer.pending

    # ------------------------------------------------------------------ prefetch
    def prefetch(self, handle: Any, key: RadixKey) -> bool:
        """Start reading ``key``'s pages that are in the store but not on host into host
        memory (host-only nodes), for request attempt ``handle``; returns whether one was
        started (False: one is in flight for it already)."""
        if handle in self.prefetches:
            return False
        portal = self._loop.portal
        stop = portal.call(_new_event)
        future = portal.start_task_soon(self.worker.prefetch, self._svc, key, stop)
        self.prefetches[handle] = _Prefetch(future, stop)
        return True

    def progress(self, handle: Any) -> bool:
        """Whether ``handle``'s prefetch is over (True when it has none).  Under
        ``BEST_EFFORT`` the request is being scheduled: the prefetch is told to stop and
        commit what arrived, and this waits for that."""
        pf = self.prefetches.get(handle)
        if pf is None:
            return True
        self.run_calls()
        if pf.future.done():
            return True
        if self.config.prefetch_policy is not PrefetchStopPolicy.BEST_EFFORT:
            return False
        self._loop.portal.call(_set_event, pf.stop)
        while not pf.future.done():  # its commit is a call this thread runs
            self.run_calls()
            try:
                pf.future.result(timeout=0.001)
            except concurrent.futures.TimeoutError:
                continue
            except BaseException:
                break
        return True

    def pop_loaded(self, handle: Any) -> int:
        """Tokens ``handle``'s finished prefetch inserted (0: none, a miss or a failure);
        forgets it.  One still running is left alone (0)."""
        pf = self.prefetches.get(handle)
        if pf is None or not pf.future.done():
            return 0
        del self.prefetches[handle]
        if pf.future.cancelled() or pf.future.exception() is not None:
            return 0
        return pf.future.result()

    def release(self, handle: Any) -> None:
        """The request was aborted: cancel its prefetch (what it reserved is given back at
        the next scheduler turns) and forget it."""
        pf = self.prefetches.pop(handle, None)
        if pf is not None and not pf.future.done():
            pf.future.cancel()

    # ------------------------------------------------------------------ clear
    def clear(self, timeout_s: float = 30.0) -> int:
        """``/hicache/storage-backend/clear``: flush the queued writes (within
        ``timeout_s``: pages already due reach the store, and go with the rest), then
        delete this deployment's pages from the store (see
        :meth:`~hicache.storage.base.StorageBackend.clear`); returns how many.  The store
        stays attached.  Raises what the store's ``clear`` raises
        (:class:`~hicache.storage.errors.StorageError`)."""
        portal = self._loop.portal
        self._wait(portal.start_task_soon(self.worker.flush, timeout_s))
        done = portal.start_task_soon(self.store.clear)
        self._wait(done)
        return done.result()

    def _wait(self, future: concurrent.futures.Future[Any]) -> None:
        """Run the worker's tree steps on this thread until ``future`` is done."""
        while not future.done():
            self.run_calls()
            try:
                future.result(timeout=0.01)
            except concurrent.futures.TimeoutError:
                continue
            except BaseException:
                break
        self.run_calls()

    # ------------------------------------------------------------------ detach
    def close(self, timeout_s: float = 30.0) -> None:
        """Detach: cancel the prefetches, flush the queued writes (within ``timeout_s``),
        stop the writer, unsubscribe, close the store and the loop thread.  The scheduler
        thread keeps running the worker's tree steps meanwhile."""
        for handle in list(self.prefetches):
            self.release(handle)
        portal = self._loop.portal
        self._wait(portal.start_task_soon(self.worker.close, timeout_s))
        self._writes.cancel()
        while not self._writes.done():
            self.run_calls()
            try:
                self._writes.result(timeout=0.01)
            except (concurrent.futures.TimeoutError, concurrent.futures.CancelledError):
                continue
            except BaseException:
                break
        self.run_calls()
        self.cache.unsubscribe(self._hop)
        self._detach_worker(timeout_s)
        self.worker.writer.drop_queued()
        try:
            portal.call(self.store.close)
        finally:
            self._loop.stop()

    def _detach_worker(self, timeout_s: float) -> None:
        """Detach the worker from the cache (a later ``/hicache/storage-backend`` attach
        builds a new one), once its cancelled prefetches have given back their pins (their
        last tree steps run here); after ``timeout_s`` the detach's error is raised."""
        deadline = time.monotonic() + timeout_s
        while True:
            self.run_calls()
            try:
                self.worker.detach(self.cache)
                return
            except InvalidInputError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.005)


async def _new_event() -> anyio.Event:
    return anyio.Event()


async def _set_event(event: anyio.Event) -> None:
    event.set()


# ---------------------------------------------------------------------- configuration
def parse_extra_config(text: str | None) -> dict[str, Any]:
    """``--hicache-storage-backend-extra-config``: a JSON object, or ``@path`` of a JSON
    file.  Raises :class:`~urc.errors.ConfigError` for anything else."""
    if not text:
        return {}
    try:
        if text.startswith("@"):
            text = Path(text[1:]).read_text()
        value = json.loads(text)
    except (OSError, ValueError) as e:
        raise ConfigError(f"--hicache-storage-backend-extra-config: {e}") from e
    if not isinstance(value, dict):
        raise ConfigError("--hicache-storage-backend-extra-config must be a JSON object")
    return value


def storage_config(
    prefetch_policy: str, naming: SGLangNaming, page_size: int, extra: Mapping[str, Any]
) -> StorageConfig:
    """The worker's configuration for SGLang's ``--hicache-storage-prefetch-policy`` and
    the extra config's ``prefetch_threshold`` (tokens, default 256),
    ``prefetch_timeout_base`` (s, default 1) and ``prefetch_timeout_per_ki_token`` (s per
    1024 tokens, default 0.25), with SGLang's object names (its key scheme: pages a
    default SGLang replica shares)."""
    try:
        policy = PrefetchStopPolicy(prefetch_policy)
    except ValueError:
        raise ConfigError(
            f"--hicache-storage-prefetch-policy {prefetch_policy}: urc serves "
            + ", ".join(p.value for p in PrefetchStopPolicy)
        ) from None
    threshold = int(extra.get("prefetch_threshold", 256))
    per_ki = float(extra.get("prefetch_timeout_per_ki_token", 0.25))
    return StorageConfig(
        prefetch_policy=policy,
        prefetch_threshold_pages=max(1, threshold // page_size),
        timeout_base_s=float(extra.get("prefetch_timeout_base", 1.0)),
        timeout_per_page_s=per_ki * page_size / 1024,
        key_scheme=KeyScheme.SGLANG,
        sglang_naming=naming,
    )


# The extra-config keys SGLang's storage controller reads itself (not a store's settings).
_CONTROLLER_KEYS = (
    "prefetch_threshold",
    "prefetch_timeout_base",
    "prefetch_timeout_per_ki_token",
    "hicache_storage_pass_prefix_keys",
)


def attach_storage(
    cache: UnifiedRadixCache,
    tier: HostMemoryTier,
    backend: str,
    extra_config_json: str | None,
    model_name: str | None,
    prefetch_policy: str,
    tp_rank: int = 0,
    tp_size: int = 1,
) -> SchedulerStorage:
    """Open urc's store for SGLang's storage options and attach it to ``cache`` (see
    :func:`open_store` and :func:`storage_config`).  Raises
    :class:`~urc.errors.ConfigError` for an option urc cannot serve (nothing attached)."""
    extra = parse_extra_config(extra_config_json)
    naming = SGLangNaming(model_name or "", tp_rank, tp_size)
    config = storage_config(prefetch_policy, naming, cache.page_size, extra)
    settings = {k: v for k, v in extra.items() if k not in _CONTROLLER_KEYS}
    return SchedulerStorage(
        cache, tier, open_store(backend, settings, naming.suffix), config, backend
    )


def open_store(
    backend: str, extra_config: Mapping[str, Any] | None, sglang_suffix: str | None = None
) -> Callable[[], Awaitable[StorageBackend]]:
    """How to open urc's store for ``--hicache-storage-backend backend`` with
    ``--hicache-storage-backend-extra-config`` (parsed): ``file`` -- ``HiCacheFile``'s
    directory (``SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR``, else the extra config's
    ``file_storage_path``, else ``/tmp/hicache``); ``mooncake`` -- SGLang's Mooncake
    settings (``master_server_address`` or ``MOONCAKE_MASTER``, ``protocol``,
    ``global_segment_size``, ``local_hostname``, ``metadata_server``); ``dynamic`` -- urc's
    own store as ``urc.apps.sglang.hicache_storage`` reads the extra config (``store``:
    file, valkey or mooncake, and its settings; ``sglang_suffix``, this rank's page-name
    suffix, is what a capacity-limited file store owns).  ``sglang_suffix`` is the
    deployment every store's ``clear()`` deletes the pages of.  Raises
    :class:`~urc.errors.ConfigError` for another backend or a setting urc cannot serve."""
    extra = dict(extra_config or {})
    if backend == "file":
        path = (
            os.environ.get("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR")
            or extra.get("file_storage_path")
            or "/tmp/hicache"
        )

        async def open_file() -> StorageBackend:
            from hicache.storage.file import FileStorage

            return await FileStorage.open(Path(path), sglang_suffix=sglang_suffix)

        return open_file
    if backend == "mooncake":
        return _open_mooncake(extra, sglang_suffix)
    if backend == "dynamic":
        if extra.get("module_path") not in (None, "urc.apps.sglang.hicache_storage"):
            raise ConfigError(
                "--hicache-storage-backend dynamic with --radix-cache-backend urc: the "
                "backend is urc's own (module_path urc.apps.sglang.hicache_storage), "
                f"not {extra.get('module_path')!r}"
            )

        async def open_dynamic() -> StorageBackend:
            from urc.apps.sglang.hicache_storage import build_store

            return await build_store(extra, sglang_suffix)

        return open_dynamic
    raise ConfigError(
        f"--hicache-storage-backend {backend}: with --radix-cache-backend urc the L3 is "
        f"one of urc's stores ({', '.join(STORAGE_BACKENDS)})"
    )


def _open_mooncake(
    extra: Mapping[str, Any], sglang_suffix: str | None
) -> Callable[[], Awaitable[StorageBackend]]:
    master = extra.get("master_server_address") or os.environ.get("MOONCAKE_MASTER")
    if not master:
        raise ConfigError(
            "--hicache-storage-backend mooncake: no master (extra config "
            "'master_server_address' or MOONCAKE_MASTER)"
        )
    settings: dict[str, Any] = {"master_address": master, "sglang_suffix": sglang_suffix}
    # SGLang's extra-config keys, else its environment variables, as urc's settings.
    for sglang_name, env, urc_name in (
        ("protocol", "MOONCAKE_PROTOCOL", "protocol"),
        ("global_segment_size", "MOONCAKE_GLOBAL_SEGMENT_SIZE", "global_segment_size"),
        ("local_hostname", "MOONCAKE_LOCAL_HOSTNAME", "local_hostname"),
        ("metadata_server", "MOONCAKE_TE_META_DATA_SERVER", "metadata_server"),
    ):
        value = extra.get(sglang_name, os.environ.get(env))
        if value is not None:
            settings[urc_name] = value
    if "global_segment_size" in settings:
        settings["global_segment_size"] = int(settings["global_segment_size"])

    async def open_mooncake() -> StorageBackend:
        from hicache.storage.mooncake import MooncakeConfig, MooncakeProtocol, MooncakeStorage

        fields = dict(settings)
        if "protocol" in fields:
            fields["protocol"] = MooncakeProtocol(fields["protocol"])
        return await MooncakeStorage.open(MooncakeConfig(**fields))

    return open_mooncake
