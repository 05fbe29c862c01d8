"""MooncakeStorage against a real ``mooncake_master`` on 127.0.0.1 (TCP, P2P handshake).

Skips when the optional ``mooncake`` package (mooncake-transfer-engine-non-cuda) cannot be
imported, e.g. because it is not installed or ``libibverbs`` is missing.
"""

from __future__ import annotations

import secrets
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from valkey_server import free_port, wait_until

from hicache.storage.codec import HEADER_SIZE
from hicache.storage.keys import StorageComponent, page_keys
from hicache.storage.mooncake import MooncakeConfig, MooncakeStorage, _chunks

mooncake_store = pytest.importorskip(
    "mooncake.store",
    reason="optional mooncake-transfer-engine-non-cuda (with libibverbs) is not importable",
    exc_type=ImportError,
)

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def master_address(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    import mooncake

    binary = Path(mooncake.__file__).parent / "mooncake_master"
    if not binary.exists():
        pytest.skip("the mooncake package ships no mooncake_master binary")
    port = free_port()
    log = (tmp_path_factory.mktemp("mooncake") / "master.log").open("wb")
    process = subprocess.Popen(
        [
            str(binary),
            f"--rpc_port={port}",
            "--rpc_address=127.0.0.1",
            f"--metrics_port={free_port()}",
            "--enable_metric_reporting=false",
            "--default_kv_lease_ttl=50",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )

    def accepts() -> bool:
        if process.poll() is not None:
            raise RuntimeError("mooncake_master exited before it accepted connections")
        socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
        return True

    try:
        wait_until(accepts, f"mooncake_master on port {port}", deadline_s=15)
        yield f"127.0.0.1:{port}"
    finally:
        process.kill()
        process.wait(timeout=10)
        log.close()


def config_for(master_address: str) -> MooncakeConfig:
    return MooncakeConfig(
        master_address=master_address,
        global_segment_size=128 << 20,
        local_buffer_size=16 << 20,
        key_prefix=f"t{secrets.token_hex(4)}:",
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
