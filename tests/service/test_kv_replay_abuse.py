"""The KV-event replay ROUTER under abuse (issue 50 item 1), on real ZMQ sockets: a flood of
requests from a client that never reads, an oversized or malformed request frame.  The
replay server bounds each (one replay per client, frames of at most 1 KiB, stalled clients
abandoned) and well-behaved clients and the service keep being served."""

from __future__ import annotations

from typing import Any

import anyio
import pytest

pytest.importorskip("msgspec")
pytest.importorskip("zmq")
import zmq
import zmq.asyncio

from urc import CacheConfig, ComponentType, ConfigError
from urc.kv_events import BlockStored, StorageMedium
from urc.service import AsyncUnifiedRadixCache, KVEventPublisher, KVEventsConfig

END_SEQ = (-1).to_bytes(8, "big", signed=True)
TIMEOUT = 60


def _config() -> CacheConfig:
    return CacheConfig(components=(ComponentType.FULL,), page_size=4, kv_size=1024)


def _publisher(**kw: Any) -> KVEventPublisher:
    return KVEventPublisher(
        KVEventsConfig(endpoint="tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0", **kw)
    )


def _batch(i: int, tokens: int = 4) -> list[Any]:
    return [BlockStored([i], None, list(range(tokens)), tokens, None, StorageMedium.GPU)]


async def _fill(pub: KVEventPublisher, batches: int, tokens: int = 4) -> None:
    for i in range(batches):
        assert pub.offer(_batch(i, tokens))
    await pub.wait_published(batches)


async def _replay(ctx: Any, endpoint: str, start: int) -> list[int]:
    """A well-behaved client: the sequences replayed from ``start``, up to the end marker."""
    req = ctx.socket(zmq.DEALER)
    req.setsockopt(zmq.LINGER, 0)
    req.connect(endpoint)
    try:
        await req.send_multipart([b"", start.to_bytes(8, "big")])
        seqs = []
        while True:
            frames = await req.recv_multipart()
            if frames[2] == END_SEQ:
                return seqs
            seqs.append(int.from_bytes(frames[2], "big"))
    finally:
        req.close()


async def _wait_for(pred: Any) -> None:
    while not pred():
        await anyio.sleep(0.01)


@pytest.mark.asyncio
async def test_a_flood_of_repeats_from_one_client_gets_one_replay_and_others_are_served() -> None:
    """300 requests from a client that never reads: one replay runs, 299 are refused, and a
    well-behaved client and the service's commands are served meanwhile."""
    pub = _publisher(buffer_steps=5000, max_queued=5000)
    ctx = zmq.asyncio.Context()
    flood = ctx.socket(zmq.DEALER)
    flood.setsockopt(zmq.LINGER, 0)
    flood.setsockopt(zmq.RCVHWM, 1)
    try:
        with anyio.fail_after(TIMEOUT):
            async with AsyncUnifiedRadixCache(_config(), workers=[pub]) as svc:
                await pub.started.wait()
                assert pub.replay_endpoint is not None
                await _fill(pub, 5000)
                flood.connect(pub.replay_endpoint)
                for _ in range(300):
                    await flood.send_multipart([b"", (0).to_bytes(8, "big")])
                assert await _replay(ctx, pub.replay_endpoint, 4990) == list(range(4990, 5000))
                slots = await svc.alloc(8)
                await svc.insert(list(range(8)), slots)
                assert (await svc.match(list(range(8)))).prefix_len == 8
                await _wait_for(lambda: pub.stats.replay_requests == 301)
                s = pub.stats
                assert s.replay_requests_refused >= 290, s
    finally:
        flood.close()
        ctx.term()


