"""The ``urc`` command line.  One subcommand so far: ``urc replay`` (see :mod:`urc.apps.replay`).

Examples::

    urc replay                                   # built-in multi-turn chat, HiCache on
    urc replay --workload agent-loop --model mamba --device-tokens 0.1
    urc replay --trace conversation_trace.jsonl --prefill-only --json report.json
    urc replay --trace conversation_trace.jsonl --prefill-only --host-tokens 0 --sweep

Exit status: 0 on success; 1 when the run failed (unreadable, malformed or empty trace, no
request served, or the final invariant check failed); 2 on a usage or configuration error
(including a ``--json`` / ``--plot`` path that cannot be written, checked before the run);
130 when interrupted.

Start-up stays cheap: this module imports only the standard library at import time; the
replay machinery (torch, the cache, the service) is imported by the command that runs it,
after argparse has handled ``--help`` and ``--version``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from urc.apps.replay import Capacity, ReplayConfig, ReplayReport
    from urc.apps.replay.sweep import SweepResult

if sys.version_info < (3, 11):  # pragma: no cover
    from exceptiongroup import BaseExceptionGroup

__all__ = ["DISTRIBUTION", "build_parser", "main", "version"]

DISTRIBUTION = "unified-radix-cache"
"""The package's distribution name (what ``urc --version`` reports the version of)."""

_CAPACITY_HELP = (
    "a token count (65536) or, written with a '.', a fraction of the workload's unique "
    "prompt tokens (input tokens minus the ideal prefix hits of an unbounded cache at this "
    "page size; computed by a first pass over the trace or workload)"
)

_REPLAY_HELP = "replay a request trace or a synthetic workload through the cache"


