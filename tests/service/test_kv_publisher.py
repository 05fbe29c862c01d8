"""The service's KV-event publisher on real ZMQ sockets (127.0.0.1): SGLang 0.5.23's frames
(topic, 8-byte sequence, msgpack batch), the replay ROUTER and its end marker, the bounded
queue and its drop counts, and the cache's events turned off when the service closes."""

from __future__ import annotations

from typing import Any

import anyio
import pytest

pytest.importorskip("zmq")
msgspec = pytest.importorskip("msgspec")
import zmq  # noqa: E402
import zmq.asyncio  # noqa: E402

from urc import CacheConfig, ComponentType, ConfigError  # noqa: E402
from urc.kv_events import BlockStored, StorageMedium  # noqa: E402
from urc.service import AsyncUnifiedRadixCache, KVEventPublisher, KVEventsConfig  # noqa: E402

END_SEQ = (-1).to_bytes(8, "big", signed=True)
PS = 4


def _config() -> CacheConfig:
    return CacheConfig(components=(ComponentType.FULL,), page_size=PS, kv_size=1024)


def _publisher(**kw: Any) -> KVEventPublisher:
    return KVEventPublisher(
        KVEventsConfig(
            endpoint="tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0", topic="kv", **kw
        )
    )


async def _insert(svc: AsyncUnifiedRadixCache, branch: int) -> None:
    tokens = [*range(1, 9), *([100 + branch] * PS)]
    slots = await svc.alloc(len(tokens))
    await svc.insert(tokens, slots)


async def _replay(ctx: Any, endpoint: str, start: int) -> list[list[bytes]]:
    req = ctx.socket(zmq.DEALER)
    req.setsockopt(zmq.LINGER, 0)
    req.connect(endpoint)
    try:
        await req.send_multipart([b"", start.to_bytes(8, "big")])
        out = []
        while True:
            frames = await req.recv_multipart()
            if frames[2] == END_SEQ:
                assert frames == [b"", b"", END_SEQ, b""]
                return out
            out.append(frames[1:])
    finally:
        req.close()


@pytest.mark.asyncio
async def test_batches_go_out_as_topic_sequence_payload_and_replay_after_a_gap() -> None:
    pub = _publisher()
    ctx = zmq.asyncio.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    try:
        with anyio.fail_after(20):
            async with AsyncUnifiedRadixCache(_config(), workers=[pub]) as svc:
                await pub.started.wait()
                assert pub.endpoint is not None and pub.replay_endpoint is not None
                sub.connect(pub.endpoint)
                sub.setsockopt(zmq.SUBSCRIBE, b"kv")
                for branch in range(4):
                    await _insert(svc, branch)
                # Live frames (a subscriber may join late: it replays what it missed).
                live: dict[int, list[bytes]] = {}
                with anyio.move_on_after(2):
                    while len(live) < 4:
                        frames = await sub.recv_multipart()
                        live[int.from_bytes(frames[1], "big")] = frames
                # A gap: the subscriber lost seq 1 and on (and whatever never arrived).
                first = min(n for n in range(4) if n not in live or n >= 1)
                replayed = await _replay(ctx, pub.replay_endpoint, first)
                assert [int.from_bytes(f[1], "big") for f in replayed] == list(range(first, 4))
                for topic, seq, payload in replayed:
                    assert topic == b"kv" and len(seq) == 8
                    n = int.from_bytes(seq, "big")
                    if n in live:
                        assert live[n] == [topic, seq, payload]  # the same bytes
                    ts, events, rank = msgspec.msgpack.decode(payload)
                    assert isinstance(ts, float) and rank == 0
                    (event,) = events
                    assert event["type"] == "BlockStored" and event["medium"] == "GPU"
                    assert event["token_ids"][-PS:] == [100 + n] * PS
                    assert set(event) == {
                        "type",
                        "block_hashes",
                        "parent_block_hash",
                        "token_ids",
                        "block_size",
                        "lora_id",
                        "medium",
                    }
                assert pub.stats.replay_requests == 1
    finally:
        sub.close()
        ctx.term()


@pytest.mark.asyncio
async def test_a_full_queue_drops_whole_batches_and_counts_them() -> None:
    pub = _publisher(max_queued=2)
    stored = [BlockStored([i], None, [i], 1, None, StorageMedium.GPU) for i in range(3)]
    assert pub.offer(stored[:1]) and pub.offer(stored[1:2])
    assert not pub.offer(stored[2:] + stored[:1])  # the queue holds two batches: dropped
    s = pub.stats
    assert (s.batches_dropped, s.events_dropped, s.batches_published) == (1, 2, 0)
    ctx = zmq.asyncio.Context()
    try:
        with anyio.fail_after(20):
            async with AsyncUnifiedRadixCache(_config(), workers=[pub]) as svc:
                await pub.started.wait()
                assert pub.replay_endpoint is not None
                await _insert(svc, 0)
                await pub.wait_published(3)
                frames = await _replay(ctx, pub.replay_endpoint, 0)
                payloads = [msgspec.msgpack.decode(f[2])[1] for f in frames]
                assert [p[0]["block_hashes"] for p in payloads[:2]] == [[0], [1]]
                assert payloads[2][0]["token_ids"][-PS:] == [100] * PS
            assert pub.stats.events_published == 3
            assert svc.cache.kv_events is None  # off again once the publisher stopped
    finally:
        ctx.term()


@pytest.mark.asyncio
async def test_events_recorded_as_the_service_closes_are_still_sent() -> None:
    pub = _publisher()
    with anyio.fail_after(20):
        async with AsyncUnifiedRadixCache(_config(), workers=[pub]) as svc:
            await pub.started.wait()
            await _insert(svc, 0)
            await _insert(svc, 1)
    assert pub.stats.events_published == 2 and pub.queued == 0


@pytest.mark.parametrize(
    "kw",
    [{"max_queued": 0}, {"buffer_steps": -1}, {"hwm": -1}, {"endpoint": "127.0.0.1:5557"}],
)
def test_bad_publisher_configs_are_refused(kw: dict[str, Any]) -> None:
    with pytest.raises(ConfigError):
        KVEventsConfig(**kw)


def test_the_publishers_counters_are_scraped_from_its_stats() -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from metrics.kv_events import KVPublisherMetrics

    pub = _publisher(max_queued=1)
    registry = CollectorRegistry()
    KVPublisherMetrics(registry, pub)
    event = BlockStored([1], None, [1], 1, None, StorageMedium.GPU)
    pub.offer([event])
    pub.offer([event, event])  # dropped: the queue holds one batch
    text = generate_latest(registry).decode()
    assert "urc_kv_event_batches_dropped_total 1.0" in text
    assert "urc_kv_events_dropped_total 2.0" in text
    assert "urc_kv_events_published_total 0.0" in text
    with pytest.raises(ValueError):
        KVPublisherMetrics(registry, pub)  # the names are taken
