"""A minimal async server embedding the cache: a line protocol over TCP, on anyio alone.

Protocol (one request per line, one reply per line; token ids are integers)::

    INSERT tok tok ...   -> OK <already_cached> <total>      cache this token sequence
    MATCH tok tok ...    -> OK <device_hit> <host_hit>       longest cached prefix
    STATS                -> OK nodes=<n> cached_tokens=<t> match_requests=<m> hit_tokens=<h>
    QUIT                 -> (closes the connection)
    anything else        -> ERR <message>

Every connection is served by its own task; all of them share one
:class:`~urc.AsyncUnifiedRadixCache`, whose actor applies their commands one at a time, so
the handlers need no lock.  The server binds 127.0.0.1.

Run it and talk to it::

    python examples/async_server.py --port 7000
    printf 'INSERT 1 2 3 4\\nMATCH 1 2 3 9\\nSTATS\\n' | nc -q1 127.0.0.1 7000
"""

from __future__ import annotations

import argparse
import contextlib
from functools import partial

import anyio
from anyio.abc import SocketAttribute, SocketStream, TaskStatus
from anyio.streams.buffered import BufferedByteReceiveStream

from urc import AsyncUnifiedRadixCache, CacheConfig, Tier, URCError

MAX_LINE = 1 << 20


async def respond(svc: AsyncUnifiedRadixCache, line: str) -> str | None:
    """The reply to one request line (``None``: close the connection)."""
    verb, _, rest = line.strip().partition(" ")
    verb = verb.upper()
    if verb == "QUIT":
        return None
    try:
        if verb == "STATS":
            s = await svc.stats()
            cached = sum(c.evictable + c.protected for c in s.components if c.tier == 0)
            return (
                f"OK nodes={s.num_nodes} cached_tokens={cached} "
                f"match_requests={s.match_requests} hit_tokens={s.hit_tokens[Tier.DEVICE]}"
            )
        try:
            tokens = [int(t) for t in rest.split()]
        except ValueError as exc:  # int("x"); an id outside int64 is the cache's to refuse
            return f"ERR token ids must be integers: {exc}"
        if not tokens:
            return f"ERR {verb or 'empty line'}: expected a verb and token ids"
        if verb == "MATCH":
            m = await svc.match(tokens)
            return f"OK {m.prefix_len} {m.host_hit_length}"
        if verb == "INSERT":
            slots = await svc.alloc(len(tokens))  # evicts least recently used data when full
            res = await svc.insert(tokens, slots)  # the tree takes the slots (frees duplicates)
            return f"OK {res.prefix_len} {res.total_len}"
        return f"ERR unknown verb {verb!r} (INSERT, MATCH, STATS, QUIT)"
    except URCError as exc:  # e.g. OutOfMemoryError: the service keeps serving
        return f"ERR {type(exc).__name__}: {exc}"


async def handle(svc: AsyncUnifiedRadixCache, stream: SocketStream) -> None:
    """Serve one connection until QUIT or the client closes."""
    async with stream:
        reader = BufferedByteReceiveStream(stream)
        while True:
            try:
                raw = await reader.receive_until(b"\n", MAX_LINE)
            except (anyio.EndOfStream, anyio.IncompleteRead, anyio.DelimiterNotFound):
                return
            reply = await respond(svc, raw.decode("utf-8", errors="replace"))
            if reply is None:
                return
            await stream.send(reply.encode() + b"\n")


async def serve(
    svc: AsyncUnifiedRadixCache,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    task_status: TaskStatus[int] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Listen on ``host:port`` (0: a free port, reported through ``task_status``) until
    cancelled."""
    listener = await anyio.create_tcp_listener(local_host=host, local_port=port)
    async with listener:
        task_status.started(int(listener.extra(SocketAttribute.local_port)))
        await listener.serve(partial(handle, svc))


async def main(port: int, kv_size: int) -> None:
    svc = AsyncUnifiedRadixCache(CacheConfig(kv_size=kv_size))
    async with svc, anyio.create_task_group() as tg:
        bound = await tg.start(serve, svc, "127.0.0.1", port)
        print(f"listening on 127.0.0.1:{bound} (Ctrl-C to stop)", flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=7000, help="TCP port (0: any free port)")
    parser.add_argument("--kv-size", type=int, default=1 << 16, help="device KV slots")
    args = parser.parse_args()
    with contextlib.suppress(KeyboardInterrupt):
        anyio.run(main, args.port, args.kv_size)
