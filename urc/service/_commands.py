"""Commands of the async service: one frozen dataclass per operation, and their results.

Every public coroutine of :class:`~urc.service.AsyncUnifiedRadixCache` builds one of these, sends it
to the actor and awaits the reply; the executor (:class:`~urc.service._executor.CommandExecutor`)
applies it to the synchronous core.  Commands are immutable; the objects they point at (a ``Req``, a
value tensor) are owned by the caller until the actor has applied the command.
Results that cross back to callers never contain tree nodes: a match returns a
:class:`MatchOutcome` (indices, hit lengths, an opaque :class:`~urc.service.NodeHandle` and,
when asked, a :class:`~urc.service.Lease`), an insert an :class:`InsertOutcome`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any, ClassVar, Generic, TypeAlias, TypeVar, get_args, get_origin

import torch

from urc.host_protocol import BackupTicket, LoadTicket
from urc.key import RadixKey
from urc.params import EvictParams, EvictResult
from urc.reuse_hint import ReuseHint
from urc.stats import CacheStats

if TYPE_CHECKING:
    from urc.cache import UnifiedRadixCache
    from urc.node import ComponentType
    from urc.req import Req
    from urc.service._attachable import AttachableWorker
    from urc.service._lease import Lease, NodeHandle
    from urc.service._request_ops import PendingLoad

__all__ = [
    "Alloc",
    "AllocMamba",
    "AllocReqMamba",
    "AllocReqRow",
    "AttachWorker",
    "COMMAND_TYPES",
    "CacheFinishedReq",
    "CacheUnfinishedReq",
    "Call",
    "Command",
    "CommandKind",
    "DetachWorker",
    "Evict",
    "EvictHost",
    "FinishBackups",
    "FinishLoadBack",
    "FinishReqLoad",
    "Free",
    "FreeMamba",
    "Insert",
    "InsertOutcome",
    "Lock",
    "Match",
    "MatchOutcome",
    "MatchReq",
    "OnCancel",
    "Release",
    "SanityCheck",
    "SlideReqWindow",
    "StartBackups",
    "StartLoadBack",
    "StartReqLoad",
    "Stats",
    "WriteReqSlots",
]


_R = TypeVar("_R", covariant=True)
_T = TypeVar("_T")


class Returns(Generic[_R]):
    """A command whose reply is an ``_R``: the service's ``_submit`` returns that type, so
    no call site annotates what it awaits."""

    __slots__ = ()


class CommandKind(Enum):
    """What a command asks the actor to do (one value per public service operation)."""

    MATCH = "match"
    MATCH_REQ = "match_req"
    INSERT = "insert"
    LOCK = "lock"
    RELEASE = "release"
    EVICT = "evict"
    ALLOC = "alloc"
    FREE = "free"
    ALLOC_MAMBA = "alloc_mamba"
    FREE_MAMBA = "free_mamba"
    START_REQ_LOAD = "start_req_load"
    FINISH_REQ_LOAD = "finish_req_load"
    ALLOC_REQ_ROW = "alloc_req_row"
    WRITE_REQ_SLOTS = "write_req_slots"
    ALLOC_REQ_MAMBA = "alloc_req_mamba"
    SLIDE_REQ_WINDOW = "slide_req_window"
    CACHE_FINISHED_REQ = "cache_finished_req"
    CACHE_UNFINISHED_REQ = "cache_unfinished_req"
    STATS = "stats"
    SANITY_CHECK = "sanity_check"
    START_BACKUPS = "start_backups"
    FINISH_BACKUPS = "finish_backups"
    START_LOAD_BACK = "start_load_back"
    FINISH_LOAD_BACK = "finish_load_back"
    EVICT_HOST = "evict_host"
    CALL = "call"
    ATTACH_WORKER = "attach_worker"
    DETACH_WORKER = "detach_worker"


class OnCancel(Enum):
    """What happens to a command whose caller is cancelled after sending it."""

    SKIP = 0  # skipped if the actor has not taken it yet; a lease it produced is released
    APPLY = 1  # applied anyway (a release: the lease is already marked released)
    AWAIT = 2  # the caller waits (shielded) for the outcome: slots or a request change owner


@dataclass(frozen=True, slots=True)
class Match(Returns["MatchOutcome"]):
    """Longest cached prefix of ``key``; with ``lock`` also lock it (the result has a lease).

    ``cow_mamba`` with ``req`` copies the matched Mamba state into ``req``'s own slot.
    """

    kind: ClassVar[CommandKind] = CommandKind.MATCH
    on_cancel: ClassVar[OnCancel] = OnCancel.SKIP
    key: RadixKey
    lock: bool = False
    cow_mamba: bool = False
    req: Req | None = None


@dataclass(frozen=True, slots=True)
class MatchReq(Returns["MatchOutcome"]):
    """Match ``req``'s tokens and attach the lock to ``req`` (``last_node``/``lock``),
    setting ``prefix_indices`` and ``cache_protected_len``; ``cache_*_req`` releases it.

    ``load_back``: a threshold (tokens; ``None``: never): a host continuation at least that
    long also starts loading back (the outcome's ``pending_load``, which a
    :class:`FinishReqLoad` must follow)."""

    kind: ClassVar[CommandKind] = CommandKind.MATCH_REQ
    on_cancel: ClassVar[OnCancel] = OnCancel.AWAIT
    req: Req
    cow_mamba: bool = False
    load_back: int | None = None


@dataclass(frozen=True, slots=True)
class StartReqLoad(Returns["MatchOutcome"]):
    """For a request holding its lock: match again and start loading the host continuation
    (at least ``threshold`` tokens) back; the outcome's ``pending_load`` (if any) must be
    followed by a :class:`FinishReqLoad`.  The lock is unchanged."""

    kind: ClassVar[CommandKind] = CommandKind.START_REQ_LOAD
    on_cancel: ClassVar[OnCancel] = OnCancel.AWAIT
    req: Req
    threshold: int = 0


@dataclass(frozen=True, slots=True)
class FinishReqLoad(Returns["MatchOutcome | None"]):
    """Commit ``load`` (``ok``: its bytes were copied) or drop it; after a commit, re-match
    ``req`` and move its lock to the longer hit (``cow_mamba`` as for :class:`MatchReq`)."""

    kind: ClassVar[CommandKind] = CommandKind.FINISH_REQ_LOAD
    on_cancel: ClassVar[OnCancel] = OnCancel.AWAIT
    req: Req
    load: PendingLoad
    ok: bool = True
    cow_mamba: bool = False


@dataclass(frozen=True, slots=True)
class AllocReqRow(Returns[int]):
    """Give ``req`` a ``req_to_token`` row; the result is its index."""

    kind: ClassVar[CommandKind] = CommandKind.ALLOC_REQ_ROW
    on_cancel: ClassVar[OnCancel] = OnCancel.AWAIT
    req: Req


@dataclass(frozen=True, slots=True)
class WriteReqSlots(Returns[None]):
    """Write caller-owned ``slots`` into ``req``'s row after what it holds (the request then
    owns them) and set its committed length to ``committed``."""

    kind: ClassVar[CommandKind] = CommandKind.WRITE_REQ_SLOTS
    on_cancel: ClassVar[OnCancel] = OnCancel.AWAIT
    req: Req
    slots: torch.Tensor
    committed: int


@dataclass(frozen=True, slots=True)
class AllocReqMamba(Returns[torch.Tensor]):
    """Give ``req`` its live Mamba state slot unless it has one; the result is that slot."""

    kind: ClassVar[CommandKind] = CommandKind.ALLOC_REQ_MAMBA
    on_cancel: ClassVar[OnCancel] = OnCancel.AWAIT
    req: Req


@dataclass(frozen=True, slots=True)
class SlideReqWindow(Returns[int]):
    """SWA: free ``req``'s own SWA slots that slid out of the window at ``seq_len`` tokens;
    the result is the SWA tokens freed."""

    kind: ClassVar[CommandKind] = CommandKind.SLIDE_REQ_WINDOW
    on_cancel: ClassVar[OnCancel] = OnCancel.AWAIT
    req: Req
    seq_len: int


@dataclass(frozen=True, slots=True)
class Insert(Returns["InsertOutcome"]):
    """Insert ``key`` -> ``value`` (see ``UnifiedRadixCache.insert`` for slot ownership)."""

    kind: ClassVar[CommandKind] = CommandKind.INSERT
    on_cancel: ClassVar[OnCancel] = OnCancel.AWAIT
    key: RadixKey
    value: torch.Tensor
    prev_prefix_len: int = 0
    mamba_value: torch.Tensor | None = None
    swa_evicted_seqlen: int = 0
    chunked: bool = False
    priority: int = 0


@dataclass(frozen=True, slots=True)
class Lock(Returns["Lease"]):
    """Lock the node behind ``node`` (from an earlier match); the result is a lease."""

    kind: ClassVar[CommandKind] = CommandKind.LOCK
    on_cancel: ClassVar[OnCancel] = OnCancel.SKIP
    node: NodeHandle


@dataclass(frozen=True, slots=True)
class Release(Returns[None]):
    """Release ``lease`` (already marked released by the caller)."""

    kind: ClassVar[CommandKind] = CommandKind.RELEASE
    on_cancel: ClassVar[OnCancel] = OnCancel.APPLY
    lease: Lease


@dataclass(frozen=True, slots=True)
class Evict(Returns[EvictResult]):
    """Evict at least the amounts in ``params`` where possible."""

    kind: ClassVar[CommandKind] = CommandKind.EVICT
    on_cancel: ClassVar[OnCancel] = OnCancel.SKIP
    params: EvictParams


@dataclass(frozen=True, slots=True)
class Alloc(Returns[torch.Tensor]):
    """Allocate ``num_tokens`` Full KV slots for the caller, evicting first if ``evict``."""

    kind: ClassVar[CommandKind] = CommandKind.ALLOC
    on_cancel: ClassVar[OnCancel] = OnCancel.AWAIT
    num_tokens: int
    evict: bool = True


@dataclass(frozen=True, slots=True)
class Free(Returns[None]):
    """Give caller-owned Full KV slots back to the allocator."""

    kind: ClassVar[CommandKind] = CommandKind.FREE
    on_cancel: ClassVar[OnCancel] = OnCancel.AWAIT
    indices: torch.Tensor


@dataclass(frozen=True, slots=True)
class AllocMamba(Returns[torch.Tensor]):
    """Allocate ``num`` Mamba state slots for the caller, evicting states first if ``evict``."""

    kind: ClassVar[CommandKind] = CommandKind.ALLOC_MAMBA
    on_cancel: ClassVar[OnCancel] = OnCancel.AWAIT
    num: int = 1
    evict: bool = True


@dataclass(frozen=True, slots=True)
class FreeMamba(Returns[None]):
    """Give caller-owned Mamba state slots back to the pool (all or nothing)."""

    kind: ClassVar[CommandKind] = CommandKind.FREE_MAMBA
    on_cancel: ClassVar[OnCancel] = OnCancel.AWAIT
    indices: torch.Tensor


@dataclass(frozen=True, slots=True)
class CacheFinishedReq(Returns[None]):
    """``cache_finished_req(req, is_insert, hint=hint)``."""

    kind: ClassVar[CommandKind] = CommandKind.CACHE_FINISHED_REQ
    on_cancel: ClassVar[OnCancel] = OnCancel.AWAIT
    req: Req
    is_insert: bool = True
    hint: ReuseHint | None = None


@dataclass(frozen=True, slots=True)
class CacheUnfinishedReq(Returns[None]):
    """``cache_unfinished_req(req, chunked)``."""

    kind: ClassVar[CommandKind] = CommandKind.CACHE_UNFINISHED_REQ
    on_cancel: ClassVar[OnCancel] = OnCancel.AWAIT
    req: Req
    chunked: bool = False


@dataclass(frozen=True, slots=True)
class Stats(Returns[CacheStats]):
    """A ``CacheStats`` snapshot."""

    kind: ClassVar[CommandKind] = CommandKind.STATS
    on_cancel: ClassVar[OnCancel] = OnCancel.SKIP


@dataclass(frozen=True, slots=True)
class SanityCheck(Returns[None]):
    """``sanity_check()`` then ``check_pools(held)`` (``held``: units owned by requests)."""

    kind: ClassVar[CommandKind] = CommandKind.SANITY_CHECK
    on_cancel: ClassVar[OnCancel] = OnCancel.SKIP
    held: Mapping[ComponentType, int] | None = None


# ---------------------------------------------------------------- the host tier's transfers
@dataclass(frozen=True, slots=True)
class StartBackups(Returns["list[BackupTicket]"]):
    """Start the backups of up to ``limit`` due nodes (host slots reserved, nodes pinned):
    :func:`urc.host.transfers.start_due_backups`.  A caller gone before it got the tickets
    has them aborted (``give_back``)."""

    kind: ClassVar[CommandKind] = CommandKind.START_BACKUPS
    on_cancel: ClassVar[OnCancel] = OnCancel.AWAIT
    limit: int


@dataclass(frozen=True, slots=True)
class FinishBackups(Returns[int]):
    """Commit (``ok``) or drop the copies of ``tickets`` and unpin; the tokens backed up."""

    kind: ClassVar[CommandKind] = CommandKind.FINISH_BACKUPS
    on_cancel: ClassVar[OnCancel] = OnCancel.AWAIT
    tickets: tuple[BackupTicket, ...]
    ok: bool = True


@dataclass(frozen=True, slots=True)
class StartLoadBack(Returns["LoadTicket | None"]):
    """Start loading the host continuation of ``key``'s cached prefix back to device (at
    least ``threshold`` tokens): :func:`urc.host.transfers.start_load_back_of`.  A caller
    gone before it got the ticket has it aborted (``give_back``)."""

    kind: ClassVar[CommandKind] = CommandKind.START_LOAD_BACK
    on_cancel: ClassVar[OnCancel] = OnCancel.AWAIT
    key: RadixKey
    threshold: int = 0


@dataclass(frozen=True, slots=True)
class FinishLoadBack(Returns[int]):
    """Commit (``ok``) or drop the loaded device slots of ``tickets`` and unpin; the tokens
    loaded."""

    kind: ClassVar[CommandKind] = CommandKind.FINISH_LOAD_BACK
    on_cancel: ClassVar[OnCancel] = OnCancel.AWAIT
    tickets: tuple[LoadTicket, ...]
    ok: bool = True


@dataclass(frozen=True, slots=True)
class EvictHost(Returns[int]):
    """Free host-only leaves (no host lock), oldest first, for ``num_tokens`` host slots;
    the Full tokens freed."""

    kind: ClassVar[CommandKind] = CommandKind.EVICT_HOST
    on_cancel: ClassVar[OnCancel] = OnCancel.SKIP
    num_tokens: int


@dataclass(frozen=True, slots=True)
class Call(Returns[_T]):
    """Run ``fn(cache)`` inside the actor (internal: HiCache workers, tests).

    ``fn`` must be synchronous and atomic in the same sense as the core: raise a
    :class:`~urc.errors.URCError` before changing anything, or succeed.  ``undo``, when
    given, is what the service runs inside the actor, as ``undo(cache, result)``, if the
    caller was cancelled natively and so never received ``fn``'s result (give back what the
    result owns: slots, pins); without it such a result is dropped.
    """

    kind: ClassVar[CommandKind] = CommandKind.CALL
    on_cancel: ClassVar[OnCancel] = OnCancel.AWAIT
    fn: Callable[[UnifiedRadixCache], _T]
    undo: Callable[[UnifiedRadixCache, Any], None] | None = None


@dataclass(frozen=True, slots=True, eq=False)
class AttachWorker(Returns[None]):
    """``worker.attach(cache)``: the actor's half of ``svc.attach_worker`` (the worker
    subscribes to the cache's events).  A caller cancelled natively after it was applied
    never learns of it: the service detaches the worker again (``give_back``)."""

    kind: ClassVar[CommandKind] = CommandKind.ATTACH_WORKER
    on_cancel: ClassVar[OnCancel] = OnCancel.AWAIT
    worker: AttachableWorker


@dataclass(frozen=True, slots=True, eq=False)
class DetachWorker(Returns[None]):
    """``worker.detach(cache)``: the actor's half of ``svc.detach_worker``, after the worker
    drained and its background coroutine ended."""

    kind: ClassVar[CommandKind] = CommandKind.DETACH_WORKER
    on_cancel: ClassVar[OnCancel] = OnCancel.AWAIT
    worker: AttachableWorker


Command: TypeAlias = (
    Match
    | MatchReq
    | StartReqLoad
    | FinishReqLoad
    | AllocReqRow
    | WriteReqSlots
    | AllocReqMamba
    | SlideReqWindow
    | Insert
    | Lock
    | Release
    | Evict
    | Alloc
    | Free
    | AllocMamba
    | FreeMamba
    | CacheFinishedReq
    | CacheUnfinishedReq
    | Stats
    | SanityCheck
    | StartBackups
    | FinishBackups
    | StartLoadBack
    | FinishLoadBack
    | EvictHost
    | Call[Any]
    | AttachWorker
    | DetachWorker
)

#: Every command class (the members of :data:`Command`).
COMMAND_TYPES: tuple[type[Command], ...] = tuple(get_origin(t) or t for t in get_args(Command))


@dataclass(frozen=True, slots=True, eq=False)
class MatchOutcome:
    """Result of a match.

    ``device_indices``: Full device slots of the cached prefix (``prefix_len`` of them).
    ``host_hit_length``: tokens past the device hit that are cached on host (HiCache).
    ``node``: handle of the node that ends the device hit (for :meth:`lock`).
    ``lease``: the lock, when the match was asked to lock (else ``None``).
    ``host_loaded_len``: tokens of the device hit this call loaded back from host (a request
    match with load-back); ``pending_load``: a load-back started and not yet finished (only
    between the two commands of a request match with load-back, never returned to callers).
    """

    device_indices: torch.Tensor
    prefix_len: int
    host_hit_length: int
    node: NodeHandle
    lease: Lease | None = None
    mamba_branching_seqlen: int | None = None
    host_loaded_len: int = 0
    pending_load: PendingLoad | None = None


@dataclass(frozen=True, slots=True)
class InsertOutcome:
    """Result of an insert: ``prefix_len`` tokens were already cached out of ``total_len``;
    ``mamba_exist``: the caller still owns (and must free) its Mamba slot."""

    prefix_len: int
    total_len: int
    mamba_exist: bool = False
