"""Tests of the ``/metrics`` endpoints (``metrics.http``): text format on 127.0.0.1, parsed
back by ``prometheus_client``'s parsers; bad requests never take the server down."""

from __future__ import annotations

import os
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import anyio
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.openmetrics.parser import (
    text_string_to_metric_families as openmetrics_families,
)
from prometheus_client.parser import text_string_to_metric_families

import urc
from metrics import (
    CacheMetrics,
    MetricsServer,
    MetricsServerConfig,
    start_metrics_http_server,
)
from urc.params import InsertParams, MatchPrefixParams
from urc.service._commands import CommandKind

TIMEOUT_S = 20


def _fed_registry() -> tuple[CollectorRegistry, urc.UnifiedRadixCache]:
    """A fresh registry whose exporter saw one insert, one match and one command."""
    registry = CollectorRegistry()
    exporter = CacheMetrics(registry)
    cache = urc.build_cache(urc.CacheConfig(kv_size=512))
    v = cache.token_to_kv_pool_allocator.alloc(48)
    assert v is not None
    cache.insert(InsertParams(key=urc.RadixKey(list(range(48))), value=v))
    cache.match_prefix(MatchPrefixParams(key=urc.RadixKey(list(range(20)))))
    exporter.on_command(CommandKind.MATCH, 1e-6, 4e-6, None)
    exporter.on_batch(cache.stats(), 0)
    return registry, cache


async def _request(port: int, raw: bytes) -> tuple[int, dict[str, str], bytes]:
    """Send ``raw`` to 127.0.0.1:``port``; status, lower-cased headers and body of the reply."""
    async with await anyio.connect_tcp("127.0.0.1", port) as stream:
        await stream.send(raw)
        data = bytearray()
        try:
            while True:
                data += await stream.receive()
        except anyio.EndOfStream:
            pass
    head, _, body = bytes(data).partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines:
        k, _, v = line.partition(":")
        headers[k.strip().lower()] = v.strip()
    return int(status_line.split(" ")[1]), headers, body


def _get(path: str = "/metrics", accept: str | None = None, method: str = "GET") -> bytes:
    extra = f"Accept: {accept}\r\n" if accept else ""
    return f"{method} {path} HTTP/1.1\r\nHost: localhost\r\n{extra}\r\n".encode()


@pytest.mark.asyncio
async def test_serves_text_format_on_loopback() -> None:
    registry, cache = _fed_registry()
    with anyio.fail_after(TIMEOUT_S):
        async with MetricsServer(registry) as server:
            assert server.config.host == "127.0.0.1"
            assert server.port > 0
            assert server.url == f"http://127.0.0.1:{server.port}/metrics"
            status, headers, body = await _request(server.port, _get())
    assert status == 200
    assert headers["content-type"].startswith("text/plain")
    assert int(headers["content-length"]) == len(body)
    families = {f.name: f for f in text_string_to_metric_families(body.decode())}
    # Counters are exposed with ``_total`` samples; the family name drops the suffix.
    assert {"urc_cache_evictable_tokens", "urc_match_requests", "urc_command_duration_seconds"} <= (
        set(families)
    )
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in families.values()
        for s in f.samples
    }
    dev = (("component", "full"), ("tier", "device"))
    assert samples[("urc_cache_evictable_tokens", dev)] == cache.evictable_size() == 48
    assert samples[("urc_match_hit_tokens_total", (("tier", "device"),))] == 20
    assert samples[("urc_command_duration_seconds_count", (("kind", "match"),))] == 1


@pytest.mark.asyncio
async def test_openmetrics_on_request_and_head() -> None:
    registry, _ = _fed_registry()
    with anyio.fail_after(TIMEOUT_S):
        async with MetricsServer(registry, MetricsServerConfig(render_in_thread=False)) as srv:
            status, headers, body = await _request(
                srv.port, _get(accept="application/openmetrics-text; version=1.0.0")
            )
            assert status == 200
            assert headers["content-type"].startswith("application/openmetrics-text")
            names = {f.name for f in openmetrics_families(body.decode())}
            assert "urc_match_requests" in names and "urc_tree_nodes" in names
            status, headers, body = await _request(srv.port, _get(method="HEAD"))
            assert status == 200 and body == b"" and int(headers["content-length"]) > 0


@pytest.mark.asyncio
async def test_bad_requests_get_errors_and_server_keeps_serving() -> None:
    registry, _ = _fed_registry()
    cfg = MetricsServerConfig(max_request_bytes=1024)
    with anyio.fail_after(TIMEOUT_S):
        async with MetricsServer(registry, cfg) as srv:
            assert (await _request(srv.port, _get("/other")))[0] == 404
            assert (await _request(srv.port, _get("/metrics?name[]=x")))[0] == 200
            status, headers, _ = await _request(srv.port, _get(method="POST"))
            assert status == 405 and headers["allow"] == "GET, HEAD"
            assert (await _request(srv.port, b"nonsense\r\n\r\n"))[0] == 400
            assert (await _request(srv.port, b"GET /metrics SPDY/3\r\n\r\n"))[0] == 400
            assert (await _request(srv.port, b"GET /metrics HTTP/1.1\r\nbroken\r\n\r\n"))[0] == 400
            huge = b"GET /metrics HTTP/1.1\r\nX: " + b"a" * 4096 + b"\r\n\r\n"
            assert (await _request(srv.port, huge))[0] == 431
            # A client that connects and closes without a request is simply dropped.
            async with await anyio.connect_tcp("127.0.0.1", srv.port):
                pass
            status, _, body = await _request(srv.port, _get())
            assert status == 200 and b"urc_tree_nodes" in body


