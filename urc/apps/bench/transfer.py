"""Bandwidth of page-gathered device<->host copies against a plain contiguous copy; prints JSON.

Usage: ``python -m urc.apps.bench.transfer [--tokens N] [--page-sizes 1 16 64]``.

Both directions copy ``--tokens`` scattered slots (random whole pages) of a KV pool; a second
load-back lands in freshly allocated slots (the usual case).  The baseline copies the same
number of bytes with one contiguous ``tensor.copy_``.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from hicache.host_pool import HostPool
from urc.pools.allocator import TokenSlotAllocator
from urc.pools.kv_pool import KVPool, KVShape

__all__ = ["main", "measure"]


def _best(fn: object, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()  # type: ignore[operator]
        best = min(best, time.perf_counter() - t0)
    return best


def measure(tokens: int, page_size: int, shape: KVShape, repeat: int = 5) -> dict[str, float]:
    """GB/s of backup, load-back and a contiguous copy of the same bytes."""
    pool_tokens = 4 * tokens
    device = KVPool(pool_tokens, shape)
    device.kv.normal_()
    host = HostPool(device.slot_buffers(), 2 * tokens, page_size)
    pages = torch.randperm(pool_tokens // page_size)[: tokens // page_size]
    dev_idx = (pages.unsqueeze(1) * page_size + torch.arange(page_size)).reshape(-1)
    host_idx = host.allocator.alloc(tokens)
    assert host_idx is not None
    nbytes = tokens * host.bytes_per_slot
    src = torch.empty(nbytes, dtype=torch.uint8)
    dst = torch.empty(nbytes, dtype=torch.uint8)
    src.fill_(1)
    t_backup = _best(lambda: host.backup(dev_idx, host_idx), repeat)
    t_load = _best(lambda: host.load(host_idx, dev_idx), repeat)
    t_plain = _best(lambda: dst.copy_(src), repeat)
    # Load-back normally lands in freshly allocated device slots (runs of whole pages), not
    # back into the scattered pages it came from.
    fresh = TokenSlotAllocator(pool_tokens, page_size).alloc(tokens)
    assert fresh is not None
    t_fresh = _best(lambda: host.load(host_idx, fresh), repeat)
    gbs = nbytes / 1e9
    return {
        "page_size": page_size,
        "tokens": tokens,
        "bytes": nbytes,
        "backup_gb_s": round(gbs / t_backup, 2),
        "load_back_gb_s": round(gbs / t_load, 2),
        "contiguous_copy_gb_s": round(gbs / t_plain, 2),
        "backup_ratio": round(t_plain / t_backup, 2),
        "load_back_ratio": round(t_plain / t_load, 2),
        "load_back_fresh_gb_s": round(gbs / t_fresh, 2),
        "load_back_fresh_ratio": round(t_plain / t_fresh, 2),
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m urc.apps.bench.transfer")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--page-sizes", nargs="+", type=int, default=[1, 16, 64])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    args = ap.parse_args(argv)
    shape = KVShape(args.layers, args.heads, args.head_dim, torch.float16)
    results = [measure(args.tokens, ps, shape) for ps in args.page_sizes]
    print(json.dumps({"bytes_per_token": shape.bytes_per_token, "results": results}, indent=2))


if __name__ == "__main__":
    main()
