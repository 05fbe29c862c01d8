"""Instructions per call of one core phase under valgrind's callgrind, for one or more
checkouts; prints a table (and JSON with ``--json``).

Usage::

    python -m urc.apps.bench.instructions TREE [TREE ...] --phase insert
        [--components full|full+swa|full+mamba] [--page-size 1] [--num-seqs 200]
        [--chunk-len 256] [--jobs 2]

Wall-clock comparisons (:mod:`urc.apps.bench.compare`) read within a few percent at best on a
shared machine; the instructions a call executes do not depend on the neighbours, so two
checkouts can be told apart by a 1-2% change.  Each tree runs the phases of
:mod:`urc.apps.bench.call_phases` (this checkout's copy, loaded by path, driving the tree's
own ``urc`` through its top-level API) on the reference workload, in a child process under
``valgrind --tool=callgrind --cache-sim=yes``.  Collection is on only inside
``operator.call``, and only the measured phase's cache method is called through it
(``insert``, ``match_prefix``, ``inc_lock_ref``, ``dec_lock_ref`` or ``evict``): the figures
are that method's instructions (``Ir``), first-level data misses (``D1``) and last-level data
misses (``LL``, a simulated 32 MiB cache) per call, averaged over the phase's calls.  The
other phases run uninstrumented, so a lock is counted on the caches a match pass left, as the
SGLang benchmark times it.

A run costs a few minutes per tree (importing torch under valgrind dominates); ``--jobs`` runs
trees side by side.  Needs ``valgrind`` on ``PATH``.  Instruction counts say nothing of memory
latency: quote them beside a wall-clock comparison, not instead of one.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

from urc.apps.bench import call_phases
from urc.apps.bench.core import generate_sequences

__all__ = ["METHODS", "PhaseCost", "main", "measure", "parse_callgrind"]

#: The cache method each phase calls (what is counted).
METHODS = {
    "insert": "insert",
    "match": "match_prefix",
    "lock": "inc_lock_ref",
    "unlock": "dec_lock_ref",
    "evict": "evict",
}
_MARKER = "_operator_call"  # operator.call's C function: collection is on inside it
_LL = "--LL=33554432,16,64"  # a fixed last-level cache, so counts do not follow the host's


@dataclass(frozen=True)
class PhaseCost:
    """One tree's phase under callgrind: calls, and per call instructions and data misses."""

    tree: str
    phase: str
    calls: int
    ir: float
    d1_misses: float
    ll_misses: float


# The child: this checkout's call_phases (by path) drives TREE's urc; only the measured
# method goes through operator.call.  Its arguments come in a pickle file, its call count
# goes out in one.
_CHILD = """
import importlib.util, operator, pickle, sys
from functools import partial
args_file, out_file = sys.argv[1], sys.argv[2]
with open(args_file, "rb") as f:
    a = pickle.load(f)
sys.path.insert(0, a["tree"])
import urc
spec = importlib.util.spec_from_file_location("_urc_call_phases", a["call_phases"])
phases = importlib.util.module_from_spec(spec)
spec.loader.exec_module(phases)

class Measured:
    def __init__(self, cache):
        self._cache = cache
    def __getattr__(self, name):
        v = getattr(self._cache, name)
        return partial(operator.call, v) if name == a["method"] else v

class Urc:
    def __getattr__(self, name):
        v = getattr(urc, name)
        return (lambda config: Measured(v(config))) if name == "build_cache" else v

lat = phases.run_call_phases(Urc(), a["components"], a["page_size"], a["seqs"], a["chunk_len"])
with open(out_file, "wb") as f:
    pickle.dump({"calls": len(lat[a["phase"]]), "checksum": lat["checksum"]}, f)
"""


def parse_callgrind(text: str) -> dict[str, int]:
    """The event totals of a callgrind output file (``events:`` names, ``totals:`` or
    ``summary:`` values); raises ``ValueError`` when either line is missing."""
    names: list[str] | None = None
    values: list[int] | None = None
    for line in text.splitlines():
        if line.startswith("events:"):
            names = line.split()[1:]
        elif line.startswith(("totals:", "summary:")):
            values = [int(v) for v in line.split()[1:]]
    if names is None or values is None:
        raise ValueError("not a callgrind output file (no events: or totals: line)")
    return dict(zip(names, values + [0] * (len(names) - len(values)), strict=True))


