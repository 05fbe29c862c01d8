"""Shared pieces of the service tests: a small config, the end-of-test checks, request steps,
a random client and the sequential replay of a recorded history."""

from __future__ import annotations

import contextlib
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
import torch

from urc import (
    CacheConfig,
    ComponentType,
    InvalidLockError,
    OutOfMemoryError,
    RadixKey,
    Req,
    UnifiedRadixCache,
    build_cache,
)
from urc.params import EvictParams
from urc.service import AsyncUnifiedRadixCache
from urc.service._commands import (
    CacheFinishedReq,
    CacheUnfinishedReq,
    Call,
    Command,
    InsertOutcome,
    Lock,
    MatchOutcome,
    MatchReq,
    Release,
)
from urc.service._executor import CommandExecutor
from urc.service._lease import Lease, NodeHandle

FULL = ComponentType.FULL
TIMEOUT = 30


def small_config(kv_size: int = 4096, max_num_reqs: int = 64) -> CacheConfig:
    return CacheConfig(kv_size=kv_size, max_num_reqs=max_num_reqs, max_context_len=64)


def check_clean(cache: UnifiedRadixCache) -> None:
    """After close: invariants hold, nothing is locked, every slot is free or in the tree."""
    cache.sanity_check()
    cache.check_pools({FULL: 0})
    assert cache.protected_size() == 0


# ====================================================================== request steps
# Callables run inside the actor through ``svc.call``; dataclasses so a replay can rebind
# them to its own Req objects.


@dataclass(frozen=True)
class AllocRow:
    """Give ``req`` a req_to_token row (atomic: raises before changing anything)."""

    req: Req

    def __call__(self, cache: UnifiedRadixCache) -> int:
        row = cache.req_to_token_pool.alloc()
        if row is None:
            raise OutOfMemoryError("no free request rows")
        self.req.req_pool_idx = row
        return row


@dataclass(frozen=True)
class FillRow:
    """Allocate slots for the unmatched part of ``req`` and write its whole row."""

    req: Req

    def __call__(self, cache: UnifiedRadixCache) -> None:
        req = self.req
        row = req.req_pool_idx
        assert row is not None
        n = len(req.origin_input_ids)
        p = req.cache_protected_len
        allocator = cache.token_to_kv_pool_allocator
        new = allocator.alloc(n - p)
        if new is None:
            cache.evict(EvictParams(num_tokens=n - p - allocator.available_size()))
            new = allocator.alloc(n - p)
            if new is None:
                raise OutOfMemoryError(f"cannot allocate {n - p} slots for {req.rid}")
        cache.req_to_token_pool.write(row, 0, req.prefix_indices)
        cache.req_to_token_pool.write(row, p, new)
        req.kv_committed_len = req.kv_allocated_len = n


# ====================================================================== random clients
PREFIXES = [[100 + i] * 4 + [i, i + 1, i + 2, i + 3] for i in range(6)]


def random_key(rng: random.Random) -> list[int]:
    base = rng.choice(PREFIXES)[: rng.randint(0, 8)]
    return base + [rng.randrange(12) for _ in range(rng.randint(1, 8))]


Chaos = Callable[[anyio.CancelScope, RadixKey], None]


@dataclass
class Client:
    """One coroutine's random workload; it tracks what it owns and gives it all back.

    ``owned``: slots allocated and not handed to the tree; ``leases``: locks it holds.  Its
    bookkeeping follows each call synchronously, so a cancellation (which lands at the next
    await) never separates a call's effect from the record of it.  ``chaos`` sees each op's
    cancel scope and key and may arrange for the scope to be cancelled.
    """

    svc: AsyncUnifiedRadixCache
    rng: random.Random
    name: str
    chaos: Chaos | None = None
    owned: list[torch.Tensor] = field(default_factory=list)
    leases: list[Lease] = field(default_factory=list)
    handles: list[NodeHandle] = field(default_factory=list)
    ops: int = 0
    cancelled: int = 0

    async def run(self, num_ops: int) -> None:
        try:
            for i in range(num_ops):
                with anyio.CancelScope() as scope:
                    await self.step(i, scope)
                self.ops += 1
                if scope.cancelled_caught:
                    self.cancelled += 1
        finally:
            with anyio.CancelScope(shield=True):
                await self.cleanup()

    async def cleanup(self) -> None:
        for lease in self.leases:
            if not lease.released:  # a cancelled release was still applied
                await lease.release()
        self.leases.clear()
        for v in self.owned:
            await self.svc.free(v)
        self.owned.clear()

    async def step(self, i: int, scope: anyio.CancelScope) -> None:
        svc, rng = self.svc, self.rng
        r = rng.random()
        key = RadixKey(random_key(rng))
        if self.chaos is not None:
            self.chaos(scope, key)
        if r < 0.25:
            m = await svc.match(key)
            assert m.prefix_len == m.device_indices.shape[0] <= len(key)
            self.handles.append(m.node)
        elif r < 0.4:
            m = await svc.match(key, lock=True)
            assert m.lease is not None
            self.leases.append(m.lease)
        elif r < 0.55:
            if self.leases:
                lease = self.leases[rng.randrange(len(self.leases))]
                try:
                    await lease.release()
                finally:
                    if lease.released:  # even when cancelled while waiting
                        self.leases.remove(lease)
        elif r < 0.6:
            if self.handles:
                with contextlib.suppress(InvalidLockError):  # evicted since the match
                    self.leases.append(await svc.lock(self.handles[-1]))
        elif r < 0.8:
            await self.insert(key)
        elif r < 0.95:
            await self.finish(key.token_ids, f"{self.name}-{i}", unfinished=rng.random() < 0.3)
        else:
            await svc.evict(num_tokens=rng.randint(1, 16))

    async def insert(self, key: RadixKey) -> None:
        svc = self.svc
        m = await svc.match(key, lock=True)
        assert m.lease is not None
        self.leases.append(m.lease)
        try:
            v = await svc.alloc(len(key) - m.prefix_len)
        except OutOfMemoryError:
            return
        self.owned.append(v)
        value = torch.cat([m.device_indices, v])
        res = await svc.insert(key, value, prev_prefix_len=m.prefix_len)
        # The tree took the slots (and freed duplicates).  Identity, not tensor ==.
        self.owned = [t for t in self.owned if t is not v]
        assert isinstance(res, InsertOutcome) and res.total_len == len(key)
        try:
            await m.lease.release()
        finally:
            if m.lease.released:
                self.leases.remove(m.lease)

    async def finish(self, key: list[int], rid: str, unfinished: bool) -> None:
        await serve_request(self.svc, Req(rid, key), unfinished)


