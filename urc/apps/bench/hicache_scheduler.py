"""The scheduler thread's time blocked on HiCache copies inside SGLang (the plug-in's
write-through backups and load-backs), synchronous copies against copies on a worker thread;
prints JSON.

Usage: ``python -m urc.apps.bench.hicache_scheduler [--steps 64] [--tokens 256]
[--device-tokens 4096] [--layers 32 --heads 8 --head-dim 128 --dtype bfloat16]
[--forward-ms 5] [--repeat 3] [--phase backup|load_back|both] [--torch-threads N]``.

Backups (``backup``).  Each step does what SGLang's scheduler does around a prefill with
``--enable-hierarchical-cache`` and urc as the tree: a request's ``--tokens`` new tokens
are inserted into the tree (fresh KV slots holding random bytes, evicting when the device
pool is full), then the scheduler turn calls the plug-in's ``check_hicache_events`` (what SGLang's
``_process_hicache_events`` calls: commit the backups that completed, start those that came
due), then a stand-in for the forward pass runs on the same thread (a bf16 matmul sized to
take about ``--forward-ms``).  ``blocked_ms_per_step`` is the time the thread spends inside
``check_hicache_events`` per step; ``step_ms`` the whole step.  Two engines run in one process,
interleaved ``--repeat`` times (best of each): ``sync`` (the copy runs inside the call,
:class:`~hicache.transfer_engine.HostTransferEngine`, the plug-in before issue 51) and
``thread`` (:class:`~hicache.transfer_engine.ThreadTransferEngine`, what the plug-in uses on
a CPU device now: the call starts the copy and returns; the copy overlaps the forward).

Load-backs (``load_back``).  ``--steps`` prompts of ``--tokens`` tokens are inserted and
demoted to host (write-back); each step then does what SGLang's scheduler does for a
request whose prefix is on host: match it, ``init_load_back`` (admission), then
``ready_to_load_host_cache`` (the new batch), the forward (``--layers`` slices of the
stand-in, each reading its layer through the counter's ``wait_until``, as SGLang's KV pool
does), and the next turn's ``check_hicache_events``; the prompt is demoted again (not
timed).  ``blocked_ms_per_step`` is the time in those calls plus the forward's waits.
``sync``: the copy inside ``init_load_back`` (the plug-in before, and on CUDA);
``thread``: layer-wise on the host tier's load worker (the plug-in on a CPU device now).
The KV pool is SGLang's layout, one K and one V buffer per layer (:class:`PerLayerKVPool`).
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
from urc import (
    CacheConfig,
    EvictParams,
    InsertParams,
    KVShape,
    MatchPrefixParams,
    RadixKey,
    build_cache,
)
from urc.apps.sglang._hicache import HiCacheSurface
from urc.apps.sglang._load_back import LayerLoadCounter, layer_plan
from urc.cache import UnifiedRadixCache
from urc.config import build_pools
from urc.host_protocol import WritePolicy
from urc.node import ComponentType
from urc.pools.kv_pool import KVPool

__all__ = ["PerLayerKVPool", "main", "measure", "measure_load_back"]


class PerLayerKVPool(KVPool):
    """urc's KV pool seen as SGLang's ``MHATokenToKVPool``: one K and one V buffer per
    layer (views of ``kv``), so the host tier mirrors them buffer by buffer and a load-back
    can land layer by layer."""

    __slots__ = ()

    def slot_buffers(self) -> list[tuple[torch.Tensor, int]]:
        layers = range(self.shape.num_layers)
        return [(self.kv[0, i], 0) for i in layers] + [(self.kv[1, i], 0) for i in layers]


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


def _layered_cache(args: argparse.Namespace, engine: TransferEngine) -> UnifiedRadixCache:
    shape = KVShape(args.layers, args.heads, args.head_dim, getattr(torch, args.dtype))
    config = CacheConfig(
        components=(ComponentType.FULL,),
        page_size=args.page_size,
        kv_size=args.device_tokens,
        kv_shape=shape,
    )
    pools = build_pools(config)
    pools.kv_pool = PerLayerKVPool(config.kv_size, shape)
    core = build_cache(config, pools)
    host_tokens = max(2 * args.device_tokens, (args.steps + 1) * args.tokens)
    attach_hicache(
        core, HiCacheConfig(write_policy=WritePolicy.WRITE_BACK, host_tokens=host_tokens), engine
    )
    return core


class _Params:
    """SGLang's ``InitLoadBackParams`` as the plug-in reads it."""

    def __init__(self, best: Any, last: Any) -> None:
        self.best_match_node = best
        self.req = self
        self.last_node = last