def version() -> str:
    """The installed distribution's version (``"unknown"`` when it is not installed)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version(DISTRIBUTION)
    except PackageNotFoundError:
        return "unknown"


def _capacity(text: str) -> Capacity:
    from urc.apps.replay import Capacity
    from urc.errors import ConfigError

    try:
        return Capacity.parse(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _fractions(text: str) -> tuple[Capacity, ...]:
    caps = tuple(_capacity(t) for t in text.split(",") if t.strip())
    if not caps:
        raise argparse.ArgumentTypeError("give at least one capacity")
    return caps


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"port must be in 0..65535, got {value}")
    return value


def _top_parser() -> tuple[argparse.ArgumentParser, Any]:
    parser = argparse.ArgumentParser(
        prog="urc", description="Unified Radix Cache tools (see 'urc replay --help')."
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    return parser, sub


def build_parser(*, with_replay_options: bool = True) -> argparse.ArgumentParser:
    """The ``urc`` argument parser.  ``with_replay_options=False`` builds only the top level
    (what ``urc --help`` and ``urc --version`` need: no import beyond the standard library)."""
    parser, sub = _top_parser()
    if not with_replay_options:
        sub.add_parser("replay", help=_REPLAY_HELP)
        return parser
    _add_replay_parser(sub)
    return parser


def _enum_option(group: Any, flag: str, members: Sequence[Enum], default: Enum, help: str) -> None:
    """An option whose choices are the values of ``members`` (enum members)."""
    group.add_argument(flag, choices=[m.value for m in members], default=default.value, help=help)


def _add_replay_parser(sub: Any) -> None:
    from hicache.config import StorageBackupPolicy
    from urc.apps.replay import DEFAULT_CHUNK_SIZE, Capacity, ModelProfile
    from urc.apps.replay.sweep import DEFAULT_SWEEP
    from urc.apps.workloads import DEFAULT_BLOCK_SIZE, WorkloadKind
    from urc.eviction_policy import EvictionPolicy
    from urc.host.protocol import WritePolicy

    p = sub.add_parser(
        "replay",
        help=_REPLAY_HELP,
        description=(
            "Drive the async cache service the way a serving loop would: per request "
            "match (loading host hits back), chunked prefill with cache_unfinished_req, "
            "output slots, cache_finished_req; many requests in flight; HiCache backup "
            "running. Ends with a report (hit rate by tier, evictions, backups, load-backs, "
            "latency percentiles, invariant check). The same flags give the same report "
            "(timings aside) unless --realtime, --speed or --l3-dir is used."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    src = p.add_argument_group("workload")
    excl = src.add_mutually_exclusive_group()
    excl.add_argument(
        "--trace",
        type=Path,
        help="a Mooncake-format trace (JSON lines: timestamp, input_length, output_length, "
        "hash_ids), read streaming; e.g. the traces in Mooncake's FAST25-release/traces/",
    )
    _enum_option(
        excl,
        "--workload",
        list(WorkloadKind),
        WorkloadKind.MULTI_TURN_CHAT,
        "built-in synthetic workload (used when no --trace is given)",
    )
    src.add_argument(
        "--num-requests",
        type=int,
        default=None,
        help="requests to replay (a trace: the first N; synthetic: its size, default 2000)",
    )
    src.add_argument("--seed", type=int, default=0, help="seed of the synthetic workload")
    src.add_argument(
        "--block-size",
        type=_positive_int,
        default=DEFAULT_BLOCK_SIZE,
        help="tokens per trace hash id",
    )

    cache = p.add_argument_group("cache")
    _enum_option(
        cache,
        "--model",
        list(ModelProfile),
        ModelProfile.FULL,
        "full attention, hybrid sliding-window (SWA) or hybrid Mamba",
    )
    cache.add_argument(
        "--window", type=_positive_int, default=4096, help="SWA window (tokens; --model swa)"
    )
    cache.add_argument(
        "--swa-tokens",
        type=_capacity,
        default=None,
        help="SWA KV pool size (--model swa; default: the device pool's size): " + _CAPACITY_HELP,
    )
    cache.add_argument(
        "--mamba-states",
        type=_positive_int,
        default=None,
        help="Mamba state slots (--model mamba; default: device tokens / chunk size + "
        "2 x concurrency)",
    )
    cache.add_argument(
        "--device-tokens", type=_capacity, default=Capacity(fraction=0.25), help=_CAPACITY_HELP
    )
    cache.add_argument(
        "--host-tokens",
        type=_capacity,
        default=Capacity(fraction=0.25),
        help="host tier (HiCache, in RAM) size: " + _CAPACITY_HELP + "; 0 turns it off",
    )
    _enum_option(
        cache,
        "--write-policy",
        list(WritePolicy),
        WritePolicy.WRITE_BACK,
        "when device KV is copied to host: write_back copies a device leaf when it is "
        "evicted (device + host then act like one cache of their combined size); "
        "write_through copies a node after its first hit (selective: second), so KV "
        "evicted before it was hit again is lost",
    )
    _enum_option(
        cache,
        "--eviction-policy",
        list(EvictionPolicy),  # every member, so new policies appear here by themselves
        EvictionPolicy.LRU,
        "order in which device (and host) leaves are evicted; fork-aware: LRU that evicts "
        "first a branch the traffic just forked away from; belady: the offline "
        "optimum (reads the whole workload first; measurement only)",
    )
    cache.add_argument(
        "--partial-leaf-eviction",
        action="store_true",
        help="evict only the tail pages of a victim leaf that an allocation needs (default: "
        "whole leaves, as SGLang)",
    )
    cache.add_argument(
        "--l3-dir",
        type=Path,
        default=None,
        help="add the L3 storage tier: page files in this directory (kept between runs, so "
        "a second run can hit pages the first one wrote); --model full only",
    )
    _enum_option(
        cache,
        "--l3-backup",
        [p for p in StorageBackupPolicy if p is not StorageBackupPolicy.OFF],
        StorageBackupPolicy.ON_HOST_EVICTION,
        "when host pages are written to L3",
    )
    cache.add_argument(
        "--page-size", type=_positive_int, default=16, help="tree page (a power of two)"
    )

    loop = p.add_argument_group("serving loop")
    loop.add_argument(
        "--concurrency", type=_positive_int, default=8, help="requests in flight at once"
    )
    loop.add_argument(
        "--chunk-size",
        type=_positive_int,
        default=DEFAULT_CHUNK_SIZE,
        help="prefill chunk (tokens, a multiple of --page-size; SGLang's "
        "--chunked-prefill-size). Each chunk re-inserts the prompt so far, so small chunks "
        "make long prompts cost O(length^2)",
    )
    loop.add_argument(
        "--prefill-only",
        action="store_true",
        help="cache the prompts only (no output tokens): comparable with trace-level "
        "simulations and the ideal hit rate",
    )
    loop.add_argument(
        "--speed",
        type=float,
        default=0.0,
        help="pace arrivals at timestamp / SPEED (1 = real time); 0 replays as fast as "
        "possible, in timestamp order",
    )
    loop.add_argument(
        "--realtime",
        action="store_true",
        help="copy host-tier KV in worker threads and read the trace with aiofiles, like a "
        "server (backups then race evictions: hit rates vary slightly between runs); "
        "default: deterministic, the same flags give the same report",
    )

    out = p.add_argument_group("output")
    out.add_argument(
        "--json", type=Path, default=None, help="also write the report as JSON here ('-': stdout)"
    )
    out.add_argument(
        "--sweep",
        type=_fractions,
        nargs="?",
        const=DEFAULT_SWEEP,
        default=None,
        metavar="C1,C2,...",
        help="replay once per device capacity (default list: "
        + ",".join(str(c) for c in DEFAULT_SWEEP)
        + ") and print the hit rate against device capacity, as a table and an ASCII chart; "
        "the other flags (host tier included) stay as given",
    )
    out.add_argument(
        "--plot",
        type=Path,
        default=None,
        help="with --sweep: also save the curve as a PNG here (needs matplotlib)",
    )
    out.add_argument(
        "--metrics-port",
        type=_port,
        default=None,
        help="serve Prometheus /metrics on 127.0.0.1:PORT during the run (0: any free port)",
    )
    out.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress bar (it is also off when stderr is not a terminal)",
    )


def _config(args: argparse.Namespace) -> ReplayConfig:
    from hicache.config import StorageBackupPolicy
    from urc.apps.replay import ModelProfile, ReplayConfig
    from urc.apps.workloads import WorkloadKind
    from urc.eviction_policy import EvictionPolicy
    from urc.host.protocol import WritePolicy

    return ReplayConfig(
        trace=args.trace,
        workload=WorkloadKind(args.workload),
        num_requests=args.num_requests,
        seed=args.seed,
        block_size=args.block_size,
        model=ModelProfile(args.model),
        window=args.window,
        swa_tokens=args.swa_tokens,
        mamba_states=args.mamba_states,
        device_tokens=args.device_tokens,
        host_tokens=args.host_tokens,
        write_policy=WritePolicy(args.write_policy),
        eviction_policy=EvictionPolicy(args.eviction_policy),
        partial_leaf_eviction=args.partial_leaf_eviction,
        l3_dir=args.l3_dir,
        l3_backup=StorageBackupPolicy(args.l3_backup),
        page_size=args.page_size,
        chunk_size=args.chunk_size,
        concurrency=args.concurrency,
        prefill_only=args.prefill_only,
        speed=args.speed,
        realtime=args.realtime,
    )


def _leaf(exc: BaseException) -> BaseException:
    """The first non-group exception inside (nested) exception groups."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return exc


