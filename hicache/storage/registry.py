"""The registry of L3 storage backends: a name -> how to open one from plain settings.

::

    store = await open_backend("valkey", {"addresses": ["10.0.0.5:6379"], "key_prefix": "l3:"})

Built in: ``"file"`` (:class:`~hicache.storage.file.FileStorage`: ``path``,
``capacity_bytes``, ``op_timeout_s``, ``sglang_suffix``), ``"valkey"`` (the fields of
:class:`~hicache.storage.valkey.ValkeyConfig`; ``addresses`` as ``"host:port"`` strings or
``[host, port]`` pairs) and ``"mooncake"`` (the fields of
:class:`~hicache.storage.mooncake.MooncakeConfig`; ``protocol`` by value).  The shared
backends' optional packages are imported only when one is opened.  A new backend is one
:func:`register_backend` call: whatever opens stores by name (the SGLang plug-in) and the
storage conformance tests (``tests/storage_backends.py``) pick it up from here.

Settings are validated when the store is opened: an unknown backend or setting raises
:class:`~urc.errors.ConfigError`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hicache.storage.base import StorageBackend
from hicache.storage.file import FileStorage
from urc.errors import ConfigError

__all__ = ["BackendEntry", "backend_names", "open_backend", "register_backend"]

Opener = Callable[[Mapping[str, Any]], Awaitable[StorageBackend]]


@dataclass(frozen=True)
class BackendEntry:
    """One registered backend: its ``name``, the coroutine that opens it from settings,
    and the settings it takes (for error messages and documentation)."""

    name: str
    open: Opener
    settings: tuple[str, ...]


_REGISTRY: dict[str, BackendEntry] = {}


def register_backend(entry: BackendEntry) -> None:
    """Add ``entry`` (raises ``ConfigError`` if its name is taken)."""
    if entry.name in _REGISTRY:
        raise ConfigError(f"a storage backend named {entry.name!r} is registered already")
    _REGISTRY[entry.name] = entry


def backend_names() -> tuple[str, ...]:
    """The registered backends' names, in registration order."""
    return tuple(_REGISTRY)


async def open_backend(name: str, settings: Mapping[str, Any]) -> StorageBackend:
    """Open the backend registered as ``name`` with ``settings``; raises ``ConfigError``
    for an unknown backend or setting (and what the backend raises when it cannot start,
    e.g. ``StorageUnavailableError``)."""
    entry = _REGISTRY.get(name)
    if entry is None:
        raise ConfigError(f"unknown urc store {name!r}: {', '.join(_REGISTRY)}")
    unknown = sorted(set(settings) - set(entry.settings))
    if unknown:
        raise ConfigError(
            f"unknown {name} store settings {unknown} (it takes {sorted(entry.settings)})"
        )
    return await entry.open(settings)


def _field_names(config_type: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(config_type))


def _address(value: Any) -> tuple[str, int]:
    if isinstance(value, str):
        host, sep, port = value.rpartition(":")
        if sep and port.isdigit():
            return host, int(port)
    elif isinstance(value, list | tuple) and len(value) == 2:
        return str(value[0]), int(value[1])
    raise ConfigError(f"a store address is 'host:port' or [host, port], not {value!r}")


async def _open_file(settings: Mapping[str, Any]) -> StorageBackend:
    return await FileStorage.open(
        Path(settings.get("path", "/tmp/hicache")),
        settings.get("capacity_bytes"),
        op_timeout_s=settings.get("op_timeout_s", 30.0),
        sglang_suffix=settings.get("sglang_suffix"),
    )


async def _open_valkey(settings: Mapping[str, Any]) -> StorageBackend:
    from hicache.storage.valkey import ValkeyConfig, ValkeyStorage

    fields = dict(settings)
    if "addresses" in fields:
        fields["addresses"] = tuple(_address(a) for a in fields["addresses"])
    return ValkeyStorage(ValkeyConfig(**fields))


async def _open_mooncake(settings: Mapping[str, Any]) -> StorageBackend:
    from hicache.storage.mooncake import MooncakeConfig, MooncakeProtocol, MooncakeStorage

    fields = dict(settings)
    if "protocol" in fields:
        fields["protocol"] = MooncakeProtocol(fields["protocol"])
    return await MooncakeStorage.open(MooncakeConfig(**fields))


def _valkey_settings() -> tuple[str, ...]:
    try:
        from hicache.storage.valkey import ValkeyConfig
    except ImportError:  # the redis extra is missing: opening one says so
        return ()
    return _field_names(ValkeyConfig)


def _mooncake_settings() -> tuple[str, ...]:
    from hicache.storage.mooncake import MooncakeConfig  # imports no mooncake package

    return _field_names(MooncakeConfig)


register_backend(
    BackendEntry("file", _open_file, ("path", "capacity_bytes", "op_timeout_s", "sglang_suffix"))
)
register_backend(BackendEntry("valkey", _open_valkey, _valkey_settings()))
register_backend(BackendEntry("mooncake", _open_mooncake, _mooncake_settings()))
