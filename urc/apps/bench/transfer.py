"""Bandwidth of HiCache's host-tier copies against a plain copy of the same bytes; prints JSON.

Usage: ``python -m urc.apps.bench.transfer [--device auto|cpu|cuda] [--tokens N]
[--page-sizes 1 16 64] [--layouts auto layer_first page_first] [--layers 32 --heads 8
--head-dim 128 --dtype bfloat16]``.

The KV rows are Llama-3-8B's by default (32 layers, 8 KV heads, head dim 128, bf16: 128 KiB
per token).  ``--tokens`` slots in random whole pages of a device pool twice that size are
copied through a :class:`~hicache.host_pool.HostPool` in each of ``--layouts`` (``auto``: the
device's default :class:`~hicache.host_layout.HostLayout`):

- ``backup``: scattered device pages to one run of host pages (a fresh host allocation);
- ``backup_scattered``: scattered device pages to host pages in random order;
- ``load_back``: one run of host pages to a fresh device allocation (the usual load-back);
- ``load_back_scattered``: host pages in random order to scattered device pages.

Each is timed from submission until its completion is done, best of ``--repeat``.  On CUDA
the host pool is pinned, the copies run on the transfer engine's streams, and the time is
read from CUDA events (the start recorded on the submitting stream, the end after that
stream waited on the completion; synchronized before reading).  The baselines are a plain
``copy_`` of the same number of bytes between one contiguous device tensor and one pinned
host tensor, each way (timed the same way); on the CPU, a contiguous ``copy_`` in memory.
``*_fraction`` is the copy's bandwidth over its direction's baseline.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from typing import Any

import torch

from hicache.host_layout import HostLayout
from hicache.host_pool import HostPool
from hicache.transfer_engine import Completion
from urc.pools.allocator import TokenSlotAllocator
from urc.pools.kv_pool import KVPool, KVShape

__all__ = ["LLAMA3_8B", "main", "measure", "page_slots", "significant"]

#: The default KV rows: Llama-3-8B (32 layers, 8 KV heads, head dim 128, bf16).
LLAMA3_8B = KVShape(32, 8, 128, torch.bfloat16)


def _timer(device: torch.device) -> Callable[[Callable[[], Completion | None]], float]:
    """Seconds one transfer takes, from submission until its completion is done."""
    if device.type != "cuda":

        def wall(fn: Callable[[], Completion | None]) -> float:
            t0 = time.perf_counter()
            done = fn()
            if done is not None:
                done.wait()
            return time.perf_counter() - t0

        return wall

    def events(fn: Callable[[], Completion | None]) -> float:
        torch.cuda.synchronize(device)
        start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        start.record()
        done = fn()
        if done is not None:
            done.wait_stream()
        end.record()
        torch.cuda.synchronize(device)
        return float(start.elapsed_time(end)) / 1e3

    return events


def _best(timer: Callable[[Callable[[], Any]], float], fn: Callable[[], Any], repeat: int) -> float:
    timer(fn)  # warm-up: allocator, streams, the host pool's first touch
    return min(timer(fn) for _ in range(repeat))


def page_slots(pages: torch.Tensor, page_size: int) -> torch.Tensor:
    """The slots of whole pages ``pages``, page by page."""
    return (pages.unsqueeze(1) * page_size + torch.arange(page_size)).reshape(-1)


def measure(
    tokens: int,
    page_size: int,
    shape: KVShape = LLAMA3_8B,
    device: str | torch.device = "cpu",
    repeat: int = 5,
    seed: int = 0,
    layout: HostLayout | None = None,
) -> dict[str, float]:
    """GB/s of each copy (see the module docstring), of the baselines, and the fractions;
    ``layout``: the host pool's (default: the device's)."""
    dev = torch.device(device)
    gen = torch.Generator().manual_seed(seed)
    pool_tokens = 2 * tokens
    kv = KVPool(pool_tokens, shape, dev)
    kv.kv.normal_()
    host = HostPool(kv.slot_buffers(), tokens, page_size, layout=layout)
    n_pages = tokens // page_size
    picked = torch.randperm(pool_tokens // page_size, generator=gen)[:n_pages]
    dev_idx = page_slots(picked, page_size)
    host_run = host.allocator.alloc(tokens)
    assert host_run is not None
    host_scattered = page_slots(torch.randperm(n_pages, generator=gen), page_size)
    fresh = TokenSlotAllocator(pool_tokens, page_size).alloc(tokens)
    assert fresh is not None
    nbytes = tokens * host.bytes_per_slot
    timer = _timer(dev)
    times = {
        "backup": _best(timer, lambda: host.backup(dev_idx, host_run), repeat),
        "backup_scattered": _best(timer, lambda: host.backup(dev_idx, host_scattered), repeat),
        "load_back": _best(timer, lambda: host.load(host_run, fresh), repeat),
        "load_back_scattered": _best(timer, lambda: host.load(host_scattered, dev_idx), repeat),
    }
    pinned = dev.type == "cuda"
    src_dev = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    plain = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
    src_dev.fill_(1)
    plain.fill_(2)

    def d2h() -> None:
        plain.copy_(src_dev, non_blocking=pinned)

    def h2d() -> None:
        src_dev.copy_(plain, non_blocking=pinned)

    base_d2h = _best(timer, d2h, repeat)
    base_h2d = _best(timer, h2d, repeat)
    gb = nbytes / 1e9
    out: dict[str, Any] = {
        "device": str(dev),
        "page_size": page_size,
        "layout": host.layout.value,
        "tokens": tokens,
        "bytes": nbytes,
        "pinned": host.pinned,
        "plain_d2h_gb_s": significant(gb / base_d2h),
        "plain_h2d_gb_s": significant(gb / base_h2d),
    }
    for name, t in times.items():
        base = base_d2h if name.startswith("backup") else base_h2d
        out[f"{name}_gb_s"] = significant(gb / t)
        out[f"{name}_fraction"] = significant(base / t)
    return out


def significant(x: float, digits: int = 3) -> float:
    """``x`` to ``digits`` significant digits: a small figure (a few KiB copied on a loaded
    machine: 0.004 GB/s) keeps its digits where rounding to two decimals printed 0.0."""
    return float(f"{x:.{digits}g}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m urc.apps.bench.transfer")
    ap.add_argument("--device", default="auto", help="auto (cuda when available), cpu, cuda")
    ap.add_argument("--tokens", type=int, default=None, help="default 8192 on CUDA, 1024 on CPU")
    ap.add_argument("--page-sizes", nargs="+", type=int, default=[1, 16, 64])
    ap.add_argument(
        "--layouts",
        nargs="+",
        default=["auto"],
        choices=["auto", *(v.value for v in HostLayout)],
        help="host layouts to measure (auto: the device's default)",
    )
    ap.add_argument("--layers", type=int, default=LLAMA3_8B.num_layers)
    ap.add_argument("--heads", type=int, default=LLAMA3_8B.num_heads)
    ap.add_argument("--head-dim", type=int, default=LLAMA3_8B.head_dim)
    ap.add_argument("--dtype", default="bfloat16", help="a torch dtype name")
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args(argv)
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    tokens = args.tokens or (8192 if device.startswith("cuda") else 1024)
    dtype = getattr(torch, args.dtype)
    if not isinstance(dtype, torch.dtype):
        raise SystemExit(f"not a torch dtype: {args.dtype}")
    shape = KVShape(args.layers, args.heads, args.head_dim, dtype)
    layouts = [None if v == "auto" else HostLayout(v) for v in args.layouts]
    results = [
        measure(tokens, ps, shape, device, args.repeat, layout=layout)
        for layout in layouts
        for ps in args.page_sizes
    ]
    print(json.dumps({"bytes_per_token": shape.bytes_per_token, "results": results}, indent=2))


if __name__ == "__main__":
    main()
