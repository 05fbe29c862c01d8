"""urc's L3 worker driven the way SGLang's scheduler drives it with urc as the tree
(``urc.apps.sglang._l3``): the worker on a loop thread of its own, its tree steps run on the
calling ("scheduler") thread at ``run_calls``, a real :class:`FileStorage` in SGLang's key
scheme.  No SGLang process is needed: these are the bridge's contracts; the live server
cases are in ``tests/live_sglang``.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest
import torch
from hicache_harness import FULL, check, insert, make, match, seq, zero_device
from test_sglang_hicache_surface import Scheduler

from hicache.config import PrefetchStopPolicy
from hicache.storage.file import FileStorage
from hicache.storage.sglang_keys import SGLangNaming, sglang_page_keys
from hicache.storage.stats import StorageOp
from urc import EvictParams, UnifiedRadixCache
from urc.apps.sglang._l3 import (
    SchedulerActor,
    SchedulerStorage,
    attach_storage,
    open_store,
    parse_extra_config,
    storage_config,
)
from urc.errors import ConfigError
from urc.host_protocol import WritePolicy

pytestmark = pytest.mark.timeout(120)

NAMING = SGLangNaming("org/tiny")
DEADLINE_S = 30.0


def _until(cond: Any, l3: SchedulerStorage) -> None:
    """Run the worker's tree steps on this thread until ``cond()``."""
    deadline = time.monotonic() + DEADLINE_S
    while not cond():
        l3.run_calls()
        assert time.monotonic() < deadline, "the L3 worker did not finish in time"
        time.sleep(0.002)


def _bridge(cache: UnifiedRadixCache, root: Path, policy: str = "timeout") -> SchedulerStorage:
    tier: Any = cache.host_tier
    extra = f'{{"file_storage_path": "{root}", "prefetch_threshold": 1}}'
    return attach_storage(cache, tier, "file", extra, NAMING.model_name, policy)


# ---------------------------------------------------------------------- the actor
def test_actor_runs_each_call_on_the_thread_that_runs_the_calls_and_returns_its_result() -> None:
    cache: Any = object()
    actor = SchedulerActor(cache)
    seen: list[Any] = []
    out: list[Any] = []

    async def caller() -> None:
        out.append(await actor.call(lambda c: (seen.append(threading.get_ident()), c)[1]))

    t = threading.Thread(target=asyncio.run, args=(caller(),))
    t.start()
    deadline = time.monotonic() + DEADLINE_S
    while t.is_alive():
        actor.run_calls()
        assert time.monotonic() < deadline
        time.sleep(0.001)
    assert seen == [threading.get_ident()] and out == [cache]


def test_actor_hands_a_calls_exception_to_its_caller() -> None:
    actor = SchedulerActor(object())  # type: ignore[arg-type]
    errors: list[BaseException] = []

    def boom(cache: Any) -> None:
        raise KeyError("boom")

    async def caller() -> None:
        try:
            await actor.call(boom)
        except KeyError as e:
            errors.append(e)

    t = threading.Thread(target=asyncio.run, args=(caller(),))
    t.start()
    while t.is_alive():
        actor.run_calls()
        time.sleep(0.001)
    assert len(errors) == 1


def test_actor_undoes_a_result_whose_caller_was_cancelled_and_skips_a_cancelled_call() -> None:
    actor = SchedulerActor(object())  # type: ignore[arg-type]
    ran: list[str] = []
    undone: list[Any] = []

    async def cancelled_caller(name: str) -> None:
        task = asyncio.ensure_future(
            actor.call(lambda c: ran.append(name) or name, undo=lambda c, r: undone.append(r))
        )
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(cancelled_caller("before"))  # cancelled before the call ran: it never runs
    assert actor.run_calls() == 0 and ran == [] and undone == []


