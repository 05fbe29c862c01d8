"""HiCache and L3 inside a live SGLang 0.5.23 server with urc as the tree (issue 51).

SGLang's own HiCache host pool cannot run on a CPU machine (``cudaHostRegister``), so the
reference here is urc without HiCache on the same workload: every HiCache server's outputs
must equal it request by request.  The workload puts a 400-token prefix in, pushes it off the
device with other prompts (the pool holds about two), then asks for it again: with HiCache the
prefix comes back from host (``cached_tokens_details["host"]``), without it is recomputed.

- one server per write policy (``write_through``, ``write_through_selective``,
  ``write_back``): requests ok, outputs equal, tokens served from host per request, SGLang's
  idle leak check quiet;
- L3 (``--hicache-storage-backend file``, SGLang's ``HiCacheFile`` layout): the
  ``write_through`` server writes the pages; the ``write_back`` server, a second process
  started afresh on the same directory once the first stopped, serves the prefix from L3 on
  its first request (``cached_tokens_details["storage"]``), outputs equal;
- L3 on Mooncake (a real ``mooncake_master``, as the unit suite's Mooncake tests start it):
  the ``write_through_selective`` server writes the pages through
  ``--hicache-storage-backend mooncake``; a fresh server on ``--hicache-storage-backend
  dynamic`` (urc's own store, ``urc.apps.sglang.hicache_storage``, here on the same Mooncake
  store, ``--hicache-storage-prefetch-policy wait_complete``) started while the first still
  lends its segment serves the prefix from L3 on its first request, outputs equal;
- the rest of the scheduler's surface on the ``write_back`` server once its workload is
  done: ``/hicache/storage-backend`` detach and attach at runtime, then ``/flush_cache``
  (device and host emptied) after which the prefix comes back from the re-attached L3;
  then ``/flush_cache`` and ``/hicache/storage-backend/clear`` (urc's store deletes this
  model's pages), after which the prefix is served from nowhere (no L3 hit);
- load-backs run layer by layer off the scheduler thread (the plug-in logs it at start-up).
"""

from __future__ import annotations

import json
import os
import random
import re
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
from live_server import LiveServer, ServerConfig
from mooncake_master import MooncakeMaster, find_master_binary
from pairs import CHECKOUT, ServerPool
from side_env import SideEnv

pytestmark = [pytest.mark.live_sglang, pytest.mark.timeout(1200)]

POOL = 1200  # device tokens: two of the 400-token prompts and their outputs
PREFIX = 400
ADMIN_KEY = "urc-live-admin"  # SGLang serves /hicache/storage-backend only with one
LAYERWISE = "urc HiCache: load-backs layer by layer"


@dataclass(frozen=True)
class Answer:
    """One ``/generate`` answer: output ids, ``cached_tokens`` and its split by tier."""

    output_ids: tuple[int, ...]
    cached: int
    tiers: dict[str, int]

    @property
    def host(self) -> int:
        return int(self.tiers.get("host", 0))

    @property
    def storage(self) -> int:
        return int(self.tiers.get("storage", 0))


def generate(server: LiveServer, ids: list[int], new: int = 8) -> Answer:
    body = {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": new, "temperature": 0.0, "ignore_eos": True},
    }
    req = urllib.request.Request(
        f"{server.url}/generate", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=180) as r:
        out = json.loads(r.read())
    meta = out["meta_info"]
    details = meta.get("cached_tokens_details") or {}
    tiers = {k: int(v) for k, v in details.items() if isinstance(v, int)}
    return Answer(tuple(out["output_ids"]), int(meta["cached_tokens"]), tiers)