def _failure_status(prog: str, exc: BaseException) -> int | None:
    """Print a one-line error for an expected failure and return its exit status."""
    from urc.apps.replay.source import EmptyWorkloadError
    from urc.apps.workloads import TraceFormatError
    from urc.errors import ConfigError

    if isinstance(exc, TraceFormatError):
        print(f"{prog}: error: malformed trace: {exc}", file=sys.stderr)
        return 1
    if isinstance(exc, ConfigError):
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    if isinstance(exc, EmptyWorkloadError):
        print(f"{prog}: error: {exc}: nothing to replay", file=sys.stderr)
        return 1
    if isinstance(exc, OSError):
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 1
    if isinstance(exc, KeyboardInterrupt):
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    return None


def _output_path_problem(path: Path) -> str | None:
    """Why ``path`` cannot receive an output file, or ``None`` when it can (``-``: stdout).

    Checked before a run starts, so a finished run is never lost to a bad path."""
    if str(path) == "-":
        return None
    if path.is_dir():
        return f"{path} is a directory"
    parent = path.parent
    if not parent.is_dir():
        return f"directory {parent} does not exist"
    if path.exists():
        if not os.access(path, os.W_OK):
            return f"{path} is not writable"
    elif not os.access(parent, os.W_OK | os.X_OK):
        return f"directory {parent} is not writable"
    return None


