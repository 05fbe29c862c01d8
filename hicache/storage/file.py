"""``FileStorage``: the embedded L3 backend, one file per page under a local directory.

Layout: ``<root>/<hex[:2]>/<hex>.<component>.v<version>``, built only from a validated key's
parts (never from a caller's string).  Writes go to a temp file in the same directory and are
``os.replace``d into place, so a reader sees the old file, the new one, or none, never half of
one; a crash can leave only a temp file, which the next ``open`` removes.  Every read is
checked against the page header and checksum: a corrupt or truncated file reads as a miss and
is deleted.

SGLang-scheme keys (``sglang:<hash><suffix>``, see ``hicache.storage.sglang_keys``) are
stored as SGLang's ``HiCacheFile`` stores them: ``<root>/<hash><suffix>.bin`` holding the raw
page (no header, so only the size is checked on a read), so an SGLang replica pointed at the
same directory reads what this one wrote and the other way round.  Their temp files are
``.<hash><suffix>.bin.<12 hex>.tmp`` in the root; the scan removes only those, never
SGLang's own (``.<uuid>.tmp``, possibly a write in flight).

Capacity: an in-memory index (key -> size, least recently used first) is rebuilt from disk
when the backend is created (by modification time, the best order disk keeps) and updated on
every put and hit.  When a put would exceed ``capacity_bytes``, the least recently used pages
are deleted first; pages of the batch being stored are never evicted for each other.  A page
that cannot fit, or a failed write (``ENOSPC``, ``EIO``), ends the put early: it degrades to
"stored fewer", never to an exception.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import re
import secrets
from collections import OrderedDict
from collections.abc import Sequence
from enum import Enum
from pathlib import Path

import anyio
import torch

from hicache.storage.base import StorageBackend
from hicache.storage.codec import (
    PageStatus,
    copy_raw_page_into,
    decode_page_into_async,
    encode_page_async,
    raw_page,
)
from hicache.storage.errors import InvalidStorageKeyError
from hicache.storage.keys import (
    KEY_FORMAT_VERSION,
    SGLANG_FILE_STEM,
    PageKey,
    SGLangPageKey,
    StorageComponent,
)
from hicache.storage.keys import parse_page_key as _parse_page_key

__all__ = ["FileStorage"]

_log = logging.getLogger(__name__)
_PAGE_NAME = re.compile(r"([0-9a-f]{64})\.(full|swa|mamba)\.v([0-9]+)")
_FANOUT_DIR = re.compile(r"[0-9a-f]{2}")
_TEMP_SUFFIX = ".tmp"
# SGLang-scheme pages in the root, and this backend's temp files for them.
_SGLANG_FILE = re.compile(rf"({SGLANG_FILE_STEM})\.bin")
_SGLANG_TEMP = re.compile(rf"\.{SGLANG_FILE_STEM}\.bin\.[0-9a-f]{{12}}\.tmp")


class _Presence(Enum):
    """Where a key stands in this instance's index."""

    ABSENT = "absent"
    WRITING = "writing"  # space claimed, file not yet in place
    STORED = "stored"


