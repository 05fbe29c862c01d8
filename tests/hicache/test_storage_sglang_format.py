"""SGLang's L3 format on urc's side: its key scheme, ``HiCacheFile``'s file naming and raw
pages in ``FileStorage``, its ``page_first`` payload, and two urc replicas sharing pages
under it.  (That SGLang itself reads and writes the same pages is shown against the real
wheel in ``tests/sglang/test_sglang_l3_interop.py``.)"""

from __future__ import annotations

import hashlib
import os
import struct
import time
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from sglang_l3_harness import SHAPE, replica, sglang_payloads, tokens_of

import hicache
from hicache.config import HiCacheConfig, StorageConfig
from hicache.host_pool import HostPool
from hicache.storage.errors import InvalidStorageKeyError
from hicache.storage.file import TEMP_GRACE_S, FileStorage
from hicache.storage.keys import (
    KeyScheme,
    PageKey,
    SGLangPageKey,
    StorageComponent,
    page_keys,
    parse_page_key,
)
from hicache.storage.sglang_keys import (
    SGLangNaming,
    sglang_namespace,
    sglang_namespace_seed,
    sglang_page_hashes,
    sglang_page_keys,
)
from hicache.storage_worker import HostPageLayout
from hicache.storage_worker.sglang_pages import SGLangPagePayload
from urc import CacheConfig, ComponentType, ConfigError, KVShape, build_cache
from urc.pools.kv_pool import KVPool
from urc.specs import SlidingWindowSpec

pytestmark = pytest.mark.timeout(60)
NAMING = SGLangNaming("org/model-7b")
SUFFIX = "_org-model-7b_0_1"


# ---------------------------------------------------------------------- keys
def test_naming_suffix_is_hicache_files_config_suffix() -> None:
    assert NAMING.suffix == SUFFIX
    assert SGLangNaming().suffix == "__0_1"
    assert SGLangNaming("m", 3, 4).suffix == "_m_3_4"


@pytest.mark.parametrize(
    ("model", "rank", "size"), [("a b", 0, 1), ("x\n", 0, 1), ("m", 1, 1), ("m", -1, 2)]
)
def test_naming_refuses_unsafe_names_and_bad_ranks(model: str, rank: int, size: int) -> None:
    with pytest.raises(InvalidStorageKeyError):
        SGLangNaming(model, rank, size)


def test_sglang_key_strings_parse_to_full_sglang_keys() -> None:
    key = f"sglang:{'ab' * 32}{SUFFIX}"
    parsed = parse_page_key(key)
    assert isinstance(parsed, SGLangPageKey) and parsed.scheme is KeyScheme.SGLANG
    assert parsed.component is StorageComponent.FULL
    assert PageKey(0, StorageComponent.FULL, parsed.digest) != parsed
    assert str(parsed) == key and parsed.sglang_name == f"{'ab' * 32}{SUFFIX}"
    urc = parse_page_key(page_keys([1], 1, StorageComponent.FULL)[0])
    assert urc.scheme is KeyScheme.URC and parsed != urc


@pytest.mark.parametrize(
    "bad",
    [
        "sglang:" + "ab" * 32,  # no suffix
        "sglang:" + "AB" * 32 + SUFFIX,  # upper-case hex
        "sglang:" + "ab" * 31 + SUFFIX,  # short hash
        "sglang:" + "ab" * 32 + "_../x_0_1/y",  # a path
        "sglang:" + "ab" * 32 + SUFFIX + "\n",
    ],
)
def test_malformed_sglang_keys_are_refused(bad: str) -> None:
    with pytest.raises(InvalidStorageKeyError):
        parse_page_key(bad)


@pytest.mark.parametrize(
    ("ns", "pair"),
    [
        (None, (None, None)),
        (("extra", "lora-a"), ("lora-a", None)),
        (("salt", "tenant"), (None, "tenant")),
        (("salt", ""), (None, None)),
        (("extra", "", "salt", "t"), ("", "t")),
        (("extra", "e", "salt", "t"), ("e", "t")),
    ],
)
def test_sglang_namespace_maps_the_plug_in_namespaces(
    ns: tuple[str, ...] | None, pair: tuple[str | None, str | None]
) -> None:
    assert sglang_namespace(ns) == pair


def test_other_namespaces_get_a_distinct_extra_key() -> None:
    a, _ = sglang_namespace(("tenant", 1))
    b, _ = sglang_namespace(("tenant", "1"))
    assert a is not None and b is not None and a != b and a.startswith("urc:")


