"""Cost of chunked prefill against prompt length: ``python -m urc.apps.bench.chunk``.

Replays one request per prompt length (4k, 32k and 128k tokens by default) in chunks of
``--chunk-size`` tokens (512 by default) through :func:`~urc.apps.replay.run_replay`, the same
serving loop ``urc replay`` runs (prefill-only, no host tier), best of ``--repeat`` runs, and
prints the time per prompt token.  Flat per-token figures mean a request costs linearly in
its length; figures that grow with the length mean a quadratic term.

It also prints the time spent in the core's ``cache_unfinished_req`` per prompt token (the
client-side latency of the chunk commits).  A commit costs its chunk: the insert resumes at
the request's locked node, the key is a view of the request's prompt, packed once
(``Req.fill_prefix``), and the re-match result is a view of the request's row, so what is
left per chunk that grows with the prompt is a few Python steps per node on the path (the
stamps SGLang's order needs).
The numbers are printed, never asserted (timings on shared machines are noise-prone).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import anyio

from urc.apps.replay.config import Capacity, ReplayConfig
from urc.apps.replay.driver import run_replay

__all__ = ["ChunkCost", "format_costs", "main", "measure"]

DEFAULT_LENGTHS = (4096, 32768, 131072)


@dataclass(frozen=True, slots=True)
class ChunkCost:
    """Best-of timing of one prompt length."""

    length: int
    chunks: int
    replay_s: float
    commit_s: float

    @property
    def us_per_token(self) -> float:
        return self.replay_s / self.length * 1e6

    @property
    def commit_us_per_token(self) -> float:
        return self.commit_s / self.length * 1e6


def _trace(path: Path, length: int, block_size: int) -> Path:
    blocks = -(-length // block_size)
    rec = {"timestamp": 0, "input_length": length, "output_length": 1}
    path.write_text(json.dumps({**rec, "hash_ids": list(range(blocks))}) + "\n")
    return path


def measure(
    lengths: Sequence[int] = DEFAULT_LENGTHS,
    chunk_size: int = 512,
    page_size: int = 16,
    repeat: int = 3,
) -> list[ChunkCost]:
    """Replay one prompt of each length ``repeat`` times; the best run of each."""
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        for length in lengths:
            trace = _trace(Path(tmp) / f"p{length}.jsonl", length, 512)
            config = ReplayConfig(
                trace=trace,
                device_tokens=Capacity(tokens=length + 2 * chunk_size),
                host_tokens=Capacity(tokens=0),
                page_size=page_size,
                chunk_size=chunk_size,
                concurrency=1,
                prefill_only=True,
            )
            best: ChunkCost | None = None
            for _ in range(repeat):
                report = anyio.run(run_replay, config)
                lat = report.latency.get("cache_unfinished_req")
                commit = lat.count * lat.mean_us / 1e6 if lat is not None else 0.0
                cost = ChunkCost(length, -(-length // chunk_size), report.wall_time_s, commit)
                if best is None or cost.replay_s < best.replay_s:
                    best = cost
            assert best is not None
            out.append(best)
    return out


def format_costs(costs: Sequence[ChunkCost], chunk_size: int) -> str:
    """The table :func:`main` prints."""
    lines = [
        f"chunked prefill, {chunk_size}-token chunks, one request per length (best run)",
        f"{'prompt':>8} {'chunks':>7} {'replay s':>9} {'us/token':>9} {'x first':>8} "
        f"{'commit us/token':>16}",
    ]
    base = costs[0].us_per_token if costs else 1.0
    for c in costs:
        lines.append(
            f"{c.length:>8,} {c.chunks:>7,} {c.replay_s:>9.3f} {c.us_per_token:>9.3f} "
            f"{c.us_per_token / base:>8.2f} {c.commit_us_per_token:>16.3f}"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m urc.apps.bench.chunk", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--lengths", type=int, nargs="+", default=list(DEFAULT_LENGTHS))
    parser.add_argument("--chunk-size", type=int, default=512)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args(argv)
    costs = measure(args.lengths, args.chunk_size, args.page_size, args.repeat)
    print(format_costs(costs, args.chunk_size))
    return 0


if __name__ == "__main__":
    sys.exit(main())
