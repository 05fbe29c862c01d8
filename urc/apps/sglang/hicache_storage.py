"""urc's L3 stores inside SGLang (0.5.23): a ``HiCacheStorage`` for its ``dynamic`` backend.

::

    python -m sglang.launch_server ... --enable-hierarchical-cache \\
        --hicache-storage-backend dynamic --hicache-storage-backend-extra-config '{
            "backend_name": "urc", "module_path": "urc.apps.sglang.hicache_storage",
            "class_name": "UrcHiCacheStorage",
            "store": "valkey", "addresses": ["10.0.0.5:6379"], "key_prefix": "l3:"}'

SGLang's ``StorageBackendFactory`` imports this module and calls
``UrcHiCacheStorage(storage_config, kwargs)``.  ``store`` picks urc's backend; the other keys
of the extra config (besides SGLang's own: ``backend_name``, ``module_path``, ``class_name``)
are that backend's settings:

- ``"file"`` (the default): ``path`` (default ``/tmp/hicache``), ``capacity_bytes``,
  ``op_timeout_s``.  Pages are SGLang ``HiCacheFile``'s files (``<hash><suffix>.bin``, raw),
  so this and SGLang's own ``file`` backend share a directory.
- ``"valkey"``: the fields of :class:`~hicache.storage.valkey.ValkeyConfig`, ``addresses``
  as ``"host:port"`` strings or ``[host, port]`` pairs (needs the ``redis`` extra).
- ``"mooncake"``: the fields of :class:`~hicache.storage.mooncake.MooncakeConfig`.

Pages are named as urc's SGLang key scheme names them (``hicache.storage.sglang_keys``:
SGLang's page hash and ``_<model>_<tp rank>_<tp size>``) and hold SGLang's own page payload,
so a urc replica with ``StorageConfig(key_scheme=KeyScheme.SGLANG)`` on the same store shares
them.  SGLang's generic page path is served (``batch_exists``/``batch_get``/``batch_set``,
one flat page per key), for full-attention models; the zero-copy ``interface_v1`` and the
v2 pool transfers of hybrid models' sidecar pools are not (refused when SGLang attaches).

urc's fault handling holds inside SGLang: an unreachable, failing or slow store reads as
misses (``batch_exists`` 0, ``batch_get`` ``None``\\ s, ``batch_set`` ``False``), never as an
exception, and every failure is counted (:meth:`UrcHiCacheStorage.stats`); bad settings
raise :class:`~urc.errors.ConfigError` at construction, a malformed key
:class:`~hicache.storage.errors.InvalidStorageKeyError`.  urc's backends are asynchronous:
they run on an event loop in a thread of their own, which SGLang's storage threads call into.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Coroutine, Mapping
from typing import Any, TypeVar

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage

from hicache.storage import InvalidBufferError, StorageBackend, StorageStats
from hicache.storage.registry import open_backend
from hicache.storage.sglang_keys import SGLangNaming
from urc.errors import ConfigError

__all__ = ["UrcHiCacheStorage", "build_store"]

_log = logging.getLogger(__name__)
_T = TypeVar("_T")
# The extra-config keys that are SGLang's own (the factory's, and options SGLang pops or reads).
_SGLANG_KEYS = frozenset(
    {"backend_name", "module_path", "class_name", "interface_v1", "tp_lcm_size", "store"}
)
# A call waits this much longer than the backend's own deadline before giving up on it.
_SLACK_S = 5.0


async def build_store(
    extra_config: Mapping[str, Any], sglang_suffix: str | None = None
) -> StorageBackend:
    """urc's backend for an SGLang extra config (see the module docstring), opened through
    the backend registry (``hicache.storage.registry``); raises
    :class:`~urc.errors.ConfigError` for an unknown store or setting.  ``sglang_suffix``
    (this rank's object-name suffix) is the deployment the store owns: a capacity-limited
    file store never counts or evicts other models' or ranks' pages in a shared directory,
    and ``clear()`` deletes this deployment's pages only, whatever the store."""
    kind = extra_config.get("store", "file")
    settings = {k: v for k, v in extra_config.items() if k not in _SGLANG_KEYS}
    if sglang_suffix is not None and kind in ("file", "valkey", "mooncake"):
        settings["sglang_suffix"] = sglang_suffix
    return await open_backend(kind, settings)


def _naming(storage_config: Any) -> SGLangNaming:
    """The object-name suffix of this rank, as ``HiCacheFile`` makes it (non-MLA, no PP/CP)."""
    unsupported = []
    if storage_config.is_mla_model:
        unsupported.append("an MLA model (its pages are shared by the TP ranks)")
    if storage_config.pp_size > 1 or storage_config.attn_cp_size > 1:
        unsupported.append("pipeline or attention context parallelism")
    if getattr(storage_config, "dcp_size", 1) > 1 or storage_config.should_split_heads:
        unsupported.append("decode context parallelism or split heads")
    if unsupported:
        raise ConfigError("urc's HiCache storage does not serve " + "; ".join(unsupported))
    return SGLangNaming(
        storage_config.model_name or "", storage_config.tp_rank, storage_config.tp_size
    )


class UrcHiCacheStorage(HiCacheStorage):  # type: ignore[misc]
    """SGLang's ``HiCacheStorage`` on one of urc's stores (see the module docstring).

    ``storage_config`` is SGLang's ``HiCacheStorageConfig`` (its ``extra_config`` picks and
    configures the store); ``kwargs`` is what SGLang's factory passes along (unused).
    """

    def __init__(self, storage_config: Any, kwargs: Mapping[str, Any] | None = None) -> None:
        extra = dict(storage_config.extra_config or {})
        if extra.get("interface_v1"):
            raise ConfigError(
                "interface_v1: urc's HiCache storage serves SGLang's generic page path only"
            )
        self._suffix = _naming(storage_config).suffix
        self._stalled = 0
        self._closed = False
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="urc-hicache-storage", daemon=True
        )
        self._thread.start()
        try:
            future = asyncio.run_coroutine_threadsafe(build_store(extra, self._suffix), self._loop)
            self._backend = future.result()
        except BaseException:
            self._stop_loop()
            raise
        timeout = self._backend.op_timeout_s
        self._wait_s = None if timeout is None else timeout + _SLACK_S

    # -- what urc adds ---------------------------------------------------------------------

    @property
    def backend(self) -> StorageBackend:
        """The urc backend pages are stored in."""
        return self._backend

    def stats(self) -> StorageStats:
        """The backend's counters (reads, writes, errors, timeouts, failures by operation)."""
        return self._backend.stats()

    @property
    def stalled_calls(self) -> int:
        """Calls given up on after the backend's deadline plus a slack (read as misses)."""
        return self._stalled

    def key_of(self, key: str) -> str:
        """urc's key string of SGLang's page key ``key`` on this rank."""
        return f"sglang:{key}{self._suffix}"

    # -- SGLang's HiCacheStorage -------------------------------------------------------------

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        """How many leading ``keys`` are stored (0 when the store fails)."""
        names = [self.key_of(k) for k in keys]
        return self._call(self._backend.exists(names), 0)

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def batch_get(
        self,
        keys: list[str],
        target_locations: Any = None,
        target_sizes: Any = None,
    ) -> list[torch.Tensor | None]:
        """Read each page into its target (a flat CPU page tensor); the targets of the
        leading pages read are returned, ``None`` from the first miss on."""
        if target_locations is None or len(target_locations) != len(keys):
            raise InvalidBufferError("urc's HiCache storage reads into one target per key")
        names = [self.key_of(k) for k in keys]
        n = self._call(self._backend.get(names, list(target_locations)), 0)
        return [t if i < n else None for i, t in enumerate(target_locations)]

    def get(
        self, key: str, target_location: Any = None, target_sizes: Any = None
    ) -> torch.Tensor | None:
        return self.batch_get([key], [target_location])[0]

    def batch_set(
        self,
        keys: list[str],
        values: Any = None,
        target_locations: Any = None,
        target_sizes: Any = None,
    ) -> bool:
        """Store one flat page per key; ``True`` only if every page was stored."""
        if values is None or len(values) != len(keys):
            raise InvalidBufferError("urc's HiCache storage stores one value per key")
        names = [self.key_of(k) for k in keys]
        pages = [v.contiguous() for v in values]
        return self._call(self._backend.put(names, pages), 0) == len(keys)

    def set(
        self,
        key: str,
        value: Any = None,
        target_location: Any = None,
        target_sizes: Any = None,
    ) -> bool:
        return self.batch_set([key], [value])

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """Take the KV host pool; refuse a sidecar pool (SWA, Mamba, indexer, ...) with a
        :class:`~urc.errors.ConfigError`, which fails SGLang's storage attach: their pages
        move through SGLang's v2 pool transfers, which this backend does not serve."""
        if str(host_pool_name) != "kv":
            raise ConfigError(
                f"urc's HiCache storage stores full-attention KV pages only, not the "
                f"{host_pool_name} pool's (a hybrid model needs SGLang's v2 pool transfers)"
            )
        super().register_mem_host_pool_v2(host_pool, host_pool_name)

    def clear(self) -> bool:
        """SGLang's ``/hicache/storage-backend/clear``: delete this deployment's pages (its
        rank's object-name suffix, under the store's directory or key prefix; see
        :meth:`~hicache.storage.base.StorageBackend.clear`), never other deployments' in a
        shared store.  ``True`` once they are gone; ``False`` (logged) when the store
        refused or failed the clear."""
        from hicache.storage import StorageError

        future = asyncio.run_coroutine_threadsafe(self._backend.clear(), self._loop)
        try:
            deleted = future.result()
        except StorageError as exc:
            _log.warning("clearing urc's store failed: %s: %s", type(exc).__name__, exc)
            return False
        _log.info("cleared urc's store: %d pages of %s deleted", deleted, self._suffix)
        return True

    def close(self) -> None:
        """Close the backend and stop its event loop (idempotent)."""
        if self._closed:
            return
        self._closed = True
        try:
            asyncio.run_coroutine_threadsafe(self._backend.close(), self._loop).result(self._wait_s)
        except Exception as exc:  # closing must not fail SGLang's shutdown
            _log.warning("closing urc's store failed: %s", exc)
        finally:
            self._stop_loop()

    # -- plumbing ----------------------------------------------------------------------------

    def _call(self, coro: Coroutine[Any, Any, _T], miss: _T) -> _T:
        """Run one backend call on the loop thread.  The backend turns failures into misses
        itself; a call still running ``_SLACK_S`` past its deadline is abandoned (counted
        in ``stalled_calls``) and reads as ``miss``."""
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result(self._wait_s)
        except concurrent.futures.TimeoutError:
            future.cancel()
            self._stalled += 1
            _log.warning("urc's store did not answer within %s s", self._wait_s)
            return miss

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        if not self._thread.is_alive():
            self._loop.close()