def _by_hand(tokens: list[int], ps: int, seed: bytes | None) -> list[bytes]:
    """SGLang's storage chain as its sources state it: SHA-256 of the previous digest (the
    seed first) and the page's tokens as little-endian uint32."""
    out, prior = [], seed
    for start in range(0, len(tokens) - ps + 1, ps):
        h = hashlib.sha256(prior or b"")
        h.update(struct.pack(f"<{ps}I", *tokens[start : start + ps]))
        prior = h.digest()
        out.append(prior)
    return out


@pytest.mark.parametrize("ps", [1, 16, 64])
@pytest.mark.parametrize("ns", [None, ("extra", "lora"), ("extra", "e", "salt", "s")])
def test_page_hashes_follow_sglangs_chain(ps: int, ns: tuple[str, ...] | None) -> None:
    tokens = tokens_of(3 * ps + ps // 2, seed=ps)
    seed = sglang_namespace_seed(*sglang_namespace(ns))
    assert (seed is None) == (ns is None)
    assert sglang_page_hashes(tokens, ps, ns) == _by_hand(tokens, ps, seed)
    keys = sglang_page_keys(tokens, ps, NAMING, ns)
    assert keys == [f"sglang:{d.hex()}{SUFFIX}" for d in _by_hand(tokens, ps, seed)]


def test_namespace_seed_distinguishes_absent_and_empty_parts() -> None:
    seeds = {
        sglang_namespace_seed(e, s)
        for e, s in [("", None), (None, ""), ("", ""), ("a", None), (None, "a"), ("a", "")]
    }
    assert len(seeds) == 6


def test_negative_tokens_are_refused() -> None:
    with pytest.raises(InvalidStorageKeyError):
        sglang_page_keys([1, -2], 2, NAMING)


# ---------------------------------------------------------------------- FileStorage
def _page(seed: int, n: int = 96) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)).to(torch.float16)


@pytest.mark.asyncio
async def test_sglang_pages_are_raw_files_named_as_hicache_file_names_them(tmp_path: Path) -> None:
    keys = sglang_page_keys(tokens_of(8, 1), 4, NAMING)
    pages = [_page(1), _page(2)]
    async with FileStorage(tmp_path) as store:
        assert await store.put(keys, pages) == 2
        for key, page in zip(keys, pages, strict=True):
            path = tmp_path / f"{parse_page_key(key).sglang_name}.bin"
            assert path.read_bytes() == page.numpy().tobytes()
        out = [torch.empty_like(p) for p in pages]
        assert await store.exists(keys) == 2
        assert await store.get(keys, out) == 2
        assert all(torch.equal(a, b) for a, b in zip(out, pages, strict=True))
        # A page of another size is a miss and stays (it is SGLang's, maybe another model's).
        assert await store.get(keys[:1], [torch.empty(95, dtype=torch.float16)]) == 0
        assert (tmp_path / f"{parse_page_key(keys[0]).sglang_name}.bin").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        f"{parse_page_key(k).sglang_name}.bin" for k in keys
    )


@pytest.mark.asyncio
async def test_a_file_sglang_wrote_is_read_and_counted(tmp_path: Path) -> None:
    key = sglang_page_keys(tokens_of(4, 2), 4, NAMING)[0]
    page = _page(3)
    (tmp_path / f"{parse_page_key(key).sglang_name}.bin").write_bytes(page.numpy().tobytes())
    async with FileStorage(tmp_path) as store:
        assert store.used_bytes == page.nbytes  # found by the scan
        out = torch.empty_like(page)
        assert await store.get([key], [out]) == 1 and torch.equal(out, page)


@pytest.mark.asyncio
async def test_scan_removes_only_its_own_temp_files(tmp_path: Path) -> None:
    name = parse_page_key(sglang_page_keys(tokens_of(4, 3), 4, NAMING)[0]).sglang_name
    ours = tmp_path / f".{name}.bin.0123456789ab.tmp"
    sglangs = tmp_path / f".{'c' * 32}.tmp"  # HiCacheFile's, maybe a write in flight
    ours.write_bytes(b"x")
    sglangs.write_bytes(b"y")
    old = time.time() - TEMP_GRACE_S - 1  # only old temp files: a young one may be in flight
    os.utime(ours, (old, old))
    os.utime(sglangs, (old, old))
    FileStorage(tmp_path)
    assert not ours.exists() and sglangs.exists()


