"""FileStorage: byte-exact round trips, leading-page counts, corruption, capacity, faults.

Also covers the ``StorageBackend`` contract shared by every backend (argument checks, the
deadline) through the file backend, which needs no server.
"""

from __future__ import annotations

import errno
import os
import time
import tracemalloc
from collections.abc import Sequence
from pathlib import Path

import anyio
import pytest
import torch

from hicache.storage import _page_files
from hicache.storage.base import StorageBackend
from hicache.storage.codec import HEADER_SIZE
from hicache.storage.errors import (
    ClearUnsupportedError,
    InvalidBufferError,
    InvalidStorageKeyError,
    StorageClosedError,
    StorageTimeout,
)
from hicache.storage.file import MAX_STUCK_CALLS, TEMP_GRACE_S, FileStorage
from hicache.storage.keys import PageKey, StorageComponent, page_keys, parse_page_key
from hicache.storage.stats import StorageOp
from urc.errors import ConfigError

pytestmark = pytest.mark.timeout(30)

PAGE_SHAPE = (2, 4, 16)  # a small (k/v, heads, dims) page


def make_pages(count: int, seed: int = 0, dtype: torch.dtype = torch.float16) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(PAGE_SHAPE, generator=generator).to(dtype) for _ in range(count)]


def empty_like_all(pages: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [torch.full_like(page, 0) for page in pages]


def keys_for(count: int, extra_key: tuple[str | int, ...] | None = None) -> list[str]:
    return page_keys(list(range(count * 4)), 4, StorageComponent.FULL, extra_key)


def page_nbytes() -> int:
    return HEADER_SIZE + make_pages(1)[0].nbytes


def stored_files(root: Path) -> list[Path]:
    return sorted(path for path in root.rglob("*") if path.is_file())


@pytest.mark.asyncio
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.int8])
async def test_round_trip_is_byte_exact(tmp_path: Path, dtype: torch.dtype) -> None:
    pages = make_pages(5, dtype=dtype)
    keys = keys_for(5)
    async with await FileStorage.open(tmp_path) as store:
        assert await store.put(keys, pages) == 5
        assert await store.exists(keys) == 5
        out = empty_like_all(pages)
        assert await store.get(keys, out) == 5
    for page, read in zip(pages, out, strict=True):
        assert page.view(torch.uint8).equal(read.view(torch.uint8))
    stats = store.stats()
    assert (stats.writes, stats.reads) == (5, 5)
    assert stats.bytes_written == stats.bytes_read == sum(p.nbytes for p in pages)


@pytest.mark.asyncio
async def test_a_uint8_buffer_receives_any_dtype(tmp_path: Path) -> None:
    page = make_pages(1)[0]
    keys = keys_for(1)
    async with FileStorage(tmp_path) as store:
        await store.put(keys, [page])
        raw = torch.zeros(page.nbytes, dtype=torch.uint8)
        assert await store.get(keys, [raw]) == 1
    assert raw.equal(page.reshape(-1).view(torch.uint8))


@pytest.mark.asyncio
async def test_exists_and_get_count_leading_pages_only(tmp_path: Path) -> None:
    pages = make_pages(4)
    keys = keys_for(4)
    async with FileStorage(tmp_path) as store:
        await store.put(keys, pages)
        await store.delete([keys[1]])
        assert await store.exists(keys) == 1
        assert await store.exists(keys[2:]) == 2
        out = empty_like_all(pages)
        assert await store.get(keys, out) == 1
        assert out[0].equal(pages[0])
        assert await store.exists([]) == 0


@pytest.mark.asyncio
async def test_a_wrong_size_buffer_is_a_miss_and_untouched(tmp_path: Path) -> None:
    keys = keys_for(1)
    async with FileStorage(tmp_path) as store:
        await store.put(keys, make_pages(1))
        small = torch.full((3,), 7, dtype=torch.float16)
        assert await store.get(keys, [small]) == 0
        assert small.eq(7).all()
        assert await store.exists(keys) == 1  # a sound page is kept
        assert store.stats().corrupt == 0


