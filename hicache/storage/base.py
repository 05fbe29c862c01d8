"""``StorageBackend``: the async contract every L3 store implements.

Public methods validate their arguments (raising typed errors for caller mistakes), then call
the backend's ``_exists``/``_get``/``_put``/``_delete`` under one deadline.  Transport trouble
never escapes untyped: a backend raises ``StorageUnavailableError`` or ``StorageTimeout`` (or
the deadline fires, or the backend's client raises something unforeseen, which is treated as
unavailability) and the caller sees a miss (``0``), with the failure counted in ``stats()``
(``errors`` or ``timeouts``, and ``failures`` by operation).  With ``raise_errors=True`` the
failure is raised instead, as a :class:`~hicache.storage.errors.StorageUnavailableError` or
:class:`~hicache.storage.errors.StorageTimeout` (still counted): what the storage worker uses
to count failures and back off.  This keeps the cache service simple: the L3 tier can only
make it faster, never fail it.

``clear()`` is the one exception: an operator's bulk delete of the store's own pages, it
raises every failure (see its contract).
"""

from __future__ import annotations

import abc
import logging
from collections.abc import Awaitable, Callable, Sequence
from types import TracebackType
from typing import ClassVar, TypeVar

import anyio
import torch

from hicache.storage.codec import check_buffer
from hicache.storage.errors import (
    ClearUnsupportedError,
    InvalidBufferError,
    StorageClosedError,
    StorageError,
    StorageTimeout,
    StorageUnavailableError,
)
from hicache.storage.keys import PageKey, validate_keys
from hicache.storage.stats import StatsCounter, StorageOp, StorageStats

__all__ = ["CLEAR_TIMEOUT_S", "StorageBackend"]

CLEAR_TIMEOUT_S = 300.0
"""The default deadline of one ``clear()`` (a whole store's pages, not one batch)."""

_log = logging.getLogger(__name__)
_B = TypeVar("_B", bound="StorageBackend")


class _Default:
    """The "use ``op_timeout_s``" marker of ``_guarded``'s deadline."""


_DEFAULT = _Default()


