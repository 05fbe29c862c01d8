"""The file store's disk I/O: page files under one root, reached without following links.

Everything here is synchronous and runs in a worker thread, one call per batch of pages (a
thread hop costs more than writing a small page).  Paths are never joined as strings: the
root is opened once per batch, a fan-out directory is opened relative to it with
``O_NOFOLLOW | O_DIRECTORY`` and a page file relative to that with ``O_NOFOLLOW``, so a link
anywhere below the root (a page linked to ``/dev/zero`` or to another store, a fan-out
directory replaced by a link) is refused instead of followed, and a write can never land
outside the root.  Reads open with ``O_NONBLOCK`` (a FIFO at a page's name opens at once),
accept regular files only, check the size first and read at most one page.

SGLang-layout pages (raw payload, named by their key) carry their key's tag in an extended
attribute (``user.urc.key``) when this store wrote them and the file system keeps user
attributes: a page linked under another key's name then reads as corrupt.  A file without
the attribute (SGLang's own ``HiCacheFile`` writes, or a file system without user
attributes) is served by its name, as SGLang itself serves it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from types import TracebackType

__all__ = [
    "KEY_XATTR",
    "DirectoryFds",
    "FileState",
    "PageFile",
    "PageRead",
    "WriteProgress",
    "read_pages",
    "remove_pages",
    "stat_pages",
    "temp_name",
    "write_file",
    "write_pages",
]

KEY_XATTR = "user.urc.key"
"""The extended attribute holding an SGLang-layout page's key tag (when this store wrote it)."""

_OPEN_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_OPEN_ROOT = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
_OPEN_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_OPEN_NEW = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
# "No such page": the file, or its fan-out directory, is missing.
_MISSING = (errno.ENOENT, errno.ENOTDIR)
# Not a page: a link (O_NOFOLLOW) or a directory where a page file should be.
_NOT_REGULAR = (errno.ELOOP, errno.EISDIR, errno.ENXIO)


@dataclass(frozen=True)
class PageFile:
    """Where one page lives: ``subdir`` of the root (``None``: the root itself) and ``name``."""

    subdir: str | None
    name: str


class FileState(Enum):
    """What reading one page file found."""

    READ = "read"
    """The file was read whole (its size was the expected one); verify it next."""
    MISSING = "missing"
    """No file (or no fan-out directory) under that name."""
    NOT_REGULAR = "not_regular"
    """A link, FIFO, device or directory under a page's name: never opened for data."""
    SIZE_MISMATCH = "size_mismatch"
    """A regular file of another size; ``head`` holds its first bytes (up to a header)."""
    OTHER_KEY = "other_key"
    """An SGLang-layout page whose key attribute names another key."""


@dataclass(frozen=True)
class PageRead:
    """One page file's outcome: its state, its bytes (``READ``) or first bytes
    (``SIZE_MISMATCH``), and its size on disk."""

    state: FileState
    data: bytes = b""
    size: int = 0


def temp_name(name: str) -> str:
    """A fresh temp-file name for a write of ``name`` (the store's scan knows the pattern)."""
    return f".{name}.{secrets.token_hex(6)}.tmp"


class DirectoryFds:
    """The root and its fan-out directories, opened without following links, for one batch.

    A context manager: every descriptor is closed on exit.  ``fd(subdir, create=True)``
    creates a missing fan-out directory; a fan-out name that is a link or not a directory
    raises ``OSError`` (``ELOOP``/``ENOTDIR``).
    """

    def __init__(self, root: Path) -> None:
        self._root = root
        self._root_fd = -1
        self._fds: dict[str, int] = {}

    def __enter__(self) -> DirectoryFds:
        self._root_fd = os.open(self._root, _OPEN_ROOT)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        os.close(self._root_fd)

    def fd(self, subdir: str | None, *, create: bool = False) -> int:
        if subdir is None:
            return self._root_fd
        fd = self._fds.get(subdir)
        if fd is not None:
            return fd
        try:
            fd = os.open(subdir, _OPEN_DIR, dir_fd=self._root_fd)
        except FileNotFoundError:
            if not create:
                raise
            with contextlib.suppress(FileExistsError):  # another writer made it meanwhile
                os.mkdir(subdir, 0o755, dir_fd=self._root_fd)
            fd = os.open(subdir, _OPEN_DIR, dir_fd=self._root_fd)
        self._fds[subdir] = fd
        return fd


def _read_exactly(fd: int, size: int) -> bytes | None:
    """``size`` bytes from ``fd``, or ``None`` if the file ends first (it shrank)."""
    data = os.read(fd, size)
    if len(data) == size:
        return data
    parts = [data]
    got = len(data)
    while got < size:
        chunk = os.read(fd, size - got)
        if not chunk:
            return None
        parts.append(chunk)
        got += len(chunk)
    return b"".join(parts)


def _read_one(
    dirs: DirectoryFds, page: PageFile, size: int, head: int, tag: bytes | None
) -> PageRead:
    try:
        fd = os.open(page.name, _OPEN_READ, dir_fd=dirs.fd(page.subdir))
    except OSError as exc:
        if exc.errno in _MISSING:
            return PageRead(FileState.MISSING)
        if exc.errno in _NOT_REGULAR:
            return PageRead(FileState.NOT_REGULAR)
        raise
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            return PageRead(FileState.NOT_REGULAR, size=info.st_size)
        if tag is not None:
            try:
                if os.getxattr(fd, KEY_XATTR) != tag:
                    return PageRead(FileState.OTHER_KEY, size=info.st_size)
            except OSError:
                pass  # no attribute (SGLang wrote it), or none kept here: served by name
        if info.st_size != size:
            return PageRead(FileState.SIZE_MISMATCH, os.read(fd, min(head, size)), info.st_size)
        data = _read_exactly(fd, size)
        if data is None:
            return PageRead(FileState.SIZE_MISMATCH, b"", info.st_size)
        return PageRead(FileState.READ, data, size)
    finally:
        os.close(fd)


