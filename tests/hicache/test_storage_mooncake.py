"""MooncakeStorage against a real ``mooncake_master`` on 127.0.0.1 (TCP, P2P handshake).

Skips when the optional ``mooncake`` package (mooncake-transfer-engine-non-cuda) cannot be
imported: it is not installed, or the verbs library it links (``libibverbs1``, needed even
for TCP) is missing.  ``.ci/run`` installs both.  The outage tests kill the master (a crash)
and restart it on the same port.
"""

from __future__ import annotations

import dataclasses
import secrets
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest
import torch
from cache_harness import pins
from mooncake_master import MooncakeMaster, find_master_binary
from storage_harness import L3Stack

from hicache.storage.codec import HEADER_SIZE
from hicache.storage.errors import ClearUnsupportedError, StorageTimeout, StorageUnavailableError
from hicache.storage.keys import StorageComponent, page_keys
from hicache.storage.mooncake import MooncakeConfig, MooncakeStorage, _chunks, clear_pattern
from hicache.storage.sglang_keys import SGLangNaming, sglang_page_keys
from hicache.storage.stats import StorageOp
from hicache.storage_worker import RetryPolicy
from urc import ComponentType, RadixKey
from urc.service import ServiceState

mooncake_store = pytest.importorskip(
    "mooncake.store",
    reason="optional mooncake-transfer-engine-non-cuda (with libibverbs) is not importable",
    exc_type=ImportError,
)

pytestmark = pytest.mark.timeout(90)
FULL = ComponentType.FULL


def new_master(directory: Path) -> MooncakeMaster:
    binary = find_master_binary()
    if binary is None:
        pytest.skip("the mooncake package ships no mooncake_master binary")
    return MooncakeMaster(binary, directory / "master.log")


