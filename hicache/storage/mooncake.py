"""``MooncakeStorage``: an optional L3 backend on Mooncake Store (a distributed KV store).

Needs the ``mooncake`` package (``pip install mooncake-transfer-engine-non-cuda`` on CPU-only
Linux; it also needs ``libibverbs`` installed, even for TCP) and a running ``mooncake_master``.
The package is imported only by ``MooncakeStorage.open``, so this module imports without it.

Mooncake's Python client is synchronous, so every call runs in a worker thread under the
backend's deadline.  On a timeout the caller gets a miss at once while the abandoned call
finishes in its thread.  Values are ``encode_page(buffer, key)`` bytes moved with
``put_batch``/``get_batch``; those stage data in the client's ``local_buffer_size`` buffer,
so a batch is split into chunks that fit half of it.  Mooncake leaves eviction to the store's
master (``eviction_high_watermark_ratio``): a full store makes ``put_batch`` fail, which reads
here as "stored fewer".

The client reports trouble in return codes, not exceptions (``mooncake-store/include/types.h``
``ErrorCode``): ``batch_is_exist`` gives a negative flag per key it could not ask about,
``put_batch`` a negative code, and ``get_batch`` an empty value for a missing key and for a
failed read alike.  While the master is down (killed, restarting) those codes are
``RPC_FAIL``; they raise ``StorageUnavailableError`` here, so an outage is counted and read
as a miss by the caller, not mistaken for an empty store.  An empty ``get_batch`` value is
told apart by asking ``batch_is_exist`` about that key.  After the master restarts, the
client re-registers its memory segment on its next heartbeat (about a second): pages stored
before the restart are gone (the master's metadata is in memory), new ones store again.

``clear()`` is one ``remove_by_regex`` call on the master (``force=True``: a page read a moment
ago is removed too), with an anchored pattern: the store's ``key_prefix``, then a page key of
urc's layout or an SGLang-layout key of its ``sglang_suffix``; other prefixes' values are
never matched.  Not ``remove_all`` (SGLang's own ``clear``): that empties the whole store, every
deployment's pages with it.  A ``key_prefix`` with characters outside ``[A-Za-z0-9_.:-]``, or a
client without ``remove_by_regex``, refuses the clear (``ClearUnsupportedError``).
"""

from __future__ import annotations

import functools
import importlib
import logging
import re
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any, TypeVar

import anyio
import torch

from hicache.storage.base import StorageBackend
from hicache.storage.codec import (
    HEADER_SIZE,
    PageStatus,
    decode_page_into_async,
    encode_page_async,
)
from hicache.storage.errors import ClearUnsupportedError, StorageUnavailableError
from hicache.storage.keys import SGLANG_SUFFIX_PATTERN, PageKey
from urc.errors import ConfigError

__all__ = ["MooncakeConfig", "MooncakeProtocol", "MooncakeStorage", "clear_pattern"]

_log = logging.getLogger(__name__)
_T = TypeVar("_T")
_MiB = 1 << 20

# Mooncake's ErrorCode values that are not an outage: a put of these stored fewer (the store
# is full, or has no segment with room yet; an item larger than the staging buffer).
_NO_AVAILABLE_HANDLE = -200
_INVALID_PARAMS = -600
_OBJECT_ALREADY_EXISTS = -705  # keys name content: the page is stored
_STORED_FEWER = frozenset({_NO_AVAILABLE_HANDLE, _INVALID_PARAMS})
_CODE_NAMES = {
    -1: "INTERNAL_ERROR",
    _NO_AVAILABLE_HANDLE: "NO_AVAILABLE_HANDLE",
    _INVALID_PARAMS: "INVALID_PARAMS",
    -703: "REPLICA_IS_NOT_READY",
    -704: "OBJECT_NOT_FOUND",
    _OBJECT_ALREADY_EXISTS: "OBJECT_ALREADY_EXISTS",
    -800: "TRANSFER_FAIL",
    -900: "RPC_FAIL",
    -901: "RPC_TIMEOUT",
}


_PLAIN_PREFIX = re.compile(r"[A-Za-z0-9_.:-]*")
_URC_KEY_RE = r"urc[0-9]+:(full|swa|mamba):[0-9a-f]{64}"


def clear_pattern(key_prefix: str, sglang_suffix: str | None) -> str:
    """The anchored regular expression (ECMAScript, as the master reads it) of the values
    ``clear()`` removes; raises ``ClearUnsupportedError`` for a prefix it cannot spell."""
    if not _PLAIN_PREFIX.fullmatch(key_prefix):
        raise ClearUnsupportedError(
            f"clear needs a key_prefix of [A-Za-z0-9_.:-], not {key_prefix!r}"
        )
    keys = _URC_KEY_RE
    if sglang_suffix is not None:
        keys += "|sglang:[0-9a-f]{64}" + sglang_suffix.replace(".", r"\.")
    return "^" + key_prefix.replace(".", r"\.") + "(" + keys + ")$"


