"""The fleet's shared L3 store: one store every replica's HiCache reads and writes.

A prefix one replica wrote to L3 is found by another because L3 page keys are chained hashes
of the tokens (:mod:`hicache.storage.keys`), the same on every replica.  Kinds:

* ``file`` (the embedded default): :class:`~hicache.storage.file.FileStorage` in a
  directory (a fresh temporary one unless given: in memory-backed ``/dev/shm`` where the
  machine has it, since the replay models no disk time and creating files on a disk
  dominated a run), with no per-call deadline: a replay waits for its store, so an L3 write
  is never dropped because the machine was busy;
* ``valkey``: :class:`~hicache.storage.valkey.ValkeyStorage` on a Valkey (or Redis) node
  or cluster (``--valkey host:port[,host:port...]``; more than one address: a cluster);
* ``mooncake``: :class:`~hicache.storage.mooncake.MooncakeStorage` on a running
  ``mooncake_master``.

In one process the replicas share one client of the store (FileStorage allows one instance
per directory; a Mooncake client lends the store a memory segment of its own): on separate
machines each replica would hold its own client of the same store.  The store is opened and
closed by :func:`open_shared_store`; every run starts from a fresh key prefix (valkey,
mooncake) or directory (file, unless one is given), so runs do not see each other's pages.
"""

from __future__ import annotations

import tempfile
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from hicache.storage.base import StorageBackend

__all__ = ["L3Kind", "SharedStoreConfig", "open_shared_store"]

_MEMORY_TEMP = Path("/dev/shm")


class L3Kind(str, Enum):
    """Which store the fleet shares (``none``: no L3)."""

    NONE = "none"
    FILE = "file"
    VALKEY = "valkey"
    MOONCAKE = "mooncake"


@dataclass(frozen=True, slots=True)
class SharedStoreConfig:
    """``kind``; ``directory`` (file; ``None``: a fresh temporary directory under
    ``temp_parent`` -- ``None``: the system's temporary directory -- removed after the
    run); ``valkey`` addresses (more than one: a cluster); ``mooncake_master``
    (``host:port``)."""

    kind: L3Kind = L3Kind.NONE
    directory: Path | None = None
    temp_parent: Path | None = _MEMORY_TEMP if _MEMORY_TEMP.is_dir() else None
    valkey: tuple[tuple[str, int], ...] = ()
    mooncake_master: str | None = None


@asynccontextmanager
async def open_shared_store(config: SharedStoreConfig) -> AsyncIterator[StorageBackend | None]:
    """Open the store ``config`` names for one run (``None`` for ``NONE``) and close it on
    exit.  Raises ``StorageUnavailableError`` when a remote store cannot be joined."""
    prefix = f"fleet-{uuid.uuid4().hex[:12]}:"
    if config.kind is L3Kind.NONE:
        yield None
        return
    if config.kind is L3Kind.FILE:
        from hicache.storage.file import FileStorage

        if config.directory is not None:
            store = await FileStorage.open(config.directory, op_timeout_s=None)
            async with store:
                yield store
            return
        with tempfile.TemporaryDirectory(prefix="urc-fleet-l3-", dir=config.temp_parent) as tmp:
            store = await FileStorage.open(Path(tmp), op_timeout_s=None)
            async with store:
                yield store
        return
    if config.kind is L3Kind.VALKEY:
        from hicache.storage.valkey import ValkeyConfig, ValkeyStorage

        addresses = config.valkey or (("127.0.0.1", 6379),)
        vk = ValkeyConfig(addresses=addresses, cluster=len(addresses) > 1, key_prefix=prefix)
        async with ValkeyStorage(vk) as vstore:
            yield vstore
        return
    from hicache.storage.mooncake import MooncakeConfig, MooncakeStorage

    assert config.mooncake_master is not None, "mooncake needs a master address"
    mstore = await MooncakeStorage.open(
        MooncakeConfig(master_address=config.mooncake_master, key_prefix=prefix)
    )
    async with mstore:
        yield mstore