@pytest.mark.asyncio
async def test_slow_client_times_out_without_blocking_others() -> None:
    registry, _ = _fed_registry()
    cfg = MetricsServerConfig(read_timeout_s=0.2)
    with anyio.fail_after(TIMEOUT_S):
        async with (
            MetricsServer(registry, cfg) as srv,
            await anyio.connect_tcp("127.0.0.1", srv.port) as slow,
        ):
            await slow.send(b"GET /metrics HTTP/1.1\r\n")  # never finishes its head
            status, _, _ = await _request(srv.port, _get())
            assert status == 200
            # The server gives up on the slow client: it sees the connection closed.
            with pytest.raises((anyio.EndOfStream, anyio.BrokenResourceError)):
                await slow.receive()


@pytest.mark.asyncio
async def test_serve_in_a_task_group_reports_port() -> None:
    registry, _ = _fed_registry()
    server = MetricsServer(registry)
    with pytest.raises(RuntimeError):
        _ = server.port
    with anyio.fail_after(TIMEOUT_S):
        async with anyio.create_task_group() as tg:
            port = await tg.start(server.serve)
            assert port == server.port
            assert (await _request(port, _get()))[0] == 200
            with pytest.raises(RuntimeError, match="already serving"):
                await server.serve()
            tg.cancel_scope.cancel()
    with pytest.raises(RuntimeError):
        _ = server.port


def test_config_validation() -> None:
    for kwargs in ({"port": -1}, {"port": 70000}, {"path": "metrics"}, {"read_timeout_s": 0}):
        with pytest.raises(ValueError):
            MetricsServerConfig(**kwargs)


def test_sync_server_on_loopback() -> None:
    registry, _ = _fed_registry()
    server = start_metrics_http_server(registry)
    try:
        assert server.host == "127.0.0.1" and server.port > 0
        with urllib.request.urlopen(server.url, timeout=TIMEOUT_S) as resp:
            assert resp.status == 200
            body = resp.read().decode()
        families = {f.name for f in text_string_to_metric_families(body)}
        assert "urc_cache_evictable_tokens" in families
    finally:
        server.close()
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(server.url, timeout=TIMEOUT_S)


_EMFILE_CHILD = """
import os, resource, sys
import anyio
from prometheus_client import CollectorRegistry
from metrics import MetricsServer, MetricsServerConfig

async def main():
    config = MetricsServerConfig(read_timeout_s=1.0, render_in_thread=False)
    async with MetricsServer(CollectorRegistry(), config) as server:
        # Few descriptors left: idle connections exhaust them (accept fails with EMFILE).
        used = len(os.listdir("/proc/self/fd"))
        resource.setrlimit(resource.RLIMIT_NOFILE, (used + 16, resource.getrlimit(
            resource.RLIMIT_NOFILE)[1]))
        print(server.port, flush=True)
        await anyio.sleep(3600)

anyio.run(main)
"""


@pytest.mark.asyncio
@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc")
async def test_running_out_of_file_descriptors_does_not_stop_the_server(tmp_path: Path) -> None:
    """Issue 50 item 2: with the process out of descriptors, ``accept()`` failed with EMFILE,
    the error escaped ``MetricsServer`` and ended its host program.  Now it logs, backs off,
    and serves again once descriptors are free."""
    err = tmp_path / "stderr"
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with open(err, "wb") as err_file:
        child = subprocess.Popen(
            [sys.executable, "-c", _EMFILE_CHILD],
            cwd=root,
            stdout=subprocess.PIPE,
            stderr=err_file,
        )
    try:
        assert child.stdout is not None
        port = int(child.stdout.readline())
        idle = []
        with anyio.fail_after(TIMEOUT_S):
            for _ in range(64):
                idle.append(await anyio.connect_tcp("127.0.0.1", port))
            while b"cannot accept" not in err.read_bytes():
                assert child.poll() is None, err.read_text()
                await anyio.sleep(0.05)
            for stream in idle:
                await stream.aclose()
            while True:  # the held connections time out; then scrapes are answered again
                assert child.poll() is None, err.read_text()
                with anyio.move_on_after(2):
                    try:
                        status, _, _ = await _request(port, b"GET /metrics HTTP/1.1\r\n\r\n")
                    except (OSError, ValueError, anyio.BrokenResourceError):
                        continue  # reset while the server could not accept it
                    break
        assert status == 200
        assert child.poll() is None
    finally:
        child.kill()
        child.wait()
        if child.stdout is not None:
            child.stdout.close()