class StorageBackend(abc.ABC):
    """An async page store keyed by versioned page keys (see ``hicache.storage.keys``).

    Pages of one batch are ordered: results count *leading* pages, because a prefix cache can
    only use pages up to the first gap.  Each public call is bounded by ``op_timeout_s``
    (``None`` = no deadline).  Use it as an async context manager, or call ``close()``.
    ``name`` labels the backend in metrics.
    """

    name: ClassVar[str] = "storage"

    def __init__(self, *, op_timeout_s: float | None) -> None:
        if op_timeout_s is not None and op_timeout_s <= 0:
            raise ValueError(f"op_timeout_s must be positive or None, not {op_timeout_s!r}")
        self._op_timeout_s = op_timeout_s
        self._counters = StatsCounter()
        self._closed = False

    # -- public contract ------------------------------------------------------------------

    def stats(self) -> StorageStats:
        """Return a snapshot of this backend's counters."""
        return self._counters.snapshot()

    @property
    def op_timeout_s(self) -> float | None:
        """The deadline of each public call (``None``: none)."""
        return self._op_timeout_s

    @property
    def closed(self) -> bool:
        """Whether ``close()`` was called."""
        return self._closed

    async def exists(self, keys: Sequence[str], *, raise_errors: bool = False) -> int:
        """Return how many leading ``keys`` are stored (stopping at the first miss).

        Raises ``InvalidStorageKeyError`` for a malformed key and ``StorageClosedError`` after
        ``close()``; a store failure or timeout returns 0 (raises with ``raise_errors``, see
        the module docstring).
        """
        parsed = self._prepare(keys)
        if not parsed:
            return 0
        return await self._guarded(StorageOp.EXISTS, lambda: self._exists(parsed), raise_errors)

    async def get(
        self, keys: Sequence[str], buffers: Sequence[torch.Tensor], *, raise_errors: bool = False
    ) -> int:
        """Read pages ``keys[i]`` into ``buffers[i]`` in order; return how many leading pages
        were read.

        Mutates ``buffers[:n]`` (``n`` = the result); a buffer past ``n`` may be filled or
        untouched but is never partially written.  A page that is missing, fails its checksum
        or differs in size from its buffer is a miss and stops the read.  Raises
        ``InvalidStorageKeyError``/``InvalidBufferError`` for bad arguments (buffers must be
        contiguous CPU tensors, one per key) and ``StorageClosedError`` after ``close()``.
        """
        parsed = self._prepare(keys)
        self._check_buffers(parsed, buffers)
        if not parsed:
            return 0
        return await self._guarded(StorageOp.GET, lambda: self._get(parsed, buffers), raise_errors)

    async def put(
        self, keys: Sequence[str], buffers: Sequence[torch.Tensor], *, raise_errors: bool = False
    ) -> int:
        """Store ``buffers[i]`` under ``keys[i]``; return how many leading pages were stored.

        Buffers are read, not mutated.  A full store, a failure or a timeout stores fewer
        (possibly 0).  Storing an existing key keeps one copy (keys name content, so the
        bytes are the same).  Raises like ``get`` for bad arguments.
        """
        parsed = self._prepare(keys)
        self._check_buffers(parsed, buffers)
        if not parsed:
            return 0
        return await self._guarded(StorageOp.PUT, lambda: self._put(parsed, buffers), raise_errors)

    async def delete(self, keys: Sequence[str], *, raise_errors: bool = False) -> None:
        """Remove ``keys`` if present (missing keys are fine); failures are only counted
        (raised with ``raise_errors``)."""
        parsed = self._prepare(keys)
        if parsed:
            await self._guarded(
                StorageOp.DELETE, lambda: self._delete_counted(parsed), raise_errors
            )

    async def clear(self, *, timeout_s: float | None = CLEAR_TIMEOUT_S) -> int:
        """Delete every page this store owns, and nothing else; return how many were deleted.

        What a store owns is its namespace: its directory (``FileStorage``) or its
        ``key_prefix`` (Valkey, Mooncake), and in it only values named as page keys -- urc's
        layout (``urc<version>:<component>:<hex>``, any key-format version) and SGLang's
        layout (``sglang:<hash><suffix>``) of the store's own deployment suffix
        (``sglang_suffix``; a store without one deletes no SGLang-layout page: it cannot
        tell its deployment's from another's).  Other deployments' pages in a shared
        directory or under another prefix, other values under the prefix, links and temp
        files of writes in flight are never touched.  Pages a concurrent ``put`` stores may
        survive the clear; pages stored after it returns are stored as usual.

        Unlike the page operations, failures are raised, never read as "0 deleted":
        ``ClearUnsupportedError`` when the backend cannot delete only its own pages (nothing
        deleted), ``StorageUnavailableError`` / ``StorageTimeout`` (``timeout_s`` for the
        whole clear; ``None``: no deadline) when the store failed part-way (some pages may
        be gone: calling again finishes the job), ``StorageClosedError`` after ``close()``.
        Failures are counted under ``StorageOp.CLEAR``.
        """
        if self._closed:
            raise StorageClosedError(f"{type(self).__name__} is closed")
        return await self._guarded(StorageOp.CLEAR, self._clear, True, timeout_s=timeout_s)

    async def close(self) -> None:
        """Release connections and files; later calls raise ``StorageClosedError``.

        Idempotent.
        """
        if self._closed:
            return
        self._closed = True
        await self._close()

    async def __aenter__(self: _B) -> _B:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    # -- what a backend implements --------------------------------------------------------

    @abc.abstractmethod
    async def _exists(self, keys: Sequence[PageKey]) -> int:
        """Return the number of leading stored keys (``keys`` is non-empty and valid)."""

    @abc.abstractmethod
    async def _get(self, keys: Sequence[PageKey], buffers: Sequence[torch.Tensor]) -> int:
        """Fill leading buffers; count reads, corrupt pages and bytes in ``self._counters``."""

    @abc.abstractmethod
    async def _put(self, keys: Sequence[PageKey], buffers: Sequence[torch.Tensor]) -> int:
        """Store leading pages; count writes and bytes in ``self._counters``."""

    @abc.abstractmethod
    async def _delete(self, keys: Sequence[PageKey]) -> None:
        """Remove the keys that are present."""

    @abc.abstractmethod
    async def _close(self) -> None:
        """Release resources; called once."""

    async def _clear(self) -> int:
        """Delete this store's own pages (see ``clear``); return how many.  A backend that
        cannot tell its own pages from others' keeps this default: refused."""
        raise ClearUnsupportedError(f"{type(self).__name__} cannot clear only its own pages")

    # -- shared plumbing ------------------------------------------------------------------

    def _prepare(self, keys: Sequence[str]) -> list[PageKey]:
        if self._closed:
            raise StorageClosedError(f"{type(self).__name__} is closed")
        return validate_keys(keys)

    @staticmethod
    def _check_buffers(keys: Sequence[PageKey], buffers: Sequence[torch.Tensor]) -> None:
        if len(buffers) != len(keys):
            raise InvalidBufferError(f"{len(keys)} keys but {len(buffers)} buffers")
        for buffer in buffers:
            check_buffer(buffer)

    async def _delete_counted(self, keys: Sequence[PageKey]) -> int:
        await self._delete(keys)
        return 0

    async def _guarded(
        self,
        op: StorageOp,
        call: Callable[[], Awaitable[int]],
        raise_errors: bool = False,
        *,
        timeout_s: float | _Default | None = _DEFAULT,
    ) -> int:
        """Run ``call`` under the deadline (``timeout_s``, else ``op_timeout_s``); turn
        timeouts and store failures into 0 (or, with ``raise_errors``, into a
        ``StorageTimeout`` / ``StorageUnavailableError``)."""
        counters = self._counters
        what = f"{type(self).__name__} {op.value}"
        deadline = self._op_timeout_s if isinstance(timeout_s, _Default) else timeout_s
        try:
            with anyio.fail_after(deadline):
                return await call()
        except TimeoutError as exc:  # anyio's deadline, or a backend's StorageTimeout
            counters.timeouts += 1
            counters.record_failure(op)
            _log.warning("%s timed out", what)
            if raise_errors:
                raise StorageTimeout(f"{what} timed out") from exc
        except StorageUnavailableError as exc:
            counters.errors += 1
            counters.record_failure(op)
            _log.warning("%s failed: %s", what, exc)
            if raise_errors:
                raise
        except StorageError:
            raise  # a caller mistake, or a closed backend: not a store failure
        except Exception as exc:
            # The backend's client raised something it does not map (a bug there, or a
            # failure mode nobody foresaw): the store is unavailable for this call.
            counters.errors += 1
            counters.record_failure(op)
            _log.warning("%s failed unexpectedly", what, exc_info=exc)
            if raise_errors:
                raise StorageUnavailableError(f"{what}: {type(exc).__name__}: {exc}") from exc
        return 0