# ---------------------------------------------------------------------- the store bridge
@pytest.mark.parametrize("ps", [1, 4])
def test_a_fresh_cache_prefetches_from_l3_what_another_wrote_and_loads_the_same_bytes(
    ps: int, tmp_path: Path
) -> None:
    tokens = seq(1, 8, ps)
    fill = [float(i % 97) for i in range(len(tokens))]
    first = make((FULL,), ps, kv_pages=16, host_pages=32)
    l3 = _bridge(first, tmp_path)
    try:
        assert insert(first, tokens, fill=fill)
        node = match(first, tokens).last_device_node
        assert first.write_backup(node) == len(tokens)  # host copy landed: a put is due
        _until(lambda: l3.pending_writes() == 0, l3)
        keys = sglang_page_keys(tokens, ps, NAMING)
        assert all((tmp_path / f"{k.removeprefix('sglang:')}.bin").exists() for k in keys)
        want = first.pools.kv_pool.kv[:, :, first.path_device_indices(node)].clone()  # type: ignore[union-attr]
    finally:
        l3.close()
    check(first)

    second = make((FULL,), ps, kv_pages=16, host_pages=32)
    l3 = _bridge(second, tmp_path)
    try:
        assert l3.prefetch("req-1", _key(tokens))
        assert not l3.prefetch("req-1", _key(tokens))  # one per attempt
        _until(lambda: l3.progress("req-1"), l3)
        assert l3.pop_loaded("req-1") == len(tokens)
        assert "req-1" not in l3.prefetches
        check(second)
        hit = match(second, tokens)
        assert hit.device_prefix_len == 0 and hit.host_hit_length == len(tokens)
        zero_device(second)
        assert second.load_back(hit.best_match_node) == len(tokens)
        got = second.pools.kv_pool.kv[:, :, second.path_device_indices(hit.best_match_node)]  # type: ignore[union-attr]
        assert torch.equal(got, want)
        check(second)
    finally:
        l3.close()


def test_a_prefetch_of_pages_no_store_holds_loads_nothing(tmp_path: Path) -> None:
    cache = make((FULL,), 4, kv_pages=16, host_pages=32)
    l3 = _bridge(cache, tmp_path)
    try:
        assert l3.prefetch("r", _key(seq(500, 4, 4)))
        _until(lambda: l3.progress("r"), l3)
        assert l3.pop_loaded("r") == 0
        assert match(cache, seq(500, 4, 4)).host_hit_length == 0
        assert l3.progress("unknown") and l3.pop_loaded("unknown") == 0
    finally:
        l3.close()
    check(cache)


def test_an_aborted_requests_prefetch_gives_back_its_host_slots_and_pins(tmp_path: Path) -> None:
    ps = 4
    tokens = seq(1, 6, ps)
    writer = make((FULL,), ps, kv_pages=16, host_pages=32)
    l3 = _bridge(writer, tmp_path)
    try:
        assert insert(writer, tokens)
        writer.write_backup(match(writer, tokens).last_device_node)
        _until(lambda: l3.pending_writes() == 0, l3)
    finally:
        l3.close()
    cache = make((FULL,), ps, kv_pages=16, host_pages=32)
    free = cache.host_tier.host_available(FULL)  # type: ignore[union-attr]
    l3 = _bridge(cache, tmp_path)
    try:
        l3.prefetch("r", _key(tokens))
        l3.release("r")
        assert "r" not in l3.prefetches
        # Whatever ran before the cancel is committed or given back at later turns.
        _until(lambda: _host_settled(cache, tokens, free), l3)
    finally:
        l3.close()
    check(cache)


def _host_settled(cache: UnifiedRadixCache, tokens: list[int], free: int) -> bool:
    used = free - cache.host_tier.host_available(FULL)  # type: ignore[union-attr]
    return used == match(cache, tokens).host_hit_length


