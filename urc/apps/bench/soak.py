"""Soak of the service with a write-through host tier and a local-file L3 store: many clients
for minutes, sampling the process's memory.

Usage::

    nice python -m urc.apps.bench.soak                      # 64 clients, 6.5 min, 1.5 warm-up
    nice python -m urc.apps.bench.soak --clients 16 --duration-s 60 --sample-s 5

Workload: ``--clients`` coroutines, each in a loop until the deadline: pick one of
``--conversations`` conversations (each opens with one of ``--system-prompts`` shared
prompts), extend it by a new turn of 2 to 16 pages, match it (a host hit is loaded back; a
miss sometimes fetches from L3), then as a server does: match with a lock, allocate the
uncached rest, insert, release (each insert is a hit, so write-through queues backups). A
conversation longer than ``--max-context`` tokens starts over. The device pool is small, so
the tree evicts all the time: host copies are demoted, host-only leaves evicted, pages
written to L3 (a store of ``--l3-capacity-mb``: it keeps an index entry per page it holds,
so an unbounded one grows by design).

Every ``--sample-s`` seconds it records the resident set size (``/proc/self/statm``), the
queue of nodes waiting for a host backup (``pending_backups``) and the tree's nodes, the
``TreeNode`` objects alive in the process (``gc``), the Python objects' memory blocks
(``sys.getallocatedblocks``: flat while RSS creeps means the allocator, not a leak), and
the operations done.  The summary
covers the samples after ``--warmup-s``: RSS first, last, min, max and its least-squares
slope in MB per minute (flat: near 0), and the largest ``pending_backups`` against the
tree's nodes.  Prints JSON.  CPU-heavy: run it with ``nice``.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import random
import resource
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio
import torch

import hicache
from hicache.config import HiCacheConfig, StorageConfig
from hicache.storage.file import FileStorage
from urc.cache import build_cache
from urc.config import CacheConfig
from urc.errors import OutOfMemoryError
from urc.host_protocol import WritePolicy
from urc.key import RadixKey
from urc.node import TreeNode
from urc.pools.kv_pool import KVShape
from urc.service import AsyncUnifiedRadixCache

__all__ = ["main", "run_soak"]

_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE_BYTES / 2**20


def _slope_per_min(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of (seconds, value) points, per minute."""
    n = len(points)
    if n < 2:
        return 0.0
    mt = sum(t for t, _ in points) / n
    mv = sum(v for _, v in points) / n
    var = sum((t - mt) ** 2 for t, _ in points)
    return 60.0 * sum((t - mt) * (v - mv) for t, v in points) / var if var else 0.0


