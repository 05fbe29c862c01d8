"""The request-level API of the service: a request's row, its KV slots, its Mamba slot, its
SWA window, and ``match_req(load_back=True)`` (one command pair, one walk each, for a host
hit).  Every test ends with the cache's invariants and pool conservation."""

from __future__ import annotations

import asyncio
from typing import Any

import anyio
import pytest
import torch

from hicache.config import HiCacheConfig
from hicache.host_tier import attach_hicache
from urc import CacheConfig, ComponentType, KVShape, build_cache
from urc.errors import InvalidInputError, OutOfMemoryError
from urc.host_protocol import WritePolicy
from urc.req import Req
from urc.service import AsyncUnifiedRadixCache, LoadBackPolicy
from urc.service._commands import CommandKind, MatchOutcome
from urc.service._observer import TransferKind
from urc.specs import MambaSpec, SlidingWindowSpec
from urc.stats import CacheStats

PS = 4
FULL = ComponentType.FULL


class _Counting:
    """An observer that records every command the actor applied and every transfer."""

    def __init__(self) -> None:
        self.kinds: list[CommandKind] = []
        self.transfers: list[tuple[TransferKind, int, int]] = []
        self.on_kind: dict[CommandKind, Any] = {}

    def on_command(
        self, kind: CommandKind, queue_wait_s: float, latency_s: float, error: BaseException | None
    ) -> None:
        self.kinds.append(kind)
        hook = self.on_kind.get(kind)
        if hook is not None:
            hook()

    def on_batch(self, stats: CacheStats, queued: int) -> None:
        pass

    def on_transfer(self, kind: TransferKind, tokens: int, nbytes: int, seconds: float) -> None:
        self.transfers.append((kind, tokens, nbytes))


def _service(
    *, host: bool = True, copy_in_thread: bool = False, **config: Any
) -> tuple[AsyncUnifiedRadixCache, _Counting]:
    cache = build_cache(
        CacheConfig(page_size=PS, kv_size=64, kv_shape=KVShape(2, 2, 4, torch.float32), **config)
    )
    if host:  # write-back: an evicted device leaf is backed up in the actor, synchronously
        attach_hicache(cache, HiCacheConfig(write_policy=WritePolicy.WRITE_BACK, host_tokens=256))
    obs = _Counting()
    svc = AsyncUnifiedRadixCache(
        cache, observer=obs, load_back=LoadBackPolicy(copy_in_thread=copy_in_thread)
    )
    return svc, obs


async def _serve(
    svc: AsyncUnifiedRadixCache, rid: str, tokens: list[int], *, load_back: bool = False
) -> MatchOutcome:
    """A request end to end through the request API; fills its new slots' KV with its
    token ids (so a load-back's bytes can be checked)."""
    req = Req(rid, tokens)
    await svc.alloc_req_row(req)
    m = await svc.match_req(req, load_back=load_back)
    need = len(tokens) - req.cache_protected_len
    slots = await svc.alloc(need) if need else torch.empty(0, dtype=torch.int64)
    await svc.write_req_slots(req, slots, len(tokens))
    fill = torch.tensor(tokens[req.cache_protected_len :], dtype=torch.float32)

    def write_kv(cache: Any) -> None:
        cache.pools.kv_pool.kv[:, :, slots] = fill.view(1, 1, -1, 1, 1)

    await svc.call(write_kv)
    await svc.cache_finished_req(req)
    return m


async def _kv_of(svc: AsyncUnifiedRadixCache, indices: torch.Tensor) -> torch.Tensor:
    return await svc.call(lambda cache: cache.pools.kv_pool.kv[0, 0, indices, 0, 0].clone())


def _check(svc: AsyncUnifiedRadixCache) -> None:
    cache = svc.cache
    cache.sanity_check()
    cache.check_pools()
    assert cache.protected_size() == 0


TOKENS = list(range(100, 132))  # 32 tokens, 8 pages


