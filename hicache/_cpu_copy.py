"""Copies between a CPU pool and its host mirror: page blocks, or rows for ``page_first``.

:func:`copy_pages` moves whole pages between two ``[outer, units, page elements]`` views whose
pages are contiguous on both sides (a ``layer_first`` mirror, or buffers with no layer
dimension): one ``index_select`` straight into each run of destination pages, else one
``index_copy_`` from each run of source pages, else one strided copy per page.

The rest of this module transposes, for a ``page_first`` mirror of a buffer with layers.

A buffer ``[split, mid, slots, inner]`` (KV: ``mid`` = layers, ``inner`` = heads x dim) and
its host copy ``[split, host_slots, mid, inner]`` are both viewed as rows of ``inner``
elements: device row ``(s, m, slot)`` is ``(s * mid + m) * slots + slot``, host row ``(s,
slot, m)`` is ``(s * host_slots + slot) * mid + m``.  A transfer is then row gathers and
scatters with computed row numbers (numpy): one ``index_select`` straight into each run of
destination rows where the destination runs (a host run holds a run's rows in the host's
order; a device run, one layer's rows at a time), else into each source run with
``index_copy_``, else through a temporary.  Every row is contiguous on both sides, so each
move is a memcpy of ``inner`` elements, whatever the page size.

Where both sides are scattered and a slot is large (:data:`SLOT_COPY_BYTES`), each slot is one
strided copy of ``[split, mid, inner]`` instead (a row gather of scattered rows runs at about
a fifth of that).

Where the transfer's device and host slots run together in long spans (a node's pages are
usually allocated together on both sides), each span is instead one strided ``copy_`` of
``[split, mid, length, inner]`` into ``[split, length, mid, inner]`` (torch's fastest copy
of this transposition: row gathers of rows this small reach about half its bandwidth).
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = [
    "SLOT_COPY_BYTES",
    "SPAN_SLOTS",
    "TILE_SLOTS",
    "RowMirror",
    "backup_rows",
    "copy_pages",
    "load_rows",
    "runs",
]

#: Spans that run on both sides are copied span by span when they average this many slots.
SPAN_SLOTS = 16
#: Slots scattered on both sides are copied one by one (one strided copy each) when a slot
#: holds at least this many bytes; smaller ones go through row gathers, which cost less
#: than a call per slot.
SLOT_COPY_BYTES = 16 << 10
#: A span is copied in tiles of at most this many slots (the source of a tile stays in
#: cache while its rows are written: about 1.35x the bandwidth of one copy of a long span).
TILE_SLOTS = 128


class RowMirror:
    """Row views of one device buffer and its host copy (see the module docstring)."""

    __slots__ = (
        "dev",
        "dev4",
        "host",
        "host4",
        "host_slots",
        "mid",
        "slot_bytes",
        "slots",
        "split",
    )

    def __init__(
        self, dev: torch.Tensor, host: torch.Tensor, split: int, mid: int, inner: int
    ) -> None:
        self.split = split
        self.mid = mid
        self.dev = dev.view(-1, inner)
        self.host = host.view(-1, inner)
        self.dev4 = dev.view(split, mid, -1, inner)  # [split, mid, slots, inner]
        self.host4 = host.view(split, -1, mid, inner)  # [split, host slots, mid, inner]
        self.slots = self.dev.shape[0] // (split * mid)
        self.host_slots = self.host.shape[0] // (split * mid)
        self.slot_bytes = split * mid * inner * dev.element_size()


def runs(values: np.ndarray) -> list[tuple[int, int, int]]:
    """Maximal runs of consecutive values (numpy int64): ``(position, length, first value)``
    each."""
    n = values.shape[0]
    cuts = (np.flatnonzero(np.diff(values) != 1) + 1).tolist()
    starts = [0, *cuts]
    ends = [*cuts, n]
    first = values[starts].tolist()
    return [(a, b - a, f) for a, b, f in zip(starts, ends, first, strict=True)]


def _few(runs: list[tuple[int, int, int]], n: int, per: int) -> bool:
    """Few enough runs to copy run by run (at least ``per`` slots each on average)."""
    return len(runs) * per <= n


def copy_pages(src: torch.Tensor, su: np.ndarray, dst: torch.Tensor, du: np.ndarray) -> None:
    """Copy pages ``su`` of ``src`` into pages ``du`` of ``dst`` (``[outer, units, elements]``
    views, pages contiguous; equal-length numpy int64 page numbers)."""
    n = du.shape[0]
    d_runs = runs(du)
    if _few(d_runs, n, 4):  # the destination runs: gather straight into each run
        s_idx = torch.from_numpy(su)
        for o in range(src.shape[0]):
            for pos, length, start in d_runs:
                out = dst[o, start : start + length]
                torch.index_select(src[o], 0, s_idx[pos : pos + length], out=out)
        return
    s_runs = runs(su)
    d_idx = torch.from_numpy(du)
    if _few(s_runs, n, 4):  # the source runs: scatter each run
        for o in range(src.shape[0]):
            for pos, length, start in s_runs:
                dst[o].index_copy_(0, d_idx[pos : pos + length], src[o, start : start + length])
        return
    # Both sides scattered: one strided copy per page (``index_copy_`` along dim 1 runs at a
    # seventh of the speed).
    for a, b in zip(su.tolist(), du.tolist(), strict=True):
        dst[:, b].copy_(src[:, a])


def _dev_rows(m: RowMirror, s: int, ds: np.ndarray) -> np.ndarray:
    """Device rows of slots ``ds`` in host order (slot-major, then ``mid``)."""
    lay = np.arange(m.mid, dtype=np.int64)
    rows: np.ndarray = (((s * m.mid + lay) * m.slots)[None, :] + ds[:, None]).reshape(-1)
    return rows


def _host_rows(m: RowMirror, s: int, hs: np.ndarray) -> np.ndarray:
    lay = np.arange(m.mid, dtype=np.int64)
    rows: np.ndarray = ((s * m.host_slots + hs)[:, None] * m.mid + lay[None, :]).reshape(-1)
    return rows


def _spans(ds: np.ndarray, hs: np.ndarray) -> list[tuple[int, int, int]] | None:
    """``(device slot, host slot, length)`` of the spans where both sides run, in tiles of
    at most :data:`TILE_SLOTS`, or None when they are too short on average
    (:data:`SPAN_SLOTS`)."""
    n = ds.shape[0]
    cuts = np.flatnonzero((np.diff(ds) != 1) | (np.diff(hs) != 1)) + 1
    if (cuts.shape[0] + 1) * SPAN_SLOTS > n:
        return None
    starts = [0, *cuts.tolist()]
    ends = [*cuts.tolist(), n]
    return [
        (int(ds[a]) + t, int(hs[a]) + t, min(TILE_SLOTS, b - a - t))
        for a, b in zip(starts, ends, strict=True)
        for t in range(0, b - a, TILE_SLOTS)
    ]


def backup_rows(m: RowMirror, ds: np.ndarray, hs: np.ndarray, per: int) -> None:
    """Copy device slots ``ds`` into host slots ``hs`` (equal lengths, numpy int64)."""
    spans = _spans(ds, hs)
    if spans is not None:
        for d0, h0, length in spans:
            m.host4[:, h0 : h0 + length].copy_(m.dev4[:, :, d0 : d0 + length].transpose(1, 2))
        return
    n, mid = ds.shape[0], m.mid
    host_runs = runs(hs)
    dev_runs = None if _few(host_runs, n, per) else runs(ds)
    if dev_runs is not None and not _few(dev_runs, n, per) and m.slot_bytes >= SLOT_COPY_BYTES:
        for d, h in zip(ds.tolist(), hs.tolist(), strict=True):
            m.host4[:, h].copy_(m.dev4[:, :, d])
        return
    for s in range(m.split):
        if dev_runs is None:  # the host side runs: gather straight into each run
            rows = torch.from_numpy(_dev_rows(m, s, ds))
            for pos, length, start in host_runs:
                h0 = (s * m.host_slots + start) * mid
                out = m.host[h0 : h0 + length * mid]
                torch.index_select(m.dev, 0, rows[pos * mid : (pos + length) * mid], out=out)
        elif _few(dev_runs, n, per):  # the device side runs: one layer of a run at a time
            for k in range(mid):
                h_rows = torch.from_numpy((s * m.host_slots + hs) * mid + k)
                for pos, length, start in dev_runs:
                    d0 = (s * mid + k) * m.slots + start
                    m.host.index_copy_(0, h_rows[pos : pos + length], m.dev[d0 : d0 + length])
        else:
            rows = torch.from_numpy(_dev_rows(m, s, ds))
            m.host.index_copy_(0, torch.from_numpy(_host_rows(m, s, hs)), m.dev[rows])


def load_rows(m: RowMirror, hs: np.ndarray, ds: np.ndarray, per: int) -> None:
    """Copy host slots ``hs`` into device slots ``ds`` (equal lengths, numpy int64)."""
    spans = _spans(ds, hs)
    if spans is not None:
        for d0, h0, length in spans:
            m.dev4[:, :, d0 : d0 + length].copy_(m.host4[:, h0 : h0 + length].transpose(1, 2))
        return
    n, mid = ds.shape[0], m.mid
    dev_runs = runs(ds)
    host_runs = None if _few(dev_runs, n, per) else runs(hs)
    if host_runs is not None and not _few(host_runs, n, per) and m.slot_bytes >= SLOT_COPY_BYTES:
        for d, h in zip(ds.tolist(), hs.tolist(), strict=True):
            m.dev4[:, :, d].copy_(m.host4[:, h])
        return
    for s in range(m.split):
        if host_runs is None:  # the device side runs: gather one layer of a run at a time
            for k in range(mid):
                h_rows = torch.from_numpy((s * m.host_slots + hs) * mid + k)
                for pos, length, start in dev_runs:
                    d0 = (s * mid + k) * m.slots + start
                    out = m.dev[d0 : d0 + length]
                    torch.index_select(m.host, 0, h_rows[pos : pos + length], out=out)
        elif _few(host_runs, n, per):  # the host side runs: scatter each run
            rows = torch.from_numpy(_dev_rows(m, s, ds))
            for pos, length, start in host_runs:
                h0 = (s * m.host_slots + start) * mid
                part = m.host[h0 : h0 + length * mid]
                m.dev.index_copy_(0, rows[pos * mid : (pos + length) * mid], part)
        else:
            rows = torch.from_numpy(_host_rows(m, s, hs))
            m.dev.index_copy_(0, torch.from_numpy(_dev_rows(m, s, ds)), m.host[rows])
