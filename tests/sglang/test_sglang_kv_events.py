"""``--kv-events-config`` with ``--radix-cache-backend urc``, against the real 0.5.23 wheel.

SGLang's ``create_tree_cache`` builds urc with ``enable_kv_cache_events``; SGLang's own
scheduler functions (``scheduler_steps``) drive requests through it; after every step
SGLang's own scheduler-side consumer (``SchedulerKvEventsPublisher.publish_kv_events``:
``tree_cache.take_events()`` into a ``KVEventBatch`` on its ``ZmqEventPublisher``) publishes
them, and a subscriber reads them back through the publisher's replay socket, decoded with
SGLang's own ``KVEventBatch``.  A router rebuilt from those events alone holds exactly the
tree's device pages, every page's hash is the SHA-256 chain of its path (SGLang's event
hash, recomputed here from the tokens), and evictions show up as removals.
"""

from __future__ import annotations

import json
import random
import time
from array import array
from hashlib import sha256
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.usefixtures("sglang")

_END = (-1).to_bytes(8, "big", signed=True)


def _page_hash(prior: bytes | None, page: list[int]) -> bytes:
    """SGLang's event hash of one page (``hash_binding.cpp``): SHA-256 of the previous
    page's digest and the page's tokens as little-endian uint32 (the tokens here are small)."""
    h = sha256(prior) if prior is not None else sha256()
    h.update(array("I", page).tobytes())
    return h.digest()


def _int64(digest: bytes) -> int:
    return int.from_bytes(digest[:8], "big", signed=True)


class Router:
    """What a cache-aware router keeps per replica: every live page (per medium) with its
    parent and tokens, built from the events alone."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        # medium -> block hash -> (parent hash, this page's tokens, digest of its path)
        self.pages: dict[str, dict[int, tuple[int | None, list[int], bytes]]] = {}
        self.removed: dict[str, int] = {}  # pages removed, per medium

    def apply(self, events: list[Any]) -> None:
        from sglang.srt.disaggregation.kv_events import (
            AllBlocksCleared,
            BlockRemoved,
            BlockStored,
        )

        for e in events:
            if isinstance(e, AllBlocksCleared):
                self.pages.clear()
            elif isinstance(e, BlockStored):
                self._stored(e)
            else:
                assert isinstance(e, BlockRemoved), f"not one of SGLang's events: {e!r}"
                live = self.pages.get(e.medium, {})
                for h in e.block_hashes:
                    assert h in live, f"removed {h} on {e.medium}, never stored there"
                    del live[h]
                    self.removed[e.medium] = self.removed.get(e.medium, 0) + 1

    def _stored(self, e: Any) -> None:
        ps = self.page_size
        assert e.block_size == ps and e.lora_id is None and e.cache_salt is None
        assert e.session_id is None and e.lora_name is None
        assert len(e.token_ids) == len(e.block_hashes) * ps, e
        live = self.pages.setdefault(e.medium, {})
        parent = e.parent_block_hash
        # The parent is a page this medium (or the device, for a host copy) holds.
        prior = None
        if parent is not None:
            known = live.get(parent) or self.pages.get("GPU", {}).get(parent)
            assert known is not None, f"store under unknown parent {parent}"
            prior = known[2]
        for i, h in enumerate(e.block_hashes):
            page = list(e.token_ids[i * ps : (i + 1) * ps])
            digest = _page_hash(prior, page)
            assert _int64(digest) == h, f"page {page}: hash {h} is not its path's chain"
            live[h] = (parent, page, digest)
            parent, prior = h, digest

    def paths(self, medium: str) -> list[list[int]]:
        """Each live page's whole path of tokens from the root."""
        live = self.pages.get(medium, {})
        out = []
        for h in live:
            tokens: list[int] = []
            walk: int | None = h
            while walk is not None:
                parent, page, _ = live.get(walk) or self.pages["GPU"][walk]
                tokens[:0] = page
                walk = parent
            out.append(tokens)
        return out


