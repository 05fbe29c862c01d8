"""Host (L2) mirror of a device pool, with page-gathered copies in both directions.

A device pool is described by its buffers: ``(tensor, slot_dim)`` pairs whose dimension
``slot_dim`` indexes slots (KV: ``kv[2, layers, slots, heads, dim]`` has slot dim 2; Mamba:
``conv[slots, ...]`` and ``temporal[slots, ...]`` have slot dim 0).  The host mirror holds the
same buffers with ``size`` host slots, its own allocator, and copies slots between the two.

Copies gather whole pages: with ``page_size > 1`` a slot index span is a run of whole pages, so
the slot dimension is viewed as ``(pages, page_size)`` and one ``index_select`` per buffer moves
``page_size`` contiguous slots per index (fewer, larger memory moves than per-token gathers).
Host memory is pinned when CUDA is available, so device copies can be asynchronous.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from urc.errors import ConfigError, InvalidIndicesError
from urc.pools.allocator import TokenSlotAllocator

__all__ = ["HostPool", "SlotBuffers"]

SlotBuffers = Sequence[tuple[torch.Tensor, int]]


class HostPool:
    """Host copies of the slots of one device pool.

    ``allocator`` hands out host slots (in pages of ``page_size``).  :meth:`backup` copies
    device slots into host slots, :meth:`load` the other way; both move real bytes and leave
    the source untouched.  Index tensors must be int64 and of equal length.
    """

    __slots__ = ("allocator", "device_buffers", "host_buffers", "page_size", "pinned", "size")

    def __init__(
        self,
        device_buffers: SlotBuffers,
        size: int,
        page_size: int = 1,
        pin_memory: bool | None = None,
    ) -> None:
        if not device_buffers:
            raise ConfigError("a host pool needs at least one device buffer to mirror")
        self.size = size
        self.page_size = page_size
        self.allocator = TokenSlotAllocator(size, page_size, "cpu")
        self.pinned = torch.cuda.is_available() if pin_memory is None else pin_memory
        self.device_buffers = list(device_buffers)
        self.host_buffers: list[tuple[torch.Tensor, int]] = []
        for tensor, dim in self.device_buffers:
            shape = list(tensor.shape)
            shape[dim] = size
            host = torch.empty(shape, dtype=tensor.dtype, device="cpu", pin_memory=self.pinned)
            self.host_buffers.append((host, dim))

    @property
    def bytes_per_slot(self) -> int:
        """Bytes one slot occupies across all buffers."""
        total = 0
        for tensor, dim in self.device_buffers:
            total += tensor.numel() // tensor.shape[dim] * tensor.element_size()
        return total

    def _units(self, indices: torch.Tensor) -> torch.Tensor:
        ps = self.page_size
        return indices if ps == 1 else torch.div(indices[::ps], ps, rounding_mode="floor")

    def _copy(
        self,
        src: list[tuple[torch.Tensor, int]],
        src_idx: torch.Tensor,
        dst: list[tuple[torch.Tensor, int]],
        dst_idx: torch.Tensor,
    ) -> None:
        if src_idx.shape[0] != dst_idx.shape[0]:
            raise InvalidIndicesError(
                f"copy of {src_idx.shape[0]} slots into {dst_idx.shape[0]} slots"
            )
        if src_idx.shape[0] == 0:
            return
        s_units = self._units(src_idx)
        d_units = self._units(dst_idx)
        d_runs = _runs(d_units)
        s_runs = _runs(s_units) if len(d_runs) * 4 > d_units.shape[0] else d_runs
        for (s_buf, dim), (d_buf, _) in zip(src, dst, strict=True):
            s_view = self._as_units(s_buf, dim)
            d_view = self._as_units(d_buf, dim)
            su = s_units.to(s_buf.device)
            du = d_units.to(d_buf.device)
            if s_runs is d_runs:
                # Destination in a few contiguous runs (spans are usually allocated together):
                # gather straight into each run, one pass over the bytes.
                for o in range(s_view.shape[0]):
                    rows = s_view[o]
                    for pos, length, start in d_runs:
                        out = d_view[o, start : start + length]
                        if rows.device == out.device:
                            torch.index_select(rows, 0, su[pos : pos + length], out=out)
                        else:
                            out.copy_(
                                rows.index_select(0, su[pos : pos + length]), non_blocking=True
                            )
            elif len(s_runs) * 4 <= s_units.shape[0]:
                # Source in a few runs: scatter each contiguous source run, no staging copy.
                for o in range(s_view.shape[0]):
                    rows = d_view[o]
                    for pos, length, start in s_runs:
                        part = s_view[o, start : start + length].to(d_buf.device, non_blocking=True)
                        rows.index_copy_(0, du[pos : pos + length], part)
            else:
                data = s_view.index_select(1, su).to(d_buf.device, non_blocking=self.pinned)
                d_view.index_copy_(1, du, data)

    def _as_units(self, buf: torch.Tensor, dim: int) -> torch.Tensor:
        """``buf`` viewed as ``[outer, units, unit_elems]`` (a unit = one page of slots)."""
        outer = 1
        for d in buf.shape[:dim]:
            outer *= d
        units = buf.shape[dim] // self.page_size
        return buf.view(outer, units, -1)

    def backup(self, device_indices: torch.Tensor, host_indices: torch.Tensor) -> None:
        """Copy device slots ``device_indices`` into host slots ``host_indices``."""
        self._copy(self.device_buffers, device_indices, self.host_buffers, host_indices)

    def load(self, host_indices: torch.Tensor, device_indices: torch.Tensor) -> None:
        """Copy host slots ``host_indices`` back into device slots ``device_indices``."""
        self._copy(self.host_buffers, host_indices, self.device_buffers, device_indices)


def _runs(units: torch.Tensor) -> list[tuple[int, int, int]]:
    """Maximal runs of consecutive values: ``(position, length, first value)`` each."""
    n = units.shape[0]
    breaks = torch.nonzero(units[1:] - units[:-1] != 1).flatten().tolist()
    starts = [0, *(b + 1 for b in breaks)]
    ends = [*(b + 1 for b in breaks), n]
    first = units[starts].tolist() if len(starts) > 1 else [int(units[0])]
    return [(a, b - a, f) for a, b, f in zip(starts, ends, first, strict=True)]
