"""The SGLang side of ``test_sglang_parity.py``, run in a subprocess (SGLang's import shim
stubs modules process-wide, so it never runs inside the test process).

Reads one JSON line on stdin: ``shim_dir`` (the folder holding ``sglang_shim_0523.py``,
/work/shared/sglang: development material, imported from there, never copied), ``page_size``,
``script`` (ops: ``["insert"|"match"|"load"|"backup", tokens]``, ``["evict"|"evict_host",
n]``, ``["reset"]``), ``pub``/``replay`` (urc's endpoints), ``topic``,
``gap_from``.  Runs the script on SGLang 0.5.23's own ``UnifiedRadixCache`` with
``enable_kv_cache_events=True`` (a ``load`` inserts the tokens again: on a cache without a
host tier that is how the pages come back to device; a ``backup`` is the match urc makes to
find the node it backs up; ``evict_host`` does nothing), subscribes to urc's publisher, prints
``ready``, waits for ``published N``, takes the live frames, treats every frame from
``gap_from`` on as lost, asks the replay socket for the rest, decodes every payload with
SGLang's own ``KVEventBatch`` and prints one JSON line: both streams, one record per page
and one per (merged) event.
Exit status 77: SGLang 0.5.23 could not be loaded here (the test skips).
"""

from __future__ import annotations

import json
import sys
import time
from array import array
from typing import Any


def _flat(events: list[Any]) -> list[list[Any]]:
    out: list[list[Any]] = []
    for e in events:
        name = type(e).__name__
        medium = getattr(e, "medium", None)
        medium = getattr(medium, "value", medium)
        if name == "BlockStored":
            parent = e.parent_block_hash
            bs = e.block_size
            for i, h in enumerate(e.block_hashes):
                out.append(["S", medium, h, parent, list(e.token_ids[i * bs : (i + 1) * bs])])
                parent = h
        elif name == "BlockRemoved":
            out.extend(["R", medium, h] for h in e.block_hashes)
        else:
            out.append(["C"])
    return out


def _whole(events: list[Any]) -> list[list[Any]]:
    """One record per event, as merged: type, medium, hashes, parent, tokens, block size."""
    out: list[list[Any]] = []
    for e in events:
        medium = getattr(e, "medium", None)
        out.append(
            [
                type(e).__name__,
                getattr(medium, "value", medium),
                list(getattr(e, "block_hashes", [])),
                getattr(e, "parent_block_hash", None),
                list(getattr(e, "token_ids", [])),
                getattr(e, "block_size", None),
            ]
        )
    return out


def main() -> int:
    spec = json.loads(sys.stdin.readline())
    sys.path.insert(0, spec["shim_dir"])
    try:
        import sglang_shim_0523 as shim

        h = shim.make_sglang_cache(
            "unified-full",
            page_size=spec["page_size"],
            kv_size=1 << 14,
            enable_kv_cache_events=True,
            tree_core_backend=spec.get("backend"),
        )
        import msgspec
        import zmq
        from sglang.srt.disaggregation.kv_events import KVEventBatch
        from sglang.srt.mem_cache.base_prefix_cache import (
            EvictParams,
            InsertParams,
            MatchPrefixParams,
        )
        from sglang.srt.mem_cache.radix_cache import RadixKey
    except Exception as exc:  # no wheel, no network, no compiler: nothing to compare with
        print(f"cannot load SGLang 0.5.23: {exc!r}", file=sys.stderr)
        return 77
    cache = h.cache
    cache.take_events()  # the AllBlocksCleared of its construction
    sgl: list[Any] = []
    for op in spec["script"]:
        kind = op[0]
        if kind in ("insert", "load"):
            value = h.alloc_kv(len(op[1]))
            cache.insert(InsertParams(key=RadixKey(array("q", op[1])), value=value))
        elif kind in ("match", "backup"):
            cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", op[1]))))
        elif kind == "evict":
            cache.evict(EvictParams(num_tokens=op[1]))
        elif kind == "reset":
            cache.reset()
        sgl.extend(cache.take_events())

    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.connect(spec["pub"])
    sub.setsockopt(zmq.SUBSCRIBE, spec["topic"].encode())
    # No wait for the subscription to reach the publisher: frames a late subscriber misses
    # come back through the replay below, like the ones it drops on purpose.
    print("ready", flush=True)
    published = int(sys.stdin.readline().split()[1])
    live: dict[int, bytes] = {}
    deadline = time.monotonic() + 5
    last = -1  # live frames stop at the last published one (or the deadline, if it was missed)
    while last < published - 1 and time.monotonic() < deadline:
        if sub.poll(100):
            _topic, seq, payload = sub.recv_multipart()
            last = int.from_bytes(seq, "big")
            if last < spec["gap_from"]:
                live[last] = payload
    first = min([n for n in range(published) if n not in live] or [published])
    req = ctx.socket(zmq.DEALER)
    req.setsockopt(zmq.LINGER, 0)
    req.connect(spec["replay"])
    req.send_multipart([b"", first.to_bytes(8, "big")])
    replayed: dict[int, bytes] = {}
    end = (-1).to_bytes(8, "big", signed=True)
    while True:
        if not req.poll(5000):
            print("replay timed out", file=sys.stderr)
            return 1
        _, _topic, seq, payload = req.recv_multipart()
        if seq == end:
            break
        replayed[int.from_bytes(seq, "big")] = payload
    decoder = msgspec.msgpack.Decoder(KVEventBatch)
    batches = [decoder.decode(p) for _, p in sorted({**replayed, **live}.items())]
    theirs = [e for b in batches for e in b.events]
    print(
        json.dumps(
            {
                "backend": h.backend,
                "sglang": _flat(sgl),
                "urc": _flat(theirs),
                "sglang_events": _whole(sgl),
                "urc_events": _whole(theirs),
                "types": sorted({type(e).__name__ for e in theirs}),
                "live": sorted(live),
                "replayed": sorted(replayed),
                "ranks": sorted({b.attn_dp_rank for b in batches}),
            }
        ),
        flush=True,
    )
    sub.close()
    req.close()
    ctx.term()
    return 0


if __name__ == "__main__":
    sys.exit(main())