def test_best_effort_commits_what_arrived_when_the_request_is_scheduled(tmp_path: Path) -> None:
    ps = 4
    tokens = seq(1, 6, ps)
    writer = make((FULL,), ps, kv_pages=16, host_pages=32)
    l3 = _bridge(writer, tmp_path)
    try:
        assert insert(writer, tokens)
        writer.write_backup(match(writer, tokens).last_device_node)
        _until(lambda: l3.pending_writes() == 0, l3)
    finally:
        l3.close()
    cache = make((FULL,), ps, kv_pages=16, host_pages=32)
    l3 = _bridge(cache, tmp_path, "best_effort")
    try:
        assert l3.config.prefetch_policy is PrefetchStopPolicy.BEST_EFFORT
        l3.prefetch("r", _key(tokens))
        assert l3.progress("r")  # returns once the prefetch has stopped and committed
        got = l3.pop_loaded("r")
        assert got % ps == 0 and match(cache, tokens).host_hit_length == got
    finally:
        l3.close()
    check(cache)


def test_host_eviction_under_an_l3_keeps_the_tree_whole(tmp_path: Path) -> None:
    """Write-back: a host copy lands at device eviction; the put follows (the event hops to
    the worker's loop), then host pressure evicts host leaves while puts are in flight."""
    ps = 4
    cache = make((FULL,), ps, WritePolicy.WRITE_BACK, kv_pages=8, host_pages=8)
    l3 = _bridge(cache, tmp_path)
    try:
        for i in range(6):
            assert insert(cache, seq(1000 * (i + 1), 4, ps))
            cache.evict(EvictParams(num_tokens=4 * ps))
            l3.run_calls()
            check(cache)
        _until(lambda: l3.pending_writes() == 0, l3)
        assert len(list(tmp_path.glob("*.bin"))) > 0
    finally:
        l3.close()
    check(cache)


# ---------------------------------------------------------------------- configuration
def test_sglangs_storage_options_map_to_the_workers_configuration() -> None:
    config = storage_config(
        "wait_complete",
        NAMING,
        16,
        {"prefetch_threshold": 64, "prefetch_timeout_base": 2, "prefetch_timeout_per_ki_token": 1},
    )
    assert config.prefetch_policy is PrefetchStopPolicy.WAIT_COMPLETE
    assert config.prefetch_threshold_pages == 4
    assert config.timeout_base_s == 2.0 and config.timeout_per_page_s == 16 / 1024
    assert config.sglang_naming == NAMING
    with pytest.raises(ConfigError, match="prefetch-policy"):
        storage_config("eager", NAMING, 16, {})


