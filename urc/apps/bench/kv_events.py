"""Benchmark of KV events: the drain (page hashes, events built and merged) and the
publisher (msgpack encoding, PUB sends, a SUB on loopback receiving every batch).

Usage::

    python -m urc.apps.bench.kv_events                     # page sizes 1 and 16, best of 3
    python -m urc.apps.bench.kv_events --num-seqs 500 --page-sizes 16 --repeat 5

Workload: ``urc.apps.bench.core``'s reference sequences inserted into a Full cache with events
on, then evicted until empty.  ``drain``: the time ``take_events()`` takes for all of it
(``pages_per_s``: stored and removed pages per second).  ``publish``: those events offered to
a :class:`~urc.service.KVEventPublisher` running in a service, as batches of
``--batch-events`` events, timed from the first offer until a SUB socket on 127.0.0.1 has
received the last batch (``events_per_s``, ``pages_per_s``: block hashes, ``batches_per_s``,
``mb_per_s`` of payload).
(The core benchmark's ``--kv-events`` measures the phases with events on.)  Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import anyio
import torch

from urc.apps.bench.core import generate_sequences
from urc.cache import build_cache
from urc.config import CacheConfig
from urc.key import RadixKey
from urc.kv_events import BlockRemoved, BlockStored, KVEvent
from urc.params import EvictParams, InsertParams
from urc.service import AsyncUnifiedRadixCache, KVEventPublisher, KVEventsConfig

__all__ = ["main", "run_drain", "run_publish"]

_clock = time.perf_counter


def run_drain(seqs: list[list[int]], page_size: int) -> tuple[dict[str, float], list[KVEvent]]:
    """Insert and evict ``seqs`` with events on; returns the drain figures and the events."""
    total = sum(len(s) for s in seqs)
    cache = build_cache(CacheConfig(page_size=page_size, kv_size=total + 1024))
    cache.enable_kv_events()
    alloc = cache.token_to_kv_pool_allocator
    for s in seqs:
        cache.insert(InsertParams(key=RadixKey(s), value=alloc.alloc(len(s))))
    t0 = _clock()
    events = cache.take_events()
    seconds = _clock() - t0
    cache.evict(EvictParams(num_tokens=total))
    t0 = _clock()
    events += cache.take_events()
    seconds += _clock() - t0
    pages = sum(len(e.block_hashes) for e in events if isinstance(e, BlockStored | BlockRemoved))
    figures = {
        "events": len(events),
        "pages": pages,
        "seconds": seconds,
        "events_per_s": len(events) / seconds,
        "pages_per_s": pages / seconds,
    }
    return figures, events


async def run_publish(events: list[KVEvent], batch_events: int) -> dict[str, float]:
    """Offer ``events`` to a running publisher in batches; time until a SUB got them all."""
    import zmq
    import zmq.asyncio

    batches = [events[i : i + batch_events] for i in range(0, len(events), batch_events)]
    pub = KVEventPublisher(
        KVEventsConfig(endpoint="tcp://127.0.0.1:0", max_queued=len(batches) + 1)
    )
    ctx = zmq.asyncio.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.RCVHWM, 0)
    sub.setsockopt(zmq.LINGER, 0)
    try:
        async with AsyncUnifiedRadixCache(CacheConfig(kv_size=1024), workers=[pub]):
            await pub.started.wait()
            assert pub.endpoint is not None
            sub.connect(pub.endpoint)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            # The subscription is in place once a probe batch arrives.
            while True:
                pub.offer([])
                with anyio.move_on_after(0.1):
                    await sub.recv_multipart()
                    break
            while pub.queued:
                await sub.recv_multipart()
            await anyio.sleep(0.05)
            while await sub.poll(0):
                await sub.recv_multipart()
            received = 0
            size = 0
            t0 = _clock()
            for b in batches:
                pub.offer(b)
            while received < len(batches):
                frames = await sub.recv_multipart()
                received += 1
                size += len(frames[2])
            seconds = _clock() - t0
    finally:
        sub.close()
        ctx.term()
    pages = sum(len(e.block_hashes) for e in events if isinstance(e, BlockStored | BlockRemoved))
    return {
        "batches": len(batches),
        "events": len(events),
        "pages": pages,
        "pages_per_s": pages / seconds,
        "seconds": seconds,
        "events_per_s": len(events) / seconds,
        "batches_per_s": len(batches) / seconds,
        "mb_per_s": size / seconds / 1e6,
        "dropped": pub.stats.batches_dropped,
    }


def _best(runs: list[dict[str, Any]]) -> dict[str, Any]:
    return min(runs, key=lambda r: r["seconds"])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m urc.apps.bench.kv_events", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--page-sizes", nargs="+", type=int, default=[1, 16])
    ap.add_argument("--num-seqs", type=int, default=1000)
    ap.add_argument("--chunk-len", type=int, default=256)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--batch-events", type=int, default=8, help="events per published batch")
    ap.add_argument("--repeat", type=int, default=3, help="best of N runs")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    seqs = generate_sequences(args.num_seqs, args.chunk_len, args.seed)
    report: dict[str, Any] = {}
    for ps in args.page_sizes:
        drains, publishes = [], []
        for _ in range(args.repeat):
            figures, events = run_drain(seqs, ps)
            drains.append(figures)
            publishes.append(anyio.run(run_publish, events, args.batch_events))
        report[f"page{ps}"] = {"drain": _best(drains), "publish": _best(publishes)}
        print(json.dumps({f"page{ps}": report[f"page{ps}"]}), flush=True)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
