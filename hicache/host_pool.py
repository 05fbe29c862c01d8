"""Host (L2) mirror of a device pool, in a :class:`~hicache.host_layout.HostLayout`, with
batched copies.

A device pool is described by its buffers: ``(tensor, slot_dim)`` pairs whose dimension
``slot_dim`` indexes slots (KV: ``kv[2, layers, slots, heads, dim]`` has slot dim 2; Mamba:
``conv[slots, ...]`` and ``temporal[slots, ...]`` have slot dim 0).  The host mirror holds the
same buffers with ``size`` host slots, its own allocator, and copies slots between the two.

Host layouts: a buffer ``[split, *mid, slots, *inner]`` is held as

- ``LAYER_FIRST``: ``[split, *mid, size, *inner]``, the device's own layout;
- ``PAGE_FIRST`` (SGLang's ``MHATokenToKVPoolHost`` default): ``[split, size, *mid, *inner]``
  -- the leading dimension (K/V) stays split, then all layers of a slot (and of a page of
  ``page_size`` slots) are contiguous, so a page is one K block and one V block.

A buffer with slot dim 0 (Mamba states) keeps its shape in both.  ``host_buffers`` lists the
host tensors with their slot dim; :meth:`HostPool.page_views` shows them page by page in
``PAGE_FIRST`` order whatever the layout (what L3 stores).  Either way a transfer moves
``outer`` blocks per page: ``split`` for ``PAGE_FIRST``, ``split x mid`` for ``LAYER_FIRST``.

Copies are batched per call and run on the pool's :class:`~hicache.transfer_engine.
TransferEngine`; :meth:`HostPool.backup` and :meth:`HostPool.load` return the transfer's
:class:`~hicache.transfer_engine.Completion`, and nothing they write may be read (nor what
they read be reused) before it is done.  Pools on the CPU gather straight into (or out of)
each contiguous run of host pages (:mod:`hicache._cpu_copy`).  Pools on a CUDA device gather
the pages on the device into a staging buffer in host order (on the transfer stream, with a
device copy of the indices) and move each run of host pages with one asynchronous copy per
block; host memory is then pinned (``cudaHostRegister`` on an exactly sized buffer: no
power-of-two rounding).
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Sequence

import numpy as np
import torch

from hicache._cpu_copy import RowMirror, backup_rows, copy_pages, load_rows, runs
from hicache.host_layout import HostLayout
from hicache.transfer_engine import DONE, Completion, Lane, TransferEngine, engine_for
from urc.errors import ConfigError, InvalidIndicesError
from urc.pools.allocator import TokenSlotAllocator

__all__ = ["STAGING_BYTES", "HostPool", "SlotBuffers"]

SlotBuffers = Sequence[tuple[torch.Tensor, int]]

#: A device-side staging buffer holds at most this many bytes (larger transfers go in chunks).
STAGING_BYTES = 256 << 20


class _Mirror:
    """One device buffer and its host copy as ``[outer, units, page elements]`` views, the
    device's pages in host order (see the module docstring)."""

    __slots__ = ("device", "host", "outer", "page_shape", "rows", "unit_bytes", "views")

    def __init__(
        self, dev: torch.Tensor, dim: int, host: torch.Tensor, page_size: int, layout: HostLayout
    ) -> None:
        shape = dev.shape
        split = shape[0] if dim > 0 else 1
        mid = math.prod(shape[1:dim]) if dim > 0 else 1
        inner = math.prod(shape[dim + 1 :])
        units = shape[dim] // page_size
        host_units = host.numel() // (split * mid * inner * page_size)
        self.unit_bytes = split * page_size * mid * inner * dev.element_size()
        self.rows: RowMirror | None = None
        if layout is HostLayout.PAGE_FIRST and mid > 1:
            self.outer = split
            self.page_shape: tuple[int, ...] = (page_size, mid, inner)
            # Device pages in host order: [split, units, page_size, mid, inner] (strided).
            self.device = dev.view(split, mid, units, page_size, inner).permute(0, 2, 3, 1, 4)
            pages = host.view(split, host_units, page_size, mid, inner)
            if dev.device.type == "cpu":  # row views (:mod:`hicache._cpu_copy`)
                self.rows = RowMirror(dev, host, split, mid, inner)
        else:
            self.outer = split * mid
            self.page_shape = (page_size * inner,)
            self.device = dev.view(self.outer, units, page_size * inner)
            pages = host.view(split, mid, host_units, page_size, inner).permute(0, 2, 3, 1, 4)
        self.host = host.view(self.outer, host_units, -1)
        # Host pages in PAGE_FIRST order, as bytes: [split, units, page_size, mid, inner bytes].
        self.views = pages.view(torch.uint8)