async def _write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to a new file at ``path`` (a seam the tests use to inject ENOSPC)."""
    # anyio's file API (worker threads): the same on asyncio and trio.
    async with await anyio.open_file(path, "wb") as f:
        await f.write(data)


class FileStorage(StorageBackend):
    """Pages as checksummed files under ``root``, bounded by ``capacity_bytes`` (None = no
    bound; sizes include the page header).

    The constructor scans ``root`` synchronously to rebuild the index; inside an event loop
    prefer ``await FileStorage.open(...)``, which scans in a worker thread.  One instance per
    directory: instances sharing a directory do not see each other's evictions, though
    ``exists``/``get`` do pick up files another instance wrote.
    """

    name = "file"

    def __init__(
        self,
        root: Path,
        capacity_bytes: int | None = None,
        *,
        op_timeout_s: float | None = 30.0,
    ) -> None:
        super().__init__(op_timeout_s=op_timeout_s)
        if capacity_bytes is not None and capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0 or None, not {capacity_bytes!r}")
        self._root = Path(root).resolve()
        self._capacity = capacity_bytes
        self._index: OrderedDict[PageKey, int] = OrderedDict()
        self._used = 0
        self._dirs: set[Path] = set()  # fan-out directories known to exist
        self._writing: set[PageKey] = set()  # indexed, but the file is not in place yet
        self._root.mkdir(parents=True, exist_ok=True)
        self._rebuild_index()

    @classmethod
    async def open(
        cls,
        root: Path,
        capacity_bytes: int | None = None,
        *,
        op_timeout_s: float | None = 30.0,
    ) -> FileStorage:
        """Create a ``FileStorage`` without blocking the event loop on the directory scan."""
        make = functools.partial(cls, root, capacity_bytes, op_timeout_s=op_timeout_s)
        return await anyio.to_thread.run_sync(make)

    @property
    def used_bytes(self) -> int:
        """Bytes of pages this instance knows about (headers included)."""
        return self._used

    @property
    def root(self) -> Path:
        """The directory pages live in."""
        return self._root

    def path_of(self, key: PageKey) -> Path:
        """Return the file a page is stored in (whether or not it exists)."""
        if isinstance(key, SGLangPageKey):
            return self._root / f"{key.sglang_name}.bin"
        digest = key.digest.hex()
        return self._root / digest[:2] / f"{digest}.{key.component.value}.v{key.version}"

    # -- index --------------------------------------------------------------------------

    def _rebuild_index(self) -> None:
        found: list[tuple[float, PageKey, int]] = []
        for entry in os.scandir(self._root):
            if not entry.is_file(follow_symlinks=False):
                continue
            sgl = _SGLANG_FILE.fullmatch(entry.name)
            if sgl is not None:
                try:
                    key = _parse_page_key(f"sglang:{sgl.group(1)}")
                except InvalidStorageKeyError:
                    continue
                stat = entry.stat(follow_symlinks=False)
                found.append((stat.st_mtime, key, stat.st_size))
            elif _SGLANG_TEMP.fullmatch(entry.name):
                with contextlib.suppress(OSError):
                    os.unlink(entry.path)  # ours, never renamed into place
        for fanout in os.scandir(self._root):
            if not (fanout.is_dir(follow_symlinks=False) and _FANOUT_DIR.fullmatch(fanout.name)):
                continue
            for entry in os.scandir(fanout.path):
                if entry.name.endswith(_TEMP_SUFFIX):
                    # A write that never reached os.replace (crash or cancellation).
                    with contextlib.suppress(OSError):
                        os.unlink(entry.path)
                    continue
                match = _PAGE_NAME.fullmatch(entry.name)
                if match is None or int(match.group(3)) != KEY_FORMAT_VERSION:
                    continue  # not ours, or another key format: never served, never counted
                stat = entry.stat(follow_symlinks=False)
                key = PageKey(
                    KEY_FORMAT_VERSION, StorageComponent(match.group(2)), bytes.fromhex(match[1])
                )
                found.append((stat.st_mtime, key, stat.st_size))
        for _mtime, key, size in sorted(found, key=lambda item: item[0]):
            self._index[key] = size
            self._used += size
        for victim in self._take_victims(0, frozenset()) or []:
            with contextlib.suppress(OSError):
                os.unlink(self.path_of(victim))

    def _presence(self, key: PageKey) -> _Presence:
        """Where ``key`` stands; a stored key is also marked most recently used."""
        if key in self._writing:
            return _Presence.WRITING
        if key in self._index:
            self._index.move_to_end(key)
            return _Presence.STORED
        return _Presence.ABSENT

    def _forget(self, key: PageKey) -> None:
        size = self._index.pop(key, None)
        if size is not None:
            self._used -= size

    async def _adopt(self, key: PageKey, size: int) -> None:
        """Record a page found on disk but not in the index (another instance wrote it),
        then delete least recently used pages if that went over capacity."""
        self._forget(key)
        self._index[key] = size
        self._used += size
        for victim in self._take_victims(0, frozenset((key,))) or []:
            await self._remove_file(victim)

    def _take_victims(self, size: int, protected: frozenset[PageKey]) -> list[PageKey] | None:
        """Drop least recently used entries until ``size`` more bytes fit; return them.

        Returns ``None`` (and drops nothing) if the bytes cannot fit without evicting a
        ``protected`` page.  The caller deletes the victims' files.
        """
        if self._capacity is None:
            return []
        excess = self._used + size - self._capacity
        if excess <= 0:
            return []
        if size > self._capacity:
            return None
        victims: list[PageKey] = []
        for key, key_size in self._index.items():
            if key in protected or key in self._writing:
                continue
            victims.append(key)
            excess -= key_size
            if excess <= 0:
                break
        if excess > 0:
            return None
        for key in victims:
            self._forget(key)
        return victims

    async def _remove_file(self, key: PageKey) -> None:
        try:
            await anyio.Path(self.path_of(key)).unlink()
        except FileNotFoundError:
            pass
        except OSError as exc:
            self._counters.errors += 1
            _log.warning("could not delete %s: %s", key, exc)

    # -- backend operations -------------------------------------------------------------

    async def _exists(self, keys: Sequence[PageKey]) -> int:
        count = 0
        for key in keys:
            if key in self._writing:
                break
            if key not in self._index:
                try:
                    stat = await anyio.Path(self.path_of(key)).stat()
                except OSError:
                    break
                await self._adopt(key, stat.st_size)
            count += 1
        return count

    async def _get(self, keys: Sequence[PageKey], buffers: Sequence[torch.Tensor]) -> int:
        read = 0
        for key, buffer in zip(keys, buffers, strict=True):
            if key in self._writing:
                break  # not in place yet
            try:
                async with await anyio.open_file(self.path_of(key), "rb") as f:
                    data = await f.read()
            except FileNotFoundError:
                self._forget(key)
                break
            except OSError as exc:
                self._counters.errors += 1
                _log.warning("could not read %s: %s", key, exc)
                break
            if isinstance(key, SGLangPageKey):
                status = copy_raw_page_into(data, buffer)
            else:
                status = await decode_page_into_async(data, buffer)
            if status is PageStatus.CORRUPT:
                self._counters.corrupt += 1
                self._forget(key)
                await self._remove_file(key)
                break
            if status is PageStatus.SIZE_MISMATCH:
                break
            if key in self._index:
                self._index.move_to_end(key)
            else:
                await self._adopt(key, len(data))
            self._counters.record_read(buffer.nbytes)
            read += 1
        return read

    async def _put(self, keys: Sequence[PageKey], buffers: Sequence[torch.Tensor]) -> int:
        batch = frozenset(keys)
        stored = 0
        for key, buffer in zip(keys, buffers, strict=True):
            presence = self._presence(key)
            if presence is _Presence.ABSENT:
                if isinstance(key, SGLangPageKey):
                    data = raw_page(buffer)
                else:
                    data = await encode_page_async(buffer)
                presence = self._presence(key)  # the encode may have let another put run
            if presence is _Presence.WRITING:
                break  # another task is storing it; claiming it stored could be false
            if presence is _Presence.STORED:
                stored += 1  # same key, same content: refreshed, not rewritten
                continue
            victims = self._take_victims(len(data), batch)
            if victims is None:
                break
            # Claim the space before any await, so concurrent puts see it taken.
            self._index[key] = len(data)
            self._used += len(data)
            self._writing.add(key)
            try:
                for victim in victims:
                    await self._remove_file(victim)
                await self._write_atomic(self.path_of(key), data)
            except OSError as exc:
                self._forget(key)
                self._counters.errors += 1
                _log.warning("could not store %s: %s", key, exc)
                break
            except BaseException:
                self._forget(key)  # cancelled (deadline): the page was not stored
                raise
            finally:
                self._writing.discard(key)
            self._counters.record_write(buffer.nbytes)
            stored += 1
        return stored

    async def _write_atomic(self, path: Path, data: bytes) -> None:
        if path.parent not in self._dirs:  # one makedirs per fan-out dir, not per page
            await anyio.Path(path.parent).mkdir(parents=True, exist_ok=True)
            self._dirs.add(path.parent)
        temp = path.with_name(f".{path.name}.{secrets.token_hex(6)}{_TEMP_SUFFIX}")
        try:
            await _write_bytes(temp, data)
            await anyio.Path(temp).replace(path)
        except BaseException as exc:
            if isinstance(exc, FileNotFoundError):
                self._dirs.discard(path.parent)  # removed behind our back: recreate next time
            # Synchronous on purpose: it must run even when the task is being cancelled.
            with contextlib.suppress(OSError):
                os.unlink(temp)
            raise

    async def _delete(self, keys: Sequence[PageKey]) -> None:
        for key in keys:
            self._forget(key)
            await self._remove_file(key)

    async def _close(self) -> None:
        # No handle outlives a call; the index is rebuilt from disk by the next instance.
        self._index.clear()
        self._used = 0