@pytest.mark.asyncio
async def test_capacity_counts_and_evicts_sglang_pages(tmp_path: Path) -> None:
    keys = sglang_page_keys(tokens_of(12, 4), 4, NAMING)
    page_bytes = _page(0).nbytes
    async with FileStorage(tmp_path, capacity_bytes=2 * page_bytes, sglang_suffix=SUFFIX) as store:
        assert await store.put(keys[:2], [_page(0), _page(1)]) == 2
        assert await store.put(keys[2:], [_page(2)]) == 1
        assert store.used_bytes == 2 * page_bytes
        assert await store.exists(keys[:1]) == 0 and await store.exists(keys[1:]) == 2
    assert len(os.listdir(tmp_path)) == 2


@pytest.mark.asyncio
async def test_urc_and_sglang_keys_share_a_directory(tmp_path: Path) -> None:
    tokens = tokens_of(8, 5)
    urc_keys = page_keys(tokens, 4, StorageComponent.FULL)
    sgl_keys = sglang_page_keys(tokens, 4, NAMING)
    async with FileStorage(tmp_path) as store:
        assert await store.put(urc_keys, [_page(1), _page(2)]) == 2
        assert await store.exists(sgl_keys) == 0
        assert await store.put(sgl_keys, [_page(3), _page(4)]) == 2
    async with FileStorage(tmp_path) as store:
        assert store.used_bytes > 4 * _page(0).nbytes  # urc's pages carry a header
        out = torch.empty_like(_page(0))
        assert await store.get(sgl_keys[1:], [out]) == 1 and torch.equal(out, _page(4))
        assert await store.get(urc_keys[1:], [out]) == 1 and torch.equal(out, _page(2))


# ---------------------------------------------------------------------- payload
@pytest.mark.parametrize("ps", [1, 16, 64])
def test_payload_is_sglangs_page_first_layout(ps: int) -> None:
    pool = KVPool(4 * ps, SHAPE)
    pool.kv.copy_(torch.randn(pool.kv.shape).to(SHAPE.dtype))
    host = HostPool(pool.slot_buffers(), 4 * ps, ps)
    slots = torch.arange(ps, 3 * ps)  # pages 1 and 2
    host.backup(slots, slots)
    layout = HostPageLayout(host)
    payload = SGLangPagePayload(layout)
    assert payload.identity  # urc's page_first host pool holds SGLang's payload as it is
    rows = layout.gather(slots)
    converted = payload.to_sglang(rows)
    expected = sglang_payloads(pool.kv[:, :, slots], ps)
    for row, page in zip(converted, expected, strict=True):
        assert torch.equal(row, page.view(torch.uint8))
    assert torch.equal(payload.from_sglang(converted), rows)


@pytest.mark.parametrize("ps", [1, 16, 64])
def test_per_layer_buffers_are_transposed_into_sglangs_layout(ps: int) -> None:
    """Host pools mirroring per-layer K and V buffers (SGLang's own device pools, under the
    plug-in) hold a page layer by layer: the converter swaps it into SGLang's order."""
    layers, slots = 3, 4 * ps
    k = [torch.randn(slots, 2, 4).to(torch.float16) for _ in range(layers)]
    v = [torch.randn(slots, 2, 4).to(torch.float16) for _ in range(layers)]
    host = HostPool([(t, 0) for t in [*k, *v]], slots, ps)
    picked = torch.arange(ps, 3 * ps)
    host.backup(picked, picked)
    layout = HostPageLayout(host)
    payload = SGLangPagePayload(layout)
    assert payload.identity == (ps == 1)
    rows = layout.gather(picked)
    kv = torch.stack([torch.stack(k), torch.stack(v)])  # [2, layers, slots, heads, dim]
    expected = sglang_payloads(kv[:, :, picked], ps)
    for row, page in zip(payload.to_sglang(rows), expected, strict=True):
        assert torch.equal(row, page.view(torch.uint8))
    assert torch.equal(payload.from_sglang(payload.to_sglang(rows)), rows)