@pytest.mark.asyncio
async def test_a_client_that_stops_reading_loses_its_replay() -> None:
    """Its queue stays full past ``replay_stall_s``: the replay is abandoned and counted, and
    the client may ask again."""
    pub = _publisher(buffer_steps=3000, max_queued=3000, replay_stall_s=0.2)
    ctx = zmq.asyncio.Context()
    stuck = ctx.socket(zmq.DEALER)
    stuck.setsockopt(zmq.LINGER, 0)
    stuck.setsockopt(zmq.RCVHWM, 1)
    stuck.setsockopt(zmq.RCVBUF, 4096)
    try:
        with anyio.fail_after(TIMEOUT):
            async with AsyncUnifiedRadixCache(_config(), workers=[pub]):
                await pub.started.wait()
                assert pub.replay_endpoint is not None
                await _fill(pub, 3000, tokens=1024)  # ~10 KiB a batch: ~30 MB in all
                stuck.connect(pub.replay_endpoint)
                await stuck.send_multipart([b"", (0).to_bytes(8, "big")])
                await _wait_for(lambda: pub.stats.replays_abandoned == 1)
                assert await _replay(ctx, pub.replay_endpoint, 2999) == [2999]
    finally:
        stuck.close()
        ctx.term()


@pytest.mark.asyncio
@pytest.mark.parametrize("start", [b"x" * (1 << 20), b"\x00\x01\x02"], ids=["1MiB", "3B"])
async def test_an_oversized_or_malformed_request_gets_no_answer(start: bytes) -> None:
    """A 1 MiB start frame disconnects its peer inside libzmq (never buffered); a start frame
    that is not 8 bytes is ignored (SGLang ignores a malformed request)."""
    pub = _publisher()
    ctx = zmq.asyncio.Context()
    bad = ctx.socket(zmq.DEALER)
    bad.setsockopt(zmq.LINGER, 0)
    try:
        with anyio.fail_after(TIMEOUT):
            async with AsyncUnifiedRadixCache(_config(), workers=[pub]):
                await pub.started.wait()
                assert pub.replay_endpoint is not None
                await _fill(pub, 3)
                bad.connect(pub.replay_endpoint)
                await bad.send_multipart([b"", start])
                assert await _replay(ctx, pub.replay_endpoint, 0) == [0, 1, 2]
                assert not await bad.poll(timeout=500)  # no answer, not even an end marker
                assert pub.stats.replay_requests == 1  # only the good one was read
    finally:
        bad.close()
        ctx.term()


@pytest.mark.parametrize("kw", [{"replay_max_clients": 0}, {"replay_stall_s": 0.0}])
def test_bad_replay_limits_are_refused(kw: dict[str, Any]) -> None:
    with pytest.raises(ConfigError):
        KVEventsConfig(**kw)


def test_the_pub_socket_binds_loopback_by_default() -> None:
    """Issue 50 item 9: like the metrics server and the CLI, not every interface."""
    assert KVEventsConfig().endpoint == "tcp://127.0.0.1:5557"


@pytest.mark.asyncio
async def test_batches_a_subscriber_misses_at_its_high_water_mark_are_counted() -> None:
    """Issue 50 item 9: a subscriber that never reads missed most batches at the PUB's
    high-water mark while ``batches_dropped`` stayed 0."""
    pub = _publisher(hwm=1, buffer_steps=10)
    ctx = zmq.asyncio.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.RCVHWM, 1)
    sub.setsockopt(zmq.RCVBUF, 4096)
    try:
        with anyio.fail_after(TIMEOUT):
            async with AsyncUnifiedRadixCache(_config(), workers=[pub]):
                await pub.started.wait()
                assert pub.endpoint is not None
                sub.connect(pub.endpoint)
                sub.setsockopt(zmq.SUBSCRIBE, b"")
                sent = 0
                while pub.stats.batches_dropped == 0 and sent < 20_000:
                    for i in range(200):  # ~10 KiB a batch
                        assert pub.offer(_batch(sent + i, tokens=1024))
                    sent += 200
                    await pub.wait_published(sent)
                s = pub.stats
                assert s.batches_dropped > 0 and s.events_dropped == s.batches_dropped, s
                assert s.batches_published == sent  # published: to whoever had room
    finally:
        sub.close()
        ctx.term()
