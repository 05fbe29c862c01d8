"""``FileStorage``: the embedded L3 backend, one file per page under a local directory.

Layout: ``<root>/<hex[:2]>/<hex>.<component>.v<version>``, built only from a validated key's
parts (never from a caller's string).  Each batch's file work runs in one worker-thread call
(``hicache.storage._page_files``): writes go to a temp file in the same directory and are
renamed into place, so a reader sees the old file, the new one, or none, never half of one;
a crash can leave only a temp file, which a later ``open`` removes once it is old.  Links
below the root are never followed (a page linked elsewhere, a fan-out directory replaced by
a link: refused, so nothing is read from or written outside the root).  A read accepts
regular files only, checks the size first and reads at most one page; it is checked against
the page header (its key tag and checksum): a corrupt or truncated file, or another key's
page under this key's name, reads as a miss and is deleted.

A deadline (``op_timeout_s``) stops a call even when the file system does not answer (a hung
mount): the call stops waiting for its worker thread and reads as a miss (a put stores what
was in place by then).  At most ``MAX_STUCK_CALLS`` such threads may be outstanding per
store; beyond that calls fail at once (``StorageUnavailableError``, counted) rather than
park more threads, so unrelated work keeps its threads.

SGLang-scheme keys (``sglang:<hash><suffix>``, see ``hicache.storage.sglang_keys``) are
stored as SGLang's ``HiCacheFile`` stores them: ``<root>/<hash><suffix>.bin`` holding the raw
page (no header), so an SGLang replica pointed at the same directory reads what this one
wrote and the other way round.  Only the size is checked in the file; the key is checked by
the file's name and, for files this store wrote, by a ``user.urc.key`` extended attribute
holding the key's tag (SGLang neither writes nor reads it; a file without it is served by
its name, as SGLang serves it).  Their temp files are ``.<hash><suffix>.bin.<12 hex>.tmp``
in the root; the scan removes only those, never SGLang's own (``.<uuid>.tmp``).

Capacity and ownership: an in-memory index (key -> size, least recently used first) holds
the pages this store *owns*, rebuilt from disk when the store is created (by modification
time, the best order disk keeps) and updated on every put and hit.  When a put would exceed
``capacity_bytes``, the least recently used owned pages are deleted first; pages of the
batch being stored are never evicted for each other.  A store owns urc's layout (the
fan-out directories) and, when capacity-limited, only the SGLang-layout pages of its own
deployment suffix (``sglang_suffix``): other models' or ranks' pages in a shared directory
are read if asked for but never counted, evicted or deleted, and a capacity-limited store
refuses to write SGLang keys of another suffix (``InvalidStorageKeyError``).  Without a
capacity nothing is ever evicted.  A page that cannot fit, or a failed write (``ENOSPC``,
``EIO``), ends the put early: it degrades to "stored fewer"; a put that stored nothing
because the directory or disk failed, a failed read or lookup, raise
``StorageUnavailableError`` inside (a miss, counted, at the public boundary; raised with
``raise_errors``, so the storage worker backs off), as the network stores do.

``clear()`` deletes the pages this store owns, as eviction does: urc's layout (every page
file in the fan-out directories) and the SGLang-layout pages of its own ``sglang_suffix``
(none without one), regular files only; other deployments' pages in a shared directory,
links, and temp files (writes in flight) are left alone.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from enum import Enum
from pathlib import Path
from typing import TypeVar

import anyio
import torch

from hicache.storage import _page_files as page_files
from hicache.storage._page_files import FileState, PageFile, PageRead, WriteProgress
from hicache.storage.base import StorageBackend
from hicache.storage.codec import (
    HEADER_SIZE,
    PageStatus,
    copy_raw_page_into,
    decode_page_into_async,
    encode_page_async,
    key_tag,
    payload_length,
    raw_page,
)
from hicache.storage.errors import InvalidStorageKeyError, StorageUnavailableError
from hicache.storage.keys import (
    KEY_FORMAT_VERSION,
    SGLANG_FILE_STEM,
    SGLANG_SUFFIX_PATTERN,
    PageKey,
    SGLangPageKey,
    StorageComponent,
)
from hicache.storage.keys import parse_page_key as _parse_page_key
from urc.errors import ConfigError

__all__ = ["MAX_STUCK_CALLS", "TEMP_GRACE_S", "FileStorage"]

MAX_STUCK_CALLS = 8
"""Worker threads a store may leave blocked in the file system (calls past their deadline)
before further calls fail at once."""

TEMP_GRACE_S = 600.0
"""A temp file of this store's naming is removed by the open-time scan only when it is at
least this old (a younger one may be another instance's write in flight)."""

_log = logging.getLogger(__name__)
_T = TypeVar("_T")
_PAGE_NAME = re.compile(r"([0-9a-f]{64})\.(full|swa|mamba)\.v([0-9]+)")
_PAGE_TEMP = re.compile(r"\.[0-9a-f]{64}\.(full|swa|mamba)\.v[0-9]+\.[0-9a-f]{12}\.tmp")
_FANOUT_DIR = re.compile(r"[0-9a-f]{2}")
# SGLang-scheme pages in the root, and this backend's temp files for them.
_SGLANG_FILE = re.compile(rf"({SGLANG_FILE_STEM})\.bin")
_SGLANG_TEMP = re.compile(rf"\.{SGLANG_FILE_STEM}\.bin\.[0-9a-f]{{12}}\.tmp")


class _Presence(Enum):
    """Where a key stands in this instance's index."""

    ABSENT = "absent"
    WRITING = "writing"  # space claimed, file not yet in place
    STORED = "stored"


class FileStorage(StorageBackend):
    """Pages as checksummed files under ``root``, bounded by ``capacity_bytes`` (None = no
    bound; sizes include the page header).

    The constructor scans ``root`` synchronously to rebuild the index; inside an event loop
    prefer ``await FileStorage.open(...)``, which scans in a worker thread.  One
    capacity-limited instance per directory and deployment: instances sharing a directory
    do not see each other's evictions, though ``exists``/``get`` do pick up files another
    instance wrote.  ``sglang_suffix`` names the SGLang-layout pages this store owns (see
    the module docstring).  Raises ``ConfigError`` when ``root`` cannot be a page directory
    (a regular file, say) or an argument is invalid.
    """

    name = "file"

    def __init__(
        self,
        root: Path,
        capacity_bytes: int | None = None,
        *,
        op_timeout_s: float | None = 30.0,
        sglang_suffix: str | None = None,
    ) -> None:
        super().__init__(op_timeout_s=op_timeout_s)
        if capacity_bytes is not None and capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0 or None, not {capacity_bytes!r}")
        if sglang_suffix is not None and not SGLANG_SUFFIX_PATTERN.fullmatch(sglang_suffix):
            raise ConfigError(f"not an SGLang deployment suffix: {sglang_suffix!r}")
        root = Path(root)
        try:
            root.mkdir(parents=True, exist_ok=True)
        except FileExistsError as exc:
            raise ConfigError(f"{root} is not a directory: it cannot hold L3 pages") from exc
        except OSError as exc:
            raise ConfigError(f"cannot use {root} as the L3 page directory: {exc}") from exc
        self._root = root.resolve()
        self._capacity = capacity_bytes
        self._sglang_suffix = sglang_suffix
        self._index: OrderedDict[PageKey, int] = OrderedDict()
        self._used = 0
        self._writing: set[PageKey] = set()  # indexed, but the file is not in place yet
        self._stuck_lock = threading.Lock()
        self._stuck = 0  # worker threads still running after their caller gave up
        self._rebuild_index()

    @classmethod
    async def open(
        cls,
        root: Path,
        capacity_bytes: int | None = None,
        *,
        op_timeout_s: float | None = 30.0,
        sglang_suffix: str | None = None,
    ) -> FileStorage:
        """Create a ``FileStorage`` without blocking the event loop on the directory scan."""
        make = functools.partial(
            cls, root, capacity_bytes, op_timeout_s=op_timeout_s, sglang_suffix=sglang_suffix
        )
        return await anyio.to_thread.run_sync(make)

    @property
    def used_bytes(self) -> int:
        """Bytes of the pages this instance owns and knows about (headers included)."""
        return self._used

    @property
    def root(self) -> Path:
        """The directory pages live in."""
        return self._root

    @property
    def stuck_calls(self) -> int:
        """Worker threads still blocked in the file system after their call's deadline."""
        return self._stuck

    def path_of(self, key: PageKey) -> Path:
        """Return the file a page is stored in (whether or not it exists)."""
        page = self._page_file(key)
        if page.subdir is None:
            return self._root / page.name
        return self._root / page.subdir / page.name

    @staticmethod
    def _page_file(key: PageKey) -> PageFile:
        if isinstance(key, SGLangPageKey):
            return PageFile(None, f"{key.sglang_name}.bin")
        digest = key.digest.hex()
        return PageFile(digest[:2], f"{digest}.{key.component.value}.v{key.version}")

    def _owns(self, key: PageKey) -> bool:
        """Whether this store counts, evicts and deletes ``key``'s page: urc's layout always;
        SGLang's when no capacity applies or the suffix is this store's."""
        if not isinstance(key, SGLangPageKey) or self._capacity is None:
            return True
        return key.suffix == self._sglang_suffix

    # -- worker threads -----------------------------------------------------------------

    async def _in_thread(
        self, call: Callable[..., _T], *args: object, progress: WriteProgress | None = None
    ) -> _T:
        """Run ``call(*args)`` in a worker thread that a deadline abandons instead of
        waiting for (a hung file system); counts abandoned threads until they return."""
        if self._stuck >= MAX_STUCK_CALLS:
            raise StorageUnavailableError(
                f"{self._stuck} file operations under {self._root} have not returned "
                "(a hung file system?)"
            )
        lock = self._stuck_lock
        state = {"finished": False, "abandoned": False}

        def run() -> _T:
            try:
                return call(*args)
            finally:
                with lock:
                    state["finished"] = True
                    if state["abandoned"]:
                        self._stuck -= 1

        try:
            return await anyio.to_thread.run_sync(run, abandon_on_cancel=True)
        except BaseException:
            if progress is not None:
                progress.stop()
            with lock:
                if not state["finished"]:
                    state["abandoned"] = True
                    self._stuck += 1
            raise

    # -- index --------------------------------------------------------------------------

    def _rebuild_index(self) -> None:
        found: list[tuple[float, PageKey, int]] = []
        stale = time.time() - TEMP_GRACE_S
        stale_temps: list[PageFile] = []
        for entry in os.scandir(self._root):
            if not entry.is_file(follow_symlinks=False):
                continue
            sgl = _SGLANG_FILE.fullmatch(entry.name)
            if sgl is not None:
                try:
                    key = _parse_page_key(f"sglang:{sgl.group(1)}")
                except InvalidStorageKeyError:
                    continue
                if not self._owns(key):
                    continue  # another deployment's page: never counted, never evicted
                stat = entry.stat(follow_symlinks=False)
                found.append((stat.st_mtime, key, stat.st_size))
            elif (
                _SGLANG_TEMP.fullmatch(entry.name)
                and entry.stat(follow_symlinks=False).st_mtime < stale
            ):
                stale_temps.append(PageFile(None, entry.name))  # ours, never renamed
        for fanout in os.scandir(self._root):
            if not (fanout.is_dir(follow_symlinks=False) and _FANOUT_DIR.fullmatch(fanout.name)):
                continue
            for entry in os.scandir(fanout.path):
                if not entry.is_file(follow_symlinks=False):
                    continue  # a link or anything else: not a page of ours
                stat = entry.stat(follow_symlinks=False)
                if _PAGE_TEMP.fullmatch(entry.name):
                    # A write that never reached its rename (crash or cancellation).
                    if stat.st_mtime < stale:
                        stale_temps.append(PageFile(fanout.name, entry.name))
                    continue
                match = _PAGE_NAME.fullmatch(entry.name)
                if match is None or int(match.group(3)) != KEY_FORMAT_VERSION:
                    continue  # not ours, or another key format: never served, never counted
                if match.group(1)[:2] != fanout.name:
                    continue  # not where this key lives: never served, never counted
                key = PageKey(
                    KEY_FORMAT_VERSION, StorageComponent(match.group(2)), bytes.fromhex(match[1])
                )
                found.append((stat.st_mtime, key, stat.st_size))
        for _mtime, key, size in sorted(found, key=lambda item: item[0]):
            self._index[key] = size
            self._used += size
        victims = [self._page_file(key) for key in self._take_victims(0, frozenset()) or []]
        page_files.remove_pages(self._root, [*stale_temps, *victims])

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

    async def _adopt(self, found: Sequence[tuple[PageKey, int]]) -> None:
        """Record pages found on disk but not in the index (another instance wrote them),
        then delete least recently used pages if that went over capacity."""
        protected = frozenset(key for key, _size in found)
        for key, size in found:
            if not self._owns(key):
                continue
            self._forget(key)
            self._index[key] = size
            self._used += size
        victims = self._take_victims(0, protected) or []
        await self._remove_files(victims)

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

    async def _remove_files(self, keys: Sequence[PageKey]) -> None:
        if not keys:
            return
        pages = [self._page_file(key) for key in keys]
        try:
            failures = await self._in_thread(page_files.remove_pages, self._root, pages)
        except OSError as exc:
            failures = [exc]
        for failure in failures:
            self._counters.errors += 1
            _log.warning("could not delete a page under %s: %s", self._root, failure)

    # -- backend operations -------------------------------------------------------------

    async def _exists(self, keys: Sequence[PageKey]) -> int:
        count = 0
        for key in keys:
            if key in self._writing or key not in self._index:
                break
            count += 1
        if count == len(keys) or keys[count] in self._writing:
            return count
        # The rest are not indexed: look on disk (another instance may have written them).
        rest = keys[count:]
        try:
            sizes = await self._in_thread(
                page_files.stat_pages, self._root, [self._page_file(k) for k in rest]
            )
        except OSError as exc:
            raise StorageUnavailableError(f"cannot look up pages: {exc}") from exc
        found = []
        for key, size in zip(rest, sizes, strict=False):
            if key in self._writing:
                break
            found.append((key, size))
        await self._adopt([(k, s) for k, s in found if k not in self._index])
        return count + len(found)

    def _expected_size(self, key: PageKey, buffer: torch.Tensor) -> int:
        return buffer.nbytes if isinstance(key, SGLangPageKey) else HEADER_SIZE + buffer.nbytes

    async def _get(self, keys: Sequence[PageKey], buffers: Sequence[torch.Tensor]) -> int:
        leading = []
        for key in keys:
            if key in self._writing:
                break  # not in place yet
            leading.append(key)
        if not leading:
            return 0
        sizes = [self._expected_size(k, b) for k, b in zip(leading, buffers, strict=False)]
        tags = [key_tag(k) if isinstance(k, SGLangPageKey) else None for k in leading]
        pages = [self._page_file(k) for k in leading]
        try:
            results: list[PageRead] = await self._in_thread(
                page_files.read_pages, self._root, pages, sizes, HEADER_SIZE, tags
            )
        except OSError as exc:
            # The directory or the disk failed, not one page: the store is unavailable.
            raise StorageUnavailableError(f"cannot read pages under {self._root}: {exc}") from exc
        read = 0
        adopt: list[tuple[PageKey, int]] = []
        for key, buffer, result in zip(leading, buffers, results, strict=False):
            status = await self._verify(key, buffer, result)
            if status is not PageStatus.OK:
                break
            if key in self._index:
                self._index.move_to_end(key)
            else:
                adopt.append((key, result.size))
            self._counters.record_read(buffer.nbytes)
            read += 1
        await self._adopt(adopt)
        return read

    async def _verify(self, key: PageKey, buffer: torch.Tensor, result: PageRead) -> PageStatus:
        """Check one file read and copy it into ``buffer`` if sound; a damaged page of
        this store's own layout is forgotten and deleted."""
        state = result.state
        if state is FileState.MISSING:
            self._forget(key)
            return PageStatus.CORRUPT
        sglang = isinstance(key, SGLangPageKey)
        if state is FileState.READ:
            if sglang:
                return copy_raw_page_into(result.data, buffer)
            status = await decode_page_into_async(result.data, buffer, key)
        elif state is FileState.SIZE_MISMATCH:
            if sglang:
                return PageStatus.SIZE_MISMATCH  # a raw page of another size: kept
            length = payload_length(result.data, key)
            if length is not None and length + HEADER_SIZE == result.size:
                return PageStatus.SIZE_MISMATCH  # a page of another size: kept
            status = PageStatus.CORRUPT
        else:  # NOT_REGULAR, OTHER_KEY: never ours to delete
            self._counters.corrupt += 1
            self._forget(key)
            return PageStatus.CORRUPT
        if status is PageStatus.CORRUPT:
            self._counters.corrupt += 1
            self._forget(key)
            await self._remove_files([key])
        return status

    async def _put(self, keys: Sequence[PageKey], buffers: Sequence[torch.Tensor]) -> int:
        if self._capacity is not None:
            for key in keys:
                if not self._owns(key):
                    raise InvalidStorageKeyError(
                        f"this capacity-limited store owns SGLang pages of suffix "
                        f"{self._sglang_suffix!r} only, not {key}"
                    )
        batch = frozenset(keys)
        # Plan the batch: leading pages already stored count as stored; the others are
        # written in one worker-thread call, their space claimed first.
        plan: list[PageKey | None] = []  # None: already stored
        writes: list[tuple[PageKey, bytes, int]] = []
        victims: list[PageKey] = []
        for key, buffer in zip(keys, buffers, strict=True):
            presence = self._presence(key)
            if presence is _Presence.ABSENT:
                if isinstance(key, SGLangPageKey):
                    data = raw_page(buffer)
                else:
                    data = await encode_page_async(buffer, key)
                presence = self._presence(key)  # the encode may have let another put run
            if presence is _Presence.WRITING:
                break  # another task is storing it; claiming it stored could be false
            if presence is _Presence.STORED:
                plan.append(None)  # same key, same content: refreshed, not rewritten
                continue
            taken = self._take_victims(len(data), batch)
            if taken is None:
                break
            victims.extend(taken)
            # Claim the space before any await, so concurrent puts see it taken.
            self._index[key] = len(data)
            self._used += len(data)
            self._writing.add(key)
            plan.append(key)
            writes.append((key, data, buffer.nbytes))
        if not writes:
            return len(plan)
        progress = WriteProgress()
        try:
            failures = await self._in_thread(
                page_files.write_pages,
                self._root,
                [self._page_file(v) for v in victims],
                [self._page_file(k) for k, _data, _n in writes],
                [data for _k, data, _n in writes],
                [key_tag(k) if isinstance(k, SGLangPageKey) else None for k, _d, _n in writes],
                progress,
                progress=progress,
            )
        except OSError as exc:
            if progress.done == 0 and plan[0] is not None:
                # Not a page stored: the directory or the disk failed (ENOSPC, EIO, gone).
                raise StorageUnavailableError(
                    f"cannot store pages under {self._root}: {exc}"
                ) from exc
            self._counters.errors += 1  # stored fewer: the rest failed
            _log.warning("could not store a page under %s: %s", self._root, exc)
            failures = []
        finally:
            done = progress.stop()
            for key, _data, _n in writes[done:]:
                self._forget(key)  # not in place: the page was not stored
            for key, _data, _n in writes:
                self._writing.discard(key)
        for failure in failures:
            self._counters.errors += 1
            _log.warning("could not delete a page under %s: %s", self._root, failure)
        for _key, _data, nbytes in writes[:done]:
            self._counters.record_write(nbytes)
        stored = 0
        written = 0
        for entry in plan:
            if entry is not None:
                if written == done:
                    break
                written += 1
            stored += 1
        return stored

    async def _delete(self, keys: Sequence[PageKey]) -> None:
        for key in keys:
            self._forget(key)
        await self._remove_files(keys)

    def _in_clear_scope(self, key: PageKey) -> bool:
        """Whether ``clear()`` deletes ``key``'s page: urc's layout, or SGLang's layout of
        this store's suffix."""
        if isinstance(key, SGLangPageKey):
            return self._sglang_suffix is not None and key.suffix == self._sglang_suffix
        return True

    async def _clear(self) -> int:
        try:
            removed, failures = await self._in_thread(
                _remove_owned_files, self._root, self._sglang_suffix
            )
        except OSError as exc:
            raise StorageUnavailableError(f"cannot clear pages under {self._root}: {exc}") from exc
        for key in removed:
            self._forget(key)
        for key in [k for k in self._index if self._in_clear_scope(k)]:
            if key not in self._writing:
                self._forget(key)  # indexed, but its file is gone (or was never in place)
        if failures:
            raise StorageUnavailableError(
                f"could not delete {len(failures)} pages under {self._root}: {failures[0]}"
            )
        return len(removed)

    async def _close(self) -> None:
        # No handle outlives a call; the index is rebuilt from disk by the next instance.
        self._index.clear()
        self._used = 0


def _remove_owned_files(
    root: Path, sglang_suffix: str | None
) -> tuple[list[PageKey], list[OSError]]:
    """Unlink the page files ``clear()`` deletes (see ``FileStorage._in_clear_scope``):
    regular files only, reached without following links.  Returns the pages removed and the
    failures other than "already gone"; raises ``OSError`` when the root cannot be read."""
    removed: list[PageKey] = []
    failures: list[OSError] = []

    def unlink(name: str, dir_fd: int, key: PageKey) -> None:
        try:
            os.unlink(name, dir_fd=dir_fd)
        except FileNotFoundError:
            return
        except OSError as exc:
            failures.append(exc)
            return
        removed.append(key)

    with page_files.DirectoryFds(root) as dirs:
        root_fd = dirs.fd(None)
        fanouts: list[str] = []
        with os.scandir(root_fd) as entries:
            listed = list(entries)
        for entry in listed:
            if _FANOUT_DIR.fullmatch(entry.name) and entry.is_dir(follow_symlinks=False):
                fanouts.append(entry.name)
                continue
            sgl = _SGLANG_FILE.fullmatch(entry.name)
            if sglang_suffix is None or sgl is None or not entry.is_file(follow_symlinks=False):
                continue
            try:
                key = _parse_page_key(f"sglang:{sgl.group(1)}")
            except InvalidStorageKeyError:
                continue
            if isinstance(key, SGLangPageKey) and key.suffix == sglang_suffix:
                unlink(entry.name, root_fd, key)
        for fanout in fanouts:
            try:
                fanout_fd = dirs.fd(fanout)
            except OSError:
                continue  # replaced by a link or removed meanwhile: not ours to walk
            with os.scandir(fanout_fd) as entries:
                listed = list(entries)
            for entry in listed:
                match = _PAGE_NAME.fullmatch(entry.name)
                if match is None or match.group(1)[:2] != fanout:
                    continue
                if not entry.is_file(follow_symlinks=False):
                    continue
                key = PageKey(
                    int(match.group(3)), StorageComponent(match.group(2)), bytes.fromhex(match[1])
                )
                unlink(entry.name, fanout_fd, key)
    return removed, failures
