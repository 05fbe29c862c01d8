"""``CommandExecutor``: applies service commands to a synchronous cache (the actor's core).

This is the synchronous half of the async service: ``apply(command)`` mutates the cache and
returns the command's result, or raises a :class:`~urc.errors.URCError` having changed
nothing.  It owns the lease table (lease id -> locked node and its receipt), so tree nodes
never leave it.  It knows nothing about tasks or streams and can be driven directly, which is
how tests replay a recorded service history on a fresh cache.

:func:`give_back` is the other half of the cancellation rules: the commands that return to
the pools what a command's result would have handed to a caller that is gone.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch

from urc.cache import UnifiedRadixCache
from urc.errors import InvalidInputError, InvalidLockError, LeaseError, OutOfMemoryError
from urc.host import transfers as host_transfers
from urc.host_protocol import BackupTicket, LoadTicket
from urc.node import TreeNode
from urc.params import EvictParams, IncLockRefResult, InsertParams, MatchPrefixParams, MatchResult
from urc.service import _request_ops as request_ops
from urc.service._commands import (
    Alloc,
    AllocMamba,
    AllocReqMamba,
    AllocReqRow,
    AttachWorker,
    CacheFinishedReq,
    CacheUnfinishedReq,
    Call,
    Command,
    DetachWorker,
    Evict,
    EvictHost,
    FinishBackups,
    FinishLoadBack,
    FinishReqLoad,
    Free,
    FreeMamba,
    Insert,
    InsertOutcome,
    Lock,
    Match,
    MatchOutcome,
    MatchReq,
    Release,
    SanityCheck,
    SlideReqWindow,
    StartBackups,
    StartLoadBack,
    StartReqLoad,
    Stats,
    WriteReqSlots,
)
from urc.service._lease import Lease, LeaseOwner, NodeHandle

__all__ = ["CommandExecutor", "give_back"]


_HANDLERS: dict[type[Any], Callable[..., Any]] = {}
_H = TypeVar("_H", bound=Callable[..., Any])


def handles(command_type: type[Any]) -> Callable[[_H], _H]:
    """Register the decorated :class:`CommandExecutor` method as the handler of
    ``command_type`` (one per command: a new operation is a facade method, a command class
    and one handler here)."""

    def register(handler: _H) -> _H:
        assert command_type not in _HANDLERS, f"two handlers for {command_type.__name__}"
        _HANDLERS[command_type] = handler
        return handler

    return register


class CommandExecutor:
    """Applies commands to ``cache``; leases it issues name ``owner`` as their releaser.

    Not thread-safe and not re-entrant: exactly one owner (the service's actor task) calls
    :meth:`apply`.
    """

    __slots__ = ("_dispatch", "_next_lease_id", "cache", "leases", "owner")

    def __init__(self, cache: UnifiedRadixCache, owner: LeaseOwner | None = None) -> None:
        self.cache = cache
        self.owner = owner
        # Lease id -> (lease, locked node, acquire receipt); the only place nodes are kept.
        self.leases: dict[int, tuple[Lease, TreeNode, IncLockRefResult]] = {}
        self._next_lease_id = 1
        # Each command type's handler, bound (see ``handles``).
        self._dispatch: dict[type[Any], Callable[[Any], Any]] = {
            cls: handler.__get__(self) for cls, handler in _HANDLERS.items()
        }

    def apply(self, command: Command) -> Any:
        """Apply ``command`` and return its result (see each command's docstring).

        Raises a :class:`~urc.errors.URCError` with the cache unchanged; any other exception
        means a bug (the cache may be half-updated).
        """
        return self._dispatch[type(command)](command)

    # ------------------------------------------------------------------ leases
    def _new_lease(self, node: TreeNode, depth: int) -> Lease:
        receipt = self.cache.inc_lock_ref(node)
        lease = Lease(self._next_lease_id, depth, self.owner)
        self._next_lease_id += 1
        self.leases[lease.id] = (lease, node, receipt)
        return lease

    def release_lease(self, lease: Lease) -> None:
        """Apply the ``dec_lock_ref`` of ``lease`` (raises :class:`LeaseError` if unknown)."""
        entry = self.leases.get(lease.id)
        if entry is None or entry[0] is not lease:
            raise LeaseError(f"lease {lease.id} is not held by this service")
        _, node, receipt = entry
        self.cache.dec_lock_ref(node, receipt.to_dec_params())
        del self.leases[lease.id]

    def release_all(self) -> int:
        """Release every lease still held (marking each released); returns how many."""
        count = 0
        for lease, node, receipt in list(self.leases.values()):
            self.cache.dec_lock_ref(node, receipt.to_dec_params())
            if not lease.released:
                lease.mark_released()
            count += 1
        self.leases.clear()
        return count

    # ------------------------------------------------------------------ handlers
    @handles(Match)
    def _match(self, cmd: Match) -> MatchOutcome:
        res = self.cache.match_prefix(MatchPrefixParams(cmd.key, cmd.cow_mamba, cmd.req))
        node = res.last_device_node
        n = int(res.indices.shape[0])
        lease = self._new_lease(node, n) if cmd.lock else None
        return MatchOutcome(
            res.indices,
            n,
            res.host_hit_length,
            NodeHandle(node),
            lease,
            res.mamba_branching_seqlen,
        )

    @handles(MatchReq)
    def _match_req(self, cmd: MatchReq) -> MatchOutcome:
        res, load = request_ops.match_req(self.cache, cmd.req, cmd.cow_mamba, cmd.load_back)
        return _req_outcome(res, load)

    @handles(StartReqLoad)
    def _start_req_load(self, cmd: StartReqLoad) -> MatchOutcome:
        res, load = request_ops.start_req_load(self.cache, cmd.req, cmd.threshold)
        return _req_outcome(res, load)

    @handles(FinishReqLoad)
    def _finish_req_load(self, cmd: FinishReqLoad) -> MatchOutcome | None:
        """The re-matched outcome, or ``None`` when nothing was loaded (the request's match
        stands)."""
        load = cmd.load
        res = request_ops.finish_req_load(self.cache, cmd.req, load, cmd.ok, cmd.cow_mamba)
        if res is None:
            return None
        # What the longer hit gained is the host span first (what a concurrent insert added
        # past it counts as device).
        gained = max(0, int(res.indices.shape[0]) - load.prefix_len)
        return _req_outcome(res, None, min(gained, load.host_hit_length))

    @handles(AllocReqRow)
    def _alloc_req_row(self, cmd: AllocReqRow) -> int:
        return request_ops.alloc_req_row(self.cache, cmd.req)

    @handles(WriteReqSlots)
    def _write_req_slots(self, cmd: WriteReqSlots) -> None:
        request_ops.write_req_slots(self.cache, cmd.req, cmd.slots, cmd.committed)

    @handles(AllocReqMamba)
    def _alloc_req_mamba(self, cmd: AllocReqMamba) -> torch.Tensor:
        return request_ops.alloc_req_mamba(self.cache, cmd.req)

    @handles(SlideReqWindow)
    def _slide_req_window(self, cmd: SlideReqWindow) -> int:
        return request_ops.slide_req_window(self.cache, cmd.req, cmd.seq_len)

    @handles(Insert)
    def _insert(self, cmd: Insert) -> InsertOutcome:
        res = self.cache.insert(
            InsertParams(
                key=cmd.key,
                value=cmd.value,
                mamba_value=cmd.mamba_value,
                prev_prefix_len=cmd.prev_prefix_len,
                swa_evicted_seqlen=cmd.swa_evicted_seqlen,
                chunked=cmd.chunked,
                priority=cmd.priority,
            )
        )
        return InsertOutcome(res.prefix_len, res.total_len, res.mamba_exist)

    @handles(Lock)
    def _lock(self, cmd: Lock) -> Lease:
        node = cmd.node.node
        if node.evicted:
            # Demoted to host since the match (or deleted): the lease would hold a node that
            # host eviction may delete under it, and protect fewer tokens than its depth.
            raise InvalidLockError(f"lock on node {node.id}, which was evicted from device")
        depth = 0
        walk: TreeNode | None = node
        while walk is not None and walk.parent is not None:
            depth += walk.key_len
            walk = walk.parent
        return self._new_lease(node, depth)

    @handles(Release)
    def _release(self, cmd: Release) -> None:
        self.release_lease(cmd.lease)

    @handles(Evict)
    def _evict(self, cmd: Evict) -> Any:
        return self.cache.evict(cmd.params)

    @handles(Alloc)
    def _alloc(self, cmd: Alloc) -> torch.Tensor:
        n = cmd.num_tokens
        if n < 0:
            raise InvalidInputError(f"cannot allocate {n} slots")
        out = self.cache.alloc_tokens(n, cmd.evict)
        if out is None:
            cache = self.cache
            pools = ", ".join(
                f"{c.component_type.name}: {c.pool_available()} free, {c.evictable_size} evictable"
                for c in cache.components
            )
            raise OutOfMemoryError(f"cannot allocate {n} slots ({pools})")
        return out

    @handles(Free)
    def _free(self, cmd: Free) -> None:
        self.cache.token_to_kv_pool_allocator.free(cmd.indices)

    def _mamba_pool(self) -> Any:
        pool = self.cache.pools.mamba
        if pool is None:
            raise InvalidInputError("this cache has no Mamba component")
        return pool

    @handles(AllocMamba)
    def _alloc_mamba(self, cmd: AllocMamba) -> torch.Tensor:
        n = cmd.num
        if n < 0:
            raise InvalidInputError(f"cannot allocate {n} Mamba slots")
        pool = self._mamba_pool()
        out: torch.Tensor | None = pool.alloc(n)
        if out is None and cmd.evict:
            self.cache.evict(EvictParams(mamba_num=n - pool.available_size()))
            out = pool.alloc(n)
        if out is None:
            raise OutOfMemoryError(
                f"cannot allocate {n} Mamba slots: {pool.available_size()} free, "
                f"{self.cache.mamba_evictable_size()} evictable"
            )
        return out

    @handles(FreeMamba)
    def _free_mamba(self, cmd: FreeMamba) -> None:
        self._mamba_pool().free(cmd.indices)

    @handles(CacheFinishedReq)
    def _cache_finished(self, cmd: CacheFinishedReq) -> None:
        self.cache.cache_finished_req(cmd.req, cmd.is_insert, hint=cmd.hint)

    @handles(CacheUnfinishedReq)
    def _cache_unfinished(self, cmd: CacheUnfinishedReq) -> None:
        self.cache.cache_unfinished_req(cmd.req, cmd.chunked)

    @handles(Stats)
    def _stats(self, cmd: Stats) -> Any:
        return self.cache.stats()

    @handles(SanityCheck)
    def _sanity_check(self, cmd: SanityCheck) -> None:
        self.cache.sanity_check()
        self.cache.check_pools(cmd.held)

    @handles(StartBackups)
    def _start_backups(self, cmd: StartBackups) -> list[BackupTicket]:
        return host_transfers.start_due_backups(self.cache, cmd.limit)

    @handles(FinishBackups)
    def _finish_backups(self, cmd: FinishBackups) -> int:
        cache, ok = self.cache, cmd.ok
        return sum(host_transfers.finish_backup(cache, t, ok) for t in cmd.tickets)

    @handles(StartLoadBack)
    def _start_load_back(self, cmd: StartLoadBack) -> LoadTicket | None:
        return host_transfers.start_load_back_of(self.cache, cmd.key, cmd.threshold)

    @handles(FinishLoadBack)
    def _finish_load_back(self, cmd: FinishLoadBack) -> int:
        cache, ok = self.cache, cmd.ok
        return sum(host_transfers.finish_load_back(cache, t, ok) for t in cmd.tickets)

    @handles(EvictHost)
    def _evict_host(self, cmd: EvictHost) -> int:
        return self.cache.evict_host(cmd.num_tokens)

    @handles(Call)
    def _call(self, cmd: Call[Any]) -> Any:
        return cmd.fn(self.cache)

    @handles(AttachWorker)
    def _attach_worker(self, cmd: AttachWorker) -> None:
        cmd.worker.attach(self.cache)

    @handles(DetachWorker)
    def _detach_worker(self, cmd: DetachWorker) -> None:
        cmd.worker.detach(self.cache)


def _req_outcome(
    res: MatchResult, load: request_ops.PendingLoad | None, host_loaded: int = 0
) -> MatchOutcome:
    n = int(res.indices.shape[0])
    return MatchOutcome(
        res.indices, n, res.host_hit_length, NodeHandle(res.last_device_node), None,
        res.mamba_branching_seqlen, host_loaded, load,
    )  # fmt: skip


def give_back(cmd: Command, result: Any) -> list[Command]:
    """The commands that give back what ``result`` (``cmd``'s successful result) handed to
    its caller, for a caller that is gone (cancelled natively, see the service's cancellation
    rules).  Marks a returned lease released.  Empty when the result owns nothing: the
    request commands leave what they change in the ``Req``, which the server still holds,
    and what a caller passed in (an insert's value and its unaligned tail, a Mamba value
    the tree did not adopt) is the caller's whichever way it was cancelled: only what it
    would have got back is given back here.

    - a lease (a locking match, a lock): its release;
    - slots from ``alloc`` / ``alloc_mamba``: their free;
    - a request match that started a load-back (``pending_load``): that load dropped
      (the request keeps its match and lock);
    - started backups or a started load-back: aborted (slots freed, nodes unpinned);
    - a ``call`` with an ``undo``: that undo, run on the result;
    - an attached worker (``attach_worker``, whose caller never started it): its detach.
    """
    match cmd:
        case Match() | Lock():
            lease = result if isinstance(result, Lease) else result.lease
            if lease is None or lease.released:
                return []
            lease.mark_released()
            return [Release(lease)]
        case Alloc():
            return [Free(result)] if result.shape[0] else []
        case AllocMamba():
            return [FreeMamba(result)] if result.shape[0] else []
        case MatchReq() | StartReqLoad():
            load = result.pending_load
            return [] if load is None else [FinishReqLoad(cmd.req, load, False)]
        case StartBackups():
            return [FinishBackups(tuple(result), False)] if result else []
        case StartLoadBack():
            return [] if result is None else [FinishLoadBack((result,), False)]
        case Call(undo=undo) if undo is not None:
            return [Call(lambda cache: undo(cache, result))]
        case AttachWorker(worker=worker):
            return [DetachWorker(worker)]
        case _:
            return []
