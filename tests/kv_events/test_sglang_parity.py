"""urc's published KV events against SGLang 0.5.23's own cache, over real ZMQ sockets.

One script of inserts, matches, evictions, write-backs (backups), load-backs, host evictions
and resets runs on urc's service (with a host tier and the publisher) and, in a subprocess
(``sglang_side.py``), on SGLang's ``UnifiedRadixCache`` with ``enable_kv_cache_events=True``
(its Rust tree core, the default, and its Python one; without a host tier: a load-back there
is the same tokens inserted again, a backup the match urc's side makes to find its node, a
host eviction nothing).  The subprocess subscribes to urc's publisher, loses part of the
stream on purpose, replays it through the ROUTER socket and decodes every batch with
SGLang's own msgspec ``KVEventBatch``.

Asserted, one record per page and one per merged event: urc's GPU and reset events are
exactly SGLang's, in the same order with the same hashes, parents and tokens; everything
else urc published is on ``CPU_PINNED`` (the host tier SGLang's cache here does not have),
each page with the hash its GPU twin has.  Needs /work/shared/sglang (development material,
used in place) and the wheel; skips cleanly without them.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest
from anyio.streams.buffered import BufferedByteReceiveStream
from hicache_harness import make

pytest.importorskip("zmq")
pytest.importorskip("msgspec")

from urc import ComponentType, MatchPrefixParams, RadixKey, UnifiedRadixCache
from urc.host_protocol import WritePolicy
from urc.service import AsyncUnifiedRadixCache, KVEventPublisher, KVEventsConfig

SHIM_DIR = Path(__file__).resolve().parents[2].parent / "shared" / "sglang"
SIDE = Path(__file__).with_name("sglang_side.py")
pytestmark = pytest.mark.skipif(
    not (SHIM_DIR / "sglang_shim_0523.py").exists(), reason=f"{SHIM_DIR} is absent"
)


def _script(ps: int) -> list[list[Any]]:
    def pages(start: int, n: int) -> list[int]:
        return list(range(start, start + n * ps))

    a = pages(1, 8)
    b = a[: 4 * ps] + pages(5000, 4)
    c = a[: 2 * ps] + pages(6000, 3)
    d = pages(7000, 5)
    return [
        ["insert", a], ["backup", a], ["insert", b], ["insert", c], ["insert", d],
        ["evict", 4 * ps], ["evict", 4 * ps], ["load", a], ["match", d], ["insert", b],
        ["evict", 100 * ps], ["evict_host", 100 * ps],
        ["insert", a], ["backup", a], ["insert", c], ["reset"],
        ["insert", c], ["insert", d], ["evict", 3 * ps], ["evict", 100 * ps],
    ]  # fmt: skip


async def _run_urc(svc: AsyncUnifiedRadixCache, script: list[list[Any]]) -> None:
    def node_of(cache: UnifiedRadixCache, tokens: list[int], host: bool) -> Any:
        m = cache.match_prefix(MatchPrefixParams(RadixKey(tokens)))
        return m.last_host_node if host else m.last_device_node

    for op in script:
        kind, arg = op[0], op[-1]
        if kind == "insert":
            await svc.insert(arg, await svc.alloc(len(arg)))
        elif kind == "match":
            await svc.match(arg)
        elif kind == "evict":
            await svc.evict(arg)
        elif kind == "backup":
            assert await svc.call(lambda c, t=arg: c.write_backup(node_of(c, t, False))) > 0
        elif kind == "load":
            assert await svc.call(lambda c, t=arg: c.load_back(node_of(c, t, True))) > 0
        elif kind == "evict_host":
            await svc.call(lambda c, n=arg: c.evict_host(n))
        else:
            await svc.call(lambda c: c.reset())
        await svc.sanity_check()


@pytest.mark.asyncio
@pytest.mark.parametrize(("ps", "backend"), [(1, "rust"), (4, "rust"), (4, "python")])
async def test_urc_publishes_every_event_sglang_records_in_order_with_its_hashes(
    ps: int, backend: str
) -> None:
    script = _script(ps)
    pub = KVEventPublisher(
        KVEventsConfig(
            endpoint="tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0", topic="urc"
        )
    )
    cache = make((ComponentType.FULL,), ps, WritePolicy.WRITE_THROUGH, kv_pages=128)
    async with AsyncUnifiedRadixCache(cache, workers=[pub]) as svc:
        with anyio.fail_after(10):
            await pub.started.wait()
        proc = await anyio.open_process(
            [sys.executable, str(SIDE)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        async with proc:
            assert proc.stdin is not None and proc.stdout is not None
            out = BufferedByteReceiveStream(proc.stdout)
            spec = {
                "shim_dir": str(SHIM_DIR), "page_size": ps, "topic": "urc", "gap_from": 3,
                "backend": backend,
                "script": script,
                "pub": pub.endpoint, "replay": pub.replay_endpoint,
            }  # fmt: skip
            await proc.stdin.send((json.dumps(spec) + "\n").encode())
            try:
                with anyio.fail_after(600):  # the first run unpacks the wheel
                    ready = await out.receive_until(b"\n", 1 << 10)
            except (anyio.IncompleteRead, anyio.EndOfStream):
                await proc.wait()
                if proc.returncode == 77:
                    pytest.skip("SGLang 0.5.23 cannot be loaded here")
                raise
            assert ready == b"ready"
            await _run_urc(svc, script)
            with anyio.fail_after(10):
                await pub.wait_drained()
            published = pub.stats.batches_published
            await proc.stdin.send(f"published {published}\n".encode())
            with anyio.fail_after(60):
                line = await out.receive_until(b"\n", 1 << 26)
            assert await proc.wait() == 0
    got = json.loads(line)
    assert got["backend"] == backend  # SGLang's tree core that recorded its events
    assert got["types"] == ["AllBlocksCleared", "BlockRemoved", "BlockStored"]
    assert got["ranks"] == [0]
    # Part of the stream was lost on purpose and came back through the replay socket.
    assert got["replayed"] and min(got["replayed"]) <= 3
    assert sorted(set(got["live"]) | set(got["replayed"])) == list(range(published))
    ours, theirs = got["urc"], got["sglang"]
    assert theirs, "SGLang recorded no event"
    on_device = [r for r in ours if r[0] == "C" or r[1] == "GPU"]
    assert on_device == theirs
    host = [r for r in ours if r not in on_device]
    assert host and all(r[1] == "CPU_PINNED" for r in host)
    gpu_hashes = {r[2] for r in theirs if r[0] == "S"}
    assert {r[2] for r in host} <= gpu_hashes
    # Merged as SGLang's recorder merges them (each side drains once per operation).
    assert [e for e in got["urc_events"] if e[1] != "CPU_PINNED"] == got["sglang_events"]
