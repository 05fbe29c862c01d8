"""Benchmark: the tree cache's own time per scheduler step in a live SGLang 0.5.23 server,
urc against SGLang's default cache (its ``UnifiedRadixCache`` on the Rust tree core).

    python tests/live_sglang/bench_tree_cache_time.py [--rounds 2] [--requests 256]

One run starts a default-cache server and a urc server of the same configuration (the side
environment of :mod:`side_env`; tiny dummy-weight Llama, page size 1, a pool the workload
overflows) one after the other, each with :mod:`cache_timer` loaded as a SGLang plug-in,
which times every public call into the tree cache (outermost calls) and counts scheduler
steps (``run_batch``).  Each server gets a warm-up pass, then ``--rounds`` measured passes
of a cache-stressing workload: long shared prefixes (4 system prompts of 1024 tokens) and
many small requests (a 4-24 token question each, 2 new tokens, 32 in flight), so the tree
matches, inserts, splits, locks and evicts on every step.  Printed per server: steps, cache
calls, cache time per step (mean over the measured passes) and its share of the steps' model
time; then the ratio urc / default.  This is a benchmark command, not a test: it asserts
nothing about speed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import random
import sys
import tempfile
import time
from pathlib import Path

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


def _snapshot(path: Path, after: float) -> dict[str, object]:
    """The timer's totals as written after ``after`` (monotonic; the writer runs twice a second)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if path.exists() and path.stat().st_mtime > after:
            return dict(json.loads(path.read_text()))
        time.sleep(0.2)
    raise RuntimeError(f"{path}: the cache timer wrote nothing (plug-in not loaded?)")


def measure(backend: str, scratch: Path, rounds: int, n: int) -> dict[str, float]:
    side = ensure()
    out = scratch / f"timer-{backend}.json"
    config = dataclasses.replace(CONFIG, backend=backend, env=(("URC_CACHE_TIMER_OUT", str(out)),))
    with LiveServer(side, config, Path(__file__).resolve().parents[2], scratch) as server:
        print(f"{backend}: {server.tree_cache_line()}", flush=True)
        server.generate_many(workload(0, n), concurrency=32)  # warm-up
        time.sleep(1.0)
        before = _snapshot(out, time.time())
        for r in range(rounds):
            results = server.generate_many(workload(1 + r, n), concurrency=32)
            bad = [x.error for x in results if not x.ok]
            if bad:
                raise RuntimeError(f"{backend}: {len(bad)} requests failed: {bad[0]}")
        time.sleep(1.0)
        after = _snapshot(out, time.time())
        leaks = server.leak_reports()
    steps = int(after["steps"]) - int(before["steps"])  # type: ignore[call-overload]
    cache_ns = int(after["cache_ns"]) - int(before["cache_ns"])  # type: ignore[call-overload]
    step_ns = int(after["step_ns"]) - int(before["step_ns"])  # type: ignore[call-overload]
    calls = int(after["cache_calls"]) - int(before["cache_calls"])  # type: ignore[call-overload]
    per_method = {
        k: v - before["per_method"].get(k, 0)  # type: ignore[attr-defined]
        for k, v in after["per_method"].items()  # type: ignore[attr-defined]
    }
    top = sorted(per_method.items(), key=lambda kv: -kv[1])[:5]
    print(
        f"{backend}: {steps} steps, {calls} cache calls, cache {cache_ns / 1e6:.1f} ms = "
        f"{cache_ns / max(steps, 1) / 1e3:.1f} us/step ({100 * cache_ns / max(step_ns, 1):.1f}% "
        f"of run_batch time); leak reports {len(leaks)}; top: "
        + ", ".join(f"{k} {v / 1e6:.1f} ms" for k, v in top),
        flush=True,
    )
    return {"steps": steps, "us_per_step": cache_ns / max(steps, 1) / 1e3}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2, help="measured passes per server")
    parser.add_argument("--requests", type=int, default=256, help="requests per pass")
    args = parser.parse_args()
    try:
        ensure()
    except SideEnvUnavailable as e:
        print(f"live SGLang side environment unavailable: {e}")
        return 3
    print(
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {platform.node()}, "
        f"{platform.processor() or platform.machine()}; {args.rounds} x {args.requests} requests",
        flush=True,
    )
    with tempfile.TemporaryDirectory(prefix="urc-bench-") as scratch:
        default = measure("default", Path(scratch), args.rounds, args.requests)
        urc = measure("urc", Path(scratch), args.rounds, args.requests)
    print(
        f"tree cache time per scheduler step: urc {urc['us_per_step']:.1f} us, "
        f"default (Rust core) {default['us_per_step']:.1f} us, "
        f"ratio urc/default {urc['us_per_step'] / default['us_per_step']:.2f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
