"""The HiCache surface SGLang 0.5.23's scheduler reads of its tree cache, served by urc's
host tier (``--enable-hierarchical-cache`` with ``--radix-cache-backend urc``).

What the scheduler reads, and where (``managers/scheduler.py`` unless named):

- ``is_fully_idle`` (every idle turn, ``/flush_cache``, storage attach/detach):
  ``ongoing_write_through``, ``ongoing_load_back``, ``enable_storage`` and, with storage,
  ``ongoing_prefetch`` and ``ongoing_backup``: the transfers in flight (write-through
  backups whose copies run on the host tier's engine; load-backs committed and not yet
  copied; L3 prefetches and writes on the L3 worker's thread);
- ``_process_hicache_events`` / ``process_batch_result``: ``check_hicache_events`` and
  ``flush_pending_backups`` (commit the backups whose copies completed, start those that
  came due, without waiting for their copies);
- ``schedule_policy.add_one_req``: ``init_load_back`` and ``load_back_is_cache_owned`` for a
  request whose match ends on host-only nodes; ``get_new_batch_prefill``:
  ``ready_to_load_host_cache`` (start the queued load-backs; the batch's forward waits for
  each layer it reads: :mod:`urc.apps.sglang._load_back`);
- ``cache_controller``: SGLang's registry logs ``hicache_attached`` from it, and the
  scheduler sets fence streams on it and reads ``storage_backend`` / ``write_policy``
  (:class:`HostTierController`);
- ``/hicache/storage-backend`` (``attach_storage_backend``, ``detach_storage_backend``)
  and ``/hicache/storage-backend/clear`` (``clear_storage_backend``).

This module imports no SGLang: :class:`HiCacheSurface` is a mixin of
:class:`~urc.apps.sglang._cache.SGLangRadixCache`.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from hicache.transfer_engine import Lane
from urc.apps.sglang._load_back import (
    LayerLoadCounter,
    LayerPlan,
    PendingLoad,
    commit_load_back,
    load_work,
    release_load_back,
)
from urc.host import transfers as host_transfers
from urc.node import ComponentType, TreeNode

if TYPE_CHECKING:
    from hicache.host_tier import HostMemoryTier
    from hicache.transfer_engine import Completion
    from urc.apps.sglang._l3 import SchedulerStorage
    from urc.cache import UnifiedRadixCache

__all__ = ["HiCacheSurface", "HostTierController"]

_log = logging.getLogger(__name__)


class HostTierController:
    """What SGLang reads of ``tree_cache.cache_controller`` with urc's host tier as the
    controller: the write policy, the L3 backend, the layer-wise transfer counter
    (``layer_done_counter``: :class:`~urc.apps.sglang._load_back.LayerLoadCounter` on a CPU
    device, else None: load-backs there land before ``init_load_back`` returns), no CUDA
    transfer in flight.

    The scheduler assigns ``load_fence_stream`` / ``write_fence_stream`` (the forward
    stream); urc's copies do not fence on them (on a CPU device there are no streams; on
    CUDA they complete before the forward starts).
    """

    def __init__(self, write_policy: str, host: HostMemoryTier) -> None:
        self.write_policy = write_policy
        self.host = host
        self.storage_backend: Any = None
        self.storage_backend_type: str | None = None
        self.layer_done_counter: Any = None
        self.load_fence_stream: Any = None
        self.write_fence_stream: Any = None

    def has_inflight_device_transfers(self) -> bool:
        """No CUDA copy of urc's is in flight on a stream SGLang would have to gate on:
        False (urc's copies on CUDA complete before ``init_load_back`` returns)."""
        return False


class HiCacheSurface:
    """HiCache methods and attributes of :class:`~urc.apps.sglang._cache.SGLangRadixCache`
    (see the module docstring).  ``self.urc`` is the core and ``self.host`` urc's host tier
    (``None`` without ``--enable-hierarchical-cache``: every method is then a no-op)."""

    urc: UnifiedRadixCache
    host: HostMemoryTier | None
    cache_controller: Any

    def init_hicache_surface(self) -> None:
        """Set the surface's state: empty in-flight tables, no L3, and a
        :class:`HostTierController` when the host tier is attached (else ``None``, as
        SGLang's own cache without HiCache)."""
        #: Write-through backups whose copies are in flight: ticket and completions.
        self.ongoing_write_through: dict[int, tuple[Any, list[Any]]] = {}
        #: Load-backs committed to the tree whose copies have not completed (queued or
        #: in flight), by id; empty while load-backs are synchronous.
        self.ongoing_load_back: dict[int, PendingLoad] = {}
        #: Layer-wise load-backs (:meth:`enable_layerwise_load_back`): the counter the KV
        #: pool waits on, the host buffers of each layer, the loads not started yet, and
        #: the last transfer started (its producer slot and completion).
        self.load_counter: LayerLoadCounter | None = None
        self.load_plan: LayerPlan = ()
        self._load_queue: list[PendingLoad] = []
        self._last_load: tuple[int, Completion] | None = None
        #: urc's L3 store inside the scheduler (``--hicache-storage-backend``), or None.
        self.l3: SchedulerStorage | None = None
        self.hicache_storage_pass_prefix_keys = False
        self.storage_prefetch_retries = None
        self.buffer_pipeline = None
        policy = self.urc.write_policy
        self.cache_controller = (
            HostTierController(policy.value, self.host)
            if self.host is not None and policy is not None
            else None
        )

    # ------------------------------------------------------------------ load-back
    def enable_layerwise_load_back(self, counter: LayerLoadCounter, plan: LayerPlan) -> None:
        """Run load-backs off the scheduler thread from now on, signalling ``counter`` layer
        by layer (``plan``: the host buffers of each model layer); the caller registers
        ``counter`` where the forward waits on it (SGLang's KV pool and model worker)."""
        if self.host is None:
            raise ValueError("layer-wise load-backs need the host tier")
        if len(plan) != counter.num_layers:
            raise ValueError(
                f"a plan of {len(plan)} layers for a {counter.num_layers}-layer counter"
            )
        self.load_counter = counter
        self.load_plan = plan
        if self.cache_controller is not None:
            self.cache_controller.layer_done_counter = counter

    def init_load_back(self, params: Any) -> tuple[int, TreeNode] | None:
        """Load the host-only part of the path to ``params.best_match_node`` to device.
        Returns ``(tokens loaded, the node the request's prefix now ends on)``: all the
        promised host hit, or ``(0, req.last_node)`` when device memory could not be found
        (SGLang then recomputes).  Layer-wise (:meth:`enable_layerwise_load_back`): the
        device slots are the tree's on return and the copy is queued (started by
        :meth:`ready_to_load_host_cache`; the batch's forward waits layer by layer);
        otherwise the copy has completed when this returns."""
        node = params.best_match_node
        if self.host is None:
            return 0, params.req.last_node
        if self.load_counter is None:
            loaded = self.urc.load_back(node)
            return (loaded, node) if loaded else (0, params.req.last_node)
        ticket = host_transfers.start_load_back(self.urc, node)
        if ticket is None:
            return 0, params.req.last_node
        pending = commit_load_back(self.urc, ticket)
        self._load_queue.append(pending)
        self.ongoing_load_back[id(pending)] = pending
        return pending.tokens, node

    def load_back_is_cache_owned(self) -> bool:
        """The loaded slots belong to the tree (``cache_protected_len`` covers them)."""
        return True

    def ready_to_load_host_cache(self) -> int:
        """Start the queued load-backs as one transfer on the host tier's load worker and
        return its producer slot: the new batch's ``hicache_consumer_index``, whose forward
        waits for each layer it reads.  Nothing queued: the slot of a transfer still in
        flight (the batch may read slots it fills), else -1."""
        counter = self.load_counter
        if counter is None:
            return -1
        if not self._load_queue:
            last = self._last_load
            return last[0] if last is not None and not last[1].done() else -1
        return self._start_loads(counter)

    def _start_loads(self, counter: LayerLoadCounter) -> int:
        """Submit the queued load-backs; returns their producer slot."""
        assert self.host is not None
        loads, self._load_queue = self._load_queue, []
        index = counter.update_producer()
        completion = self.host.submit(
            Lane.LOAD, load_work(self.host, loads, self.load_plan, counter, index)
        )
        for pending in loads:
            pending.completion = completion
            pending.producer = index
        self._last_load = (index, completion)
        return index

    def _finish_load_backs(self, wait: bool = False) -> None:
        """Release the pins of the load-backs whose copies completed (``wait``: start the
        queued ones and wait for every one)."""
        if wait and self._load_queue and self.load_counter is not None:
            self._start_loads(self.load_counter)
        ongoing = self.ongoing_load_back
        for key in list(ongoing):
            completion = ongoing[key].completion
            if completion is None or not (wait or completion.done()):
                continue
            completion.wait()  # a failed copy raises here
            release_load_back(self.urc, ongoing.pop(key))

    # ------------------------------------------------------------------ backups
    def check_hicache_events(self) -> None:
        """Commit the backups whose copies completed, start the write-through backups that
        came due (evicting unpinned host leaves when the host pool is full), and run the
        tree steps the L3 worker queued."""
        self._finish_load_backs()
        if self._load_queue and self.load_counter is not None:
            # Queued by a batch that was not formed: start them (a later batch that reads
            # their slots waits for this transfer, see ready_to_load_host_cache).
            self._start_loads(self.load_counter)
        self.flush_pending_backups()
        if self.l3 is not None:
            self.l3.run_calls()

    def flush_pending_backups(self) -> None:
        """Commit the backups whose copies completed (``finish_backup``: the host copies
        join the tree, the device pins are released), then start one for every node due
        (``start_backup`` reserves host slots and pins the chain; the copies are submitted
        to the host tier's engine -- a worker thread on the CPU, a stream on CUDA -- and
        not waited for: ``ongoing_write_through`` holds them until they complete).  A node
        whose ancestor's backup is still in flight waits for the next turn."""
        core = self.urc
        host = self.host
        if host is None:
            return
        self._finish_backups()
        deferred: list[TreeNode] = []
        in_flight = core.backups_in_flight
        while core.pending_backups:
            _, node = core.pending_backups.popitem()
            full = node.data[ComponentType.FULL]
            if node.deleted or full is None or full.value is None or full.host_value is not None:
                continue
            ticket = host_transfers.start_backup(core, node)
            if ticket is None and _ancestor_in_flight(node, in_flight):
                deferred.append(node)
                continue
            if ticket is None and self._free_host(node.key_len):
                ticket = host_transfers.start_backup(core, node)
            if ticket is None:
                continue
            done = [host.backup(item.component, item.device, item.host) for _, item in ticket.items]
            self.ongoing_write_through[id(ticket)] = (ticket, done)
        for node in deferred:
            core.pending_backups[node.id] = node

    def wait_for_backups(self) -> None:
        """Wait for every backup and load-back copy in flight and commit / release them
        (what the scheduler's idle turns reach by polling)."""
        self._finish_load_backs(wait=True)
        self._finish_backups(wait=True)

    def _finish_backups(self, wait: bool = False) -> None:
        """Commit every backup in flight whose copies have all completed (``wait``: every
        one, waiting for its copies)."""
        ongoing = self.ongoing_write_through
        for key in [k for k, (_, done) in ongoing.items() if wait or all(d.done() for d in done)]:
            ticket, done = ongoing.pop(key)
            for d in done:
                d.wait()  # a failed copy raises here
            host_transfers.finish_backup(self.urc, ticket)

    def _free_host(self, tokens: int) -> int:
        """Evict unpinned host-only leaves for ``tokens`` host slots; returns tokens freed."""
        return self.urc.evict_host(tokens) if self.host is not None else 0

    def evict_host(self, num_tokens: int) -> int:
        """Free ``num_tokens`` host slots from unpinned host-only leaves; returns tokens
        freed (SGLang's ``evict_host``)."""
        return self._free_host(num_tokens)

    def is_backuped(self, node: TreeNode) -> bool:
        """Whether ``node``'s Full data has a host copy."""
        full = node.data[ComponentType.FULL]
        return full is not None and full.host_value is not None

    def has_pending_cache_operations(self) -> bool:
        return False

    # ------------------------------------------------------------------ storage (L3)
    @property
    def enable_storage(self) -> bool:
        """Whether an L3 store is attached."""
        return self.l3 is not None

    @property
    def ongoing_prefetch(self) -> dict[Any, Any]:
        """Prefetches from L3 in flight or not yet popped, by request attempt."""
        return self.l3.prefetches if self.l3 is not None else {}

    @property
    def ongoing_backup(self) -> range:
        """One entry per L3 write queued or in flight (SGLang reads only its length)."""
        return range(self.l3.pending_writes() if self.l3 is not None else 0)

    def attach_l3(self, l3: SchedulerStorage) -> None:
        """Serve SGLang's storage calls from ``l3`` from now on."""
        self.l3 = l3
        if self.cache_controller is not None:
            self.cache_controller.storage_backend = l3.store
            self.cache_controller.storage_backend_type = l3.backend_type

    def prefetch_from_storage(
        self,
        request: Any,
        last_host_node: TreeNode,
        new_input_tokens: Any,
        last_hash: Any = None,
        prefix_keys: Any = None,
        *,
        matched_prefix_tokens: Any = None,
        extra_key: str | None = None,
        cache_salt: str | None = None,
        storage_hit_end: int | None = None,
    ) -> bool:
        """Start reading from L3 the pages of the request's tokens (``matched_prefix_tokens``
        then ``new_input_tokens``) that are not on host, for attempt ``request``; returns
        whether a prefetch was started.  The pages land as host-only nodes, which the
        request's next match reports as a host hit."""
        if self.l3 is None:
            return False
        from urc.apps.sglang._keys import namespace
        from urc.key import RadixKey

        tokens = [*(matched_prefix_tokens or ()), *new_input_tokens]
        return self.l3.prefetch(request, RadixKey(tokens, namespace(extra_key, cache_salt)))

    def check_prefetch_progress(self, request: Any) -> bool:
        """Whether attempt ``request``'s prefetch is over (SGLang's prefetch stop policy:
        see :meth:`~urc.apps.sglang._l3.SchedulerStorage.progress`)."""
        return self.l3.progress(request) if self.l3 is not None else True

    def has_ongoing_prefetch(self, request: Any) -> bool:
        return self.l3 is not None and request in self.l3.prefetches

    def pop_prefetch_loaded_tokens(self, request: Any) -> int:
        """Tokens attempt ``request``'s finished prefetch brought from L3 (then forgotten)."""
        return self.l3.pop_loaded(request) if self.l3 is not None else 0

    def pop_prefetch_loaded_span(self, request: Any) -> tuple[int, int | None]:
        return self.pop_prefetch_loaded_tokens(request), None

    def release_aborted_request(self, request: Any) -> None:
        """An aborted attempt: cancel its prefetch."""
        if self.l3 is not None:
            self.l3.release(request)

    def get_last_hash_value(self, node: TreeNode) -> None:
        """No page hash is kept on nodes (urc hashes the request's tokens itself)."""
        return None

    def get_prefix_hash_values(self, node: TreeNode) -> list[str]:
        return []

    def attach_storage_backend(
        self,
        storage_backend: str,
        storage_backend_extra_config_json: str | None = None,
        served_model_name: str | None = None,
        hicache_storage_prefetch_policy: str | None = None,
        hicache_write_policy: str | None = None,
    ) -> tuple[bool, str]:
        """``/hicache/storage-backend`` (PUT): attach urc's store for ``storage_backend``
        (``file``, ``mooncake``, ``dynamic``); ``(False, why)`` changes nothing."""
        from hicache.storage.errors import StorageError
        from urc.apps.sglang._l3 import attach_storage
        from urc.errors import URCError

        if self.host is None:
            return False, "HiCache is not enabled (--enable-hierarchical-cache)"
        if self.l3 is not None:
            return False, f"a storage backend ({self.l3.backend_type}) is attached already"
        policy = self.urc.write_policy
        if hicache_write_policy not in (None, policy.value if policy else None):
            return False, (
                f"hicache_write_policy {hicache_write_policy}: urc keeps the launch's write "
                "policy while running"
            )
        try:
            l3 = attach_storage(
                self.urc,
                self.host,
                storage_backend,
                storage_backend_extra_config_json,
                served_model_name,
                hicache_storage_prefetch_policy or "timeout",
            )
        except (URCError, StorageError, OSError, ValueError) as e:
            return False, f"{type(e).__name__}: {e}"
        self.attach_l3(l3)
        return True, f"attached urc's {storage_backend} store"

    def detach_storage_backend(self) -> tuple[bool, str]:
        """``/hicache/storage-backend`` (DELETE): flush the queued writes, detach the store
        and close it; idempotent."""
        if self.l3 is None:
            return True, "no HiCache storage backend is attached"
        l3, self.l3 = self.l3, None
        l3.close()
        if self.cache_controller is not None:
            self.cache_controller.storage_backend = None
            self.cache_controller.storage_backend_type = None
        return True, f"detached urc's {l3.backend_type} store"

    def release_host_resources(self) -> None:
        """SGLang's graceful shutdown: detach the L3 store, flushing its queued writes
        (within 10 s), and wait for the backups in flight."""
        self.wait_for_backups()
        if self.l3 is not None:
            l3, self.l3 = self.l3, None
            l3.close(timeout_s=10.0)

    def clear_storage_backend(self) -> bool:
        """``/hicache/storage-backend/clear`` (SGLang's ``clear_hicache_storage_wrapped``
        calls it on the scheduler thread): flush the queued L3 writes, then delete this
        deployment's pages from the attached store (its rank's page-name suffix; never
        other deployments' in a shared directory or store); the store stays attached.
        ``True`` once cleared; ``False`` without a store, or when the store refused or
        failed the clear (logged, as SGLang's own ``clear`` logs it).  Never raises: the
        scheduler's handler does not catch."""
        if self.l3 is None:
            _log.warning("no HiCache storage backend is attached: nothing to clear")
            return False
        from hicache.storage.errors import StorageError

        try:
            deleted = self.l3.clear()
        except StorageError as e:
            _log.warning(
                "clearing urc's %s store failed: %s: %s", self.l3.backend_type, type(e).__name__, e
            )
            return False
        except Exception:  # a bug: logged with its traceback, the scheduler keeps running
            _log.exception("clearing urc's %s store failed", self.l3.backend_type)
            return False
        _log.info("cleared urc's %s store: %d pages deleted", self.l3.backend_type, deleted)
        return True


def _ancestor_in_flight(node: TreeNode, in_flight: set[int]) -> bool:
    """Whether a node on ``node``'s path (itself included) has a backup in flight."""
    walk: TreeNode | None = node
    while walk is not None and walk.parent is not None:
        if walk.id in in_flight:
            return True
        walk = walk.parent
    return False