def read_pages(
    root: Path,
    pages: Sequence[PageFile],
    sizes: Sequence[int],
    head: int,
    tags: Sequence[bytes | None],
) -> list[PageRead]:
    """Read ``pages[i]`` if it is a regular file of exactly ``sizes[i]`` bytes, in order,
    stopping after the first page that is not ``READ``.

    A page of another size is not read: only its first ``head`` bytes are (so a header can
    tell a damaged page from another page size).  ``tags[i]`` (SGLang layout) is compared
    with the file's key attribute when it has one.  Raises ``OSError`` for I/O failures.
    """
    results: list[PageRead] = []
    with DirectoryFds(root) as dirs:
        for page, size, tag in zip(pages, sizes, tags, strict=True):
            try:
                result = _read_one(dirs, page, size, head, tag)
            except OSError as exc:
                if exc.errno in _MISSING:
                    result = PageRead(FileState.MISSING)
                elif exc.errno in _NOT_REGULAR:
                    result = PageRead(FileState.NOT_REGULAR)
                else:
                    raise
            results.append(result)
            if result.state is not FileState.READ:
                break
    return results


def stat_pages(root: Path, pages: Sequence[PageFile]) -> list[int]:
    """Sizes of the leading ``pages`` that are regular files (links are not followed),
    stopping at the first that is not."""
    sizes: list[int] = []
    with DirectoryFds(root) as dirs:
        for page in pages:
            try:
                info = os.stat(page.name, dir_fd=dirs.fd(page.subdir), follow_symlinks=False)
            except OSError:
                break
            if not stat.S_ISREG(info.st_mode):
                break
            sizes.append(info.st_size)
    return sizes


def remove_pages(root: Path, pages: Sequence[PageFile]) -> list[OSError]:
    """Unlink ``pages`` (a link is removed, never followed); returns the failures other than
    "already gone"."""
    failures: list[OSError] = []
    with DirectoryFds(root) as dirs:
        for page in pages:
            try:
                os.unlink(page.name, dir_fd=dirs.fd(page.subdir))
            except OSError as exc:
                if exc.errno not in _MISSING:
                    failures.append(exc)
    return failures


class WriteProgress:
    """How far a batch write got, shared by the writing thread and the caller.

    The caller may give up (a deadline) while the thread still runs: :meth:`stop` then says
    how many pages are in place, and the thread places no more (a page it renamed into
    place after the stop is removed again, so what the caller counts is what is on disk).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stopped = False
        self._done = 0

    @property
    def done(self) -> int:
        """Pages in place so far."""
        return self._done

    def stopping(self) -> bool:
        """Whether the caller gave up (a method, not a property: it changes under us)."""
        return self._stopped

    def placed(self) -> bool:
        """Count one more page in place; ``False`` if the caller already gave up."""
        with self._lock:
            if self._stopped:
                return False
            self._done += 1
            return True

    def stop(self) -> int:
        """Give up: no page is placed after this; returns how many were."""
        with self._lock:
            self._stopped = True
            return self._done


def write_file(dir_fd: int, name: str, data: bytes, tag: bytes | None) -> None:
    """Create ``name`` (it must not exist) under ``dir_fd`` holding ``data``; with ``tag``,
    record it as the key attribute (best effort)."""
    fd = os.open(name, _OPEN_NEW, 0o644, dir_fd=dir_fd)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        if tag is not None:
            # Without user attributes on this file system the page is served by its name.
            with contextlib.suppress(OSError):
                os.setxattr(fd, KEY_XATTR, tag)
    finally:
        os.close(fd)


def write_pages(
    root: Path,
    victims: Sequence[PageFile],
    pages: Sequence[PageFile],
    datas: Sequence[bytes],
    tags: Sequence[bytes | None],
    progress: WriteProgress,
) -> list[OSError]:
    """Unlink ``victims``, then write ``pages[i]`` = ``datas[i]`` in order, each to a temp
    file renamed into place (a reader sees the old file, the new one or none).

    ``progress`` counts pages in place; the first failure raises ``OSError`` (its temp file
    removed).  Returns the victims that could not be removed.
    """
    with DirectoryFds(root) as dirs:
        failures: list[OSError] = []
        for victim in victims:
            try:
                os.unlink(victim.name, dir_fd=dirs.fd(victim.subdir))
            except OSError as exc:
                if exc.errno not in _MISSING:
                    failures.append(exc)
        for page, data, tag in zip(pages, datas, tags, strict=True):
            if progress.stopping():
                break
            dir_fd = dirs.fd(page.subdir, create=True)
            temp = temp_name(page.name)
            try:
                write_file(dir_fd, temp, data, tag)
                if progress.stopping():
                    raise InterruptedError("the caller gave up")
                os.replace(temp, page.name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(temp, dir_fd=dir_fd)
                if progress.stopping():
                    break
                raise
            if not progress.placed():
                # Placed after the caller gave up: it does not count it, so remove it.
                with contextlib.suppress(OSError):
                    os.unlink(page.name, dir_fd=dir_fd)
                break
        return failures
