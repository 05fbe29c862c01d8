"""Read a live SGLang server's KV events through its publisher's replay socket (side env).

Run by the live suite with the side environment's interpreter, where SGLang is importable:
``python kv_event_reader.py <replay endpoint>``, one process per server for its lifetime
(importing SGLang is slow).  For each sequence number it reads on stdin it asks SGLang's
``ZmqEventPublisher`` replay ROUTER for every batch from there on, decodes each with SGLang's
own ``KVEventBatch`` (msgspec), and prints one JSON line: ``next`` (the sequence number after
the last batch read) and ``events``, one ``[type, blocks]`` per event (``blocks``: the number
of block hashes it names; 0 for ``AllBlocksCleared``).  Exits 2 when the publisher does not
answer within 30 s.
"""

from __future__ import annotations

import json
import sys

import msgspec
import zmq
from sglang.srt.disaggregation.kv_events import KVEventBatch

_END = (-1).to_bytes(8, "big", signed=True)


def main() -> int:
    endpoint = sys.argv[1]
    socket = zmq.Context.instance().socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(endpoint)
    print("ready", flush=True)
    for line in sys.stdin:
        first = int(line)
        socket.send_multipart((b"", first.to_bytes(8, "big")))
        events: list[list[object]] = []
        nxt = first
        while True:
            if not socket.poll(30_000):
                print(f"replay {endpoint}: no answer from sequence {nxt}", file=sys.stderr)
                return 2
            _, _, seq, payload = socket.recv_multipart()
            if seq == _END:
                break
            nxt = int.from_bytes(seq, "big") + 1
            for event in msgspec.msgpack.decode(payload, type=KVEventBatch).events:
                events.append([type(event).__name__, len(getattr(event, "block_hashes", ()))])
        print(json.dumps({"next": nxt, "events": events}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