async def serve_request(svc: AsyncUnifiedRadixCache, req: Req, unfinished: bool) -> None:
    """A request's whole life through the service: a row, ``match_req``, its slots,
    optionally ``cache_unfinished_req``, then ``cache_finished_req``; whatever way it ends
    (no room, cancelled), everything it holds is given back.  The row is recorded in the
    ``Req`` by the actor, so it is found even if the caller was cancelled."""
    try:
        await svc.call(AllocRow(req))
        await svc.match_req(req)
        await svc.call(FillRow(req))
        if unfinished:
            await svc.cache_unfinished_req(req)
        await svc.cache_finished_req(req)
    except OutOfMemoryError:
        pass
    finally:
        if req.req_pool_idx is not None:  # not finished: give everything back
            with anyio.CancelScope(shield=True):
                await svc.cache_finished_req(req, is_insert=False)


async def run_clients(
    svc: AsyncUnifiedRadixCache,
    n_clients: int,
    num_ops: int,
    seed: int,
    chaos: Chaos | None = None,
) -> list[Client]:
    clients = [
        Client(svc, random.Random(seed * 100_003 + k), f"c{k}", chaos) for k in range(n_clients)
    ]
    async with anyio.create_task_group() as tg:
        for c in clients:
            tg.start_soon(c.run, num_ops)
    return clients


# ====================================================================== history replay
@dataclass
class History:
    """What the actor applied, in order (recorded by the trace hook)."""

    entries: list[tuple[Command, Any, BaseException | None]] = field(default_factory=list)

    def __call__(self, cmd: Command, result: Any, error: BaseException | None) -> None:
        self.entries.append((cmd, result, error))


def same_result(a: Any, b: Any) -> bool:
    if isinstance(a, MatchOutcome):
        return (
            isinstance(b, MatchOutcome)
            and torch.equal(a.device_indices, b.device_indices)
            and (a.prefix_len, a.host_hit_length) == (b.prefix_len, b.host_hit_length)
            and same_result(a.lease, b.lease)
        )
    if isinstance(a, Lease):
        return isinstance(b, Lease) and (a.id, a.prefix_len) == (b.id, b.prefix_len)
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    return bool(a == b)


def replay(config: CacheConfig, history: History) -> UnifiedRadixCache:
    """Apply the recorded commands one by one to a fresh core; every result must match."""
    cache = build_cache(config)
    ex = CommandExecutor(cache)
    reqs: dict[str, Req] = {}
    handles: dict[int, NodeHandle] = {}

    def req_of(r: Req) -> Req:
        if r.rid not in reqs:
            reqs[r.rid] = Req(r.rid, list(r.origin_input_ids))
        return reqs[r.rid]

    def remap(cmd: Command) -> Command:
        match cmd:
            case Release(lease=lease):
                return Release(ex.leases[lease.id][0])
            case Lock(node=h):
                return Lock(handles[id(h)])
            case MatchReq(req=r, cow_mamba=cow):
                return MatchReq(req_of(r), cow)
            case CacheFinishedReq(req=r, is_insert=ins):
                return CacheFinishedReq(req_of(r), ins)
            case CacheUnfinishedReq(req=r, chunked=ch):
                return CacheUnfinishedReq(req_of(r), ch)
            case Call(fn=AllocRow(req=r)):
                return Call(AllocRow(req_of(r)))
            case Call(fn=FillRow(req=r)):
                return Call(FillRow(req_of(r)))
            case Call():
                raise AssertionError(f"cannot replay {cmd}")
            case _:
                return cmd

    for i, (cmd, result, error) in enumerate(history.entries):
        try:
            got = ex.apply(remap(cmd))
        except Exception as exc:
            assert error is not None and type(exc) is type(error), (i, cmd, exc, error)
            continue
        assert error is None, (i, cmd, "replay succeeded where the service raised", error)
        assert same_result(result, got), (i, cmd, result, got)
        if isinstance(result, MatchOutcome):
            handles[id(result.node)] = got.node
    return cache