@settings(max_examples=40, deadline=None)
@given(
    ps=st.sampled_from([1, 2, 4, 16]),
    layers=st.integers(1, 4),
    heads=st.integers(1, 3),
    dim=st.sampled_from([1, 2, 8]),
    pages=st.integers(1, 3),
)
def test_payload_conversion_is_a_byte_permutation_both_ways(
    ps: int, layers: int, heads: int, dim: int, pages: int
) -> None:
    """Any KV geometry: urc rows -> SGLang payload is SGLang's page_first layout of the same
    bytes, and back is the identity."""
    shape = KVShape(layers, heads, dim, torch.float16)
    pool = KVPool(pages * ps, shape)
    pool.kv.copy_(torch.randn(pool.kv.shape).to(shape.dtype))
    host = HostPool(pool.slot_buffers(), pages * ps, ps)
    slots = torch.arange(pages * ps)
    host.backup(slots, slots)
    layout = HostPageLayout(host)
    payload = SGLangPagePayload(layout)
    rows = layout.gather(slots)
    out = payload.to_sglang(rows)
    assert torch.equal(payload.from_sglang(out), rows)
    for row, page in zip(out, sglang_payloads(pool.kv, ps), strict=True):
        assert torch.equal(row, page.view(torch.uint8))


def test_sglang_scheme_refuses_components_other_than_full(tmp_path: Path) -> None:
    cache = build_cache(
        CacheConfig(
            components=(ComponentType.FULL, SlidingWindowSpec(window=8, kv_size=256)),
            page_size=4,
            kv_size=256,
        )
    )
    with pytest.raises(ConfigError, match="Full pages only"):
        hicache.attach(
            cache,
            HiCacheConfig(host_tokens=512),
            FileStorage(tmp_path),
            storage_config=StorageConfig(key_scheme=KeyScheme.SGLANG),
        )


# ---------------------------------------------------------------------- two urc replicas
@pytest.mark.asyncio
@pytest.mark.parametrize("ps", [1, 16, 64])
@pytest.mark.parametrize("ns", [None, ("extra", "e", "salt", "s")])
async def test_two_replicas_share_pages_under_sglangs_scheme(
    tmp_path: Path, ps: int, ns: tuple[str, ...] | None
) -> None:
    tokens = tokens_of(3 * ps, seed=ps)
    async with replica(FileStorage(tmp_path), ps, NAMING) as first:
        original = await first.put(tokens, ns)
        assert first.worker.stats.pages_written == 3
    files = sorted(p.name for p in tmp_path.iterdir())
    names = [
        f"{parse_page_key(k).sglang_name}.bin" for k in sglang_page_keys(tokens, ps, NAMING, ns)
    ]
    assert files == sorted(names)
    async with replica(FileStorage(tmp_path), ps, NAMING) as second:
        assert (await second.fetch(tokens, None if ns else ("extra", "other")))[0] == 0
        got, data = await second.fetch(tokens, ns)
        assert got == 3 * ps and torch.equal(data, original[:, :, : 3 * ps])
    async with replica(FileStorage(tmp_path), ps, SGLangNaming("other/model")) as third:
        assert (await third.fetch(tokens, ns))[0] == 0  # another model's names


# ---------------------------------------------------------------------- issue 50, items 6-7
def _user_xattrs_kept(directory: Path) -> bool:
    probe = directory / ".xattr-probe"
    probe.write_bytes(b"")
    try:
        os.setxattr(probe, "user.probe", b"1")
    except OSError:
        return False
    finally:
        probe.unlink()
    return True


@pytest.mark.asyncio
async def test_an_sglang_page_linked_under_another_keys_name_is_not_served(tmp_path: Path) -> None:
    """SGLang's raw page has no header to hold its key: a page this store wrote carries its
    key tag in an extended attribute, so the same file under another key's name (a hard
    link) is a miss, counted, and left alone; the file stays byte-for-byte SGLang's."""
    if not _user_xattrs_kept(tmp_path):
        pytest.skip("this file system keeps no user extended attributes")
    keys = sglang_page_keys(tokens_of(8, 6), 4, NAMING)
    page = _page(5)
    async with FileStorage(tmp_path) as store:
        assert await store.put(keys[:1], [page]) == 1
        source = tmp_path / f"{parse_page_key(keys[0]).sglang_name}.bin"
        target = tmp_path / f"{parse_page_key(keys[1]).sglang_name}.bin"
        assert source.read_bytes() == page.numpy().tobytes()
        os.link(source, target)
        out = torch.zeros_like(page)
        assert await store.get(keys[1:], [out]) == 0 and out.eq(0).all()
        assert store.stats().corrupt == 1 and target.exists()
        assert await store.get(keys[:1], [out]) == 1 and torch.equal(out, page)