@pytest.mark.asyncio
async def test_a_host_hit_costs_one_command_pair_and_two_walks() -> None:
    svc, obs = _service()
    async with svc:
        with anyio.fail_after(10):
            await _serve(svc, "a", TOKENS)
            await svc.evict(num_tokens=64)  # write-back: the prompt is now host-only
            gone = await svc.match(TOKENS)
            assert gone.prefix_len == 0 and gone.host_hit_length == len(TOKENS)
            walks = svc.cache.counters.match_requests
            obs.kinds.clear()
            req = Req("b", list(TOKENS))
            await svc.alloc_req_row(req)
            obs.kinds.clear()
            m = await svc.match_req(req, load_back=True)
            assert obs.kinds == [CommandKind.MATCH_REQ, CommandKind.FINISH_REQ_LOAD]
            assert svc.cache.counters.match_requests - walks == 2
            assert m.prefix_len == len(TOKENS) and m.host_loaded_len == len(TOKENS)
            assert m.pending_load is None
            assert req.cache_protected_len == len(TOKENS)
            assert svc.cache.protected_size() == len(TOKENS)  # the request locks the longer hit
            kv = await _kv_of(svc, m.device_indices)
            assert kv.tolist() == [float(t) for t in TOKENS]  # the bytes came back
            nbytes = len(TOKENS) * 2 * 2 * 2 * 4 * 4  # K+V x 2 layers x 2 heads x 4 x fp32
            assert obs.transfers == [(TransferKind.LOAD_BACK, len(TOKENS), nbytes)]
            await svc.write_req_slots(req, torch.empty(0, dtype=torch.int64), len(TOKENS))
            await svc.cache_finished_req(req)
    _check(svc)


@pytest.mark.asyncio
async def test_without_load_back_a_host_hit_stays_on_host_in_one_command() -> None:
    svc, obs = _service()
    async with svc:
        with anyio.fail_after(10):
            await _serve(svc, "a", TOKENS)
            await svc.evict(num_tokens=64)
            obs.kinds.clear()
            m = await _serve(svc, "b", TOKENS)
            assert obs.kinds[:2] == [CommandKind.ALLOC_REQ_ROW, CommandKind.MATCH_REQ]
            assert CommandKind.FINISH_REQ_LOAD not in obs.kinds
            assert m.prefix_len == 0 and m.host_hit_length == len(TOKENS)
            assert m.host_loaded_len == 0
    _check(svc)


@pytest.mark.asyncio
async def test_a_cancelled_scope_does_not_stop_a_started_load_back() -> None:
    svc, obs = _service(copy_in_thread=True)
    async with svc:
        with anyio.fail_after(10):
            await _serve(svc, "a", TOKENS)
            await svc.evict(num_tokens=64)
            req = Req("b", list(TOKENS))
            await svc.alloc_req_row(req)
            outcome: list[MatchOutcome] = []
            with anyio.CancelScope() as scope:
                # Cancelled the moment the actor has applied the match (the load started).
                obs.on_kind[CommandKind.MATCH_REQ] = scope.cancel
                outcome.append(await svc.match_req(req, load_back=True))
                await anyio.lowlevel.checkpoint()  # the cancellation lands here
                pytest.fail("the scope was cancelled")
            obs.on_kind.clear()
            assert scope.cancelled_caught
            assert outcome[0].host_loaded_len == len(TOKENS)
            assert req.cache_protected_len == len(TOKENS)
            await svc.write_req_slots(req, torch.empty(0, dtype=torch.int64), len(TOKENS))
            await svc.cache_finished_req(req)
    _check(svc)


@pytest.mark.asyncio
async def test_a_natively_cancelled_match_req_drops_the_load_it_started() -> None:
    svc, obs = _service()
    async with svc:
        with anyio.fail_after(10):
            await _serve(svc, "a", TOKENS)
            await svc.evict(num_tokens=64)
            free_before = await svc.call(lambda c: c.token_to_kv_pool_allocator.available_size())
            req = Req("b", list(TOKENS))
            await svc.alloc_req_row(req)
            task = asyncio.ensure_future(svc.match_req(req, load_back=True))
            # Task.cancel() the moment the actor applied the match (the load started).
            obs.on_kind[CommandKind.MATCH_REQ] = task.cancel
            with pytest.raises(asyncio.CancelledError):
                await task
            obs.on_kind.clear()
            assert CommandKind.FINISH_REQ_LOAD in obs.kinds  # the service dropped the load
            assert req.cache_protected_len == 0  # the request keeps the match it got
            free_after = await svc.call(lambda c: c.token_to_kv_pool_allocator.available_size())
            assert free_after == free_before  # the slots reserved for the load came back
            again = await svc.match(TOKENS)
            assert again.prefix_len == 0 and again.host_hit_length == len(TOKENS)
            await svc.cache_finished_req(req, is_insert=False)
    _check(svc)


@pytest.mark.asyncio
async def test_load_back_req_loads_what_reached_the_host_after_the_match() -> None:
    svc, obs = _service()
    async with svc:
        with anyio.fail_after(10):
            await _serve(svc, "a", TOKENS)
            await svc.evict(num_tokens=64)
            req = Req("b", list(TOKENS))
            await svc.alloc_req_row(req)
            m = await svc.match_req(req)  # no load-back: the host hit stays there
            assert m.prefix_len == 0
            obs.kinds.clear()
            m2 = await svc.load_back_req(req)
            assert obs.kinds == [CommandKind.START_REQ_LOAD, CommandKind.FINISH_REQ_LOAD]
            assert m2.prefix_len == len(TOKENS) == m2.host_loaded_len
            assert req.cache_protected_len == len(TOKENS)
            # Nothing more on host: a second call is one command that changes nothing.
            obs.kinds.clear()
            m3 = await svc.load_back_req(req)
            assert obs.kinds == [CommandKind.START_REQ_LOAD]
            assert m3.prefix_len == len(TOKENS) and m3.host_loaded_len == 0
            await svc.write_req_slots(req, torch.empty(0, dtype=torch.int64), len(TOKENS))
            await svc.cache_finished_req(req)
    _check(svc)