def _unavailable(call: str, code: int) -> StorageUnavailableError:
    name = _CODE_NAMES.get(code, "error")
    return StorageUnavailableError(f"Mooncake {call} failed with {name} ({code})")


class MooncakeProtocol(Enum):
    """Transport between Mooncake clients."""

    TCP = "tcp"
    RDMA = "rdma"


@dataclass(frozen=True)
class MooncakeConfig:
    """How this process joins a Mooncake store.

    ``master_address``: ``host:port`` of ``mooncake_master``.  ``global_segment_size``: bytes of
    this process's memory lent to the store; ``local_buffer_size``: the client's staging buffer
    (bounds one transfer chunk).  ``setup_timeout_s`` bounds joining (the client retries for
    about 90 s against a missing master); ``op_timeout_s`` bounds each batch.
    ``sglang_suffix``: the deployment whose SGLang-layout pages ``clear()`` deletes
    (``_<model>_<tp rank>_<tp size>``; ``None``: none).
    """

    master_address: str
    local_hostname: str = "127.0.0.1"
    metadata_server: str = "P2PHANDSHAKE"
    protocol: MooncakeProtocol = MooncakeProtocol.TCP
    rdma_devices: str = ""
    global_segment_size: int = 256 * _MiB
    local_buffer_size: int = 64 * _MiB
    key_prefix: str = ""
    setup_timeout_s: float = 30.0
    op_timeout_s: float = 10.0
    sglang_suffix: str | None = None

    def __post_init__(self) -> None:
        if ":" not in self.master_address:
            raise ConfigError(f"master_address must be host:port, not {self.master_address!r}")
        if self.global_segment_size < 0 or self.local_buffer_size < _MiB:
            raise ConfigError("segment size must be >= 0 and local_buffer_size >= 1 MiB")
        if min(self.setup_timeout_s, self.op_timeout_s) <= 0:
            raise ConfigError("timeouts must be positive")
        if self.sglang_suffix is not None and not SGLANG_SUFFIX_PATTERN.fullmatch(
            self.sglang_suffix
        ):
            raise ConfigError(f"not an SGLang deployment suffix: {self.sglang_suffix!r}")


def _chunks(sizes: Sequence[int], budget: int) -> Iterator[tuple[int, int]]:
    """Yield ``(start, stop)`` ranges whose sizes sum to at most ``budget`` (at least one
    item per range, so an oversized item travels alone and fails on its own)."""
    start = 0
    while start < len(sizes):
        stop, total = start, 0
        while stop < len(sizes) and (stop == start or total + sizes[stop] <= budget):
            total += sizes[stop]
            stop += 1
        yield start, stop
        start = stop


