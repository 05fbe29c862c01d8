"""Typed errors of the L3 storage tier.

Backends *degrade* instead of raising on transport trouble: ``exists``/``get`` report a miss
and ``put`` reports fewer stored pages, and the failure is counted in ``StorageStats``.  The
errors below are raised only for caller mistakes (a bad key, a bad buffer, a closed backend)
and at construction time (a backend that cannot be configured).  Backends raise
``StorageUnavailableError`` and ``StorageTimeout`` internally; ``StorageBackend`` turns them
into misses at the public boundary.

Hierarchy::

    URCError
    └── StorageError                  base of every storage error
        ├── InvalidStorageKeyError    a key string or namespace part is malformed
        ├── InvalidBufferError        a buffer is not a contiguous CPU tensor, or counts differ
        ├── StorageClosedError        the backend was closed
        ├── StorageUnavailableError   the store could not be reached or refused the request
        ├── StorageTimeout            an operation ran past its deadline
        └── ClearUnsupportedError     the backend cannot delete only its own pages (``clear``)
"""

from __future__ import annotations

from urc.errors import URCError

__all__ = [
    "ClearUnsupportedError",
    "InvalidBufferError",
    "InvalidStorageKeyError",
    "StorageClosedError",
    "StorageError",
    "StorageTimeout",
    "StorageUnavailableError",
]


class StorageError(URCError):
    """Base class of every error the storage tier raises on purpose."""


class InvalidStorageKeyError(StorageError, ValueError):
    """A page key does not match the versioned key format, or a namespace part is invalid."""


class InvalidBufferError(StorageError, ValueError):
    """A buffer is not a contiguous CPU tensor, or keys and buffers differ in number."""


class StorageClosedError(StorageError):
    """The backend was used after ``close()``."""


class StorageUnavailableError(StorageError):
    """The store could not be reached or failed the request (connection refused, I/O error)."""


class StorageTimeout(StorageError, TimeoutError):
    """An operation did not finish within its deadline."""


class ClearUnsupportedError(StorageError):
    """``clear()`` was refused: this backend (or its client library) cannot delete its own
    pages without touching other deployments' (nothing was deleted)."""