@pytest.mark.asyncio
async def test_request_rows_are_given_once_and_run_out() -> None:
    svc, _ = _service(host=False, max_num_reqs=2)
    async with svc:
        with anyio.fail_after(10):
            a, b, c = Req("a", [1]), Req("b", [2]), Req("c", [3])
            rows = {await svc.alloc_req_row(a), await svc.alloc_req_row(b)}
            assert rows == {a.req_pool_idx, b.req_pool_idx} and len(rows) == 2
            with pytest.raises(InvalidInputError):
                await svc.alloc_req_row(a)
            with pytest.raises(OutOfMemoryError):
                await svc.alloc_req_row(c)
            assert c.req_pool_idx is None
            for r in (a, b):
                await svc.cache_finished_req(r, is_insert=False)
    _check(svc)


@pytest.mark.asyncio
async def test_write_req_slots_fills_the_row_after_the_prefix_and_refuses_past_its_end() -> None:
    svc, _ = _service(host=False, max_context_len=16)
    async with svc:
        with anyio.fail_after(10):
            await _serve(svc, "a", TOKENS[:8])
            req = Req("b", [*TOKENS[:8], 7, 7, 7, 7])
            row = await svc.alloc_req_row(req)
            m = await svc.match_req(req)
            assert m.prefix_len == 8
            slots = await svc.alloc(4)
            await svc.write_req_slots(req, slots, 12)
            got = await svc.call(lambda c: c.req_to_token_pool.read(row, 0, 12).clone())
            assert got.tolist() == m.device_indices.tolist() + slots.tolist()
            assert (req.kv_allocated_len, req.kv_committed_len) == (12, 12)
            more = await svc.alloc(8)
            with pytest.raises(InvalidInputError):
                await svc.write_req_slots(req, more, 20)  # 20 > the row's 16
            assert req.kv_allocated_len == 12  # unchanged
            await svc.free(more)
            await svc.cache_finished_req(req)
    _check(svc)


@pytest.mark.asyncio
async def test_alloc_req_mamba_gives_one_slot_per_request_and_needs_mamba() -> None:
    svc, _ = _service(host=False, components=(FULL, MambaSpec(size=4, chunk_size=4)))
    async with svc:
        with anyio.fail_after(10):
            req = Req("a", TOKENS[:8])
            await svc.alloc_req_row(req)
            await svc.match_req(req)
            slot = await svc.alloc_req_mamba(req)
            assert req.mamba_pool_idx is not None and int(slot) == int(req.mamba_pool_idx)
            assert int(await svc.alloc_req_mamba(req)) == int(slot)  # it has one already
            await svc.cache_finished_req(req, is_insert=False)
    _check(svc)
    plain, _ = _service(host=False)
    async with plain:
        with pytest.raises(InvalidInputError, match="MAMBA"):
            await plain.alloc_req_mamba(Req("a", [1]))


@pytest.mark.asyncio
async def test_slide_req_window_frees_what_left_the_window_and_needs_swa() -> None:
    svc, _ = _service(host=False, components=(FULL, SlidingWindowSpec(window=8, kv_size=64)))
    async with svc:
        with anyio.fail_after(10):
            req = Req("a", TOKENS)
            await svc.alloc_req_row(req)
            await svc.match_req(req)
            await svc.write_req_slots(req, await svc.alloc(len(TOKENS)), len(TOKENS))
            before = await svc.call(lambda c: c.token_to_kv_pool_allocator.swa_available_size())
            freed = await svc.slide_req_window(req, len(TOKENS))
            after = await svc.call(lambda c: c.token_to_kv_pool_allocator.swa_available_size())
            assert freed == len(TOKENS) - 8 == after - before
            assert req.swa_evicted_seqlen == len(TOKENS) - 8
            assert await svc.slide_req_window(req, len(TOKENS)) == 0  # nothing more slid out
            await svc.cache_finished_req(req)
    _check(svc)
    plain, _ = _service(host=False)
    async with plain:
        with pytest.raises(InvalidInputError, match="SWA"):
            await plain.slide_req_window(Req("a", [1]), 1)
