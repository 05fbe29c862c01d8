"""Benchmark of the async service against the synchronous core, on the reference workload.

Usage::

    python -m urc.apps.bench.service                         # 1, 16 and 256 clients, asyncio
    python -m urc.apps.bench.service --clients 1 16 --backend trio --num-seqs 500
    python -m urc.apps.bench.service --replies               # reply-object micro-benchmark

The workload is ``urc.apps.bench.core``'s reference workload (seeded sequences sharing prefixes).
Per run, on a fresh cache, four phases run one after another: insert every sequence (values
allocated before timing), match every sequence, match-and-lock every sequence then release every
lease, and evict (as many calls as the direct run needed to empty the tree).  The
direct run applies the same operations to a core in a plain loop; each service run splits
every phase's operations round-robin over N client coroutines that ``await`` them (every
client count runs the same operations in total).  Reported per phase and in total: awaited
ops/s, p50/p99 latency of one awaited op in µs, ``overhead`` = service wall time / direct
wall time for the same operations (<= 2 is the target at one client) and, per client count,
``vs_1_client`` = its ops/s / the 1-client ops/s (> 1: batching pays).  Prints JSON.

Fairness: the clock of a phase runs from the moment every client is started and waiting to
the moment the last one got its last reply (spawning and joining N tasks is not service
time); configurations are interleaved and each phase is the best of ``--repeat`` runs; the
workload's token lists (millions of ints) are frozen out of the garbage collector, which
otherwise spends ~0.1 s per full collection traversing them -- a cost of the benchmark's
input, not of the cache, that lands in whichever run happens to trigger one.  The collector
stays on for everything the runs allocate.  The invariant checks (slow at this size) run in
the first repeat only.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import statistics
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import anyio
import torch
from anyio.abc import TaskStatus

from urc.apps.bench.core import generate_sequences
from urc.cache import UnifiedRadixCache, build_cache
from urc.config import CacheConfig
from urc.key import RadixKey
from urc.params import EvictParams, InsertParams, MatchPrefixParams
from urc.service import AsyncUnifiedRadixCache, Lease

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


def _summary(ops: int, wall: float, lat: list[float]) -> dict[str, Any]:
    """Figures of one phase; ``_lat`` (the sorted latencies) is dropped before printing."""
    lat.sort()
    n = len(lat)
    return {
        "ops": ops,
        "seconds": round(wall, 4),
        "ops_per_s": round(ops / wall, 1) if wall else 0.0,
        "p50_us": round(statistics.median(lat) * 1e6, 2) if n else 0.0,
        "p99_us": round(lat[min(n - 1, int(n * 0.99))] * 1e6, 2) if n else 0.0,
        "_lat": lat,
    }


def run_direct(seqs: list[list[int]], check: bool = True) -> tuple[dict[str, Any], int]:
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
    if check:
        cache.sanity_check()
        cache.check_pools()
    return phases, calls


async def _burst(
    n_clients: int, ops: Sequence[Callable[[], Awaitable[Any]]]
) -> tuple[float, list[float], list[Any]]:
    """Run ``ops`` round-robin over ``n_clients`` coroutines; wall time, latencies, results.

    The wall time runs from releasing the clients (all started and waiting) to the last
    reply: starting and joining the tasks is not counted."""
    lat: list[float] = []
    results: list[Any] = [None] * len(ops)
    go = anyio.Event()
    running = [n_clients]
    end = [0.0]

    async def client(k: int, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        await go.wait()
        for i in range(k, len(ops), n_clients):
            t0 = _clock()
            results[i] = await ops[i]()
            lat.append(_clock() - t0)
        running[0] -= 1
        if not running[0]:
            end[0] = _clock()

    async with anyio.create_task_group() as tg:
        for k in range(n_clients):
            await tg.start(client, k)
        t = _clock()
        go.set()
    return end[0] - t, lat, results


async def run_service(
    seqs: list[list[int]], n_clients: int, evict_calls: int, per_call: int, check: bool = True
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
        if check:
            await svc.sanity_check()
    return phases


def _total(phases: dict[str, Any]) -> dict[str, Any]:
    """All phases together (p50/p99 over every op of the phases given); drops ``_lat``."""
    ops = sum(p["ops"] for p in phases.values())
    wall = sum(p["seconds"] for p in phases.values())
    lat = sorted(x for p in phases.values() for x in p.pop("_lat"))
    total = _summary(ops, wall, lat)
    del total["_lat"]
    total["seconds"] = round(wall, 4)
    return total


async def _replies(n: int) -> dict[str, float]:
    """Round-trip cost of one-shot reply objects with a trivial actor (on asyncio also the
    bare future the service uses there)."""
    out: dict[str, float] = {}
    send, recv = anyio.create_memory_object_stream[Any](64)

    async def actor() -> None:
        async with recv:
            async for reply in recv:
                if isinstance(reply, anyio.Event):
                    reply.set()
                elif isinstance(reply, asyncio.Future):
                    reply.set_result(1)
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
        try:
            loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            loop = None  # trio
        if loop is not None:
            t = _clock()
            for _ in range(n):
                fut = loop.create_future()
                send.send_nowait(fut)
                await fut
            out["future_us"] = round((_clock() - t) / n * 1e6, 2)
        send.close()
    return out


def _best(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per phase, the repeat with the shortest wall time (the machine may be shared)."""
    return {name: min((r[name] for r in runs), key=lambda p: p["seconds"]) for name in runs[0]}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m urc.apps.bench.service", description=__doc__.split("\n")[0]
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
    gc.collect()
    gc.freeze()  # the workload lives throughout: keep full collections from traversing it
    direct_runs: list[dict[str, Any]] = []
    service_runs: dict[int, list[dict[str, Any]]] = {n: [] for n in args.clients}
    evict_calls = 0
    for r in range(args.repeat):  # interleaved, so load changes hit every configuration
        gc.collect()
        phases, evict_calls = run_direct(seqs, check=r == 0)
        direct_runs.append(phases)
        for n in args.clients:
            gc.collect()
            service_runs[n].append(
                anyio.run(run_service, seqs, n, evict_calls, per_call, r == 0, backend=args.backend)
            )
    gc.unfreeze()
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
    best = {n: _best(service_runs[n]) for n in args.clients}
    totals = {n: _total(phases) for n, phases in best.items()}
    one_client = totals[1]["ops_per_s"] if 1 in totals else None
    for n, phases in best.items():
        total = totals[n]
        total["overhead"] = round(total["seconds"] / direct_total["seconds"], 3)
        if one_client:
            total["vs_1_client"] = round(total["ops_per_s"] / one_client, 3)
        for name, p in phases.items():
            p["overhead"] = round(p["seconds"] / direct[name]["seconds"], 3)
        report["service"][str(n)] = {"phases": phases, "total": total}
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
