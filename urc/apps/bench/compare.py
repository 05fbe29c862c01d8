"""Two checkouts' core benchmark in one process, interleaved; prints ratios.

Usage::

    python -m urc.apps.bench.compare OLD_TREE NEW_TREE [--rounds 5] [--components full ...]
        [--driver calls|core] [--page-sizes 1 16] [--num-seqs 2000] [--chunk-len 256]

``OLD_TREE`` and ``NEW_TREE`` are source trees (each with its C extensions built in place,
``python setup.py build_ext --inplace``).  Both copies of ``urc`` are imported into this
process, each fully (every submodule, so that no lazy import crosses over), and their
``sys.modules`` entries are swapped in before each run: round by round, configuration by
configuration, old and new run back to back on the same workload (which goes first alternates
by round) and the best of the rounds is kept per phase.  Run it with the same tree twice to
see the noise floor.  On a shared machine this is the comparison to quote (a ratio from one
process), never two figures from separate runs.

``--driver calls`` (the default): this checkout's :mod:`urc.apps.bench.call_phases` drives
both trees through the top-level API (one copy of the timing code for both), timing every
call as SGLang's tree benchmark does (GC off, lock and unlock per call right after the match
pass); each phase is reported twice, ``robust`` (descheduled calls left out: the ratio to
quote) and ``sum`` (SGLang's figure).  ``--driver core``: each tree's own
``urc.apps.bench.core.run_phases`` (``--old-module urc.bench`` for a tree from before the
applications moved to ``urc.apps``), whose lock and unlock are back-to-back passes on a
frozen heap, and which adds the match without indices.  docs/benchmarks.md says why the two
read lock and match differently.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import pkgutil
import sys
import time
from types import ModuleType
from typing import Any

from urc.apps.bench.call_phases import CALL_PHASES, robust_ops, run_call_phases, sum_ops
from urc.apps.bench.core import generate_sequences

__all__ = ["main"]

# Application modules of either layout (before and after ``urc.apps``).
_APPS = (".apps", ".cli", ".replay", ".workloads", "bench")
_PHASES = ("insert", "match_prefix", "match_prefix_without_indices", "lock", "unlock", "evict")


def _urc_keys() -> list[str]:
    return [k for k in sys.modules if k == "urc" or k.startswith("urc.")]


def _load(tree: str, bench_module: str) -> tuple[ModuleType, dict[str, ModuleType]]:
    """Import ``bench_module`` and every ``urc`` submodule from ``tree``; returns the
    benchmark module and the ``urc`` modules of that tree (removed from ``sys.modules``)."""
    for k in _urc_keys():
        del sys.modules[k]
    sys.path.insert(0, tree)
    try:
        bench = importlib.import_module(bench_module)
        urc = sys.modules["urc"]
        for info in pkgutil.walk_packages(urc.__path__, "urc."):
            app = any(part in info.name for part in _APPS)
            if app and info.name != bench_module:
                continue  # applications pull in hicache/metrics: not needed here
            with contextlib.suppress(ImportError):  # an optional part (a missing extra)
                importlib.import_module(info.name)
    finally:
        sys.path.remove(tree)
    modules = {k: sys.modules.pop(k) for k in _urc_keys()}
    return bench, modules


def _run(
    bench: ModuleType, modules: dict[str, ModuleType], name: str, ps: int, seqs: Any
) -> dict[str, Any]:
    for k in _urc_keys():
        del sys.modules[k]
    sys.modules.update(modules)
    result: dict[str, Any] = bench.run_phases(bench.COMPONENT_SETS[name], ps, seqs)
    return result


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m urc.apps.bench.compare", description=__doc__)
    ap.add_argument("old_tree")
    ap.add_argument("new_tree")
    ap.add_argument(
        "--driver",
        choices=["calls", "core"],
        default="calls",
        help="calls: one timing code for both trees, per call, GC off (SGLang's shape); "
        "core: each tree's own urc.apps.bench.core",
    )
    ap.add_argument("--old-module", default="urc.apps.bench.core")
    ap.add_argument("--new-module", default="urc.apps.bench.core")
    ap.add_argument("--components", nargs="+", default=["full", "full+swa", "full+mamba"])
    ap.add_argument("--page-sizes", nargs="+", type=int, default=[1, 16])
    ap.add_argument("--num-seqs", type=int, default=2000)
    ap.add_argument("--chunk-len", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument(
        "--clock",
        choices=["wall", "thread"],
        default="wall",
        help="thread: time with this thread's CPU clock (time.thread_time), which a busy "
        "machine's other processes do not inflate (it leaves out waits the phases never make); "
        "a read costs ~1.5 us on a VM without a vDSO thread clock, which per-call timings add "
        "to every call",
    )
    args = ap.parse_args(argv)
    if args.driver == "calls":
        _compare_calls(args)
        return
    if args.clock == "thread":
        # The benchmarks read ``time.perf_counter``; on a shared machine a descheduled
        # thread's wall time measures the neighbours, its CPU time the code.
        time.perf_counter = time.thread_time
    old = _load(args.old_tree, args.old_module)
    new = _load(args.new_tree, args.new_module)
    import torch

    torch.set_num_threads(1)
    seqs = new[0].generate_sequences(args.num_seqs, args.chunk_len, 42)
    best: dict[tuple[str, str, int], dict[str, float]] = {}
    for r in range(args.rounds):
        # Alternate which tree runs first, so that neither always meets a warmer machine.
        order = (("old", old), ("new", new)) if r % 2 == 0 else (("new", new), ("old", old))
        for name in args.components:
            for ps in args.page_sizes:
                for label, (bench, modules) in order:
                    res = _run(bench, modules, name, ps, seqs)
                    cell = best.setdefault((label, name, ps), {})
                    for phase in _PHASES:
                        ops = res[phase]["ops_per_s"]
                        cell[phase] = max(cell.get(phase, 0.0), ops)
    report: dict[str, Any] = {}
    for name in args.components:
        for ps in args.page_sizes:
            o, n = best[("old", name, ps)], best[("new", name, ps)]
            report[f"{name}/page{ps}"] = {
                p: {"old": round(o[p]), "new": round(n[p]), "ratio": round(n[p] / o[p], 3)}
                for p in _PHASES
            }
    print(f"{'config':18}" + "".join(f"{p[:14]:>16}" for p in _PHASES))
    for cfg, row in report.items():
        print(f"{cfg:18}" + "".join(f"{row[p]['ratio']:>16.3f}" for p in _PHASES))
    print(json.dumps(report))


def _compare_calls(args: argparse.Namespace) -> None:
    """``--driver calls``: :func:`run_call_phases` on both trees, interleaved."""
    clock = time.thread_time_ns if args.clock == "thread" else time.perf_counter_ns
    trees = {"old": _load(args.old_tree, "urc")[1], "new": _load(args.new_tree, "urc")[1]}
    import torch

    torch.set_num_threads(1)
    seqs = generate_sequences(args.num_seqs, args.chunk_len, 42)
    stats = {"robust": robust_ops, "sum": sum_ops}
    best: dict[tuple[str, str, int, str], dict[str, float]] = {}
    checksums: dict[tuple[str, int], set[tuple[int, ...]]] = {}
    for r in range(args.rounds):
        order = ("old", "new") if r % 2 == 0 else ("new", "old")
        for name in args.components:
            for ps in args.page_sizes:
                for label in order:
                    modules = trees[label]
                    for k in _urc_keys():
                        del sys.modules[k]
                    sys.modules.update(modules)
                    lat = run_call_phases(modules["urc"], name, ps, seqs, args.chunk_len, clock)
                    checksums.setdefault((name, ps), set()).add(tuple(lat.pop("checksum")))
                    for stat, f in stats.items():
                        cell = best.setdefault((label, name, ps, stat), {})
                        for phase in CALL_PHASES:
                            cell[phase] = max(cell.get(phase, 0.0), f(lat[phase]))
    report: dict[str, Any] = {}
    for name in args.components:
        for ps in args.page_sizes:
            row: dict[str, Any] = {"checksums_agree": len(checksums[(name, ps)]) == 1}
            for stat in stats:
                o, n = best[("old", name, ps, stat)], best[("new", name, ps, stat)]
                row[stat] = {
                    p: {"old": round(o[p]), "new": round(n[p]), "ratio": round(n[p] / o[p], 3)}
                    for p in CALL_PHASES
                }
            report[f"{name}/page{ps}"] = row
    print(f"{'config (new/old)':24}" + "".join(f"{p:>10}" for p in CALL_PHASES))
    for cfg, row in report.items():
        for stat in stats:
            cells = "".join(f"{row[stat][p]['ratio']:>10.3f}" for p in CALL_PHASES)
            print(f"{cfg + ' ' + stat:24}" + cells)
        if not row["checksums_agree"]:
            print(f"{cfg}: the trees matched or evicted different amounts")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
