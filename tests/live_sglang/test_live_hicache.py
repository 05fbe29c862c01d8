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
  its first request (``cached_tokens_details["storage"]``), outputs equal.
"""

from __future__ import annotations

import json
import random
import time
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
from live_server import LiveServer, ServerConfig
from pairs import CHECKOUT, ServerPool
from side_env import SideEnv

pytestmark = [pytest.mark.live_sglang, pytest.mark.timeout(900)]

POOL = 1200  # device tokens: two of the 400-token prompts and their outputs
PREFIX = 400


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
def runs(side_env: SideEnv, scratch: Path) -> dict[str, tuple[list[Answer], LiveServer]]:
    """The workload on urc without HiCache (the reference) and with each write policy;
    the ``write_through`` server also writes an L3 directory, which the ``write_back``
    server (started after it stopped) reads.  Two servers at a time, four in all; each is
    stopped once its answers and log are in."""
    l3 = scratch / "l3"
    l3.mkdir(parents=True, exist_ok=True)
    file_l3 = ("--hicache-storage-backend", "file")
    l3_env = (("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", str(l3)),)
    prompts = workload()
    out: dict[str, tuple[list[Answer], LiveServer]] = {}
    with_l3 = config(*hicache("write_through", *file_l3), env=l3_env)
    # The write-back server is a second process started afresh on the directory the first
    # (write-through) one wrote: its first request finds the prefix in L3.
    fresh_l3 = config(*hicache("write_back", *file_l3), env=l3_env)
    rounds = [
        [("no hicache", config()), ("write_through+l3", with_l3)],
        [
            ("write_through_selective", config(*hicache("write_through_selective"))),
            ("write_back+l3", fresh_l3),
        ],
    ]
    for round_ in rounds:
        servers = start(side_env, scratch, [c for _, c in round_])
        try:
            with ThreadPoolExecutor(len(servers)) as pool:
                answers = list(pool.map(lambda s: run(s, prompts), servers))
            for (name, _), server, got in zip(round_, servers, answers, strict=True):
                server.settle(2.0)  # idle turns: the leak check, the L3 writes
                out[name] = (got, server)
        finally:
            for server in servers:
                server.stop()
    return out


def _line(name: str, answers: list[Answer]) -> str:
    cells = [
        f"{a.cached}(h{a.host},s{a.storage})" if a.host or a.storage else str(a.cached)
        for a in answers
    ]
    return f"[hicache {name}] cached per request: {' '.join(cells)}"


@pytest.mark.parametrize("name", ["write_through+l3", "write_through_selective", "write_back+l3"])
def test_each_write_policy_serves_the_evicted_prefix_from_host_with_the_same_outputs(
    name: str, runs: dict[str, tuple[list[Answer], LiveServer]], report: Callable[[str], None]
) -> None:
    reference, _ = runs["no hicache"]
    got, server = runs[name]
    report(_line("no hicache", reference))
    report(_line(name, got))
    leaks = server.leak_reports()
    report(f"[hicache {name}] {server.tree_cache_line()}; leak reports {len(leaks)}")
    assert [a.output_ids for a in got] == [a.output_ids for a in reference]
    assert "hicache_attached=True" in server.tree_cache_line()
    # Without HiCache the prefix was recomputed after the other prompts pushed it out ...
    assert reference[5].cached < PREFIX, reference[5]
    # ... with it, it came back from host.
    assert got[5].host >= PREFIX - 1 and got[5].cached >= PREFIX, got[5]
    assert leaks == [], leaks


def test_a_fresh_server_serves_from_l3_what_the_first_one_wrote(
    runs: dict[str, tuple[list[Answer], LiveServer]], report: Callable[[str], None]
) -> None:
    reference, _ = runs["no hicache"]
    got, _ = runs["write_back+l3"]
    report(_line("fresh process on the L3 directory, first request", got[:1]))
    assert got[0].output_ids == reference[0].output_ids
    assert got[0].storage >= PREFIX - 1 and got[0].cached >= PREFIX - 1, got[0]
