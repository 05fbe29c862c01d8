"""Benchmark: the tree cache's own time per scheduler step in a live SGLang 0.5.23 server,
urc against SGLang's default cache (its ``UnifiedRadixCache`` on the Rust tree core).

    python tests/live_sglang/bench_tree_cache_time.py [--rounds 2] [--requests 128]

One run starts a default-cache server and a urc server of the same configuration (the side
environment of :mod:`side_env`; tiny dummy-weight Llama, page size 1, a pool the workload
overflows), each with :mod:`cache_timer` loaded as a SGLang plug-in: it times every public
call into the tree cache (outermost calls) and counts scheduler steps (``run_batch``).  Each
server gets a warm-up pass, then ``--rounds`` measured passes, alternating between the two
servers, of a cache-stressing workload: long shared prefixes (4 system prompts of 1024
tokens) and many small requests (a 4-24 token question each, 2 new tokens, 32 in flight),
so the tree matches, inserts, splits, locks and evicts on every step.  Printed per server:
steps, cache calls, the cache's CPU time per step over the measured passes and the methods
that took most; then the ratio urc / default.  A benchmark command, not a test: it
asserts nothing about speed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import random
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from live_server import GenRequest, LiveServer, ServerConfig  # noqa: E402
from side_env import SideEnvUnavailable, ensure  # noqa: E402
from workloads import tokens  # noqa: E402

CONFIG = ServerConfig(
    "default",
    page_size=1,
    max_total_tokens=12288,
    chunked_prefill_size=2048,
    plugins=(("urc_cache_timer", "cache_timer:install"),),
)


def workload(seed: int, n: int) -> list[GenRequest]:
    rng = random.Random(seed)
    systems = [tokens(rng, 1024) for _ in range(4)]
    return [
        GenRequest(rng.choice(systems) + tokens(rng, rng.randrange(4, 25)), max_new_tokens=2)
        for _ in range(n)
    ]


def _snapshot(path: Path, after: float) -> dict[str, Any]:
    """The timer's totals as written after ``after`` (monotonic; the writer runs twice a second)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if path.exists() and path.stat().st_mtime > after:
            return dict(json.loads(path.read_text()))
        time.sleep(0.2)
    raise RuntimeError(f"{path}: the cache timer wrote nothing (plug-in not loaded?)")


class Timed:
    """A started server with the cache timer, and its measured totals."""

    def __init__(self, backend: str, scratch: Path) -> None:
        self.backend = backend
        self.out = scratch / f"timer-{backend}.json"
        config = dataclasses.replace(
            CONFIG, backend=backend, env=(("URC_CACHE_TIMER_OUT", str(self.out)),)
        )
        self.server = LiveServer(ensure(), config, HERE.parent.parent, scratch)
        self.totals: dict[str, float] = {"steps": 0, "step_ns": 0, "cache_ns": 0, "calls": 0}
        self.per_method: dict[str, int] = {}

    def run(self, requests: list[GenRequest], measured: bool) -> None:
        before = _snapshot(self.out, time.time())
        results = self.server.generate_many(requests, concurrency=32)
        bad = [x.error for x in results if not x.ok]
        if bad:
            raise RuntimeError(f"{self.backend}: {len(bad)} requests failed: {bad[0]}")
        time.sleep(1.0)  # the writer runs twice a second
        after = _snapshot(self.out, time.time())
        if not measured:
            return
        for key, field in (
            ("steps", "steps"),
            ("step_ns", "step_ns"),
            ("cache_ns", "cache_ns"),
            ("calls", "cache_calls"),
        ):
            self.totals[key] += after[field] - before[field]
        old = before["per_method"]
        for k, v in after["per_method"].items():
            self.per_method[k] = self.per_method.get(k, 0) + v - old.get(k, 0)

    @property
    def us_per_step(self) -> float:
        return self.totals["cache_ns"] / max(self.totals["steps"], 1) / 1e3

    def line(self) -> str:
        t = self.totals
        top = sorted(self.per_method.items(), key=lambda kv: -kv[1])[:5]
        return (
            f"{self.backend}: {t['steps']:.0f} steps, {t['calls']:.0f} cache calls, cache "
            f"{t['cache_ns'] / 1e6:.1f} ms CPU = {self.us_per_step:.1f} us/step; leak "
            f"reports {len(self.server.leak_reports())}; top: "
            + ", ".join(f"{k} {v / 1e6:.1f} ms" for k, v in top)
        )


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2, help="measured passes per server")
    parser.add_argument("--requests", type=int, default=128, help="requests per pass")
    args = parser.parse_args()
    try:
        ensure()
    except SideEnvUnavailable as e:
        print(f"live SGLang side environment unavailable: {e}")
        return 3
    print(
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {platform.node()}, "
        f"{_cpu_model()} x{os.cpu_count()}; {args.rounds} x {args.requests} requests",
        flush=True,
    )
    with tempfile.TemporaryDirectory(prefix="urc-bench-") as scratch:
        with ThreadPoolExecutor(2) as pool:
            started = [pool.submit(Timed, b, Path(scratch)) for b in ("default", "urc")]
        servers = [f.result() for f in started if f.exception() is None]
        try:
            for f in started:
                if f.exception() is not None:
                    raise RuntimeError("a server did not start") from f.exception()
            for s in servers:
                print(f"{s.backend}: {s.server.tree_cache_line()}", flush=True)
                s.run(workload(0, args.requests), measured=False)  # warm-up
            # Rounds alternate between the servers (the other idles), so a change in the
            # machine's load falls on both.
            for r in range(args.rounds):
                for s in servers if r % 2 == 0 else servers[::-1]:
                    s.run(workload(1 + r, args.requests), measured=True)
            default, urc = servers
            print(default.line())
            print(urc.line())
        finally:
            for s in servers:
                s.server.stop()
    print(
        f"tree cache time per scheduler step: urc {urc.us_per_step:.1f} us, "
        f"default (Rust core) {default.us_per_step:.1f} us, "
        f"ratio urc/default {urc.us_per_step / default.us_per_step:.2f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
