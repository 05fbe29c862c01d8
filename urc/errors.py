"""Typed errors raised at the public API boundary.

Every error leaves the cache exactly as it was before the call.  Internal invariants are
checked with ``assert`` instead; an ``AssertionError`` means a bug in this library.

Hierarchy::

    URCError                         base of everything this library raises on purpose
    ├── ConfigError                  invalid configuration (page size, window, pool sizes)
    ├── InvalidInputError            a call's arguments are wrong
    │   ├── KeyValueMismatchError    key and value lengths differ
    │   ├── InvalidIndicesError      value tensor of the wrong dtype/device, or outside the pool
    │   │   └── TreeOwnedSlotError   a tree-owned slot passed as the caller's (free/insert/copy)
    │   ├── InvalidLockError         unlocking an unlocked node, a wrong or missing lock receipt
    │   └── UnsupportedParamError    a parameter field urc does not serve (named in ``field``)
    ├── PoolError                    an allocator refused an operation
    │   ├── DoubleFreeError          freeing a slot that is not allocated (or twice)
    │   └── OutOfMemoryError         not enough free slots, even after eviction
    ├── LeaseError                   an async lease was released twice or is unknown
    └── ServiceError                 the async service cannot take the command
        ├── ServiceClosedError       the service was closed (or never started)
        └── ServiceFailedError       the actor task died; the cause is chained
"""

from __future__ import annotations

__all__ = [
    "ConfigError",
    "DoubleFreeError",
    "InvalidIndicesError",
    "InvalidInputError",
    "InvalidLockError",
    "KeyValueMismatchError",
    "LeaseError",
    "OutOfMemoryError",
    "PoolError",
    "ServiceClosedError",
    "ServiceError",
    "ServiceFailedError",
    "TreeOwnedSlotError",
    "URCError",
    "UnsupportedParamError",
]


class URCError(Exception):
    """Base class of every error this library raises on purpose."""


class ConfigError(URCError, ValueError):
    """Raised when a configuration value is invalid (e.g. a page size that is not a power of 2)."""


class InvalidInputError(URCError, ValueError):
    """Raised when the arguments of a call are invalid; nothing was changed."""


class KeyValueMismatchError(InvalidInputError):
    """Raised when a key and its value tensor have different lengths."""


class InvalidIndicesError(InvalidInputError):
    """Raised when a value tensor has the wrong dtype or device, or indexes outside its pool."""


class TreeOwnedSlotError(InvalidIndicesError):
    """Raised when a slot the tree owns (e.g. a node's Mamba state) is passed where the caller's
    own slot is expected: inserted as new state, freed, or used as a copy-on-write target."""


class InvalidLockError(InvalidInputError):
    """Raised when unlocking a node that is not locked, or with a wrong or missing receipt."""


class UnsupportedParamError(InvalidInputError):
    """Raised when a parameter object sets a field urc does not serve (an engine's param
    field left at its default is fine); ``field`` names it, e.g. ``"InsertParams.c128_value"``."""

    def __init__(self, field: str, why: str) -> None:
        super().__init__(f"{field}: {why}")
        self.field = field


class PoolError(URCError):
    """Raised when an allocator refuses an operation; the allocator is unchanged."""


class DoubleFreeError(PoolError):
    """Raised when freeing a slot that is not currently allocated (including twice in a call)."""


class OutOfMemoryError(PoolError):
    """Raised when an allocation cannot be satisfied even after eviction."""


class LeaseError(URCError):
    """Raised when an async lock lease is released twice, or does not belong to the service."""


class ServiceError(URCError):
    """Raised when the async service cannot take a command."""


class ServiceClosedError(ServiceError):
    """Raised by every call made after the service was closed (or before it was started)."""


class ServiceFailedError(ServiceError):
    """Raised to every waiting and later caller once the actor task has died; see ``__cause__``."""