class HostPool:
    """Host copies of the slots of one device pool (see the module docstring).

    ``allocator`` hands out host slots (in pages of ``page_size``).  :meth:`backup` copies
    device slots into host slots, :meth:`load` the other way; both move real bytes, leave
    the source untouched and return the transfer's completion.  Host indices are CPU int64
    tensors (the allocator's); device indices may live on the host or the device.
    ``layout``: how the host buffers hold slots (default:
    :meth:`~hicache.host_layout.HostLayout.for_device` of the pool's device);
    ``pin_memory``: pin the host buffers (default: when the device pool is on CUDA);
    ``engine``: where copies run (default: :func:`~hicache.transfer_engine.engine_for` the
    pool's device).  Raises :class:`~urc.errors.ConfigError` for no buffers, buffers of
    several devices, a buffer that is not contiguous, or a ``layout`` that is not a
    :class:`~hicache.host_layout.HostLayout`.
    """

    __slots__ = (
        "_mirrors",
        "allocator",
        "device",
        "device_buffers",
        "engine",
        "host_buffers",
        "layout",
        "page_size",
        "pinned",
        "size",
    )

    def __init__(
        self,
        device_buffers: SlotBuffers,
        size: int,
        page_size: int = 1,
        pin_memory: bool | None = None,
        engine: TransferEngine | None = None,
        layout: HostLayout | None = None,
    ) -> None:
        if not device_buffers:
            raise ConfigError("a host pool needs at least one device buffer to mirror")
        device = device_buffers[0][0].device
        if any(t.device != device for t, _ in device_buffers):
            raise ConfigError("a host pool mirrors buffers of one device")
        if layout is not None and not isinstance(layout, HostLayout):
            raise ConfigError(f"layout must be a HostLayout, got {layout!r}")
        self.size = size
        self.page_size = page_size
        self.device = device
        self.layout = HostLayout.for_device(device) if layout is None else layout
        self.allocator = TokenSlotAllocator(size, page_size, "cpu")
        self.pinned = device.type == "cuda" if pin_memory is None else pin_memory
        self.engine = engine_for(device) if engine is None else engine
        self.device_buffers = list(device_buffers)
        self.host_buffers: list[tuple[torch.Tensor, int]] = []
        self._mirrors: list[_Mirror] = []
        for tensor, dim in self.device_buffers:
            if not tensor.is_contiguous():
                raise ConfigError("a host pool mirrors contiguous device buffers")
            shape = list(tensor.shape)
            if dim == 0 or self.layout is HostLayout.LAYER_FIRST:
                host_shape = [*shape[:dim], size, *shape[dim + 1 :]]
                host_dim = dim
            else:
                host_shape = [shape[0], size, *shape[1:dim], *shape[dim + 1 :]]
                host_dim = 1
            host = _host_buffer(host_shape, tensor.dtype, self.pinned)
            self.host_buffers.append((host, host_dim))
            self._mirrors.append(_Mirror(tensor, dim, host, page_size, self.layout))

    @property
    def bytes_per_slot(self) -> int:
        """Bytes one slot occupies across all buffers."""
        total = 0
        for tensor, dim in self.device_buffers:
            total += tensor.numel() // tensor.shape[dim] * tensor.element_size()
        return total

    def page_views(self) -> list[torch.Tensor]:
        """Each host buffer as bytes, page by page in ``PAGE_FIRST`` order whatever the
        layout: ``[split, host pages, page_size, mid, inner bytes]`` views (strided for
        ``LAYER_FIRST``) of the live buffers -- writing through them writes the pool."""
        return [m.views for m in self._mirrors]

    def backup(self, device_indices: torch.Tensor, host_indices: torch.Tensor) -> Completion:
        """Copy device slots ``device_indices`` into host slots ``host_indices``; returns
        the completion (the host slots hold the bytes once it is done)."""
        host_units = self._host_units(device_indices, host_indices)
        if host_units is None:
            return DONE
        if self.device.type == "cpu":
            return self.engine.submit(
                Lane.WRITE, lambda: self._gather_local(device_indices, host_units)
            )
        return self.engine.submit(
            Lane.WRITE, lambda: self._backup_staged(device_indices, host_units)
        )

    def load(self, host_indices: torch.Tensor, device_indices: torch.Tensor) -> Completion:
        """Copy host slots ``host_indices`` back into device slots ``device_indices``;
        returns the completion (the host slots must stay unchanged until it is done)."""
        host_units = self._host_units(device_indices, host_indices)
        if host_units is None:
            return DONE
        if self.device.type == "cpu":
            return self.engine.submit(
                Lane.LOAD, lambda: self._scatter_local(device_indices, host_units)
            )
        return self.engine.submit(Lane.LOAD, lambda: self._load_staged(device_indices, host_units))

    def load_buffers(
        self,
        host_indices: torch.Tensor,
        device_indices: torch.Tensor,
        buffers: Sequence[int] | None = None,
    ) -> None:
        """Copy host slots ``host_indices`` of the device buffers numbered ``buffers``
        (positions in ``device_buffers``; ``None``: all) back into device slots
        ``device_indices``, on the calling thread, and return once they have landed (pools
        on the CPU).  For a caller that runs a load in parts on its own thread -- one
        model layer's buffers at a time -- and signals each part (SGLang's layer-wise
        load-back); :meth:`load` is the whole transfer on the pool's engine."""
        if self.device.type != "cpu":
            raise ConfigError(
                f"load_buffers copies on the calling thread (CPU pools), not on {self.device}"
            )
        hu = self._host_units(device_indices, host_indices)
        if hu is not None:
            self._scatter_local(device_indices, hu, buffers)

    # ------------------------------------------------------------------ internals
    def _host_units(
        self, device_indices: torch.Tensor, host_indices: torch.Tensor
    ) -> np.ndarray | None:
        """The host page numbers of a transfer (numpy), or None when it moves nothing."""
        n = host_indices.shape[0]
        if device_indices.shape[0] != n:
            raise InvalidIndicesError(f"copy of {device_indices.shape[0]} slots into {n} slots")
        if host_indices.device.type != "cpu" or host_indices.dtype != torch.int64:
            raise InvalidIndicesError(
                f"host indices must be CPU int64, got {host_indices.dtype} on {host_indices.device}"
            )
        if n == 0:
            return None
        return _page_numbers(host_indices.numpy(), self.page_size)

    def _device_units(self, device_indices: torch.Tensor) -> torch.Tensor:
        """Device page numbers, on the pool's device (inside the work: on its stream)."""
        idx = device_indices.to(self.device, non_blocking=True)
        ps = self.page_size
        return idx if ps == 1 else torch.div(idx[::ps], ps, rounding_mode="floor")

    def _slots(self, units: np.ndarray) -> np.ndarray:
        """The slots (numpy) of whole pages ``units``, page by page."""
        ps = self.page_size
        if ps == 1:
            return units
        return (units[:, None] * ps + np.arange(ps, dtype=np.int64)).reshape(-1)

    def _gather_local(self, device_indices: torch.Tensor, hu: np.ndarray) -> None:
        """Backup, pools on the CPU (:mod:`hicache._cpu_copy`)."""
        du = _page_numbers(device_indices.numpy(), self.page_size)
        for m in self._mirrors:
            if m.rows is not None:  # a transposition: row copies
                backup_rows(m.rows, self._slots(du), self._slots(hu), 4 * self.page_size)
            else:
                copy_pages(m.device, du, m.host, hu)

    def _scatter_local(
        self, device_indices: torch.Tensor, hu: np.ndarray, buffers: Sequence[int] | None = None
    ) -> None:
        """Load, pools on the CPU (:mod:`hicache._cpu_copy`): every buffer, or those
        numbered ``buffers``."""
        du = _page_numbers(device_indices.numpy(), self.page_size)
        mirrors = self._mirrors if buffers is None else [self._mirrors[i] for i in buffers]
        for m in mirrors:
            if m.rows is not None:
                load_rows(m.rows, self._slots(hu), self._slots(du), 4 * self.page_size)
            else:
                copy_pages(m.host, hu, m.device, du)

    def _chunks(self, hu: np.ndarray) -> list[tuple[int, int, list[tuple[int, int, int]]]]:
        """The runs of ``hu`` grouped in chunks that fit the staging buffer:
        ``(first position, units, runs)`` each, runs split where a chunk ends."""
        unit_bytes = sum(m.unit_bytes for m in self._mirrors)
        cap = max(1, STAGING_BYTES // unit_bytes)
        chunks: list[tuple[int, int, list[tuple[int, int, int]]]] = []
        cur: list[tuple[int, int, int]] = []
        first = used = 0
        for pos, length, start in runs(hu):
            while length:
                take = min(length, cap - used)
                cur.append((pos, take, start))
                used += take
                pos += take
                start += take
                length -= take
                if used == cap:
                    chunks.append((first, used, cur))
                    cur, first, used = [], pos, 0
        if cur:
            chunks.append((first, used, cur))
        return chunks

    def _backup_staged(self, device_indices: torch.Tensor, hu: np.ndarray) -> None:
        """Backup, pools on a device: gather pages on the device, one copy per host run."""
        du = self._device_units(device_indices)
        for first, count, parts in self._chunks(hu):
            for m in self._mirrors:
                staging = torch.empty(
                    (m.outer, count, m.host.shape[2]), dtype=m.host.dtype, device=self.device
                )
                for s in range(m.outer):
                    out = staging[s].view(count, *m.page_shape)
                    torch.index_select(m.device[s], 0, du[first : first + count], out=out)
                    for pos, length, start in parts:
                        a = pos - first
                        m.host[s, start : start + length].copy_(
                            staging[s, a : a + length], non_blocking=True
                        )

    def _load_staged(self, device_indices: torch.Tensor, hu: np.ndarray) -> None:
        """Load, pools on a device: one copy per host run into staging, scatter on device."""
        du = self._device_units(device_indices)
        for first, count, parts in self._chunks(hu):
            for m in self._mirrors:
                staging = torch.empty(
                    (m.outer, count, m.host.shape[2]), dtype=m.host.dtype, device=self.device
                )
                for s in range(m.outer):
                    for pos, length, start in parts:
                        a = pos - first
                        staging[s, a : a + length].copy_(
                            m.host[s, start : start + length], non_blocking=True
                        )
                    part = staging[s].view(count, *m.page_shape)
                    m.device[s].index_copy_(0, du[first : first + count], part)


def _page_numbers(slots: np.ndarray, page_size: int) -> np.ndarray:
    """The page numbers of page-aligned slot indices (numpy)."""
    return slots if page_size == 1 else slots[::page_size] // page_size


def _host_buffer(shape: list[int], dtype: torch.dtype, pinned: bool) -> torch.Tensor:
    """An uninitialized host tensor of exactly ``shape``; ``pinned``: page-locked in place
    with ``cudaHostRegister`` (``torch.empty(pin_memory=True)`` would round the allocation
    up to a power of two), unregistered when the tensor is collected."""
    host = torch.empty(shape, dtype=dtype)
    if pinned and host.numel():
        cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
        ptr = host.data_ptr()
        err = cudart.cudaHostRegister(ptr, host.numel() * host.element_size(), 0)
        if int(err) != 0:
            raise ConfigError(f"cudaHostRegister of the host pool failed: {err}")
        weakref.finalize(host, cudart.cudaHostUnregister, ptr)
    return host