class MooncakeStorage(StorageBackend):
    """Pages in a Mooncake store; build it with ``await MooncakeStorage.open(config)``."""

    name = "mooncake"

    def __init__(self, store: Any, config: MooncakeConfig) -> None:
        """Wrap an already set-up ``MooncakeDistributedStore`` (``open`` does that)."""
        super().__init__(op_timeout_s=config.op_timeout_s)
        self._store = store
        self._config = config
        # One client call at a time, held by the thread that makes it: a call abandoned at
        # its deadline keeps running, and anyio's limiter would let the next call (or the
        # close) into the client beside it; the client crashes on such overlaps while it
        # reconnects to a restarted master.
        self._client_lock = threading.Lock()
        self._limiter = anyio.CapacityLimiter(1)

    @classmethod
    async def open(cls, config: MooncakeConfig) -> MooncakeStorage:
        """Join the store.  Raises ``StorageUnavailableError`` if ``mooncake`` is not
        installed, or the master cannot be reached within ``setup_timeout_s``."""
        try:
            module = importlib.import_module("mooncake.store")
        except ImportError as exc:
            raise StorageUnavailableError(
                f"mooncake is not importable ({exc}); pip install mooncake-transfer-engine-non-cuda"
            ) from exc
        store = module.MooncakeDistributedStore()
        setup = functools.partial(
            store.setup,
            config.local_hostname,
            config.metadata_server,
            config.global_segment_size,
            config.local_buffer_size,
            config.protocol.value,
            config.rdma_devices,
            config.master_address,
        )
        try:
            with anyio.fail_after(config.setup_timeout_s):
                code = await anyio.to_thread.run_sync(setup, abandon_on_cancel=True)
        except TimeoutError as exc:
            raise StorageUnavailableError(
                f"no Mooncake master at {config.master_address} within {config.setup_timeout_s} s"
            ) from exc
        if code != 0:
            raise StorageUnavailableError(f"Mooncake setup failed with code {code}")
        return cls(store, config)

    def _name(self, key: PageKey) -> str:
        return f"{self._config.key_prefix}{key}"

    def _locked(self, function: Callable[..., _T], *args: Any) -> _T:
        with self._client_lock:
            return function(*args)

    async def _call(
        self, function: Callable[..., _T], *args: Any, abandon_on_cancel: bool = True
    ) -> _T:
        """Run a blocking client call in a worker thread, after every call before it ended
        (abandoned ones too); map its failures."""
        try:
            return await anyio.to_thread.run_sync(
                functools.partial(self._locked, function, *args),
                abandon_on_cancel=abandon_on_cancel,
                limiter=self._limiter,
            )
        except (RuntimeError, OSError, ValueError) as exc:
            raise StorageUnavailableError(f"{type(exc).__name__}: {exc}") from exc

    async def _exists(self, keys: Sequence[PageKey]) -> int:
        found: list[int] = await self._call(
            self._store.batch_is_exist, [self._name(k) for k in keys]
        )
        count = 0
        for flag in found:
            if flag < 0:  # the store could not tell: an outage, not a miss
                raise _unavailable("batch_is_exist", flag)
            if flag != 1:
                break
            count += 1
        return count

    async def _check_missing(self, name: str) -> None:
        """``get_batch`` gave nothing for ``name``: return if the store does not hold it (a
        miss); raise ``StorageUnavailableError`` if it could not tell, or holds the page but
        could not read it."""
        flags: list[int] = await self._call(self._store.batch_is_exist, [name])
        if flags[0] < 0:
            raise _unavailable("get_batch", flags[0])
        if flags[0] == 1:
            raise StorageUnavailableError(f"Mooncake get_batch could not read {name!r}")

    async def _get(self, keys: Sequence[PageKey], buffers: Sequence[torch.Tensor]) -> int:
        budget = self._config.local_buffer_size // 2
        sizes = [buffer.nbytes + HEADER_SIZE for buffer in buffers]
        read = 0
        for start, stop in _chunks(sizes, budget):
            names = [self._name(k) for k in keys[start:stop]]
            values: list[bytes] = await self._call(self._store.get_batch, names)
            chunk = zip(keys[start:stop], names, values, buffers[start:stop], strict=False)
            for key, name, value, buffer in chunk:
                if not value:  # b"": a missing key, or a read that failed
                    await self._check_missing(name)
                    return read
                status = await decode_page_into_async(value, buffer, key)
                if status is PageStatus.CORRUPT:
                    self._counters.corrupt += 1
                    try:  # best effort: a damaged value is never useful
                        await self._call(self._store.remove, name, True)
                    except StorageUnavailableError:
                        self._counters.errors += 1
                if status is not PageStatus.OK:
                    return read
                self._counters.record_read(buffer.nbytes)
                read += 1
        return read

    async def _put(self, keys: Sequence[PageKey], buffers: Sequence[torch.Tensor]) -> int:
        budget = self._config.local_buffer_size // 2
        sizes = [buffer.nbytes + HEADER_SIZE for buffer in buffers]
        stored = 0
        for start, stop in _chunks(sizes, budget):
            values = [
                await encode_page_async(buffer, key)
                for key, buffer in zip(keys[start:stop], buffers[start:stop], strict=True)
            ]
            names = [self._name(k) for k in keys[start:stop]]
            code: int = await self._call(self._store.put_batch, names, values)
            if code in _STORED_FEWER:  # all or nothing per chunk (e.g. no space left)
                self._counters.errors += 1
                _log.warning("Mooncake put_batch stored nothing: code %d", code)
                break
            if code not in (0, _OBJECT_ALREADY_EXISTS):
                raise _unavailable("put_batch", code)
            for buffer in buffers[start:stop]:
                self._counters.record_write(buffer.nbytes)
            stored = stop
        return stored

    async def _delete(self, keys: Sequence[PageKey]) -> None:
        # force=True: a page read a moment ago holds a lease that would refuse a removal.
        await self._call(self._store.batch_remove, [self._name(k) for k in keys], True)

    async def _clear(self) -> int:
        pattern = clear_pattern(self._config.key_prefix, self._config.sglang_suffix)
        remove = getattr(self._store, "remove_by_regex", None)
        if remove is None:
            raise ClearUnsupportedError(
                "this Mooncake client has no remove_by_regex: it cannot remove one "
                "deployment's pages only (remove_all would remove every deployment's)"
            )
        removed: int = await self._call(remove, pattern, True)
        if removed < 0:
            raise _unavailable("remove_by_regex", removed)
        return removed

    async def _close(self) -> None:
        # Waits for a call abandoned at its deadline: closing under it would crash the client.
        await self._call(self._store.close, abandon_on_cancel=False)
