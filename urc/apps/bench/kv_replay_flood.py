"""The KV-event replay socket under a flood of never-read requests: the service's worst
command latency while it lasts.

Usage::

    python -m urc.apps.bench.kv_replay_flood                 # 10,000 batches, 300 requests
    python -m urc.apps.bench.kv_replay_flood --requests 1000 --sockets 8 --seconds 10

A service runs with a :class:`~urc.service.KVEventPublisher` whose replay buffer holds
``--batches`` batches.  One client awaits ``match`` commands back to back and records each
round trip (the time from sending the command to its result: the actor's queue wait plus
its work, which is what a stalled event loop delays).  Phase ``idle``: ``--seconds`` of that
alone.  Phase ``flood``: the same while ``--sockets`` DEALER sockets (receive high-water mark
1) each send ``--requests`` replay requests from sequence 0 and never read.  Reported per
phase: commands completed, the round trip's p50 / p99 / max in ms, and the publisher's
replay counters.  Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import anyio

from urc.config import CacheConfig
from urc.kv_events import BlockStored, StorageMedium
from urc.service import AsyncUnifiedRadixCache, KVEventPublisher, KVEventsConfig

__all__ = ["main", "run_flood"]


async def _probe(svc: AsyncUnifiedRadixCache, seconds: float) -> list[float]:
    """Round trips of back-to-back ``match`` commands for ``seconds`` (ms each)."""
    key = list(range(64))
    out = []
    end = time.perf_counter() + seconds
    while (t := time.perf_counter()) < end:
        await svc.match(key)
        out.append((time.perf_counter() - t) * 1e3)
    return out


def _figures(lat: list[float]) -> dict[str, Any]:
    lat_sorted = sorted(lat)
    return {
        "commands": len(lat),
        "p50_ms": round(statistics.median(lat_sorted), 3),
        "p99_ms": round(lat_sorted[int(0.99 * (len(lat_sorted) - 1))], 3),
        "max_ms": round(lat_sorted[-1], 3),
    }


async def run_flood(args: argparse.Namespace) -> dict[str, Any]:
    """Run both phases (see the module docstring); returns the figures."""
    import zmq
    import zmq.asyncio

    pub = KVEventPublisher(
        KVEventsConfig(
            endpoint="tcp://127.0.0.1:0",
            replay_endpoint="tcp://127.0.0.1:0",
            buffer_steps=args.batches,
            max_queued=args.batches,
        )
    )
    ctx = zmq.asyncio.Context()
    socks = []
    result: dict[str, Any] = {"config": vars(args)}
    try:
        cache_config = CacheConfig(page_size=16, kv_size=1 << 14)
        async with AsyncUnifiedRadixCache(cache_config, workers=[pub]) as svc:
            await pub.started.wait()
            assert pub.replay_endpoint is not None
            for i in range(args.batches):
                pub.offer([BlockStored([i], None, list(range(16)), 16, None, StorageMedium.GPU)])
            await pub.wait_published(args.batches)
            await svc.insert(list(range(64)), await svc.alloc(64))
            result["idle"] = _figures(await _probe(svc, args.seconds))
            for _ in range(args.sockets):
                s = ctx.socket(zmq.DEALER)
                s.setsockopt(zmq.LINGER, 0)
                s.setsockopt(zmq.RCVHWM, 1)
                s.connect(pub.replay_endpoint)
                socks.append(s)

            async def flood() -> None:
                for _ in range(args.requests):
                    for s in socks:
                        await s.send_multipart([b"", (0).to_bytes(8, "big")])

            async with anyio.create_task_group() as tg:
                tg.start_soon(flood)
                lat = await _probe(svc, args.seconds)
            result["flood"] = _figures(lat)
            st = pub.stats
            result["publisher"] = {
                "replay_requests": st.replay_requests,
                "replay_requests_refused": getattr(st, "replay_requests_refused", None),
                "replays_abandoned": getattr(st, "replays_abandoned", None),
            }
    finally:
        for s in socks:
            s.close()
        ctx.term()
    return result


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m urc.apps.bench.kv_replay_flood", description=__doc__
    )
    p.add_argument("--batches", type=int, default=10_000, help="batches in the replay buffer")
    p.add_argument("--requests", type=int, default=300, help="replay requests per socket")
    p.add_argument("--sockets", type=int, default=1, help="flooding DEALER sockets")
    p.add_argument("--seconds", type=float, default=5.0, help="length of each phase")
    args = p.parse_args(argv)
    print(json.dumps(anyio.run(run_flood, args), indent=1))


if __name__ == "__main__":
    main()