@pytest.fixture(scope="module")
def master_address(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One master for the tests that never kill it."""
    master = new_master(tmp_path_factory.mktemp("mooncake"))
    try:
        master.start()
        yield master.address
    finally:
        master.kill()


@pytest.fixture
def master(tmp_path: Path) -> Iterator[MooncakeMaster]:
    """A master of this test's own, to kill and restart."""
    process = new_master(tmp_path)
    try:
        process.start()
        yield process
    finally:
        process.kill()


def config_for(master_address: str, op_timeout_s: float = 10.0) -> MooncakeConfig:
    return MooncakeConfig(
        master_address=master_address,
        global_segment_size=128 << 20,
        local_buffer_size=16 << 20,
        key_prefix=f"t{secrets.token_hex(4)}:",
        op_timeout_s=op_timeout_s,
    )


def make_pages(count: int, numel: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(count)
    return [torch.randn(numel, generator=generator).half() for _ in range(count)]


def keys_for(count: int, extra_key: tuple[str | int, ...] | None = None) -> list[str]:
    return page_keys(list(range(count * 2)), 2, StorageComponent.FULL, extra_key)


@pytest.mark.asyncio
async def test_round_trip_in_chunks_is_byte_exact(master_address: str) -> None:
    # 10 pages of 2 MiB overflow one 8 MiB chunk (half the staging buffer) several times.
    pages = make_pages(10, 1 << 20)
    keys = keys_for(10)
    async with await MooncakeStorage.open(config_for(master_address)) as store:
        assert await store.put(keys, pages) == 10
        assert await store.exists(keys) == 10
        out = [torch.zeros_like(page) for page in pages]
        assert await store.get(keys, out) == 10
        await store.delete(keys)
        assert await store.exists(keys) == 0
    for page, read in zip(pages, out, strict=True):
        assert page.view(torch.uint8).equal(read.view(torch.uint8))


@pytest.mark.asyncio
async def test_leading_pages_and_namespaces(master_address: str) -> None:
    pages = make_pages(4, 256)
    keys = keys_for(4, ("tenant", 1))
    async with await MooncakeStorage.open(config_for(master_address)) as store:
        assert await store.put(keys, pages) == 4
        await store.delete(keys[1:2])
        assert await store.exists(keys) == 1
        assert await store.get(keys, [torch.zeros_like(p) for p in pages]) == 1
        other = keys_for(4, ("tenant", 2))
        assert await store.exists(other) == 0
        small = torch.zeros(3, dtype=torch.uint8)
        assert await store.get(keys[:1], [small]) == 0


def test_chunks_fit_the_budget() -> None:
    sizes = [HEADER_SIZE + 10] * 5 + [1000]
    ranges = list(_chunks(sizes, 3 * (HEADER_SIZE + 10)))
    assert ranges == [(0, 3), (3, 5), (5, 6)]


async def wait_writable(store: MooncakeStorage) -> None:
    """Wait until a restarted master takes writes again: the client re-registers its segment
    on its next heartbeat, and a put before that stores nothing.  Polls under a deadline
    (the restart is another process's: nothing to wait on)."""
    probe = keys_for(1, ("probe", secrets.token_hex(4)))
    page = [torch.zeros(4)]
    with anyio.fail_after(30):
        while await store.put(probe, page) != 1:
            await anyio.sleep(0.1)


@pytest.mark.asyncio
async def test_a_master_outage_reads_as_counted_misses_and_typed_errors_until_restart(
    master: MooncakeMaster,
) -> None:
    """The master is killed: every call is a miss counted by operation (``errors`` and
    ``failures``), or with ``raise_errors`` a typed ``StorageUnavailableError`` /
    ``StorageTimeout``, never an empty store read as healthy.  After a restart the pages
    stored before are gone (misses, not errors) and new pages round-trip byte-exact."""
    pages = make_pages(4, 256)
    keys = keys_for(4)
    async with await MooncakeStorage.open(config_for(master.address, op_timeout_s=2)) as store:
        assert await store.put(keys, pages) == 4
        master.kill()
        # Right after the crash the client usually fails at once (RPC_FAIL); a call may also
        # spend seconds reconnecting and hit the deadline (on a loaded machine, even the
        # first): both are typed failures, never an empty store read as healthy.
        with pytest.raises((StorageUnavailableError, StorageTimeout)):
            await store.exists(keys, raise_errors=True)
        assert await store.exists(keys) == 0
        with pytest.raises((StorageUnavailableError, StorageTimeout)):
            await store.get(keys, [torch.zeros_like(p) for p in pages], raise_errors=True)
        assert await store.get(keys, [torch.zeros_like(p) for p in pages]) == 0
        with pytest.raises((StorageUnavailableError, StorageTimeout)):
            await store.put(keys_for(1, ("outage",)), pages[:1], raise_errors=True)
        stats = store.stats()
        assert stats.failures == {StorageOp.EXISTS: 2, StorageOp.GET: 2, StorageOp.PUT: 1}
        assert stats.errors + stats.timeouts == 5 and stats.reads == 0

        master.start()
        await wait_writable(store)
        failed = store.stats().errors + store.stats().timeouts
        assert await store.exists(keys, raise_errors=True) == 0  # the old master's keys
        fresh = keys_for(4, ("after", 1))
        assert await store.put(fresh, pages, raise_errors=True) == 4
        out = [torch.zeros_like(p) for p in pages]
        assert await store.get(fresh, out, raise_errors=True) == 4
        assert store.stats().errors + store.stats().timeouts == failed
    for page, read in zip(pages, out, strict=True):
        assert page.view(torch.uint8).equal(read.view(torch.uint8))


@pytest.mark.asyncio
async def test_the_storage_worker_rides_out_a_master_restart(master: MooncakeMaster) -> None:
    """The storage worker over Mooncake: a fetch while the master is down is a miss, counted
    in the worker's stats and ``urc_storage_errors_total``; the service keeps running; after
    the restart new backups are written and fetched back byte-exact; no pin or slot leaks."""
    retry = RetryPolicy(initial_s=0.01, max_s=0.05, max_attempts=50)
    store = await MooncakeStorage.open(config_for(master.address, op_timeout_s=2))
    stack = L3Stack(store, host_tokens=512, retry=retry)
    before = [7 + i for i in range(16)]
    after = [9000 + i for i in range(16)]
    async with store, stack.svc:
        with anyio.fail_after(60):
            await stack.put(before)
            await stack.settle()
            assert stack.worker.stats.pages_written == 4
            master.kill()
            await stack.drop_device_and_host()
            assert await stack.worker.fetch(stack.svc, RadixKey(before)) == 0
            assert stack.worker.stats.errors >= 1
            assert stack.storage_errors(StorageOp.EXISTS) >= 1
            assert stack.svc.state is ServiceState.RUNNING

            master.start()
            await wait_writable(store)
            original = await stack.put(after)
            await stack.settle()
            assert stack.worker.stats.pages_written == 8
            await stack.drop_device_and_host()
            assert await stack.worker.fetch(stack.svc, RadixKey(before)) == 0  # lost
            assert await stack.worker.fetch(stack.svc, RadixKey(after)) == 16
            m = await stack.svc.match(RadixKey(after))
            assert m.prefix_len == 16 and torch.equal(stack.kv[:, :, m.device_indices], original)
            assert stack.storage_errors() == float(stack.worker.stats.errors)
            assert stack.svc.background_failures == ()
            await stack.svc.sanity_check()
            assert await stack.svc.call(pins) == 0
    stack.cache.check_pools({FULL: 0}, {FULL: 0})


# ---------------------------------------------------------------------- clear
def test_the_clear_pattern_names_the_stores_own_pages_only() -> None:
    """The master matches anywhere in a name (``regex_search``): the pattern is anchored at
    both ends, so a prefix that extends this one, or another suffix, never matches."""
    import re

    suffix = SGLangNaming("org/m.v1").suffix
    pattern = re.compile(clear_pattern("l3.a:", suffix))
    urc_key = keys_for(1)[0]
    ours = sglang_page_keys(list(range(4)), 4, SGLangNaming("org/m.v1"))[0]
    theirs = sglang_page_keys(list(range(4)), 4, SGLangNaming("org/m-v1"))[0]
    assert pattern.search("l3.a:" + urc_key) and pattern.search("l3.a:" + ours)
    for name in (
        "l3.a:" + theirs,  # another deployment ("." is no wildcard)
        "l3xa:" + urc_key,
        "l3.a:n:" + urc_key,  # a neighbour whose prefix extends this one
        "x:l3.a:" + urc_key,
        "l3.a:" + urc_key + "-copy",
        "l3.a:other",
    ):
        assert not pattern.search(name), name
    for bad in ("a b:", "a*", "(", "a\\"):
        with pytest.raises(ClearUnsupportedError):
            clear_pattern(bad, None)


@pytest.mark.asyncio
async def test_a_prefix_the_pattern_cannot_spell_refuses_the_clear_and_deletes_nothing(
    master_address: str,
) -> None:
    config = dataclasses.replace(config_for(master_address), key_prefix="t x*:")
    keys = keys_for(2, ("clear",))
    async with await MooncakeStorage.open(config) as store:
        assert await store.put(keys, make_pages(2, 64)) == 2
        with pytest.raises(ClearUnsupportedError):
            await store.clear()
        assert await store.exists(keys) == 2
        assert store.stats().failures == {}