def admin(server: LiveServer, method: str, path: str, body: object = None) -> tuple[int, str]:
    """An admin call (``--admin-api-key``): its status and body."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(
        f"{server.url}{path}",
        data,
        {"Content-Type": "application/json", "Authorization": f"Bearer {ADMIN_KEY}"},
        method=method,
    )
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return int(r.status), r.read().decode()
    except urllib.error.HTTPError as e:
        return int(e.code), e.read().decode()


def workload(seed: int = 51) -> list[list[int]]:
    """The prefix with a first suffix, three other prompts that push it off the device, the
    prefix with a second suffix (after it was used twice: a selective write-through backs
    it up on the second hit), then with a third."""
    rng = random.Random(seed)
    prefix = [rng.randrange(3, 2000) for _ in range(PREFIX)]
    others = [[rng.randrange(3, 2000) for _ in range(PREFIX)] for _ in range(3)]
    return [
        [*prefix, 5, 6, 7],
        [*prefix, 8, 9],
        *others,
        [*prefix, 10, 11, 12],
        [*prefix, 13, 14],
    ]


def config(*args: str, env: tuple[tuple[str, str], ...] = ()) -> ServerConfig:
    return ServerConfig(
        "urc", max_total_tokens=POOL, chunked_prefill_size=512, extra_args=args, env=env
    )


def hicache(policy: str, *more: str) -> tuple[str, ...]:
    return (
        "--enable-hierarchical-cache",
        "--hicache-write-policy",
        policy,
        "--hicache-ratio",  # explicit: SGLang's host-memory auto-sizing needs 10 GiB spare
        "2",
        *more,
    )


def start(side: SideEnv, scratch: Path, configs: list[ServerConfig]) -> list[LiveServer]:
    """Start ``configs`` side by side (all of them, or none: a failed start stops the rest)."""
    with ThreadPoolExecutor(len(configs)) as pool:
        futures = [pool.submit(LiveServer, side, c, CHECKOUT, scratch) for c in configs]
        started = [f.exception() or f.result() for f in futures]
    failed = [s for s in started if isinstance(s, BaseException)]
    if failed:
        for s in started:
            if isinstance(s, LiveServer):
                s.stop()
        raise failed[0]
    return [s for s in started if isinstance(s, LiveServer)]


def run(server: LiveServer, prompts: list[list[int]]) -> list[Answer]:
    out = []
    for ids in prompts:
        out.append(generate(server, ids))
        time.sleep(0.2)  # a scheduler turn or two: the backups started are committed
    return out


@pytest.fixture(scope="module")
def scratch(server_pool: ServerPool) -> Iterator[Path]:
    server_pool.close()  # at most two servers at once: the pool's pair goes first
    yield server_pool.scratch / "hicache"


@pytest.fixture(scope="module")
def mooncake(scratch: Path) -> Iterator[MooncakeMaster]:
    """A real ``mooncake_master`` for the Mooncake and ``dynamic`` cases."""
    binary = find_master_binary()
    if binary is None:
        msg = "the mooncake package (the `mooncake` extra) ships no mooncake_master here"
        if os.environ.get("URC_LIVE_SGLANG_REQUIRED") == "1":
            pytest.fail(msg)
        pytest.skip(msg)
    scratch.mkdir(parents=True, exist_ok=True)
    # Mooncake's default 5 s read lease: at the unit tests' 50 ms the fresh reader's batch
    # gets (copied from the writer's segment over TCP) failed with LEASE_EXPIRED on a busy
    # host, and its first request was recomputed.
    master = MooncakeMaster(binary, scratch / "mooncake_master.log", lease_ttl_ms=5000)
    master.start()
    try:
        yield master
    finally:
        master.kill()


@dataclass
class Runs:
    """What the servers answered: per server name its answers and (stopped) server; the
    ``write_back`` server's runtime surface calls as ``(what, status, body)``; the answers
    to the prefix after ``/flush_cache`` and after the L3 clear."""

    answers: dict[str, tuple[list[Answer], LiveServer]]
    surface: list[tuple[str, int, str]]
    after_flush: Answer | None
    after_clear: Answer | None


def storage_args(backend: str, extra: dict[str, object] | None = None) -> tuple[str, ...]:
    args = ("--hicache-storage-backend", backend)
    if extra is not None:
        args += ("--hicache-storage-backend-extra-config", json.dumps(extra))
    return args


def flush(server: LiveServer) -> tuple[str, int, str]:
    for _ in range(3):  # SGLang waits up to 30 s for an idle turn; a busy host may need more
        status, body = admin(server, "POST", "/flush_cache?timeout=30")
        if status == 200:
            break
        server.settle(1.0)
    return ("flush_cache", status, body.strip())


def surface_calls(
    server: LiveServer, prefix: list[int]
) -> tuple[list[tuple[str, int, str]], Answer, Answer]:
    """Detach and re-attach the L3 at runtime, flush the cache, then ask for the prefix
    (device and host are empty: it can only come from L3); flush again, clear the L3 and
    ask once more (it can come from nowhere)."""
    calls = []
    status, body = admin(server, "DELETE", "/hicache/storage-backend")
    calls.append(("detach", status, body.strip()))
    attach = {
        "hicache_storage_backend": "file",
        "hicache_storage_backend_extra_config_json": "{}",
        "hicache_storage_prefetch_policy": "timeout",
        "hicache_write_policy": "write_back",
    }
    status, body = admin(server, "PUT", "/hicache/storage-backend", attach)
    calls.append(("attach", status, body.strip()))
    calls.append(flush(server))
    after_flush = generate(server, [*prefix, 21, 22])
    server.settle(1.0)
    calls.append(flush(server))  # the host copies go: only the L3 could serve the prefix
    status, body = admin(server, "POST", "/hicache/storage-backend/clear")
    calls.append(("clear", status, body.strip()))
    return calls, after_flush, generate(server, [*prefix, 23, 24])


@pytest.fixture(scope="module")
def runs(side_env: SideEnv, scratch: Path, mooncake: MooncakeMaster) -> Runs:
    """The workload on urc without HiCache (the reference) and with each write policy,
    two servers at a time, five in all, each stopped once its answers and log are in:

    1. the reference; ``write_through`` writing a ``file`` L3 directory;
    2. ``write_through_selective`` writing the Mooncake store; ``write_back``, a second
       process started afresh on the directory the first wrote (then the runtime surface);
    3. ``dynamic`` (urc's store on the same Mooncake) started afresh while the
       ``write_through_selective`` server still lends the segment holding the pages."""
    l3 = scratch / "l3"
    l3.mkdir(parents=True, exist_ok=True)
    l3_env = (("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", str(l3)),)
    segment = {"protocol": "tcp", "global_segment_size": 64 << 20}
    prompts = workload()
    out: dict[str, tuple[list[Answer], LiveServer]] = {}
    with_l3 = config(*hicache("write_through", *storage_args("file")), env=l3_env)
    fresh_l3 = config(
        *hicache("write_back", *storage_args("file"), "--admin-api-key", ADMIN_KEY), env=l3_env
    )
    to_mooncake = config(
        *hicache(
            "write_through_selective",
            *storage_args("mooncake", {"master_server_address": mooncake.address, **segment}),
        )
    )
    dynamic = config(
        *hicache(
            "write_through",
            # Its first request waits for the whole prefetch: under the default `timeout`
            # policy a loaded CI host admitted it with part of the pages (64 of 400).
            "--hicache-storage-prefetch-policy",
            "wait_complete",
            *storage_args(
                "dynamic",
                {
                    "backend_name": "urc",
                    "module_path": "urc.apps.sglang.hicache_storage",
                    "class_name": "UrcHiCacheStorage",
                    "store": "mooncake",
                    "master_address": mooncake.address,
                    **segment,
                },
            ),
        )
    )

    def serve(names: list[str], servers: list[LiveServer]) -> None:
        with ThreadPoolExecutor(len(servers)) as pool:
            answers = list(pool.map(lambda s: run(s, prompts), servers))
        for name, server, got in zip(names, servers, answers, strict=True):
            server.settle(2.0)  # idle turns: the leak check, the L3 writes
            out[name] = (got, server)

    servers = start(side_env, scratch, [config(), with_l3])
    try:
        serve(["no hicache", "write_through+l3"], servers)
    finally:
        for server in servers:
            server.stop()
    servers = start(side_env, scratch, [to_mooncake, fresh_l3])
    try:
        serve(["write_through_selective+mooncake", "write_back+l3"], servers)
        surface, after_flush, after_clear = surface_calls(servers[1], prompts[0][:PREFIX])
        servers[1].settle(1.0)
        servers[1].stop()
        # The Mooncake writer keeps running: its segment holds the pages.
        (reader,) = start(side_env, scratch, [dynamic])
        servers.append(reader)
        serve(["dynamic on mooncake"], [reader])
    finally:
        for server in servers:
            server.stop()
    return Runs(out, surface, after_flush, after_clear)


def _line(name: str, answers: list[Answer]) -> str:
    cells = [
        f"{a.cached}(h{a.host},s{a.storage})" if a.host or a.storage else str(a.cached)
        for a in answers
    ]
    return f"[hicache {name}] cached per request: {' '.join(cells)}"


@pytest.mark.parametrize(
    "name", ["write_through+l3", "write_through_selective+mooncake", "write_back+l3"]
)
def test_each_write_policy_serves_the_evicted_prefix_from_host_with_the_same_outputs(
    name: str, runs: Runs, report: Callable[[str], None]
) -> None:
    reference, _ = runs.answers["no hicache"]
    got, server = runs.answers[name]
    report(_line("no hicache", reference))
    report(_line(name, got))
    leaks = server.leak_reports()
    report(f"[hicache {name}] {server.tree_cache_line()}; leak reports {len(leaks)}")
    assert [a.output_ids for a in got] == [a.output_ids for a in reference]
    assert "hicache_attached=True" in server.tree_cache_line()
    assert LAYERWISE in server.log(), "load-backs are not layer-wise"
    # Without HiCache the prefix was recomputed after the other prompts pushed it out ...
    assert reference[5].cached < PREFIX, reference[5]
    # ... with it, it came back from host.
    assert got[5].host >= PREFIX - 1 and got[5].cached >= PREFIX, got[5]
    assert leaks == [], leaks


@pytest.mark.parametrize(
    ("reader", "what"),
    [
        ("write_back+l3", "fresh process on the L3 directory"),
        ("dynamic on mooncake", "fresh dynamic (urc's store) process on the Mooncake store"),
    ],
)
def test_a_fresh_server_serves_from_l3_what_the_first_one_wrote(
    reader: str, what: str, runs: Runs, report: Callable[[str], None]
) -> None:
    reference, _ = runs.answers["no hicache"]
    got, server = runs.answers[reader]
    report(_line(f"{what}, first request", got[:1]))
    assert got[0].output_ids == reference[0].output_ids
    assert got[0].storage >= PREFIX - 1 and got[0].cached >= PREFIX - 1, got[0]
    assert [a.output_ids for a in got] == [a.output_ids for a in reference]
    assert server.leak_reports() == []


def test_the_l3_detaches_and_attaches_at_runtime_and_serves_after_a_flush(
    runs: Runs, report: Callable[[str], None]
) -> None:
    for what, status, body in runs.surface:
        report(f"[hicache write_back+l3] {what}: {status} {body}")
    assert [(what, status) for what, status, _ in runs.surface[:3]] == [
        ("detach", 200),
        ("attach", 200),
        ("flush_cache", 200),
    ]
    after = runs.after_flush
    assert after is not None
    report(_line("write_back+l3 after detach, attach, flush", [after]))
    # Device and host were flushed: the prefix came back from the re-attached L3.
    assert after.storage >= PREFIX - 1 and after.host == 0, after


def test_clearing_the_l3_deletes_this_models_pages_and_the_prefix_is_not_served_from_it(
    runs: Runs, report: Callable[[str], None]
) -> None:
    """``/hicache/storage-backend/clear`` through SGLang's own scheduler handler: urc's
    file store deletes this model's pages (the plug-in logs how many), and the prefix, no
    longer on device or host, gets no L3 hit."""
    assert [(what, status, body) for what, status, body in runs.surface[3:]] == [
        ("flush_cache", 200, runs.surface[3][2]),
        ("clear", 200, "Hierarchical cache storage backend cleared."),
    ]
    _, server = runs.answers["write_back+l3"]
    cleared = re.findall(r"cleared urc's file store: (\d+) pages deleted", server.log())
    report(f"[hicache write_back+l3] clear: {cleared} pages deleted (plug-in log)")
    assert cleared and int(cleared[-1]) > 0, cleared
    after = runs.after_clear
    assert after is not None
    report(_line("write_back+l3 after flush, clear", [after]))
    assert after.storage == 0 and after.host == 0 and after.cached < PREFIX - 1, after