@pytest.mark.asyncio
async def test_a_capacity_limited_store_never_deletes_other_deployments_pages(
    tmp_path: Path,
) -> None:
    """A directory shared with SGLang replicas of another model: a capacity-limited store
    counts and evicts only its own suffix's pages (at open and on put), never theirs."""
    other = SGLangNaming("other/model")
    theirs = sglang_page_keys(tokens_of(80, 7), 4, other)
    for i, key in enumerate(theirs):
        (tmp_path / f"{parse_page_key(key).sglang_name}.bin").write_bytes(
            _page(100 + i).numpy().tobytes()
        )
    ours = sglang_page_keys(tokens_of(16, 8), 4, NAMING)
    page_bytes = _page(0).nbytes
    async with FileStorage(tmp_path, capacity_bytes=2 * page_bytes, sglang_suffix=SUFFIX) as store:
        assert store.used_bytes == 0
        assert await store.put(ours, [_page(i) for i in range(4)]) == 2
        assert store.used_bytes == 2 * page_bytes
        assert await store.exists(theirs) == len(theirs)  # read if asked, never adopted
        assert store.used_bytes == 2 * page_bytes
        with pytest.raises(InvalidStorageKeyError):
            await store.put(theirs[:1], [_page(0)])
    names = {p.name for p in tmp_path.iterdir()}
    assert all(f"{parse_page_key(k).sglang_name}.bin" in names for k in theirs)
    with pytest.raises(ConfigError):
        FileStorage(tmp_path, sglang_suffix="not a suffix")


# ---------------------------------------------------------------------- clear
@pytest.mark.asyncio
async def test_clear_deletes_only_the_stores_own_files_in_a_shared_directory(
    tmp_path: Path,
) -> None:
    """``/hicache/storage-backend/clear`` on a directory SGLang replicas of another model
    share: this deployment's SGLang pages and urc's layout go; another suffix's pages, a
    page-named link (its target untouched), temp files of writes in flight, SGLang's own
    temp files and files that are no page stay."""
    ours = sglang_page_keys(tokens_of(8, 9), 4, NAMING)
    theirs = sglang_page_keys(tokens_of(8, 9), 4, SGLangNaming("other/model"))
    urc_keys = page_keys(tokens_of(8, 9), 4, StorageComponent.FULL)
    outside = tmp_path.parent / f"{tmp_path.name}-outside"
    outside.write_bytes(b"not a page")
    async with FileStorage(tmp_path, sglang_suffix=SUFFIX) as store:
        for keys in (ours, theirs, urc_keys):
            assert await store.put(keys, [_page(1), _page(2)]) == 2
        linked = sglang_page_keys(tokens_of(4, 10), 4, NAMING)[0]
        (tmp_path / f"{parse_page_key(linked).sglang_name}.bin").symlink_to(outside)
        name = parse_page_key(ours[0]).sglang_name
        keep = [
            tmp_path / f".{name}.bin.0123456789ab.tmp",  # our write in flight
            tmp_path / f".{'c' * 32}.tmp",  # HiCacheFile's
            tmp_path / "notes.txt",
        ]
        for path in keep:
            path.write_bytes(b"x")
        assert await store.clear() == 4
        assert await store.exists(ours) == 0 and await store.exists(urc_keys) == 0
        assert await store.exists(theirs) == 2
        assert all(path.exists() for path in keep)
        assert (tmp_path / f"{parse_page_key(linked).sglang_name}.bin").is_symlink()
        assert outside.read_bytes() == b"not a page"
        assert store.used_bytes == 2 * _page(0).nbytes  # their pages, adopted by exists
        assert await store.clear() == 0


@pytest.mark.asyncio
async def test_a_store_without_a_suffix_clears_no_sglang_page(tmp_path: Path) -> None:
    """Without ``sglang_suffix`` a store cannot tell its deployment's SGLang pages from
    another's: its clear deletes urc's layout only."""
    sgl = sglang_page_keys(tokens_of(8, 11), 4, NAMING)
    urc_keys = page_keys(tokens_of(8, 11), 4, StorageComponent.FULL)
    async with FileStorage(tmp_path) as store:
        assert await store.put(sgl, [_page(1), _page(2)]) == 2
        assert await store.put(urc_keys, [_page(1), _page(2)]) == 2
        assert await store.clear() == 2
        assert await store.exists(sgl) == 2 and await store.exists(urc_keys) == 0