class Subscriber:
    """Reads everything SGLang's ``ZmqEventPublisher`` has published, through its replay
    ROUTER (a DEALER asking from sequence ``next``), decoded with SGLang's ``KVEventBatch``."""

    def __init__(self, replay: str) -> None:
        import zmq

        self.socket = zmq.Context.instance().socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(replay)
        self.next = 0

    def read(self, batches: int, timeout: float = 30.0) -> list[Any]:
        """The events of the next ``batches`` batches, oldest first (waits for the
        publisher's thread to have sent them)."""
        import msgspec
        from sglang.srt.disaggregation.kv_events import KVEventBatch

        events: list[Any] = []
        deadline = time.monotonic() + timeout
        while batches:
            self.socket.send_multipart((b"", self.next.to_bytes(8, "big")))
            while True:
                assert self.socket.poll(int(max(deadline - time.monotonic(), 0) * 1000)), (
                    f"replay: {batches} batches from {self.next} never came"
                )
                _, _, seq, payload = self.socket.recv_multipart()
                if seq == _END:
                    break
                assert int.from_bytes(seq, "big") == self.next and batches
                events += msgspec.msgpack.decode(payload, type=KVEventBatch).events
                self.next += 1
                batches -= 1
            assert time.monotonic() < deadline, f"replay: {batches} batches never came"
        return events

    def close(self) -> None:
        self.socket.close()


def _publisher(cache: Any, tmp_path: Path) -> tuple[Any, str]:
    """SGLang's scheduler-side consumer of ``cache``'s events, publishing over ZMQ on IPC
    sockets in ``tmp_path`` (``--kv-events-config`` as JSON); returns it and its replay
    endpoint."""
    from sglang.srt.managers.scheduler_components.kv_events_publisher import (
        SchedulerKvEventsPublisher,
    )
    from sglang.srt.runtime_context import get_parallel

    replay = f"ipc://{tmp_path}/replay"
    config = json.dumps(
        {"publisher": "zmq", "endpoint": f"ipc://{tmp_path}/pub", "replay_endpoint": replay}
    )
    # The one scheduler of a single-GPU launch: rank 0 everywhere (it owns the publisher).
    ranks = dict(pp_rank=0, attn_tp_rank=0, attn_cp_rank=0, attn_dp_rank=0, dp_rank=0)
    with get_parallel().override(**ranks):
        pub = SchedulerKvEventsPublisher(
            kv_events_config=config, tree_cache=cache, send_metrics_from_scheduler=None,
            max_running_requests=8,
            max_total_num_tokens=cache.token_to_kv_pool_allocator.size, get_stats=lambda: None,
        )  # fmt: skip
    assert pub.enable_kv_cache_events
    return pub, replay


