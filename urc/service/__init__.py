"""``AsyncUnifiedRadixCache``: an awaitable cache whose tree is owned by one actor task.

Package layout (the rooms): :mod:`~urc.service._facade` (the public coroutines: build a
command, send it, await the reply), :mod:`~urc.service._transport` (send, wait for room,
cancel, abandon, give back), :mod:`~urc.service._actor` (the loop, drain, fail),
:mod:`~urc.service._workers` (background workers), :mod:`~urc.service._lifecycle` (start,
close), :mod:`~urc.service._base` (the shared state), :mod:`~urc.service._call` (what travels
on the stream), :mod:`~urc.service._anyio_private` (the only use of anyio internals); the
command layer: :mod:`~urc.service._commands` (one frozen class per operation, with its
cancellation policy), :mod:`~urc.service._executor` (one ``@handles`` method per command),
:mod:`~urc.service._request_ops`, :mod:`~urc.service._lease`, :mod:`~urc.service._observer`,
:mod:`~urc.service._snapshots`.  Only this package's ``__all__`` is public.

Usage::

    async with AsyncUnifiedRadixCache(CacheConfig(kv_size=1 << 16)) as svc:
        hit = await svc.match([1, 2, 3], lock=True)     # MatchOutcome with a Lease
        ...
        await hit.lease.release()

Design (docs/architecture.md §1-§2)
-----------------------------------
Every public coroutine builds a frozen command (:mod:`urc.service._commands`), wraps it in a call
(the command plus a one-shot reply slot), sends the call on a bounded anyio memory object
stream (``max_queued`` buffered calls) and awaits the reply: on asyncio a bare
``asyncio.Future`` of the running loop, elsewhere (trio) an ``anyio.Event``; the result
travels in the call object (``python -m urc.apps.bench.service --replies`` compares reply
objects).  Sending is ``send_nowait``: it never yields, so nothing happens between the
caller's checks and the call entering the stream.  Only when the buffer is full does a caller
fall back to ``await send(...)`` (backpressure); once one caller waits there, later callers
queue behind it through the same path, so the stream keeps send order.

One actor task takes the calls and applies them strictly in order, one at a time, through a
:class:`~urc.service._executor.CommandExecutor`.  It blocks on ``await receive()`` only when the
stream is empty; woken, it applies that call and every call already queued
(``receive_nowait``, at most ``max_batch`` in all) in one batch, then yields once, so the
callers it just answered run and their next commands form its next batch.  (It knows how many
calls are queued from a counter the senders bump, so draining a batch raises no
``WouldBlock``.)  Because applying a command never awaits, no other task ever sees the tree
mid-command and no lock is needed.

Handles, not nodes: results carry device indices, hit lengths, an opaque
:class:`~urc.service.NodeHandle` and, when asked, a :class:`~urc.service.Lease` (released exactly
once).  ``Req`` objects passed to ``match_req`` / ``cache_*_req`` do hold tree nodes
(``req.last_node``): the request belongs to the server, but only the actor may read or write
``last_node`` / ``lock`` -- callers must never touch them.

A server's request loop (what ``urc replay`` does): ``alloc_req_row(req)``;
``match_req(req, load_back=True)`` (a host hit is loaded back and locked in one command pair:
the match, then the commit after the byte copy; :mod:`urc.service._request_ops`); ``alloc`` then
``write_req_slots`` per prefill chunk, ``cache_unfinished_req`` between chunks;
``alloc_req_mamba`` / ``slide_req_window`` for hybrid models; ``cache_finished_req``.

Cancellation (nothing leaks, nothing is half-applied).  Two ways of being cancelled: a
cancelled *scope* (anyio ``CancelScope`` / ``move_on_after`` / ``fail_after``, trio's
scopes; level-triggered: delivered again at every checkpoint until the scope exits), and a
*native* asyncio cancellation (``Task.cancel()``, hence ``asyncio.timeout``, ``wait_for``,
``TaskGroup`` shutdown; delivered once).  Applying a command never awaits, so the actor's
side of every command is atomic: the core raises a :class:`~urc.errors.URCError` before
changing anything, or applies the command fully.  Where the caller can be cancelled, and what
happens then (:data:`~urc.service._call.ON_CANCEL` classifies the commands)::

    command kind         | cancelled where                | what it passed in / what it got
    ---------------------+--------------------------------+-----------------------------------
    any                  | before sending (scope already  | nothing is sent or applied; all it
                         | cancelled: raises at once)     | passed in is still its own
    ---------------------+--------------------------------+-----------------------------------
    match, lock          | waiting for room, or queued    | withdrawn: the actor skips it
    (may be abandoned)   | (actor has not taken it)       |
                         | after the actor applied it,    | the lease it would get is released
                         | before the caller resumed      | by the service (queued at once)
    evict, stats,        | same as match                  | skipped, or applied and the result
    sanity_check,        |                                | dropped (nothing to give back)
    evict_host           |                                |
    ---------------------+--------------------------------+-----------------------------------
    release              | anywhere after the call began  | the lease is marked released
                         | (scope or native)              | before the first await: the
                         |                                | release is applied regardless
    release_nowait,      | never yields: cannot be        | released (queued without waiting)
    ``async with lease`` | cancelled                      |
    ---------------------+--------------------------------+-----------------------------------
    ownership moves:     | scope cancelled after sending  | sent for sure; the caller waits
    insert, alloc, free, | (waiting for room or for the   | (shielded) and gets the outcome
    alloc_mamba,         | reply)                         | (result or typed error); the
    free_mamba,          |                                | cancellation lands at its next
    match_req,           |                                | checkpoint
    load_back_req,       | native cancellation after      | sent and applied all the same; the
    alloc_req_row,       | sending, waiting for room or   | CancelledError is raised once the
    write_req_slots,     | for the reply                  | actor answered.  Passed in: taken
    alloc_req_mamba,     |                                | as if the call returned (insert:
    slide_req_window,    |                                | the tree took the value; free:
    cache_finished_req,  |                                | freed; a Req holds its outcome;
    cache_unfinished_req,|                                | an insert's unaligned tail and an
    start_backups,       |                                | unadopted Mamba value stay the
    finish_backups,      |                                | caller's, as in every other case).
    start_load_back,     |                                | Got: given back by the service --
    finish_load_back,    |                                | alloc / alloc_mamba slots freed,
    call,                |                                | a load-back the match started
    attach_worker,       |                                | dropped (the Req keeps its match),
    detach_worker        |                                | started backups and load-backs
                         |                                | aborted, a call's result handed
                         |                                | to its ``undo`` (else dropped), an
                         |                                | attached worker detached.  If the
                         |                                | command failed (typed error),
                         |                                | nothing changed: what it passed in
                         |                                | is still its own
    ---------------------+--------------------------------+-----------------------------------
    match_req /          | after its match started a      | the copy and the commit run
    load_back_req with   | load-back (between its two     | shielded: the load is committed
    a load-back          | commands)                      | (or dropped if the copy failed)
                         |                                | before the cancellation lands

The rule under every row: what a caller passed in is either taken by the applied command or
still the caller's, whichever way it was cancelled; only results the caller never saw are
given back by the service.

So a caller that sees ``CancelledError`` from an ownership move knows which case it is in:
its own anyio/trio scope was cancelled (``current_effective_deadline() == -inf``) -- nothing
was sent; else -- the command was applied.  The waits are bounded: the actor always answers
(it drains the stream at close and fails every queued call if it dies), and a closing or
failed service refuses new sends.  Implementation: rather than entering a shielded scope on
every call, the caller catches the cancellation and, only then, waits on in a shielded scope
(looping through native cancellations, which a shield does not stop); a native cancellation
that interrupts ``await send`` checks whether the stream took the call (``_in_stream``) and
sends it again if not.  Give-backs (releases, frees) for callers that are gone are queued
without waiting (``_give_back``), or parked when the stream is full or closing and applied at
the start of the actor's next batch (so before anything queued meanwhile), or at shutdown.

Errors: a ``URCError`` raised for one command reaches that caller only and the actor keeps
serving.  Any other exception inside the actor (an ``AssertionError`` from an invariant, a
bug, a failing observer) fails the service: the failing call and every queued or later call
get :class:`~urc.errors.ServiceFailedError` with the cause chained.  A background worker's
exception ends that worker only (logged, kept in :attr:`background_failures`): it reaches
the tree only through atomic commands, so it cannot leave the tree half-changed.  Calls after
close (or before start) raise :class:`~urc.errors.ServiceClosedError`.

Observers (:mod:`urc.service._observer`): the actor times every command (one clock read when the
caller sends, two around the command) and reports it; a plain observer also gets a
``cache.stats()`` snapshot after every batch, a :class:`~urc.service.PullingObserver` pulls
snapshots from the service when it needs them (``metrics`` does so at scrape time) or asks
for them at most every so often.

Background work (HiCache): :meth:`start_background` (or ``workers=``) runs coroutines in the
service's task group; they reach the tree only through commands (``await svc.call(fn)`` runs
``fn(cache)`` inside the actor).  An :class:`AttachableWorker` (the L3 storage worker) can
also join and leave a running service: ``attach_worker`` (the ``AttachWorker`` command, then
its ``run``) and ``detach_worker`` (its ``drain``, its ``run`` cancelled, then the
``DetachWorker`` command).  Close cancels them first (their cancellation handlers may
still make shielded calls), then closes the stream to new calls, lets the actor drain it,
then releases every lease still held (pins included) and reports how many.
"""

from __future__ import annotations

from urc.service._attachable import AttachableWorker
from urc.service._base import BackgroundWorker, LoadBackPolicy, ServiceState, TraceHook
from urc.service._commands import Call, Command, CommandKind, InsertOutcome, MatchOutcome
from urc.service._facade import AsyncUnifiedRadixCache
from urc.service._kv_publisher import KVEventPublisher, KVEventsConfig, KVPublisherStats
from urc.service._lease import Lease, NodeHandle
from urc.service._observer import (
    PullingObserver,
    ServiceObserver,
    ServiceSnapshot,
    StatsSource,
    TransferKind,
)

__all__ = [
    "AsyncUnifiedRadixCache",
    "AttachableWorker",
    "BackgroundWorker",
    "Call",
    "Command",
    "CommandKind",
    "InsertOutcome",
    "KVEventPublisher",
    "KVEventsConfig",
    "KVPublisherStats",
    "Lease",
    "LoadBackPolicy",
    "MatchOutcome",
    "NodeHandle",
    "PullingObserver",
    "ServiceObserver",
    "ServiceSnapshot",
    "ServiceState",
    "StatsSource",
    "TraceHook",
    "TransferKind",
]