def measure(
    tree: str,
    phase: str,
    components: str,
    page_size: int,
    seqs: list[list[int]],
    chunk_len: int,
    valgrind: str = "valgrind",
) -> tuple[PhaseCost, list[int]]:
    """Run ``phase`` of ``tree`` under callgrind (see the module docstring); returns its cost
    and the workload's checksum (equal for trees that agree).  Raises ``RuntimeError`` when
    the child fails."""
    with tempfile.TemporaryDirectory(prefix="urc-instructions-") as tmp:
        d = Path(tmp)
        args = {
            "tree": str(Path(tree).resolve()),
            "call_phases": call_phases.__file__,
            "method": METHODS[phase],
            "phase": phase,
            "components": components,
            "page_size": page_size,
            "seqs": seqs,
            "chunk_len": chunk_len,
        }
        (d / "args.pkl").write_bytes(pickle.dumps(args))
        cmd = [
            valgrind,
            "--tool=callgrind",
            "--cache-sim=yes",
            _LL,
            "--collect-atstart=no",
            f"--toggle-collect={_MARKER}",
            f"--callgrind-out-file={d / 'callgrind.out'}",
            sys.executable,
            "-c",
            _CHILD,
            str(d / "args.pkl"),
            str(d / "out.pkl"),
        ]
        env = {**os.environ, "PYTHONHASHSEED": "0"}  # the same dict orders in every run
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp)
        if proc.returncode != 0 or not (d / "out.pkl").exists():
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
            raise RuntimeError(f"{tree}: the child failed ({proc.returncode}): {tail}")
        out = pickle.loads((d / "out.pkl").read_bytes())
        ev = parse_callgrind((d / "callgrind.out").read_text())
    calls = max(1, out["calls"])
    cost = PhaseCost(
        tree=tree,
        phase=phase,
        calls=out["calls"],
        ir=ev.get("Ir", 0) / calls,
        d1_misses=(ev.get("D1mr", 0) + ev.get("D1mw", 0)) / calls,
        ll_misses=(ev.get("DLmr", 0) + ev.get("DLmw", 0)) / calls,
    )
    return cost, list(out["checksum"])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m urc.apps.bench.instructions", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("trees", nargs="+", help="source trees (C extensions built in place)")
    p.add_argument("--phase", choices=sorted(METHODS), required=True)
    p.add_argument("--components", choices=("full", "full+swa", "full+mamba"), default="full")
    p.add_argument("--page-size", type=int, default=1)
    p.add_argument("--num-seqs", type=int, default=200)
    p.add_argument("--chunk-len", type=int, default=256)
    p.add_argument("--jobs", type=int, default=2, help="trees measured side by side")
    p.add_argument("--valgrind", default="valgrind", help="the valgrind executable")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = p.parse_args(argv)
    for name in ("page_size", "num_seqs", "chunk_len", "jobs"):
        if getattr(args, name) < 1:
            p.error(f"argument --{name.replace('_', '-')}: must be >= 1")
    if shutil.which(args.valgrind) is None:
        p.error(f"argument --valgrind: {args.valgrind!r} is not on PATH (install valgrind)")
    for tree in args.trees:
        if not (Path(tree) / "urc" / "__init__.py").is_file():
            p.error(f"{tree!r} is not a source tree (no urc/__init__.py)")
    seqs = generate_sequences(args.num_seqs, args.chunk_len, 42)

    def one(tree: str) -> tuple[PhaseCost, list[int]]:
        return measure(
            tree,
            args.phase,
            args.components,
            args.page_size,
            seqs,
            args.chunk_len,
            args.valgrind,
        )

    with ThreadPoolExecutor(args.jobs) as pool:
        results = list(pool.map(one, args.trees))
    agree = len({tuple(ck) for _, ck in results}) == 1
    base = results[0][0]
    if args.json:
        rows = [{**asdict(c), "ir_ratio": c.ir / base.ir} for c, _ in results]
        print(json.dumps({"config": vars(args), "checksums_agree": agree, "rows": rows}))
        return
    print(
        f"{args.phase}, {args.components}, page {args.page_size}, {args.num_seqs} sequences "
        f"(per call; ratio to the first tree; checksums agree: {agree})"
    )
    print(f"{'tree':40} {'calls':>6} {'Ir':>10} {'ratio':>7} {'D1 miss':>9} {'LL miss':>8}")
    for c, _ in results:
        print(
            f"{c.tree[-40:]:40} {c.calls:>6} {c.ir:>10.0f} {c.ir / base.ir:>7.3f} "
            f"{c.d1_misses:>9.1f} {c.ll_misses:>8.1f}"
        )


if __name__ == "__main__":
    main()
