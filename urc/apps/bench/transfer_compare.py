"""Another checkout's host pool against this one's, in one process, interleaved; prints ratios.

Usage::

    python -m urc.apps.bench.transfer_compare OLD_TREE [--page-sizes 1 16 64] [--tokens 4096]
        [--layers 8 --heads 8 --head-dim 128 --dtype float16] [--rounds 6] [--repeat 3]
        [--clock thread|wall] [--layout auto|layer_first|page_first] [--threads N]

``OLD_TREE``'s ``hicache/host_pool.py`` and ``hicache/storage_worker/layout.py`` are loaded
beside this tree's (they import ``urc`` and ``hicache`` from this tree: their own code is what
is compared).  Both pools mirror one
CPU device pool; round by round (which goes first alternates) each copy runs ``--repeat``
times and the best is kept per phase:

- ``backup``: scattered device pages to one run of host pages;
- ``backup_scattered``: scattered device pages to host pages in random order;
- ``load_back``: one run of host pages to a fresh run of device pages;
- ``load_scattered``: one run of host pages back into the scattered device pages;
- ``load_back_scattered``: host pages in random order to scattered device pages;
- ``l3_gather`` / ``l3_scatter``: the host pages in random order as L3 page rows and back
  (``hicache.storage_worker.layout.HostPageLayout``, the old tree's beside this one's).

Ratios are new time over old time (below 1: this tree is faster).  ``--clock thread`` (the
default) times the calling thread's CPU time with one torch thread, which a loaded machine
disturbs least.  The host pools are allocated in turn, and where their memory lands moves a
phase by a few percent: compare the tree with itself (``OLD_TREE`` = this tree) for the noise
floor.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

import hicache.host_pool as new_host_pool
from hicache.host_layout import HostLayout
from hicache.storage_worker.layout import HostPageLayout
from hicache.transfer_engine import Completion
from urc.apps.bench.transfer import page_slots
from urc.pools.allocator import TokenSlotAllocator
from urc.pools.kv_pool import KVPool, KVShape

__all__ = ["PHASES", "compare", "load_module", "main"]

PHASES = (
    "backup",
    "backup_scattered",
    "load_back",
    "load_scattered",
    "load_back_scattered",
    "l3_gather",
    "l3_scatter",
)


def load_module(tree: str | Path, relative: str) -> ModuleType:
    """``tree``'s file ``relative`` as a module of its own (``old_<file stem>``)."""
    path = Path(tree) / relative
    spec = importlib.util.spec_from_file_location(f"old_{path.stem}", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"no module at {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _clock(kind: str) -> Callable[[], float]:
    return time.thread_time if kind == "thread" else time.perf_counter


def _best(clock: Callable[[], float], fn: Callable[[], Any], repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = clock()
        done = fn()
        if isinstance(done, Completion):  # (pools before the transfer engine return None)
            done.wait()
        best = min(best, clock() - t0)
    return best


def compare(
    old: ModuleType,
    old_layout: ModuleType,
    page_size: int,
    tokens: int,
    shape: KVShape,
    rounds: int = 6,
    repeat: int = 3,
    clock: str = "thread",
    layout: HostLayout | None = None,
    seed: int = 0,
) -> dict[str, Any]:
    """New/old time ratio of each phase (see the module docstring) at one page size."""
    pool_tokens = 4 * tokens
    kv = KVPool(pool_tokens, shape)
    kv.kv.normal_()
    pools = {
        "old": old.HostPool(kv.slot_buffers(), 2 * tokens, page_size),
        "new": new_host_pool.HostPool(kv.slot_buffers(), 2 * tokens, page_size, layout=layout),
    }
    gen = torch.Generator().manual_seed(seed)
    n_pages = tokens // page_size
    dev = page_slots(torch.randperm(pool_tokens // page_size, generator=gen)[:n_pages], page_size)
    fresh = TokenSlotAllocator(pool_tokens, page_size).alloc(tokens)
    assert fresh is not None
    scattered = page_slots(torch.randperm(2 * n_pages, generator=gen)[:n_pages], page_size)
    pages = {
        "old": old_layout.HostPageLayout(pools["old"]),
        "new": HostPageLayout(pools["new"]),
    }
    tick = _clock(clock)
    best = {k: dict.fromkeys(PHASES, float("inf")) for k in pools}
    for r in range(rounds):
        for k in ("old", "new") if r % 2 == 0 else ("new", "old"):
            p = pools[k]
            run = p.allocator.alloc(tokens)
            assert run is not None
            steps = {  # phase: (direction, source slots, destination slots)
                "backup": (p.backup, dev, run),
                "backup_scattered": (p.backup, dev, scattered),
                "load_back": (p.load, run, fresh),
                "load_scattered": (p.load, run, dev),
                "load_back_scattered": (p.load, scattered, dev),
            }
            for phase, (copy, src, dst) in steps.items():
                took = _best(tick, functools.partial(copy, src, dst), repeat)
                best[k][phase] = min(best[k][phase], took)
            rows = pages[k].gather(scattered)
            l3 = {
                "l3_gather": functools.partial(pages[k].gather, scattered),
                "l3_scatter": functools.partial(pages[k].scatter, rows, scattered),
            }
            for phase, fn in l3.items():
                best[k][phase] = min(best[k][phase], _best(tick, fn, repeat))
            p.allocator.free(run)
    gb = tokens * shape.bytes_per_token / 1e9
    out: dict[str, Any] = {"page_size": page_size, "layout": pools["new"].layout.value}
    for phase in PHASES:
        out[phase] = round(best["new"][phase] / best["old"][phase], 3)
        out[f"{phase}_new_gb_s"] = round(gb / best["new"][phase], 2)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m urc.apps.bench.transfer_compare")
    ap.add_argument("old_tree")
    ap.add_argument("--page-sizes", nargs="+", type=int, default=[1, 16, 64])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--clock", choices=["thread", "wall"], default="thread")
    ap.add_argument("--layout", choices=["auto", *(v.value for v in HostLayout)], default="auto")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (thread clock: 1)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads or (1 if args.clock == "thread" else 2))
    dtype = getattr(torch, args.dtype)
    if not isinstance(dtype, torch.dtype):
        raise SystemExit(f"not a torch dtype: {args.dtype}")
    shape = KVShape(args.layers, args.heads, args.head_dim, dtype)
    layout = None if args.layout == "auto" else HostLayout(args.layout)
    old = load_module(args.old_tree, "hicache/host_pool.py")
    old_layout = load_module(args.old_tree, "hicache/storage_worker/layout.py")
    results = [
        compare(
            old, old_layout, ps, args.tokens, shape, args.rounds, args.repeat, args.clock, layout
        )
        for ps in args.page_sizes
    ]
    print(json.dumps({"new/old time": results, "shape": str(shape)}, indent=1))


if __name__ == "__main__":
    main()