def _process_age() -> float | None:
    """Seconds since this process started (Linux ``/proc``; ``None`` elsewhere)."""
    try:
        stat = Path("/proc/self/stat").read_text()
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        # Field 22 (starttime, clock ticks after boot); fields after the ")" of the name.
        start_ticks = int(stat.rsplit(")", 1)[1].split()[19])
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


def _write_json(path: Path, doc: dict[str, Any]) -> None:
    text = json.dumps(doc, indent=2)
    if str(path) == "-":
        print(text)
    else:
        path.write_text(text + "\n")


def _run_once(args: argparse.Namespace, config: ReplayConfig, progress: bool) -> ReplayReport:
    import dataclasses

    import anyio

    from urc.apps.replay import run_replay

    startup = _process_age()

    async def announce(url: str) -> None:
        print(f"urc replay: serving metrics at {url}", file=sys.stderr, flush=True)

    report = anyio.run(
        lambda: run_replay(
            config, progress=progress, metrics_port=args.metrics_port, on_metrics=announce
        )
    )
    return dataclasses.replace(report, startup_time_s=startup)


def _run_sweep(args: argparse.Namespace, config: ReplayConfig, progress: bool) -> SweepResult:
    import anyio

    from urc.apps.replay.sweep import run_sweep

    return anyio.run(lambda: run_sweep(config, args.sweep, progress=progress))


def _replay(args: argparse.Namespace) -> int:
    from urc.errors import ConfigError

    prog = "urc replay"
    try:
        config = _config(args)
    except ConfigError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    if args.plot is not None and args.sweep is None:
        print(f"{prog}: error: --plot needs --sweep", file=sys.stderr)
        return 2
    for option, path in (("--json", args.json), ("--plot", args.plot)):
        problem = None if path is None else _output_path_problem(path)
        if problem is not None:
            print(f"{prog}: error: {option}: {problem}", file=sys.stderr)
            return 2
    progress = not args.no_progress and sys.stderr.isatty()
    to_stdout = args.json is not None and str(args.json) == "-"
    try:
        if args.sweep is not None:
            sweep = _run_sweep(args, config, progress)
        else:
            report = _run_once(args, config, progress)
    except BaseException as raised:
        status = _failure_status(prog, _leaf(raised))
        if status is None:
            raise
        return status
    if args.sweep is not None:
        if args.json is not None:
            _write_json(args.json, sweep.to_dict())
        if not to_stdout:
            print(sweep.format())
        if args.plot is not None:
            note = sweep.write_png(args.plot)
            print(f"{prog}: {note}", file=sys.stderr)
        return 0 if sweep.ok else 1
    if args.json is not None:
        _write_json(args.json, report.to_dict())
    if not to_stdout:
        print(report.format())
    for warning in report.warnings:
        print(f"{prog}: warning: {warning}", file=sys.stderr)
    if report.served_nothing:
        print(f"{prog}: error: no request was served", file=sys.stderr)
        return 1
    return 0 if report.check_ok else 1


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``urc`` console script; returns the exit status."""
    args_in = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(with_replay_options=bool(args_in) and args_in[0] == "replay")
    args = parser.parse_args(args_in)
    if args.command == "replay":
        return _replay(args)
    parser.print_help(sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