async def run_soak(args: argparse.Namespace, l3_dir: Path) -> dict[str, Any]:
    """Run the soak (see the module docstring); returns samples and summary."""
    ps = args.page_size
    cache = build_cache(
        CacheConfig(
            page_size=ps,
            kv_size=args.device_tokens,
            max_num_reqs=args.clients + 8,
            max_context_len=args.max_context + 16 * ps,
            kv_shape=KVShape(2, 2, 8, torch.float16),
        )
    )
    store = await FileStorage.open(l3_dir, args.l3_capacity_mb << 20)
    hc = hicache.attach(
        cache,
        HiCacheConfig(write_policy=WritePolicy.WRITE_THROUGH, host_ratio=args.host_ratio),
        store,
        storage_config=StorageConfig(),
    )
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(50_000) for _ in range(32 * ps)] for _ in range(args.system_prompts)]
    convs = [list(prompts[i % len(prompts)]) for i in range(args.conversations)]
    ops = {"turns": 0, "load_backs": 0, "l3_fetches": 0, "oom": 0}
    samples: list[dict[str, Any]] = []
    t0 = time.monotonic()
    deadline = t0 + args.duration_s
    storage = hc.storage
    assert storage is not None

    async def client(cid: int, svc: AsyncUnifiedRadixCache) -> None:
        crng = random.Random(args.seed * 1000 + cid)
        while time.monotonic() < deadline:
            i = crng.randrange(len(convs))
            conv = convs[i]
            if len(conv) > args.max_context:
                conv = convs[i] = list(prompts[crng.randrange(len(prompts))])
            conv.extend(crng.randrange(50_000) for _ in range(crng.randint(2, 16) * ps))
            key = RadixKey(list(conv))
            m = await svc.match(key)
            if m.host_hit_length:
                await hc.controller.load_back(svc, key)
                ops["load_backs"] += 1
            elif m.prefix_len < len(key) // 2 and crng.random() < 0.1:
                await storage.fetch(svc, key)
                ops["l3_fetches"] += 1
            # As a server does: lock the cached prefix, allocate the rest, insert, release.
            m = await svc.match(key, lock=True)
            assert m.lease is not None
            try:
                try:
                    own = await svc.alloc(len(key) - m.prefix_len)
                except OutOfMemoryError:
                    ops["oom"] += 1
                    continue
                value = torch.cat([m.device_indices, own])
                await svc.insert(key, value, prev_prefix_len=m.prefix_len)
                ops["turns"] += 1
            finally:
                await svc.release(m.lease)

    async def sampler(svc: AsyncUnifiedRadixCache) -> None:
        while True:
            pending, nodes = await svc.call(lambda c: (len(c.pending_backups), c.num_nodes))
            alive = sum(1 for o in gc.get_objects() if type(o) is TreeNode)
            st = storage.stats
            samples.append(
                {
                    "t_s": round(time.monotonic() - t0, 1),
                    "rss_mb": round(_rss_mb(), 1),
                    "pending_backups": pending,
                    "tree_nodes": nodes,
                    "live_tree_nodes": alive,
                    "py_blocks": sys.getallocatedblocks(),
                    "turns": ops["turns"],
                    "l3_pages_written": st.pages_written,
                }
            )
            if args.verbose:
                print(json.dumps(samples[-1]), flush=True)
            await anyio.sleep(args.sample_s)

    async with store, AsyncUnifiedRadixCache(cache, workers=hc.workers) as svc:
        async with anyio.create_task_group() as tg:
            tg.start_soon(sampler, svc)
            async with anyio.create_task_group() as clients:
                for cid in range(args.clients):
                    clients.start_soon(client, cid, svc)
            tg.cancel_scope.cancel()
        final = await svc.stats()
    cache.sanity_check()  # after close: nothing is in flight any more
    after = [s for s in samples if s["t_s"] >= args.warmup_s]
    rss = [s["rss_mb"] for s in after]
    summary = {
        "samples_after_warmup": len(after),
        "rss_mb_first": rss[0] if rss else None,
        "rss_mb_last": rss[-1] if rss else None,
        "rss_mb_min": min(rss) if rss else None,
        "rss_mb_max": max(rss) if rss else None,
        "rss_slope_mb_per_min": round(_slope_per_min([(s["t_s"], s["rss_mb"]) for s in after]), 2),
        "pending_backups_max": max((s["pending_backups"] for s in samples), default=0),
        "tree_nodes_max": max((s["tree_nodes"] for s in samples), default=0),
        "live_tree_nodes_max": max((s["live_tree_nodes"] for s in samples), default=0),
        "py_blocks_first": after[0]["py_blocks"] if after else None,
        "py_blocks_last": after[-1]["py_blocks"] if after else None,
        "py_blocks_slope_per_min": round(
            _slope_per_min([(s["t_s"], s["py_blocks"]) for s in after])
        ),
        "max_rss_mb_process": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    }
    return {
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "ops": ops,
        "storage": dataclasses.asdict(storage.stats),
        "backed_up_tokens": final.backed_up_tokens,
        "loaded_back_tokens": final.loaded_back_tokens,
        "samples": samples,
        "summary": summary,
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m urc.apps.bench.soak", description=__doc__)
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--duration-s", type=float, default=390.0)
    p.add_argument("--warmup-s", type=float, default=90.0)
    p.add_argument("--sample-s", type=float, default=15.0)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--device-tokens", type=int, default=1 << 16)
    p.add_argument("--host-ratio", type=float, default=2.0)
    p.add_argument("--conversations", type=int, default=256)
    p.add_argument("--system-prompts", type=int, default=8)
    p.add_argument("--max-context", type=int, default=2048)
    p.add_argument("--l3-dir", type=Path, default=None, help="default: a temporary directory")
    p.add_argument(
        "--l3-capacity-mb",
        type=int,
        default=8,
        help="the store's capacity (its in-memory page index grows with the pages it holds)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--verbose", action="store_true", help="print each sample as it is taken")
    args = p.parse_args(argv)
    if args.l3_dir is not None:
        result = anyio.run(run_soak, args, args.l3_dir)
    else:
        with tempfile.TemporaryDirectory(prefix="urc-soak-") as d:
            result = anyio.run(run_soak, args, Path(d))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
