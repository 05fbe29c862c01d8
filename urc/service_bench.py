"""Benchmark of the async service against the synchronous core, on the reference workload.

Usage::

    python -m urc.service_bench                         # 1, 16 and 256 clients, asyncio
    python -m urc.service_bench --clients 1 16 --backend trio --num-seqs 500
    python -m urc.service_bench --replies               # reply-object micro-benchmark

The workload is ``urc.bench``'s reference workload (seeded sequences sharing prefixes).  Per
run, on a fresh cache, four phases run one after another: insert every sequence (values
allocated before timing), match every sequence, match-and-lock every sequence then release
every lease, and evict (as many calls as the direct run needed to empty the tree).  The
direct run applies the same operations to a core in a plain loop; each service run splits
every phase's operations round-robin over N client coroutines that ``await`` them.  Reported
per run: awaited ops/s, p50/p99 latency of one awaited op in µs, and ``overhead`` = service
wall time / direct wall time for the same operations (<= 2 is the target at one client).
Prints JSON.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import anyio
import torch

from urc.bench import generate_sequences
from urc.cache import UnifiedRadixCache
from urc.config import CacheConfig, build_cache
from urc.key import RadixKey
from urc.lease import Lease
from urc.params import EvictParams, InsertParams, MatchPrefixParams
from urc.service import AsyncUnifiedRadixCache

__all__ = ["main", "run_direct", "run_service"]

_clock = time.perf_counter


def _config(seqs: list[list[int]]) -> CacheConfig:
    total = sum(len(s) for s in seqs)
    return CacheConfig(kv_size=total + 1024, max_num_reqs=4, max_context_len=8)


def _prealloc(cache: UnifiedRadixCache, seqs: list[list[int]]) -> list[torch.Tensor]:
    out = []
    for s in seqs:
        v = cache.token_to_kv_pool_allocator.alloc(len(s))
        assert v is not None, "bench pool too small"
        out.append(v)
    return out


def _summary(ops: int, wall: float, lat: list[float]) -> dict[str, float]:
    lat.sort()
    n = len(lat)
    return {
        "ops": ops,
        "seconds": round(wall, 4),
        "ops_per_s": round(ops / wall, 1) if wall else 0.0,
        "p50_us": round(statistics.median(lat) * 1e6, 2) if n else 0.0,
        "p99_us": round(lat[min(n - 1, int(n * 0.99))] * 1e6, 2) if n else 0.0,
    }


def run_direct(seqs: list[list[int]]) -> tuple[dict[str, Any], int]:
    """The workload on the core in a plain loop; returns figures and the evict call count."""
    cache = build_cache(_config(seqs))
    values = _prealloc(cache, seqs)
    phases: dict[str, Any] = {}
    lat: list[float] = []
    t = _clock()
    for seq, v in zip(seqs, values, strict=True):
        t0 = _clock()
        cache.insert(InsertParams(key=RadixKey(seq), value=v))
        lat.append(_clock() - t0)
    phases["insert"] = _summary(len(seqs), _clock() - t, lat)
    lat = []
    t = _clock()
    for seq in seqs:
        t0 = _clock()
        cache.match_prefix(MatchPrefixParams(key=RadixKey(seq)))
        lat.append(_clock() - t0)
    phases["match"] = _summary(len(seqs), _clock() - t, lat)
    lat = []
    held = []
    t = _clock()
    for seq in seqs:
        t0 = _clock()
        node = cache.match_prefix(MatchPrefixParams(key=RadixKey(seq))).last_device_node
        held.append((node, cache.inc_lock_ref(node)))
        lat.append(_clock() - t0)
    for node, receipt in held:
        t0 = _clock()
        cache.dec_lock_ref(node, receipt.to_dec_params())
        lat.append(_clock() - t0)
    phases["lock_release"] = _summary(2 * len(seqs), _clock() - t, lat)
    per_call = -(-cache.total_size() // len(seqs))
    lat = []
    calls = 0
    t = _clock()
    while cache.total_size() > 0:
        t0 = _clock()
        cache.evict(EvictParams(num_tokens=per_call))
        lat.append(_clock() - t0)
        calls += 1
    phases["evict"] = _summary(calls, _clock() - t, lat)
    cache.sanity_check()
    cache.check_pools()
    return phases, calls


async def _burst(
    n_clients: int, ops: Sequence[Callable[[], Awaitable[Any]]]
) -> tuple[float, list[float], list[Any]]:
    """Run ``ops`` round-robin over ``n_clients`` coroutines; wall time, latencies, results."""
    lat: list[float] = []
    results: list[Any] = [None] * len(ops)

    async def client(k: int) -> None:
        for i in range(k, len(ops), n_clients):
            t0 = _clock()
            results[i] = await ops[i]()
            lat.append(_clock() - t0)

    t = _clock()
    async with anyio.create_task_group() as tg:
        for k in range(n_clients):
            tg.start_soon(client, k)
    return _clock() - t, lat, results


async def run_service(
    seqs: list[list[int]], n_clients: int, evict_calls: int, per_call: int
) -> dict[str, Any]:
    """The workload through the service with ``n_clients`` concurrent clients."""
    cache = build_cache(_config(seqs))
    values = _prealloc(cache, seqs)
    phases: dict[str, Any] = {}
    async with AsyncUnifiedRadixCache(cache, max_queued=max(1024, n_clients)) as svc:

        def ins(seq: list[int], v: torch.Tensor) -> Callable[[], Awaitable[Any]]:
            return lambda: svc.insert(RadixKey(seq), v)

        def mat(seq: list[int], lock: bool) -> Callable[[], Awaitable[Any]]:
            return lambda: svc.match(RadixKey(seq), lock=lock)

        def rel(lease: Lease) -> Callable[[], Awaitable[Any]]:
            return lambda: svc.release(lease)

        inserts = [ins(s, v) for s, v in zip(seqs, values, strict=True)]
        wall, lat, _ = await _burst(n_clients, inserts)
        phases["insert"] = _summary(len(seqs), wall, lat)
        wall, lat, _ = await _burst(n_clients, [mat(s, False) for s in seqs])
        phases["match"] = _summary(len(seqs), wall, lat)
        wall, lat, res = await _burst(n_clients, [mat(s, True) for s in seqs])
        wall2, lat2, _ = await _burst(n_clients, [rel(r.lease) for r in res])
        phases["lock_release"] = _summary(2 * len(seqs), wall + wall2, lat + lat2)
        ev = [lambda: svc.evict(per_call)] * evict_calls
        wall, lat, _ = await _burst(n_clients, ev)
        phases["evict"] = _summary(evict_calls, wall, lat)
        await svc.sanity_check()
    return phases


def _total(phases: dict[str, Any]) -> dict[str, float]:
    ops = sum(p["ops"] for p in phases.values())
    wall = sum(p["seconds"] for p in phases.values())
    return {"ops": ops, "seconds": round(wall, 4), "ops_per_s": round(ops / wall, 1)}


async def _replies(n: int) -> dict[str, float]:
    """Round-trip cost of the two one-shot reply objects with a trivial actor."""
    out: dict[str, float] = {}
    send, recv = anyio.create_memory_object_stream[Any](64)

    async def actor() -> None:
        async with recv:
            async for reply in recv:
                if isinstance(reply, anyio.Event):
                    reply.set()
                else:
                    reply.send_nowait(1)
                    reply.close()

    async with anyio.create_task_group() as tg:
        tg.start_soon(actor)
        t = _clock()
        for _ in range(n):
            ev = anyio.Event()
            send.send_nowait(ev)
            await ev.wait()
        out["event_us"] = round((_clock() - t) / n * 1e6, 2)
        t = _clock()
        for _ in range(n):
            s, r = anyio.create_memory_object_stream[int](1)
            send.send_nowait(s)
            with r:
                await r.receive()
        out["stream_us"] = round((_clock() - t) / n * 1e6, 2)
        send.close()
    return out


def _best(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per phase, the repeat with the shortest wall time (the machine may be shared)."""
    return {name: min((r[name] for r in runs), key=lambda p: p["seconds"]) for name in runs[0]}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m urc.service_bench", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--clients", nargs="+", type=int, default=[1, 16, 256])
    ap.add_argument("--num-seqs", type=int, default=2000)
    ap.add_argument("--chunk-len", type=int, default=256)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--repeat", type=int, default=3, help="best of N runs per configuration")
    ap.add_argument("--backend", choices=["asyncio", "trio"], default="asyncio")
    ap.add_argument("--replies", action="store_true", help="only the reply micro-benchmark")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    if args.replies:
        print(json.dumps(anyio.run(_replies, 20000, backend=args.backend)))
        return
    seqs = generate_sequences(args.num_seqs, args.chunk_len, args.seed)
    per_call = -(-sum(len(s) for s in seqs) // len(seqs))
    direct_runs: list[dict[str, Any]] = []
    service_runs: dict[int, list[dict[str, Any]]] = {n: [] for n in args.clients}
    evict_calls = 0
    for _ in range(args.repeat):  # interleaved, so load changes hit every configuration
        gc.collect()
        phases, evict_calls = run_direct(seqs)
        direct_runs.append(phases)
        for n in args.clients:
            gc.collect()
            service_runs[n].append(
                anyio.run(run_service, seqs, n, evict_calls, per_call, backend=args.backend)
            )
    direct = _best(direct_runs)
    direct_total = _total(direct)
    report: dict[str, Any] = {
        "workload": {
            "num_seqs": args.num_seqs,
            "chunk_len": args.chunk_len,
            "seed": args.seed,
            "backend": args.backend,
            "repeat": args.repeat,
        },
        "direct": {"phases": direct, "total": direct_total},
        "service": {},
    }
    for n in args.clients:
        phases = _best(service_runs[n])
        total = _total(phases)
        total["overhead"] = round(total["seconds"] / direct_total["seconds"], 3)
        for name, p in phases.items():
            p["overhead"] = round(p["seconds"] / direct[name]["seconds"], 3)
        report["service"][str(n)] = {"phases": phases, "total": total}
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