@pytest.mark.parametrize(
    ("kind", "page_size", "seed", "hicache"),
    [
        ("full", 1, 0, None),
        ("full", 4, 1, None),
        ("swa", 4, 2, None),
        ("mamba", 1, 3, None),
        ("full", 4, 4, "write_through"),
        ("swa", 1, 5, "write_back"),
    ],
)
def test_sglangs_publisher_takes_urcs_events_as_a_router_needs_them(
    kind: str, page_size: int, seed: int, hicache: str | None, tmp_path: Path
) -> None:
    """With HiCache (``hicache``: the write policy) the host copies are CPU_PINNED pages,
    and the router's host pages are the tree's too."""
    import sglang_wheel
    from scheduler_steps import Pools, SchedulerLoop, make_context
    from sglang.srt.mem_cache.registry import create_tree_cache

    import urc.apps.sglang

    urc.apps.sglang.register()
    host = {} if hicache is None else {"enable_hierarchical_cache": True, "hicache_ratio": 1.0}
    sglang_wheel.publish_server_args(
        radix_cache_backend="urc", page_size=page_size, attention_backend="torch_native",
        hicache_write_policy=hicache or "write_through", **host,
    )  # fmt: skip
    pools = Pools(page_size, 192, 6, 128, kind=kind)
    ctx = make_context(pools, hicache=hicache is not None, enable_kv_cache_events=True)
    cache = create_tree_cache(ctx)
    loop = SchedulerLoop(cache, pools, chunk=16)
    pub, replay = _publisher(cache, tmp_path)
    sub = Subscriber(replay)
    router = Router(page_size)
    rng = random.Random(seed)
    bases = [[rng.randrange(1, 50) for _ in range(40)] for _ in range(3)]
    published = 0
    try:
        for n in range(61):
            decoding = loop.decoding()
            if n == 60:  # the last step ends every request, so the tree can be reset
                for r in list(loop.running):
                    loop.abort(r) if r in loop.prefilling else loop.finish(r)
            elif len(loop.running) < 4:
                prompt = rng.choice(bases)[: rng.randrange(4, 40)]
                prompt += [rng.randrange(1, 50) for _ in range(rng.randrange(1, 24))]
                loop.prefill(loop.new_req(f"r{n}", prompt, rng.randrange(1, 12)))
            for r in list(loop.prefilling):
                loop.prefill(r)
            if decoding and n < 60:
                loop.decode(decoding)
                for r in decoding:
                    if len(r.output_ids) >= r.sampling_params.max_new_tokens:
                        loop.finish(r)
            loop.check()
            if hicache is not None:
                # The idle turns' polling, at once: host copies run on a worker thread, and
                # one a loaded host has not finished pins its device pages into the next
                # step, where this loop (it has no retraction) ran out of memory in decode.
                cache.wait_for_backups()
            # The scheduler's per-batch drain: whatever the step recorded, published.
            queued = len(cache.urc.kv_events)
            pub.publish_kv_events()
            published += bool(queued)
            assert cache.take_events() == []  # drained
            router.apply(sub.read(published - sub.next))
            tree_tokens = cache.full_evictable_size() + cache.full_protected_size()
            assert len(router.pages.get("GPU", {})) * page_size == tree_tokens, n
            # The router holds exactly the tree's device pages (each as its whole path).
            assert sorted(router.paths("GPU")) == _pages(cache.urc, "value"), n
            assert sorted(router.paths("CPU_PINNED")) == _pages(cache.urc, "host_value"), n
        # The pool ran full: allocations evicted from the tree, and each eviction of a
        # device page reached the router as its removal (the check above, every step).
        assert loop.min_free < 4 * page_size and router.removed.get("GPU"), router.removed
        if hicache is not None:
            assert router.pages.get("CPU_PINNED"), "no host copy was published"
        cache.reset()
        pub.publish_kv_events()
        router.apply(sub.read(1))
        assert router.pages == {}
    finally:
        sub.close()
        pub.kv_event_publisher.shutdown()


def _pages(core: Any, where: str) -> list[list[int]]:
    """Every page the tree holds on device (``where="value"``) or host (``"host_value"``),
    as its path's tokens from the root."""
    from urc.node import ComponentType

    ps = core.page_size
    out = []
    for node in core.tree.nodes():
        full = node.data[ComponentType.FULL]
        if full is None or getattr(full, where) is None:
            continue
        path: list[int] = []
        walk = node
        while walk.parent is not None:
            path[:0] = list(walk.key)
            walk = walk.parent
        start = len(path) - node.key_len
        out.extend(path[:end] for end in range(start + ps, len(path) + 1, ps))
    return sorted(out)


def test_without_kv_events_config_urc_records_no_events() -> None:
    import sglang_wheel
    from scheduler_steps import Pools, SchedulerLoop, make_context
    from sglang.srt.mem_cache.registry import create_tree_cache

    import urc.apps.sglang

    urc.apps.sglang.register()
    sglang_wheel.publish_server_args(radix_cache_backend="urc", page_size=1)
    pools = Pools(1, 64, 2, 64)
    loop = SchedulerLoop(create_tree_cache(make_context(pools)), pools, chunk=16)
    req = loop.new_req("a", [1, 2, 3, 4], 1)
    assert loop.prefill(req)
    loop.finish(req)
    loop.check()
    assert loop.cache.full_evictable_size() > 0  # the tree took the request's pages
    assert loop.cache.urc.kv_events is None and loop.cache.take_events() == []
