"""Overhead of the Prometheus exporter on the async service; prints JSON.

Usage::

    python -m urc.apps.bench.metrics                            # 1 and 16 clients, 5 repetitions
    python -m urc.apps.bench.metrics --clients 1 --num-seqs 500 --repeats 3
    python -m urc.apps.bench.metrics --modes off null on direct # also time the DIRECT write path

Workload: the service benchmark's (``urc.apps.bench.service``): ``urc.apps.bench.core``'s seeded
reference sequences; on a fresh cache per run, insert every sequence (values allocated before
timing), match every sequence, match-and-lock every sequence then release every lease, then evict in
per-sequence-sized calls -- each phase split round-robin over N client coroutines.  Each repetition
runs the workload once per mode, rotating which goes first: ``off`` (``observer=None``), ``null``
(an observer doing nothing: the service's own share), ``on`` (a
:class:`~metrics.exporter.CacheMetrics` on a fresh registry, default mode: SCRAPE in a single
process) and, when asked for, ``direct`` (``ExportMode.DIRECT``, the multiprocess write path).
The report gives the median wall time and the best CPU time of each, and ``overhead`` = on /
off - 1 (target <= 0.10).  The metrics runs also check that every command was observed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import torch
from prometheus_client import CollectorRegistry

from metrics.config import ExportMode, MetricsConfig
from metrics.exporter import CacheMetrics
from urc.apps.bench.core import generate_sequences
from urc.cache import build_cache
from urc.config import CacheConfig
from urc.key import RadixKey
from urc.service import (
    AsyncUnifiedRadixCache,
    CommandKind,
    ServiceObserver,
    StatsSource,
    TransferKind,
)
from urc.stats import CacheStats

__all__ = ["main", "run_once"]

_clock = time.perf_counter


async def _burst(n_clients: int, ops: list[Callable[[], Awaitable[Any]]]) -> list[Any]:
    """Run ``ops`` round-robin over ``n_clients`` coroutines; their results in order."""
    results: list[Any] = [None] * len(ops)

    async def client(k: int) -> None:
        for i in range(k, len(ops), n_clients):
            results[i] = await ops[i]()

    async with anyio.create_task_group() as tg:
        for k in range(n_clients):
            tg.start_soon(client, k)
    return results


class _NullObserver:
    """Observer that does nothing: isolates the service's own cost of having an observer
    (the timestamps and the per-command call) from the exporter's.  Like the exporter it
    pulls its snapshots (``attach`` returns ``None``), and it never pulls one."""

    def attach(self, source: StatsSource) -> float | None:
        return None

    def on_command(
        self, kind: CommandKind, queue_wait_s: float, latency_s: float, error: BaseException | None
    ) -> None:
        pass

    def on_batch(self, stats: CacheStats, queued: int) -> None:
        pass

    def on_transfer(self, kind: TransferKind, tokens: int, nbytes: int, seconds: float) -> None:
        pass


MODES = ("off", "null", "on")
ALL_MODES = (*MODES, "direct")


async def run_once(
    seqs: list[list[int]], n_clients: int, mode: str
) -> tuple[float, float, dict[str, float]]:
    """One run of the workload with metrics ``mode`` (off: ``observer=None``; null: an observer
    doing nothing; on: :class:`CacheMetrics`; direct: one in ``ExportMode.DIRECT``).  Returns
    (wall seconds, CPU seconds, wall seconds per phase) over the timed phases."""
    total_tokens = sum(len(s) for s in seqs)
    cache = build_cache(CacheConfig(kv_size=total_tokens + 1024, max_num_reqs=4, max_context_len=8))
    values = []
    for s in seqs:
        v = cache.token_to_kv_pool_allocator.alloc(len(s))
        assert v is not None, "bench pool too small"
        values.append(v)
    per_call = -(-total_tokens // len(seqs))
    registry = CollectorRegistry()
    observer: ServiceObserver | None = None
    if mode == "on":
        observer = CacheMetrics(registry)
    elif mode == "direct":
        observer = CacheMetrics(registry, MetricsConfig(mode=ExportMode.DIRECT))
    elif mode == "null":
        observer = _NullObserver()
    phases: dict[str, float] = {}
    cpu = time.process_time()
    async with AsyncUnifiedRadixCache(
        cache, max_queued=max(1024, n_clients), observer=observer
    ) as svc:

        def ins(seq: list[int], v: torch.Tensor) -> Callable[[], Awaitable[Any]]:
            return lambda: svc.insert(RadixKey(seq), v)

        def mat(seq: list[int], lock: bool) -> Callable[[], Awaitable[Any]]:
            return lambda: svc.match(RadixKey(seq), lock=lock)

        t = _clock()
        await _burst(n_clients, [ins(s, v) for s, v in zip(seqs, values, strict=True)])
        phases["insert"] = _clock() - t
        t = _clock()
        await _burst(n_clients, [mat(s, False) for s in seqs])
        phases["match"] = _clock() - t
        t = _clock()
        res = await _burst(n_clients, [mat(s, True) for s in seqs])

        def rel(outcome: Any) -> Callable[[], Awaitable[Any]]:
            return lambda: svc.release(outcome.lease)

        await _burst(n_clients, [rel(r) for r in res])
        phases["lock_release"] = _clock() - t
        t = _clock()
        await _burst(n_clients, [(lambda: svc.evict(per_call))] * len(seqs))
        phases["evict"] = _clock() - t
        cpu = time.process_time() - cpu
    if mode in ("on", "direct"):
        observed = 0
        for fam in registry.collect():
            for sample in fam.samples:
                if sample.name == "urc_command_duration_seconds_count":
                    observed += int(sample.value)
        assert observed == 5 * len(seqs), f"observed {observed} of {5 * len(seqs)} commands"
    return sum(phases.values()), cpu, phases


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m urc.apps.bench.metrics", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--clients", nargs="+", type=int, default=[1, 16])
    ap.add_argument("--num-seqs", type=int, default=1000)
    ap.add_argument("--chunk-len", type=int, default=256)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--backend", choices=["asyncio", "trio"], default="asyncio")
    ap.add_argument("--modes", nargs="+", choices=ALL_MODES, default=list(MODES))
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    seqs = generate_sequences(args.num_seqs, args.chunk_len, args.seed)
    report: dict[str, Any] = {
        "workload": {
            "num_seqs": args.num_seqs,
            "chunk_len": args.chunk_len,
            "seed": args.seed,
            "backend": args.backend,
            "repeats": args.repeats,
            "commands_per_run": 5 * args.num_seqs,
            "cpu_figures": "min over repeats of process CPU time (robust to other load)",
            "wall_figures": "median over repeats",
        },
        "clients": {},
    }
    anyio.run(run_once, seqs[: min(50, len(seqs))], 1, "on", backend=args.backend)  # warm-up
    commands = 5 * args.num_seqs
    modes = tuple(dict.fromkeys(["off", *args.modes]))  # "off" is the reference
    for n in args.clients:
        wall: dict[str, list[float]] = {m: [] for m in modes}
        cpu: dict[str, list[float]] = {m: [] for m in modes}
        for rep in range(args.repeats):
            # Rotate the order so drift (thermal, other load) does not favour one mode.
            for i in range(len(modes)):
                mode = modes[(i + rep) % len(modes)]
                w, c, _ = anyio.run(run_once, seqs, n, mode, backend=args.backend)
                wall[mode].append(w)
                cpu[mode].append(c)
        med = {m: statistics.median(wall[m]) for m in modes}
        best_cpu = {m: min(cpu[m]) for m in modes}
        entry: dict[str, Any] = {
            "wall_us_per_command": {m: round(med[m] / commands * 1e6, 2) for m in modes},
            "cpu_us_per_command": {m: round(best_cpu[m] / commands * 1e6, 2) for m in modes},
        }
        # on vs off: the whole cost of metrics; null vs off: the service's share (timestamps,
        # the per-command call); on vs null: the exporter's share.
        for m in ("on", "direct"):
            if m in modes:
                suffix = "" if m == "on" else "_direct"
                entry[f"overhead_wall{suffix}"] = round(med[m] / med["off"] - 1, 4)
                entry[f"overhead_cpu{suffix}"] = round(best_cpu[m] / best_cpu["off"] - 1, 4)
                if "null" in modes:
                    share = (best_cpu[m] - best_cpu["null"]) / best_cpu["off"]
                    entry[f"exporter_share_cpu{suffix}"] = round(share, 4)
        if "null" in modes:
            entry["service_share_cpu"] = round(best_cpu["null"] / best_cpu["off"] - 1, 4)
        entry["wall_runs"] = {m: [round(x, 4) for x in wall[m]] for m in modes}
        entry["cpu_runs"] = {m: [round(x, 4) for x in cpu[m]] for m in modes}
        report["clients"][str(n)] = entry
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
