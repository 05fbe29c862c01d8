"""The scheduler thread's time blocked on HiCache copies inside SGLang (the plug-in's
write-through backups), synchronous copies against copies on a worker thread; prints JSON.

Usage: ``python -m urc.apps.bench.hicache_scheduler [--steps 64] [--tokens 256]
[--device-tokens 4096] [--layers 32 --heads 8 --head-dim 128 --dtype bfloat16]
[--forward-ms 5] [--repeat 3]``.

Each step does what SGLang's scheduler does around a prefill with ``--enable-hierarchical-
cache`` and urc as the tree: a request's ``--tokens`` new tokens are inserted into the tree
(fresh KV slots holding random bytes, evicting when the device pool is full), then the
scheduler turn calls the plug-in's ``check_hicache_events`` (what SGLang's
``_process_hicache_events`` calls: commit the backups that completed, start those that came
due), then a stand-in for the forward pass runs on the same thread (a bf16 matmul sized to
take about ``--forward-ms``).  ``blocked_ms_per_step`` is the time the thread spends inside
``check_hicache_events`` per step; ``step_ms`` the whole step.  Two engines run in one process,
interleaved ``--repeat`` times (best of each): ``sync`` (the copy runs inside the call,
:class:`~hicache.transfer_engine.HostTransferEngine`, the plug-in before issue 51) and
``thread`` (:class:`~hicache.transfer_engine.ThreadTransferEngine`, what the plug-in uses on
a CPU device now: the call starts the copy and returns; the copy overlaps the forward).
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import torch

from hicache.config import HiCacheConfig
from hicache.host_tier import attach_hicache
from hicache.transfer_engine import HostTransferEngine, ThreadTransferEngine, TransferEngine
from urc import CacheConfig, EvictParams, InsertParams, KVShape, RadixKey, build_cache
from urc.apps.sglang._hicache import HiCacheSurface
from urc.cache import UnifiedRadixCache
from urc.node import ComponentType

__all__ = ["main", "measure"]


class _Scheduler(HiCacheSurface):
    """The plug-in's HiCache surface on a bare cache (no SGLang process needed)."""

    def __init__(self, core: UnifiedRadixCache) -> None:
        self.urc = core
        self.host = core.host_tier  # type: ignore[assignment]
        self.init_hicache_surface()


def _cache(args: argparse.Namespace, engine: TransferEngine) -> UnifiedRadixCache:
    shape = KVShape(args.layers, args.heads, args.head_dim, getattr(torch, args.dtype))
    core = build_cache(
        CacheConfig(
            components=(ComponentType.FULL,),
            page_size=args.page_size,
            kv_size=args.device_tokens,
            kv_shape=shape,
        )
    )
    attach_hicache(core, HiCacheConfig(host_ratio=2.0), engine)
    return core


def _forward(ms: float) -> Any:
    """A matmul on this thread sized to take about ``ms`` milliseconds (calibrated once)."""
    a = torch.randn(512, 512, dtype=torch.bfloat16)
    t0 = time.perf_counter()
    for _ in range(4):
        a @ a
    per = (time.perf_counter() - t0) / 4
    reps = max(1, round(ms / 1000 / max(per, 1e-6)))

    def run() -> None:
        for _ in range(reps):
            a @ a

    return run


def measure(args: argparse.Namespace, engine: TransferEngine, forward: Any) -> dict[str, float]:
    """One run of ``args.steps`` steps on ``engine`` (see the module docstring)."""
    core = _cache(args, engine)
    sched = _Scheduler(core)
    kv = core.pools.kv_pool.kv  # type: ignore[union-attr]
    alloc = core.token_to_kv_pool_allocator
    blocked = 0.0
    t_start = time.perf_counter()
    for step in range(args.steps):
        n = args.tokens
        slots = alloc.alloc(n)
        if slots is None:
            core.evict(EvictParams(num_tokens=n))
            sched.check_hicache_events()
            slots = alloc.alloc(n)
            if slots is None:
                sched.wait_for_backups()
                core.evict(EvictParams(num_tokens=n))
                slots = alloc.alloc(n)
        assert slots is not None, f"step {step}: no {n} slots"
        kv[:, :, slots] = torch.randn(kv[:, :, slots].shape).to(kv.dtype)
        first = step * n + 1
        core.insert(InsertParams(key=RadixKey(list(range(first, first + n))), value=slots))
        t0 = time.perf_counter()
        sched.check_hicache_events()
        blocked += time.perf_counter() - t0
        forward()
    sched.wait_for_backups()
    total = time.perf_counter() - t_start
    core.sanity_check()
    return {
        "blocked_ms_per_step": blocked / args.steps * 1e3,
        "step_ms": total / args.steps * 1e3,
        "backed_up_tokens": float(core.counters.backed_up_tokens),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--device-tokens", type=int, default=4096)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--forward-ms", type=float, default=5.0)
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args(argv)
    forward = _forward(args.forward_ms)
    best: dict[str, dict[str, float]] = {}
    thread = ThreadTransferEngine()
    try:
        for _ in range(args.repeat):  # interleaved: both engines see the same machine load
            for name, engine in (("sync", HostTransferEngine()), ("thread", thread)):
                got = measure(args, engine, forward)
                if name not in best or got["step_ms"] < best[name]["step_ms"]:
                    best[name] = got
    finally:
        thread.close()
    out: dict[str, Any] = {
        "config": vars(args),
        "kv_bytes_per_token": 2
        * args.layers
        * args.heads
        * args.head_dim
        * torch.empty((), dtype=getattr(torch, args.dtype)).element_size(),
        **best,
        "blocked_ratio_thread_over_sync": best["thread"]["blocked_ms_per_step"]
        / best["sync"]["blocked_ms_per_step"],
        "step_ratio_thread_over_sync": best["thread"]["step_ms"] / best["sync"]["step_ms"],
    }
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