@pytest.mark.parametrize(
    ("backend", "extra", "match_"),
    [
        ("hf3fs", {}, "--hicache-storage-backend hf3fs"),
        ("mooncake", {}, "master"),
        ("dynamic", {"module_path": "other.module"}, "module_path"),
    ],
)
def test_storage_backends_urc_cannot_open_are_config_errors_naming_the_flag(
    backend: str, extra: dict[str, Any], match_: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("MOONCAKE_MASTER", raising=False)
    with pytest.raises(ConfigError, match=match_):
        open_store(backend, extra)


def test_the_extra_config_is_json_or_a_json_file(tmp_path: Path) -> None:
    assert parse_extra_config(None) == {}
    assert parse_extra_config('{"a": 1}') == {"a": 1}
    path = tmp_path / "c.json"
    path.write_text('{"b": 2}')
    assert parse_extra_config(f"@{path}") == {"b": 2}
    for bad in ("[1]", "{", f"@{tmp_path / 'missing.json'}"):
        with pytest.raises(ConfigError, match="extra-config"):
            parse_extra_config(bad)


def test_the_file_backend_uses_sglangs_directory_rule(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", str(tmp_path / "env"))
    store = asyncio.run(open_store("file", {"file_storage_path": str(tmp_path / "x")})())
    assert isinstance(store, FileStorage) and store.root == (tmp_path / "env").resolve()
    asyncio.run(store.close())


def test_a_capacity_limited_dynamic_file_store_owns_this_ranks_sglang_pages(
    sglang: None, tmp_path: Path
) -> None:
    """``dynamic`` opens urc's store with this rank's suffix: a capacity-limited file store
    stores (and may evict) this rank's SGLang pages instead of refusing them as another
    deployment's."""
    extra = {"store": "file", "path": str(tmp_path), "capacity_bytes": 1 << 20}

    async def put_one() -> int:
        store = await open_store("dynamic", extra, NAMING.suffix)()
        try:
            page = torch.arange(64, dtype=torch.uint8)
            key = sglang_page_keys(list(range(4)), 4, NAMING)[0]
            return await store.put([key], [page], raise_errors=True)
        finally:
            await store.close()

    assert asyncio.run(put_one()) == 1


def _key(tokens: list[int]) -> Any:
    from urc import RadixKey

    return RadixKey(tokens)


# ---------------------------------------------------------------------- Mooncake
@pytest.fixture
def mooncake_extra(tmp_path: Path) -> Iterator[str]:
    """SGLang's Mooncake extra config for a real ``mooncake_master`` of this test's own."""
    pytest.importorskip("mooncake.store", exc_type=ImportError)
    from mooncake_master import MooncakeMaster, find_master_binary

    binary = find_master_binary()
    if binary is None:
        pytest.skip("the mooncake package ships no mooncake_master binary")
    master = MooncakeMaster(binary, tmp_path / "master.log")
    master.start()
    try:
        yield (
            f'{{"master_server_address": "{master.address}", "protocol": "tcp", '
            f'"global_segment_size": {64 << 20}, "prefetch_threshold": 1}}'
        )
    finally:
        master.kill()


def _mooncake_replica(
    extra: str, model: str, opened: list[SchedulerStorage]
) -> tuple[UnifiedRadixCache, SchedulerStorage]:
    """A page-4 cache with the plug-in's Mooncake store attached (appended to ``opened``)."""
    cache = make((FULL,), 4, kv_pages=16, host_pages=32)
    l3 = attach_storage(cache, cache.host_tier, "mooncake", extra, model, "timeout")  # type: ignore[arg-type]
    opened.append(l3)
    return cache, l3


def test_two_replicas_share_a_real_mooncake_store_under_sglangs_names(mooncake_extra: str) -> None:
    """``--hicache-storage-backend mooncake`` with SGLang's extra config: what one replica
    writes, another (its own client of the same master) prefetches, byte for byte."""
    extra = mooncake_extra
    ps = 4
    tokens = seq(1, 6, ps)
    opened: list[SchedulerStorage] = []
    try:
        writer, w3 = _mooncake_replica(extra, "org/tiny", opened)
        assert insert(writer, tokens)
        node = match(writer, tokens).last_device_node
        writer.write_backup(node)
        _until(lambda: w3.pending_writes() == 0, w3)
        want = writer.pools.kv_pool.kv[:, :, writer.path_device_indices(node)].clone()  # type: ignore[union-attr]
        reader, r3 = _mooncake_replica(extra, "org/tiny", opened)
        r3.prefetch("r", _key(tokens))
        _until(lambda: r3.progress("r"), r3)
        assert r3.pop_loaded("r") == len(tokens)
        hit = match(reader, tokens)
        assert reader.load_back(hit.best_match_node) == len(tokens)
        got = reader.pools.kv_pool.kv[:, :, reader.path_device_indices(hit.best_match_node)]  # type: ignore[union-attr]
        assert torch.equal(got, want)
        check(reader)
    finally:
        for l3 in reversed(opened):
            l3.close()


def test_a_graceful_shutdown_flushes_the_queued_l3_writes(tmp_path: Path) -> None:
    """SGLang calls ``release_host_resources`` on a graceful exit: the writes queued behind
    the last backups reach the store before the worker stops."""
    ps = 4
    cache = make((FULL,), ps, kv_pages=16, host_pages=32)
    sched = Scheduler(cache)
    sched.attach_l3(_bridge(cache, tmp_path))
    tokens = seq(1, 5, ps)
    assert insert(cache, tokens)
    sched.check_hicache_events()  # the write-through backup: host copy, then an L3 put queued
    sched.release_host_resources()
    assert sched.l3 is None and not sched.enable_storage
    keys = sglang_page_keys(tokens, ps, NAMING)
    assert all((tmp_path / f"{k.removeprefix('sglang:')}.bin").exists() for k in keys)
    check(cache)


def test_a_detached_store_can_be_attached_again_and_serves(tmp_path: Path) -> None:
    """``/hicache/storage-backend`` DELETE then PUT: the detach lets the worker go, so the
    new attach builds one (it was refused: the old worker stayed registered on the cache);
    the re-attached store serves what was written before the detach."""
    ps = 4
    cache = make((FULL,), ps, kv_pages=16, host_pages=32)
    sched = Scheduler(cache)
    extra = f'{{"file_storage_path": "{tmp_path}", "prefetch_threshold": 1}}'
    assert sched.attach_storage_backend("file", extra, NAMING.model_name)[0]
    tokens = seq(1, 5, ps)
    assert insert(cache, tokens)
    sched.check_hicache_events()
    sched.wait_for_backups()
    ok, why = sched.detach_storage_backend()  # flushes the queued writes
    assert ok and sched.l3 is None, why
    ok, why = sched.attach_storage_backend("file", extra, NAMING.model_name)
    assert ok, why
    cache.reset()  # the prefix is only in the store now
    l3 = sched.l3
    assert l3 is not None
    l3.prefetch("r", _key(tokens))
    _until(lambda: l3.progress("r"), l3)
    assert l3.pop_loaded("r") == len(tokens)
    sched.detach_storage_backend()
    check(cache)


# ---------------------------------------------------------------------- clear
def _own_files(root: Path, naming: SGLangNaming = NAMING) -> list[Path]:
    return sorted(root.glob(f"*{naming.suffix}.bin"))


def _write_theirs(root: Path) -> list[Path]:
    """Pages of another model's SGLang replicas in the same directory."""
    other = SGLangNaming("org/other")
    paths = []
    for key in sglang_page_keys(seq(7, 3, 4), 4, other):
        path = root / f"{key.removeprefix('sglang:')}.bin"
        path.write_bytes(b"\0" * 64)
        paths.append(path)
    return paths


def test_clear_flushes_the_queued_writes_then_deletes_this_deployments_pages(
    tmp_path: Path,
) -> None:
    """``/hicache/storage-backend/clear``: the writes queued when it arrives are flushed,
    then this deployment's pages are deleted (another model's in the same directory stay);
    the store stays attached, a fresh match finds nothing in L3, and new writes land."""
    ps = 4
    cache = make((FULL,), ps, kv_pages=16, host_pages=32)
    sched = Scheduler(cache)
    theirs = _write_theirs(tmp_path)
    extra = f'{{"file_storage_path": "{tmp_path}", "prefetch_threshold": 1}}'
    assert sched.attach_storage_backend("file", extra, NAMING.model_name)[0]
    tokens = seq(1, 5, ps)
    assert insert(cache, tokens)
    sched.check_hicache_events()  # the host copy, then an L3 put queued (not waited for)
    sched.wait_for_backups()
    assert sched.clear_storage_backend() is True
    assert _own_files(tmp_path) == [] and all(p.exists() for p in theirs)
    l3 = sched.l3
    assert l3 is not None and sched.enable_storage  # still attached
    cache.reset()
    l3.prefetch("after-clear", _key(tokens))
    _until(lambda: l3.progress("after-clear"), l3)
    assert l3.pop_loaded("after-clear") == 0  # nothing in L3 for a fresh request
    assert insert(cache, tokens)
    sched.check_hicache_events()
    sched.wait_for_backups()
    _until(lambda: l3.pending_writes() == 0, l3)
    assert len(_own_files(tmp_path)) == len(tokens) // ps  # the store serves writes again
    sched.detach_storage_backend()
    check(cache)


def test_clear_without_a_store_or_with_a_failing_one_answers_false_and_keeps_it(
    tmp_path: Path,
) -> None:
    cache = make((FULL,), 4, kv_pages=16, host_pages=32)
    sched = Scheduler(cache)
    assert sched.clear_storage_backend() is False  # nothing attached
    root = tmp_path / "l3"
    extra = f'{{"file_storage_path": "{root}", "prefetch_threshold": 1}}'
    assert sched.attach_storage_backend("file", extra, NAMING.model_name)[0]
    root.rename(tmp_path / "away")
    root.write_bytes(b"")  # the directory is gone: the clear fails, typed, caught
    assert sched.clear_storage_backend() is False
    assert sched.l3 is not None
    stats = sched.l3.store.stats()
    assert stats.failures == {StorageOp.CLEAR: 1}
    root.unlink()
    (tmp_path / "away").rename(root)
    assert sched.clear_storage_backend() is True
    sched.detach_storage_backend()
    check(cache)


def _sglang_clear_handler() -> Callable[..., Any]:
    """SGLang 0.5.23's own ``Scheduler.clear_hicache_storage_wrapped``, compiled from the
    wheel's source (its module needs SGLang's GPU stack to import)."""
    import ast
    import importlib.util
    import logging

    from sglang.srt.managers import io_struct

    spec = importlib.util.find_spec("sglang.srt.managers.scheduler")
    assert spec is not None and spec.origin is not None
    tree = ast.parse(Path(spec.origin).read_text())
    handler = next(
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef) and node.name == "clear_hicache_storage_wrapped"
    )
    handler.decorator_list = []
    namespace: dict[str, Any] = {
        "ClearHiCacheReqInput": io_struct.ClearHiCacheReqInput,
        "ClearHiCacheReqOutput": io_struct.ClearHiCacheReqOutput,
        "logger": logging.getLogger("sglang.srt.managers.scheduler"),
        "logging": logging,
    }
    exec(compile(ast.Module(body=[handler], type_ignores=[]), spec.origin, "exec"), namespace)
    return cast(Callable[..., Any], namespace["clear_hicache_storage_wrapped"])


def test_sglangs_own_clear_handler_clears_urcs_store(sglang: None, tmp_path: Path) -> None:
    """The scheduler path SGLang serves ``/hicache/storage-backend/clear`` on: its handler,
    run on urc's surface, clears this deployment's pages and answers success."""
    from sglang.srt.managers.io_struct import ClearHiCacheReqInput

    handler = _sglang_clear_handler()
    ps = 4
    cache = make((FULL,), ps, kv_pages=16, host_pages=32)
    sched = Scheduler(cache)
    extra = f'{{"file_storage_path": "{tmp_path}", "prefetch_threshold": 1}}'
    assert sched.attach_storage_backend("file", extra, NAMING.model_name)[0]
    assert insert(cache, seq(1, 5, ps))
    sched.check_hicache_events()
    sched.wait_for_backups()
    l3 = sched.l3
    assert l3 is not None
    _until(lambda: l3.pending_writes() == 0, l3)
    assert _own_files(tmp_path)
    scheduler = SimpleNamespace(
        enable_hierarchical_cache=True, enable_lmcache=False, tree_cache=sched
    )
    assert handler(scheduler, ClearHiCacheReqInput()).success is True
    assert _own_files(tmp_path) == []
    sched.detach_storage_backend()
    check(cache)


def test_clear_on_a_shared_mooncake_store_keeps_another_models_pages(mooncake_extra: str) -> None:
    """``--hicache-storage-backend mooncake``: the plug-in's store clears its model's pages
    only; a replica of another model on the same master keeps serving its own."""
    tokens = seq(1, 4, 4)
    opened: list[SchedulerStorage] = []
    try:
        ours, o3 = _mooncake_replica(mooncake_extra, "org/tiny", opened)
        theirs, t3 = _mooncake_replica(mooncake_extra, "org/other", opened)
        for cache, l3 in ((ours, o3), (theirs, t3)):
            assert insert(cache, tokens)
            cache.write_backup(match(cache, tokens).last_device_node)
            _until(lambda l3=l3: l3.pending_writes() == 0, l3)  # type: ignore[misc]
        assert o3.clear() == len(tokens) // 4
        assert o3.clear() == 0
        for cache, l3, want in ((ours, o3, 0), (theirs, t3, len(tokens))):
            cache.reset()
            l3.prefetch("r", _key(tokens))
            _until(lambda l3=l3: l3.progress("r"), l3)  # type: ignore[misc]
            assert l3.pop_loaded("r") == want
    finally:
        for l3 in reversed(opened):
            l3.close()