def measure_load_back(
    args: argparse.Namespace, engine: TransferEngine, layer_forward: Any, layerwise: bool
) -> dict[str, float]:
    """One load-back run of ``args.steps`` steps (see the module docstring)."""
    core = _layered_cache(args, engine)
    sched = _Scheduler(core)
    counter = LayerLoadCounter(args.layers)
    if layerwise:
        plan = layer_plan(
            [(ComponentType.FULL, i) for i in range(args.layers)], {ComponentType.FULL: args.layers}
        )
        sched.enable_layerwise_load_back(counter, plan)
    kv = core.pools.kv_pool.kv  # type: ignore[union-attr]
    alloc = core.token_to_kv_pool_allocator
    n = args.tokens
    keys = [RadixKey(list(range(i * n + 1, (i + 1) * n + 1))) for i in range(args.steps)]
    for key in keys:
        slots = alloc.alloc(n)
        if slots is None:
            core.evict(EvictParams(num_tokens=10**9))
            slots = alloc.alloc(n)
        assert slots is not None, "no device slots for a prompt"
        kv[:, :, slots] = torch.randn(kv[:, :, slots].shape).to(kv.dtype)
        core.insert(InsertParams(key=key, value=slots))
    core.evict(EvictParams(num_tokens=10**9))  # every prompt demoted to host
    blocked = 0.0
    loaded = 0
    t_start = time.perf_counter()
    for key in keys:
        hit = core.match_prefix(MatchPrefixParams(key=key))
        assert hit.host_hit_length == n, f"{hit.host_hit_length} of {n} on host"
        t0 = time.perf_counter()
        got = sched.init_load_back(_Params(hit.best_match_node, hit.last_device_node))
        counter.set_consumer(sched.ready_to_load_host_cache())
        blocked += time.perf_counter() - t0
        assert got is not None
        loaded += got[0]
        waited = counter.blocked_s
        for layer in range(args.layers):
            counter.wait_until(layer)
            layer_forward()
        blocked += counter.blocked_s - waited
        t0 = time.perf_counter()
        sched.check_hicache_events()
        blocked += time.perf_counter() - t0
        sched.wait_for_backups()  # the next turns' (not timed: the stand-in runs one batch)
        core.evict(EvictParams(num_tokens=10**9))
    total = time.perf_counter() - t_start
    core.sanity_check()
    return {
        "blocked_ms_per_step": blocked / args.steps * 1e3,
        "step_ms": total / args.steps * 1e3,
        "loaded_back_tokens": float(loaded),
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
    p.add_argument(
        "--phase", choices=("backup", "load_back", "both"), default="both", help="what to time"
    )
    p.add_argument(
        "--torch-threads",
        type=int,
        default=None,
        help="threads for the forward's matmuls (default: torch's, every core); on a small "
        "machine, fewer leave a core to the copy worker, as a GPU server's forward does",
    )
    args = p.parse_args(argv)
    if args.torch_threads is not None:
        if args.torch_threads < 1:
            p.error(f"argument --torch-threads: must be >= 1, got {args.torch_threads}")
        torch.set_num_threads(args.torch_threads)
    forward = _forward(args.forward_ms)
    layer_forward = _forward(args.forward_ms / args.layers)
    phases = ("backup", "load_back") if args.phase == "both" else (args.phase,)
    best: dict[str, dict[str, dict[str, float]]] = {phase: {} for phase in phases}
    thread = ThreadTransferEngine()
    try:
        for _ in range(args.repeat):  # interleaved: both engines see the same machine load
            for phase in phases:
                for name, engine in (("sync", HostTransferEngine()), ("thread", thread)):
                    if phase == "backup":
                        got = measure(args, engine, forward)
                    else:
                        got = measure_load_back(args, engine, layer_forward, name == "thread")
                    if name not in best[phase] or got["step_ms"] < best[phase][name]["step_ms"]:
                        best[phase][name] = got
    finally:
        thread.close()
    out: dict[str, Any] = {
        "config": vars(args),
        "kv_bytes_per_token": 2
        * args.layers
        * args.heads
        * args.head_dim
        * torch.empty((), dtype=getattr(torch, args.dtype)).element_size(),
    }
    for phase, runs in best.items():
        out[phase] = {
            **runs,
            "blocked_ratio_thread_over_sync": runs["thread"]["blocked_ms_per_step"]
            / max(runs["sync"]["blocked_ms_per_step"], 1e-9),
            "step_ratio_thread_over_sync": runs["thread"]["step_ms"] / runs["sync"]["step_ms"],
        }
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
