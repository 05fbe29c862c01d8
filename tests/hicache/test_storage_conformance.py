"""One conformance suite, run against every L3 backend (``tests/storage_backends.py``):
local files in urc's layout and in SGLang's, Valkey, Valkey Cluster and Mooncake, each
opened through the backend registry.

The contract of ``StorageBackend`` as every backend must keep it: byte-exact round trips,
results that count leading pages, deletes, one copy per key; a wrong-size buffer is a miss
and the value is kept; bad arguments raise typed errors; a damaged value, or another key's
value under a key's name, is a miss and never a partial write; an outage reads as counted
misses (typed errors with ``raise_errors``) and the store serves again once it is back;
``clear()`` deletes the store's own pages only (not another deployment's beside it) and
raises its failures; and the storage worker rides an outage out (the service never fails,
backups are retried and land, and come back byte-exact).  A backend whose service is
missing here is skipped with one line saying why.
"""

from __future__ import annotations

from collections.abc import Iterator

import anyio
import pytest
import torch
from cache_harness import pins
from storage_backends import BACKENDS, NAMING, OTHER_NAMING, BackendUnderTest, started
from storage_harness import L3Stack

from hicache.storage.errors import (
    InvalidBufferError,
    InvalidStorageKeyError,
    StorageClosedError,
    StorageTimeout,
    StorageUnavailableError,
)
from hicache.storage.sglang_keys import sglang_page_keys
from hicache.storage.stats import StorageOp
from hicache.storage_worker import RetryPolicy
from urc import ComponentType, RadixKey
from urc.service import ServiceState

pytestmark = pytest.mark.timeout(120)
FULL = ComponentType.FULL


@pytest.fixture(scope="module", params=BACKENDS, ids=[b.id for b in BACKENDS])
def backend(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[BackendUnderTest]:
    chosen: BackendUnderTest = request.param
    reason = chosen.skip_reason()
    if reason is not None:
        pytest.skip(f"{chosen.id}: {reason}")
    with started(chosen, tmp_path_factory.mktemp(chosen.id)) as running:
        yield running


def make_pages(count: int, seed: int, dtype: torch.dtype = torch.float16) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(2, 4, 16, generator=generator).to(dtype) for _ in range(count)]


def zeros(pages: list[torch.Tensor]) -> list[torch.Tensor]:
    return [torch.zeros_like(page) for page in pages]


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.reshape(-1).view(torch.uint8).equal(b.reshape(-1).view(torch.uint8))


# ---------------------------------------------------------------------- the data path
@pytest.mark.asyncio
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.int8])
async def test_pages_round_trip_and_results_count_leading_pages(
    backend: BackendUnderTest, dtype: torch.dtype
) -> None:
    pages = make_pages(6, 1, dtype)
    keys = backend.keys(6, f"round-{dtype}")
    async with await backend.open() as store:
        assert await store.exists(keys) == 0
        assert await store.put(keys, pages) == 6
        assert await store.put(keys[:3], pages[:3]) == 3  # again: one copy, still stored
        assert await store.exists(keys) == 6
        out = zeros(pages)
        assert await store.get(keys, out) == 6
        assert all(same_bytes(a, b) for a, b in zip(pages, out, strict=True))
        await store.delete(keys[2:3])
        assert await store.exists(keys) == 2
        assert await store.exists(keys[3:]) == 3
        out = zeros(pages)
        assert await store.get(keys, out) == 2
        assert out[2].eq(0).all()
        await store.delete(keys + backend.keys(2, "never-stored"))  # missing keys are fine
        assert await store.exists(keys) == 0
        stats = store.stats()
        assert stats.reads == 8 and stats.errors == stats.timeouts == stats.corrupt == 0


@pytest.mark.asyncio
async def test_namespaces_are_isolated(backend: BackendUnderTest) -> None:
    async with await backend.open() as store:
        assert await store.put(backend.keys(2, "tenant-a"), make_pages(2, 2)) == 2
        assert await store.exists(backend.keys(2, "tenant-b")) == 0
        assert await store.get(backend.keys(2, "tenant-b"), zeros(make_pages(2, 2))) == 0


@pytest.mark.asyncio
async def test_a_wrong_size_buffer_is_a_miss_and_the_value_is_kept(
    backend: BackendUnderTest,
) -> None:
    keys = backend.keys(1, "size")
    async with await backend.open() as store:
        await store.put(keys, make_pages(1, 3))
        small = torch.full((7,), 5, dtype=torch.float16)
        assert await store.get(keys, [small]) == 0
        assert small.eq(5).all()
        assert await store.exists(keys) == 1
        assert store.stats().corrupt == 0


@pytest.mark.asyncio
async def test_bad_arguments_raise_typed_errors_and_store_nothing(
    backend: BackendUnderTest,
) -> None:
    keys = backend.keys(2, "bad")
    pages = make_pages(2, 4)
    store = await backend.open()
    async with store:
        with pytest.raises(InvalidStorageKeyError):
            await store.put(["../../escape"], pages[:1])
        with pytest.raises(InvalidStorageKeyError):
            await store.exists("urc1:full:" + "0" * 64)  # one string, not a list
        with pytest.raises(InvalidBufferError):
            await store.put(keys, pages[:1])
        with pytest.raises(InvalidBufferError):
            await store.put(keys[:1], [torch.zeros(4, 4).t()])  # not contiguous
        assert await store.exists(keys) == 0
    with pytest.raises(StorageClosedError):
        await store.get(keys, pages)


