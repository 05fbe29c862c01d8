"""FileStorage: byte-exact round trips, leading-page counts, corruption, capacity, faults.

Also covers the ``StorageBackend`` contract shared by every backend (argument checks, the
deadline) through the file backend, which needs no server.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Sequence
from pathlib import Path

import anyio
import pytest
import torch

from hicache.storage import file as file_module
from hicache.storage.codec import HEADER_SIZE
from hicache.storage.errors import (
    InvalidBufferError,
    InvalidStorageKeyError,
    StorageClosedError,
)
from hicache.storage.file import FileStorage
from hicache.storage.keys import PageKey, StorageComponent, page_keys

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
    real_write = file_module._write_bytes
    calls = 0

    async def write_until_full(path: Path, data: bytes) -> None:
        nonlocal calls
        calls += 1
        if calls == 1:
            await real_write(path, data)
            return
        await real_write(path, data[:10])  # the disk fills mid-write
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(file_module, "_write_bytes", write_until_full)
    pages = make_pages(3)
    keys = keys_for(3)
    async with FileStorage(tmp_path) as store:
        assert await store.put(keys, pages) == 1
        assert await store.exists(keys) == 1
        assert store.stats().errors == 1
        assert store.used_bytes == page_nbytes()
    assert len(stored_files(tmp_path)) == 1


@pytest.mark.asyncio
async def test_reopening_rebuilds_the_index_and_drops_temp_files(tmp_path: Path) -> None:
    pages = make_pages(3)
    keys = keys_for(3)
    async with FileStorage(tmp_path) as store:
        await store.put(keys, pages)
        leftover = store.path_of(PageKey(1, StorageComponent.FULL, bytes(32))).parent
    leftover.mkdir(parents=True, exist_ok=True)
    (leftover / ".crashed.tmp").write_bytes(b"half")
    async with await FileStorage.open(tmp_path, capacity_bytes=2 * page_nbytes()) as again:
        # The smaller capacity applies at once: the oldest page went.
        assert again.used_bytes == 2 * page_nbytes()
        assert await again.exists(keys[1:]) == 2
        out = empty_like_all(pages[1:])
        assert await again.get(keys[1:], out) == 2
        assert out[1].equal(pages[2])
    assert not (leftover / ".crashed.tmp").exists()


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