@pytest.mark.asyncio
@pytest.mark.parametrize("damage", ["flip", "truncate", "empty"])
async def test_a_damaged_file_is_a_miss_and_deleted(tmp_path: Path, damage: str) -> None:
    pages = make_pages(3)
    keys = keys_for(3)
    async with FileStorage(tmp_path) as store:
        await store.put(keys, pages)
        victim = store.path_of(PageKey(1, StorageComponent.FULL, bytes.fromhex(keys[1][-64:])))
        data = victim.read_bytes()
        if damage == "flip":
            data = data[:-1] + bytes([data[-1] ^ 0x01])
        elif damage == "truncate":
            data = data[: len(data) // 2]
        else:
            data = b""
        victim.write_bytes(data)
        out = empty_like_all(pages)
        assert await store.get(keys, out) == 1
        assert out[1].eq(0).all()  # never a partial write
        assert not victim.exists()
        assert store.stats().corrupt == 1
        assert await store.exists(keys) == 1


@pytest.mark.asyncio
async def test_capacity_evicts_least_recently_used_first(tmp_path: Path) -> None:
    pages = make_pages(3)
    keys = keys_for(3)
    async with FileStorage(tmp_path, capacity_bytes=2 * page_nbytes()) as store:
        assert await store.put(keys[:2], pages[:2]) == 2
        assert await store.get(keys[:1], empty_like_all(pages[:1])) == 1  # key 0 is now newest
        assert await store.put(keys[2:], pages[2:]) == 1
        assert await store.exists(keys[1:2]) == 0  # the oldest one went
        assert await store.exists(keys[:1]) == 1
        assert await store.exists(keys[2:]) == 1
        assert store.used_bytes == 2 * page_nbytes()
        assert len(stored_files(tmp_path)) == 2


@pytest.mark.asyncio
async def test_a_batch_never_evicts_its_own_pages(tmp_path: Path) -> None:
    pages = make_pages(3)
    keys = keys_for(3)
    async with FileStorage(tmp_path, capacity_bytes=2 * page_nbytes()) as store:
        assert await store.put(keys, pages) == 2
        assert await store.exists(keys) == 2


@pytest.mark.asyncio
async def test_a_page_larger_than_capacity_stores_nothing(tmp_path: Path) -> None:
    async with FileStorage(tmp_path, capacity_bytes=10) as store:
        assert await store.put(keys_for(2), make_pages(2)) == 0
        assert stored_files(tmp_path) == []


@pytest.mark.asyncio
async def test_a_full_disk_stores_fewer_and_leaves_no_temp_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_write = _page_files.write_file
    calls = 0

    def write_until_full(dir_fd: int, name: str, data: bytes, tag: bytes | None) -> None:
        nonlocal calls
        calls += 1
        if calls == 1:
            real_write(dir_fd, name, data, tag)
            return
        real_write(dir_fd, name, data[:10], tag)  # the disk fills mid-write
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(_page_files, "write_file", write_until_full)
    pages = make_pages(3)
    keys = keys_for(3)
    async with FileStorage(tmp_path) as store:
        assert await store.put(keys, pages) == 1
        assert await store.exists(keys) == 1
        assert store.stats().errors == 1
        assert store.used_bytes == page_nbytes()
    assert len(stored_files(tmp_path)) == 1


@pytest.mark.asyncio
async def test_reopening_rebuilds_the_index_and_drops_its_own_stale_temp_files(
    tmp_path: Path,
) -> None:
    pages = make_pages(3)
    keys = keys_for(3)
    async with FileStorage(tmp_path) as store:
        await store.put(keys, pages)
        paths = [store.path_of(parse_page_key(k)) for k in keys]
    # The disk keeps only modification times (one batch may share one): give the order.
    for age, path in zip((30, 20, 10), paths, strict=True):
        os.utime(path, (time.time() - age, time.time() - age))
    fanout = paths[0].parent
    stale = fanout / f".{paths[0].name}.0123456789ab.tmp"  # our crashed write
    fresh = fanout / f".{paths[0].name}.ba9876543210.tmp"  # maybe a write in flight
    unrelated = fanout / "notes.tmp"  # not ours: never deleted
    for path in (stale, fresh, unrelated):
        path.write_bytes(b"half")
    old = time.time() - TEMP_GRACE_S - 1
    os.utime(stale, (old, old))
    os.utime(unrelated, (old, old))
    async with await FileStorage.open(tmp_path, capacity_bytes=2 * page_nbytes()) as again:
        # The smaller capacity applies at once: the oldest page went.
        assert again.used_bytes == 2 * page_nbytes()
        assert await again.exists(keys[1:]) == 2
        out = empty_like_all(pages[1:])
        assert await again.get(keys[1:], out) == 2
        assert out[1].equal(pages[2])
    assert not stale.exists()
    assert fresh.exists() and unrelated.exists()


@pytest.mark.asyncio
async def test_namespaces_are_isolated(tmp_path: Path) -> None:
    tokens = list(range(8))
    tenant_a = page_keys(tokens, 4, StorageComponent.FULL, ("tenant", "a"))
    tenant_b = page_keys(tokens, 4, StorageComponent.FULL, ("tenant", "b"))
    async with FileStorage(tmp_path) as store:
        await store.put(tenant_a, make_pages(2))
        assert await store.exists(tenant_b) == 0
        assert await store.get(tenant_b, empty_like_all(make_pages(2))) == 0


@pytest.mark.asyncio
async def test_bad_arguments_raise_typed_errors(tmp_path: Path) -> None:
    pages = make_pages(2)
    async with FileStorage(tmp_path) as store:
        with pytest.raises(InvalidStorageKeyError):
            await store.put(["../../escape"], pages[:1])
        with pytest.raises(InvalidStorageKeyError):
            await store.exists(["urc1:full:" + "z" * 64])
        with pytest.raises(InvalidBufferError):
            await store.put(keys_for(2), pages[:1])
        with pytest.raises(InvalidBufferError):
            await store.put(keys_for(1), [torch.zeros(4, 4).t()])  # not contiguous
    assert stored_files(tmp_path) == []
    with pytest.raises(StorageClosedError):
        await store.exists(keys_for(1))


class StuckStorage(FileStorage):
    """A store whose reads never finish: stands in for a hung disk or network."""

    async def _get(self, keys: Sequence[PageKey], buffers: Sequence[torch.Tensor]) -> int:
        await anyio.Event().wait()
        raise AssertionError("unreachable")


@pytest.mark.asyncio
async def test_a_stuck_store_hits_the_deadline_and_misses(tmp_path: Path) -> None:
    keys = keys_for(1)
    async with StuckStorage(tmp_path, op_timeout_s=0.2) as store:
        await store.put(keys, make_pages(1))
        assert await store.get(keys, empty_like_all(make_pages(1))) == 0
        assert store.stats().timeouts == 1


class StuckClearStorage(FileStorage):
    """A store whose clear never finishes (a hung file system under a bulk delete)."""

    async def _clear(self) -> int:
        await anyio.Event().wait()
        raise AssertionError("unreachable")


class NoClearStorage(FileStorage):
    """A backend that keeps ``StorageBackend``'s default ``_clear``."""

    _clear = StorageBackend._clear


@pytest.mark.asyncio
async def test_clear_raises_at_its_deadline_and_a_backend_without_one_refuses(
    tmp_path: Path,
) -> None:
    keys = keys_for(1)
    async with StuckClearStorage(tmp_path, op_timeout_s=0.2) as store:
        with pytest.raises(StorageTimeout):
            await store.clear(timeout_s=0.2)
        assert store.stats().failures == {StorageOp.CLEAR: 1}
    async with NoClearStorage(tmp_path) as store:
        await store.put(keys, make_pages(1))
        with pytest.raises(ClearUnsupportedError):
            await store.clear()
        assert await store.exists(keys) == 1 and store.stats().failures == {}


@pytest.mark.asyncio
async def test_concurrent_puts_of_the_same_pages_keep_one_copy(tmp_path: Path) -> None:
    pages = make_pages(8)
    keys = keys_for(8)
    results: list[int] = []
    async with FileStorage(tmp_path) as store:

        async def put() -> None:
            results.append(await store.put(keys, pages))

        async with anyio.create_task_group() as group:
            group.start_soon(put)
            group.start_soon(put)
        assert max(results) == 8  # one writer stored all; the other may have stopped early
        assert await store.exists(keys) == 8
        assert store.used_bytes == 8 * page_nbytes()
    assert len(stored_files(tmp_path)) == 8


@pytest.mark.asyncio
async def test_pages_written_by_another_instance_are_found(tmp_path: Path) -> None:
    pages = make_pages(2)
    keys = keys_for(2)
    async with FileStorage(tmp_path) as reader, FileStorage(tmp_path) as writer:
        await writer.put(keys, pages)
        assert await reader.exists(keys) == 2
        out = empty_like_all(pages)
        assert await reader.get(keys, out) == 2
        assert reader.used_bytes == 2 * page_nbytes()


# ---------------------------------------------------------------------- issue 50, items 5-7, 9
def key_of(key: str) -> PageKey:
    return parse_page_key(key)


@pytest.mark.asyncio
async def test_a_fifo_at_a_page_name_is_a_miss_at_once_and_kept(tmp_path: Path) -> None:
    """A FIFO where a page should be (a blocking read, as a hung mount would block) is not a
    page: the read misses at once, no deadline needed, and the FIFO is not deleted."""
    keys = keys_for(2)
    async with FileStorage(tmp_path, op_timeout_s=5.0) as store:
        await store.put(keys[:1], make_pages(1))
        fifo = store.path_of(key_of(keys[1]))
        fifo.parent.mkdir(parents=True, exist_ok=True)
        os.mkfifo(fifo)
        assert await store.exists(keys) == 1
        assert await store.get(keys, empty_like_all(make_pages(2))) == 1
        stats = store.stats()
        assert stats.timeouts == 0 and stats.corrupt == 1
        assert fifo.is_fifo()


async def wait_until_no_stuck_calls(store: FileStorage) -> None:
    with anyio.fail_after(10):
        while store.stuck_calls:
            await anyio.sleep(0.01)  # a thread in another kernel call: nothing to wait on


@pytest.mark.asyncio
async def test_a_hung_read_hits_the_deadline_and_leaves_threads_for_other_work(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Reads that block in the kernel (a FIFO opened without ``O_NONBLOCK``: what a hung
    network mount does to ``open``) end at ``op_timeout_s``; at most ``MAX_STUCK_CALLS``
    threads stay blocked, later calls fail at once as unavailable, and unrelated work still
    gets worker threads.  Once the file system answers, the store serves again."""
    monkeypatch.setattr(_page_files, "_OPEN_READ", os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    keys = keys_for(2)
    pages = make_pages(2)
    async with FileStorage(tmp_path, op_timeout_s=0.2) as store:
        await store.put(keys[1:], pages[1:])
        fifo = store.path_of(key_of(keys[0]))
        fifo.parent.mkdir(parents=True, exist_ok=True)
        os.mkfifo(fifo)
        calls = MAX_STUCK_CALLS + 4
        with anyio.fail_after(10):
            for _ in range(calls):
                assert await store.get(keys[:1], empty_like_all(pages[:1])) == 0
            stats = store.stats()
            assert (stats.timeouts, stats.errors) == (MAX_STUCK_CALLS, calls - MAX_STUCK_CALLS)
            assert store.stuck_calls == MAX_STUCK_CALLS
            # Unrelated work still gets a worker thread at once.
            assert await anyio.to_thread.run_sync(lambda: 42) == 42
            # The file system answers again (a writer opens the FIFO: the reads return).
            writer = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
            os.close(writer)
            await wait_until_no_stuck_calls(store)
            os.unlink(fifo)
            out = empty_like_all(pages[1:])
            assert await store.get(keys[1:], out) == 1 and out[0].equal(pages[1])


@pytest.mark.asyncio
async def test_a_huge_file_at_a_page_name_is_never_read_whole(tmp_path: Path) -> None:
    """A 1 GiB file under a page's name: the size is checked first, at most a header is
    read, and the damaged file (it is in this store's layout) is deleted."""
    keys = keys_for(1)
    async with FileStorage(tmp_path) as store:
        path = store.path_of(key_of(keys[0]))
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("wb") as f:
            f.truncate(1 << 30)  # sparse: costs no disk
        tracemalloc.start()
        try:
            assert await store.get(keys, empty_like_all(make_pages(1))) == 0
            _current, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert peak < 8 << 20, f"the read allocated {peak} bytes"
        assert store.stats().corrupt == 1 and not path.exists()


@pytest.mark.asyncio
@pytest.mark.parametrize("how", ["copy", "hardlink"])
async def test_a_page_under_another_keys_name_reads_as_corrupt(tmp_path: Path, how: str) -> None:
    """A page copied or linked under another key's name has a valid checksum; its header's
    key tag tells it apart: a miss, counted, and that name removed (the original stays)."""
    keys = keys_for(2)
    pages = make_pages(2)
    async with FileStorage(tmp_path) as store:
        await store.put(keys[:1], pages[:1])
        source = store.path_of(key_of(keys[0]))
        target = store.path_of(key_of(keys[1]))
        target.parent.mkdir(parents=True, exist_ok=True)
        if how == "copy":
            target.write_bytes(source.read_bytes())
        else:
            os.link(source, target)
        out = empty_like_all(pages)
        assert await store.get(keys[1:], out[1:]) == 0
        assert out[1].eq(0).all()
        assert store.stats().corrupt == 1 and not target.exists()
        assert await store.get(keys[:1], out[:1]) == 1 and out[0].equal(pages[0])


@pytest.mark.asyncio
async def test_a_link_out_of_the_root_is_never_followed_for_reads(tmp_path: Path) -> None:
    """A page file that is a link (here to a sound page of the same key in another store)
    is not followed: a miss, counted, and neither the link nor its target is touched."""
    keys = keys_for(1)
    pages = make_pages(1)
    elsewhere = tmp_path / "elsewhere"
    async with FileStorage(elsewhere) as other:
        await other.put(keys, pages)
        target = other.path_of(key_of(keys[0]))
    root = tmp_path / "root"
    async with FileStorage(root) as store:
        link = store.path_of(key_of(keys[0]))
        link.parent.mkdir(parents=True)
        link.symlink_to(target)
        assert await store.exists(keys) == 0
        assert await store.get(keys, empty_like_all(pages)) == 0
        assert store.stats().corrupt == 1
        assert link.is_symlink() and target.exists()
        dev_zero = store.path_of(key_of(keys_for(2)[1]))
        dev_zero.parent.mkdir(parents=True, exist_ok=True)
        dev_zero.symlink_to("/dev/zero")
        assert await store.get(keys_for(2)[1:], empty_like_all(pages)) == 0


def keys_in_one_fanout(count: int) -> list[str]:
    """``count`` single-page keys whose files share one fan-out directory."""
    by_prefix: dict[str, list[str]] = {}
    for i in range(100_000):
        key = page_keys([i] * 4, 4, StorageComponent.FULL)[0]
        group = by_prefix.setdefault(key[-64:][:2], [])
        group.append(key)
        if len(group) == count:
            return group
    raise AssertionError("unreachable: 256 prefixes")


@pytest.mark.asyncio
async def test_a_fanout_directory_replaced_by_a_link_takes_no_write_outside_the_root(
    tmp_path: Path,
) -> None:
    """A fan-out directory swapped for a link to a directory outside the root: a put under
    it stores nothing there (a counted failure), and a read through it misses."""
    first, second, third = keys_in_one_fanout(3)
    pages = make_pages(3)
    root = tmp_path / "root"
    outside = tmp_path / "outside"
    async with FileStorage(root) as store:
        assert await store.put([first], pages[:1]) == 1
        fanout = store.path_of(key_of(first)).parent
        fanout.rename(outside)
        fanout.symlink_to(outside, target_is_directory=True)
        assert await store.put([second], pages[1:2]) == 0
        assert store.stats().errors == 1
        assert sorted(p.name for p in outside.iterdir()) == [store.path_of(key_of(first)).name]
        assert await store.get([first], empty_like_all(pages[:1])) == 0
        assert await store.exists([third]) == 0


@pytest.mark.asyncio
async def test_a_root_that_is_a_regular_file_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "pages"
    path.write_bytes(b"not a directory")
    with pytest.raises(ConfigError):
        FileStorage(path)
    with pytest.raises(ConfigError):
        await FileStorage.open(path / "below")
    assert path.read_bytes() == b"not a directory"