# ---------------------------------------------------------------------- clear
@pytest.mark.asyncio
async def test_clear_deletes_the_stores_own_pages_and_nothing_else(
    backend: BackendUnderTest,
) -> None:
    """The store's pages (its layout's, and SGLang-layout pages of its deployment suffix)
    go; another deployment's SGLang pages in the same store, and a neighbour store's pages
    (the same directory with another suffix, or a key prefix extending this one's), stay.
    A second clear deletes nothing; the store serves again at once."""
    own = backend.keys(3, "clear-own")
    mine = sglang_page_keys(list(range(12)), 4, NAMING, ("clear", "mine"))
    theirs = sglang_page_keys(list(range(12)), 4, OTHER_NAMING, ("clear", "theirs"))
    pages = make_pages(3, 11)
    store = await backend.open()
    neighbour = await backend.open_neighbour()
    async with store, neighbour:
        for keys in (own, mine, theirs):
            assert await store.put(keys, pages) == 3
        kept = [theirs]  # what the neighbour holds (or sees, in a shared directory)
        if not backend.neighbour_shares_namespace:
            near = backend.keys(3, "clear-neighbour")
            kept = [near, mine]  # ``mine``: the same suffix, under another prefix
            for keys in kept:
                assert await neighbour.put(keys, pages) == 3
        assert await store.clear() == len({*own, *mine})
        assert await store.exists(own) == 0 and await store.exists(mine) == 0
        assert await store.get(own, zeros(pages)) == 0
        out = zeros(pages)
        assert await store.get(theirs, out) == 3
        assert all(same_bytes(a, b) for a, b in zip(pages, out, strict=True))
        for keys in kept:
            assert await neighbour.exists(keys) == 3
        assert await store.clear() == 0
        assert await store.put(own, pages) == 3 and await store.exists(own) == 3
        assert store.stats().failures == {}
    with pytest.raises(StorageClosedError):
        await store.clear()


@pytest.mark.asyncio
async def test_clear_raises_typed_errors_during_an_outage_and_clears_once_it_is_back(
    backend: BackendUnderTest,
) -> None:
    pages = make_pages(2, 12)
    keys = backend.keys(2, "clear-outage")
    async with await backend.open(op_timeout_s=2.0) as store:
        assert await store.put(keys, pages) == 2
        backend.take_away()
        try:
            with pytest.raises((StorageUnavailableError, StorageTimeout)):
                await store.clear(timeout_s=5.0)
            assert store.stats().failures == {StorageOp.CLEAR: 1}
        finally:
            await backend.bring_back(store)  # a restarted service may have lost its pages
        assert await store.put(keys, pages) == 2
        with anyio.fail_after(30):
            while True:  # a reconnecting client may refuse a call or two first
                try:
                    deleted = await store.clear(timeout_s=5.0)
                    break
                except (StorageUnavailableError, StorageTimeout):
                    await anyio.sleep(0.1)
        assert deleted >= 2 and await store.exists(keys) == 0


