"""HTTP ``/metrics`` endpoints: an anyio server for async programs, a thread for sync ones.

:class:`MetricsServer` is a minimal HTTP/1.1 server built on ``anyio.create_tcp_listener``.  It
answers ``GET``/``HEAD`` on :attr:`MetricsServerConfig.path` with the registry in the text
exposition format (or OpenMetrics when the scraper's ``Accept`` header asks for it), closes
the connection after each response, and never lets a bad request, or running out of file
descriptors, take the server down.  It
binds to ``127.0.0.1`` unless told otherwise: exposing metrics beyond the host is a
deployment decision, not a default.

Use it as an async context manager::

    async with MetricsServer(registry) as server:
        print(server.url)              # http://127.0.0.1:<ephemeral port>/metrics
        ...

or run it in your own task group: ``port = await tg.start(server.serve)``.

:func:`start_metrics_http_server` wraps ``prometheus_client.start_http_server`` (a daemon
thread) with the same loopback default and returns the bound port.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import anyio
import anyio.abc
import anyio.to_thread
from anyio.abc import SocketAttribute
from prometheus_client import REGISTRY, CollectorRegistry, start_http_server
from prometheus_client.exposition import choose_encoder

__all__ = [
    "MetricsServer",
    "MetricsServerConfig",
    "SyncMetricsServer",
    "start_metrics_http_server",
]

_log = logging.getLogger(__name__)

_ACCEPT_BACKOFF_MIN_S = 0.01  # first wait after an accept failed (EMFILE, ...)
_ACCEPT_BACKOFF_MAX_S = 1.0

_REASONS = {
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    405: "Method Not Allowed",
    431: "Request Header Fields Too Large",
    500: "Internal Server Error",
}


@dataclass(frozen=True, slots=True)
class MetricsServerConfig:
    """Where and how :class:`MetricsServer` listens.

    ``port=0`` picks a free ephemeral port (read it back from :attr:`MetricsServer.port`).
    ``read_timeout_s`` bounds how long a client may take to send its request head of at most
    ``max_request_bytes``.  ``render_in_thread`` renders the exposition in a worker thread so
    a large registry never stalls the event loop (the cache's actor runs there).
    """

    host: str = "127.0.0.1"
    port: int = 0
    path: str = "/metrics"
    read_timeout_s: float = 10.0
    max_request_bytes: int = 16384
    render_in_thread: bool = True

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        if not self.path.startswith("/"):
            raise ValueError(f"path must start with '/', got {self.path!r}")
        if self.read_timeout_s <= 0 or self.max_request_bytes <= 0:
            raise ValueError("read_timeout_s and max_request_bytes must be positive")


class _BadRequest(Exception):
    def __init__(self, status: int) -> None:
        super().__init__(status)
        self.status = status


def _response(
    status: int, content_type: str, body: bytes, *, head: bool = False, allow: str | None = None
) -> bytes:
    lines = [
        f"HTTP/1.1 {status} {_REASONS[status]}",
        f"Content-Type: {content_type}",
        f"Content-Length: {len(body)}",
        "Connection: close",
    ]
    if allow is not None:
        lines.append(f"Allow: {allow}")
    header = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
    return header if head else header + body


def _parse_head(raw: bytes) -> tuple[str, str, dict[str, str]]:
    """Method, path (query stripped) and lower-cased headers of a request head."""
    try:
        text = raw.decode("latin-1")
        request_line, *header_lines = text.split("\r\n")
        method, target, version = request_line.split(" ")
    except ValueError:
        raise _BadRequest(400) from None
    if not version.startswith("HTTP/1."):
        raise _BadRequest(400)
    headers: dict[str, str] = {}
    for line in header_lines:
        if not line:
            continue
        name, sep, value = line.partition(":")
        if not sep:
            raise _BadRequest(400)
        headers[name.strip().lower()] = value.strip()
    return method, target.split("?", 1)[0], headers


class MetricsServer:
    """Serves ``registry`` over HTTP on ``config.host:config.port`` (see the module docstring).

    One instance serves at most once at a time.  :attr:`port` is valid once serving started.
    """

    def __init__(
        self,
        registry: CollectorRegistry = REGISTRY,
        config: MetricsServerConfig | None = None,
    ) -> None:
        self.registry = registry
        self.config = config if config is not None else MetricsServerConfig()
        self._port: int | None = None
        self._task_group: anyio.abc.TaskGroup | None = None

    @property
    def port(self) -> int:
        """The bound TCP port (the ephemeral one when ``config.port`` was 0)."""
        if self._port is None:
            raise RuntimeError("MetricsServer is not serving")
        return self._port

    @property
    def url(self) -> str:
        """``http://host:port/path`` of the endpoint (IPv6 hosts bracketed)."""
        host = self.config.host
        if ":" in host:
            host = f"[{host}]"
        return f"http://{host}:{self.port}{self.config.path}"

    async def serve(
        self, *, task_status: anyio.abc.TaskStatus[int] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Listen and serve until cancelled; reports the bound port through ``task_status``."""
        if self._port is not None:
            raise RuntimeError("MetricsServer is already serving")
        listener = await anyio.create_tcp_listener(
            local_host=self.config.host, local_port=self.config.port, reuse_port=False
        )
        async with listener:
            self._port = int(listener.extra(SocketAttribute.local_port))
            try:
                task_status.started(self._port)
                async with anyio.create_task_group() as tg:
                    for one in listener.listeners:  # one per address the host resolved to
                        assert isinstance(one, anyio.abc.SocketListener), f"{one!r}"
                        tg.start_soon(self._accept_loop, one, tg)
            finally:
                self._port = None

    async def _accept_loop(
        self, listener: anyio.abc.SocketListener, tg: anyio.abc.TaskGroup
    ) -> None:
        """Accept connections on ``listener`` and serve each in a task of ``tg``, until
        cancelled.

        An ``accept`` that fails for lack of resources (EMFILE when the process is out of
        file descriptors, ENFILE, ENOBUFS, ENOMEM) never ends the server, whose failure
        would cancel its host program's task group: it is logged (once per episode), the
        loop backs off (10 ms doubling to 1 s: the pending connection keeps the listener
        readable) and accepting resumes once descriptors are free again."""
        backoff = 0.0
        failures = 0
        while True:
            try:
                stream = await listener.accept()
            except OSError as exc:
                if failures == 0:
                    _log.warning("metrics endpoint cannot accept (%s): backing off", exc)
                failures += 1
                backoff = min(max(2 * backoff, _ACCEPT_BACKOFF_MIN_S), _ACCEPT_BACKOFF_MAX_S)
                await anyio.sleep(backoff)
                continue
            if failures:
                _log.warning("metrics endpoint accepts again after %d failures", failures)
                failures = 0
                backoff = 0.0
            tg.start_soon(self._handle, stream)

    async def __aenter__(self) -> MetricsServer:
        tg = anyio.create_task_group()
        await tg.__aenter__()
        try:
            await tg.start(self.serve)
        except BaseException as exc:
            await tg.__aexit__(type(exc), exc, exc.__traceback__)
            raise
        self._task_group = tg
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        tg = self._task_group
        self._task_group = None
        assert tg is not None, "__aexit__ without __aenter__"
        tg.cancel_scope.cancel()
        return await tg.__aexit__(exc_type, exc, tb)

    # ------------------------------------------------------------------ one connection
    async def _handle(self, stream: anyio.abc.SocketStream) -> None:
        # Every failure stays inside this connection: an exception escaping here would cancel
        # the listener's task group and stop the endpoint.
        async with stream:
            try:
                reply = await self._reply(stream)
                # A client that stops reading must not pin this task forever either.
                with anyio.move_on_after(self.config.read_timeout_s):
                    await stream.send(reply)
            except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError):
                pass
            except TimeoutError:
                pass
            except Exception:
                _log.exception("metrics endpoint failed to answer a request")

    async def _reply(self, stream: anyio.abc.SocketStream) -> bytes:
        cfg = self.config
        try:
            with anyio.fail_after(cfg.read_timeout_s):
                raw = await self._read_head(stream)
            method, path, headers = _parse_head(raw)
        except _BadRequest as bad:
            return _response(bad.status, "text/plain; charset=utf-8", b"bad request\n")
        if method not in ("GET", "HEAD"):
            return _response(
                405, "text/plain; charset=utf-8", b"method not allowed\n", allow="GET, HEAD"
            )
        head = method == "HEAD"
        if path != cfg.path:
            return _response(404, "text/plain; charset=utf-8", b"not found\n", head=head)
        encoder, content_type = choose_encoder(headers.get("accept", ""))
        try:
            body = await self._render(encoder)
        except Exception:
            _log.exception("rendering metrics failed")
            return _response(500, "text/plain; charset=utf-8", b"internal error\n", head=head)
        return _response(200, content_type, body, head=head)

    async def _read_head(self, stream: anyio.abc.SocketStream) -> bytes:
        limit = self.config.max_request_bytes
        buf = bytearray()
        while True:
            end = buf.find(b"\r\n\r\n")
            if end >= 0:
                return bytes(buf[:end])  # a GET/HEAD body, if any, is ignored
            if len(buf) > limit:
                raise _BadRequest(431)
            buf += await stream.receive(4096)

    async def _render(self, encoder: Callable[[Any], bytes]) -> bytes:
        if self.config.render_in_thread:
            return await anyio.to_thread.run_sync(encoder, self.registry)
        return encoder(self.registry)


@dataclass(frozen=True, slots=True)
class SyncMetricsServer:
    """Handle of :func:`start_metrics_http_server`'s daemon thread; :meth:`close` stops it."""

    host: str
    port: int
    _server: Any
    _thread: threading.Thread

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        """Stop serving and release the socket (idempotent)."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()


def start_metrics_http_server(
    registry: CollectorRegistry = REGISTRY, host: str = "127.0.0.1", port: int = 0
) -> SyncMetricsServer:
    """Serve ``registry`` from a daemon thread (``prometheus_client.start_http_server``).

    Binds to ``127.0.0.1`` by default (the client's own default is every interface);
    ``port=0`` picks a free port, returned in the handle.  Serves every path, as the client
    does.
    """
    server, thread = start_http_server(port, addr=host, registry=registry)
    return SyncMetricsServer(host, int(server.server_port), server, thread)