# ---------------------------------------------------------------------- damaged values
@pytest.mark.asyncio
@pytest.mark.parametrize("damage", ["truncated", "flipped"])
async def test_a_damaged_value_is_a_miss_and_never_a_partial_write(
    backend: BackendUnderTest, damage: str
) -> None:
    if damage == "flipped" and not backend.checks_values:
        pytest.skip(f"{backend.id}: SGLang's raw pages carry no checksum (only sizes)")
    pages = make_pages(3, 5)
    keys = backend.keys(3, f"damage-{damage}")
    async with await backend.open() as store:
        assert await store.put(keys, pages) == 3
        value = await backend.read_raw(store, keys[1])
        if damage == "truncated":
            value = value[: len(value) // 2]
        else:
            value = value[:-1] + bytes([value[-1] ^ 0x01])
        await backend.write_raw(store, keys[1], value)
        out = zeros(pages)
        assert await store.get(keys, out) == 1
        assert out[1].eq(0).all() and same_bytes(out[0], pages[0])
        if backend.checks_values:
            assert store.stats().corrupt == 1
            assert await store.exists(keys) == 1  # the damaged value was dropped


@pytest.mark.asyncio
async def test_another_keys_value_under_a_keys_name_is_a_miss(backend: BackendUnderTest) -> None:
    """A value copied under another key's name (a valid page, a valid checksum): served,
    it would be the wrong tokens' KV.  It must read as a miss."""
    if not backend.detects_misplaced_values:
        pytest.skip(f"{backend.id}: a raw copy carries no key (a link does: see its tests)")
    pages = make_pages(2, 6)
    keys = backend.keys(2, "misplaced")
    async with await backend.open() as store:
        assert await store.put(keys[:1], pages[:1]) == 1
        await backend.write_raw(store, keys[1], await backend.read_raw(store, keys[0]))
        out = zeros(pages)
        assert await store.get(keys[1:], out[1:]) == 0
        assert out[1].eq(0).all() and store.stats().corrupt == 1
        assert await store.get(keys[:1], out[:1]) == 1 and same_bytes(out[0], pages[0])


# ---------------------------------------------------------------------- outages
@pytest.mark.asyncio
async def test_an_outage_reads_as_counted_misses_or_typed_errors_until_it_is_back(
    backend: BackendUnderTest,
) -> None:
    pages = make_pages(2, 7)
    async with await backend.open(op_timeout_s=2.0) as store:
        backend.take_away()
        try:
            fresh = backend.keys(2, "outage")
            with pytest.raises((StorageUnavailableError, StorageTimeout)):
                await store.exists(fresh, raise_errors=True)
            assert await store.exists(fresh) == 0
            with pytest.raises((StorageUnavailableError, StorageTimeout)):
                await store.get(fresh, zeros(pages), raise_errors=True)
            assert await store.get(fresh, zeros(pages)) == 0
            with pytest.raises((StorageUnavailableError, StorageTimeout)):
                await store.put(fresh, pages, raise_errors=True)
            assert await store.put(fresh, pages) == 0
            stats = store.stats()
            assert stats.failures == {StorageOp.EXISTS: 2, StorageOp.GET: 2, StorageOp.PUT: 2}
            assert stats.errors + stats.timeouts == 6 and stats.reads == stats.writes == 0
        finally:
            await backend.bring_back(store)
        after = backend.keys(2, "after-outage")
        assert await store.put(after, pages, raise_errors=True) == 2
        out = zeros(pages)
        assert await store.get(after, out, raise_errors=True) == 2
        assert all(same_bytes(a, b) for a, b in zip(pages, out, strict=True))


@pytest.mark.asyncio
async def test_a_stalled_store_hits_the_deadline_and_serves_again(
    backend: BackendUnderTest,
) -> None:
    """The store stops answering with its connections open (a hung server or mount): every
    call ends at ``op_timeout_s`` as a counted miss, or a typed error with
    ``raise_errors``; once it answers again its values are served."""
    reason = backend.stall_reason()
    if reason is not None:
        pytest.skip(f"{backend.id}: {reason}")
    pages = make_pages(2, 8)
    keys = backend.keys(2, "stall")
    async with await backend.open(op_timeout_s=0.5) as store:
        with anyio.fail_after(30):
            # A loaded machine can miss the short deadline before the stall too (a counted
            # miss, not a failure): store the pages first, whatever it takes.
            while await store.put(keys, pages) != 2:
                await anyio.sleep(0.1)
        backend.stall()
        try:
            with anyio.fail_after(20):
                assert await store.get(keys, zeros(pages)) == 0
                with pytest.raises((StorageTimeout, StorageUnavailableError)):
                    await store.exists(keys, raise_errors=True)
            assert store.stats().timeouts >= 1 and store.stats().reads == 0
        finally:
            backend.unstall()
        out = zeros(pages)
        with anyio.fail_after(30):
            while await store.get(keys, out) != 2:
                await anyio.sleep(0.1)  # the client reconnects on its own schedule
        assert all(same_bytes(a, b) for a, b in zip(pages, out, strict=True))


@pytest.mark.asyncio
async def test_the_storage_worker_rides_out_an_outage(backend: BackendUnderTest) -> None:
    """The whole stack (service, HiCache controller, storage worker, write-through) over the
    backend: during an outage a fetch is a miss and failures are counted (worker stats and
    ``urc_storage_errors_total``), the service keeps running; once the store is back, a
    backup written then is fetched back byte-exact; no pin or slot leaks."""
    retry = RetryPolicy(initial_s=0.01, max_s=0.05, max_attempts=200)
    store = await backend.open(op_timeout_s=2.0)
    stack = L3Stack(store, host_tokens=512, retry=retry, storage_config=backend.storage_config())
    offset = 7 * (1 + sum(map(ord, backend.id)))
    before = [offset + i for i in range(16)]
    after = [offset + 5000 + i for i in range(16)]
    async with store, stack.svc:
        with anyio.fail_after(90):
            await stack.put(before)
            await stack.settle()
            assert stack.worker.stats.pages_written == 4
            backend.take_away()
            try:
                await stack.drop_device_and_host()
                assert await stack.worker.fetch(stack.svc, RadixKey(before)) == 0
                assert stack.worker.stats.errors >= 1
                assert stack.storage_errors() == float(stack.worker.stats.errors)
                assert stack.svc.state is ServiceState.RUNNING
            finally:
                await backend.bring_back(store)
            original = await stack.put(after)
            await stack.settle()
            await stack.drop_device_and_host()
            assert await stack.worker.fetch(stack.svc, RadixKey(after)) == 16
            m = await stack.svc.match(RadixKey(after))
            assert m.prefix_len == 16 and torch.equal(stack.kv[:, :, m.device_indices], original)
            assert stack.svc.background_failures == ()
            await stack.svc.sanity_check()
            assert await stack.svc.call(pins) == 0
    stack.cache.check_pools({FULL: 0}, {FULL: 0})
