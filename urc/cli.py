"""The ``urc`` command line.  One subcommand so far: ``urc replay`` (see :mod:`urc.replay`).

Examples::

    urc replay                                   # built-in multi-turn chat, HiCache on
    urc replay --workload agent-loop --model mamba --device-tokens 0.1
    urc replay --trace conversation_trace.jsonl --prefill-only --page-size 64 \\
        --device-tokens 0.25 --host-tokens 0.5 --json report.json

Exit status: 0 on success, 1 when the run failed (unreadable or malformed trace, or the
final invariant check failed), 2 on a usage or configuration error, 130 when interrupted.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

import anyio

from hicache.config import StorageBackupPolicy
from urc.errors import ConfigError
from urc.replay import Capacity, ModelProfile, ReplayConfig, run_replay
from urc.tiers import WritePolicy
from urc.workloads import DEFAULT_BLOCK_SIZE, TraceFormatError, WorkloadKind

if sys.version_info < (3, 11):  # pragma: no cover
    from exceptiongroup import BaseExceptionGroup

__all__ = ["build_parser", "main"]

_CAPACITY_HELP = (
    "a token count (65536) or, written with a '.', a fraction of the workload's unique "
    "prompt tokens (input tokens minus the ideal prefix hits of an unbounded cache at this "
    "page size; computed by a first pass over the trace or workload)"
)


def _capacity(text: str) -> Capacity:
    try:
        return Capacity.parse(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="urc", description="Unified Radix Cache tools (see 'urc replay --help')."
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    p = sub.add_parser(
        "replay",
        help="replay a request trace or a synthetic workload through the cache",
        description=(
            "Drive the async cache service the way a serving loop would: per request "
            "match (loading host hits back), chunked prefill with cache_unfinished_req, "
            "output slots, cache_finished_req; many requests in flight; HiCache backup "
            "running. Ends with a report (hit rate by tier, evictions, backups, load-backs, "
            "latency percentiles, invariant check)."
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
    excl.add_argument(
        "--workload",
        choices=[k.value for k in WorkloadKind],
        default=WorkloadKind.MULTI_TURN_CHAT.value,
        help="built-in synthetic workload (used when no --trace is given)",
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
    cache.add_argument(
        "--model",
        choices=[m.value for m in ModelProfile],
        default=ModelProfile.FULL.value,
        help="full attention, hybrid sliding-window (SWA) or hybrid Mamba",
    )
    cache.add_argument(
        "--window", type=_positive_int, default=4096, help="SWA window (tokens; --model swa)"
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
        default=Capacity(fraction=0.5),
        help="host tier (HiCache, in RAM) size: " + _CAPACITY_HELP + "; 0 turns it off",
    )
    cache.add_argument(
        "--write-policy",
        choices=[w.value for w in WritePolicy],
        default=WritePolicy.WRITE_THROUGH.value,
        help="when device KV is backed up to host",
    )
    cache.add_argument(
        "--l3-dir",
        type=Path,
        default=None,
        help="add the L3 storage tier: page files in this directory (kept between runs, so "
        "a second run can hit pages the first one wrote); --model full only",
    )
    cache.add_argument(
        "--l3-backup",
        choices=[p.value for p in StorageBackupPolicy if p is not StorageBackupPolicy.OFF],
        default=StorageBackupPolicy.ON_HOST_EVICTION.value,
        help="when host pages are written to L3",
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
        default=512,
        help="prefill chunk (tokens, a multiple of --page-size)",
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

    out = p.add_argument_group("output")
    out.add_argument(
        "--json", type=Path, default=None, help="also write the report as JSON here ('-': stdout)"
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
    return parser


def _config(args: argparse.Namespace) -> ReplayConfig:
    return ReplayConfig(
        trace=args.trace,
        workload=WorkloadKind(args.workload),
        num_requests=args.num_requests,
        seed=args.seed,
        block_size=args.block_size,
        model=ModelProfile(args.model),
        window=args.window,
        mamba_states=args.mamba_states,
        device_tokens=args.device_tokens,
        host_tokens=args.host_tokens,
        write_policy=WritePolicy(args.write_policy),
        l3_dir=args.l3_dir,
        l3_backup=StorageBackupPolicy(args.l3_backup),
        page_size=args.page_size,
        chunk_size=args.chunk_size,
        concurrency=args.concurrency,
        prefill_only=args.prefill_only,
        speed=args.speed,
    )


def _leaf(exc: BaseException) -> BaseException:
    """The first non-group exception inside (nested) exception groups."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return exc


def _failure_status(prog: str, exc: BaseException) -> int | None:
    """Print a one-line error for an expected failure and return its exit status."""
    if isinstance(exc, TraceFormatError):
        print(f"{prog}: error: malformed trace: {exc}", file=sys.stderr)
        return 1
    if isinstance(exc, ConfigError):
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    if isinstance(exc, OSError):
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 1
    if isinstance(exc, KeyboardInterrupt):
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    return None


def _replay(args: argparse.Namespace) -> int:
    prog = "urc replay"
    try:
        config = _config(args)
    except ConfigError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    progress = not args.no_progress and sys.stderr.isatty()

    async def announce(url: str) -> None:
        print(f"{prog}: serving metrics at {url}", file=sys.stderr, flush=True)

    try:
        report = anyio.run(
            lambda: run_replay(
                config, progress=progress, metrics_port=args.metrics_port, on_metrics=announce
            )
        )
    except BaseException as raised:
        status = _failure_status(prog, _leaf(raised))
        if status is None:
            raise
        return status
    if args.json is not None:
        doc = json.dumps(report.to_dict(), indent=2)
        if str(args.json) == "-":
            print(doc)
        else:
            args.json.write_text(doc + "\n")
    if args.json is None or str(args.json) != "-":
        print(report.format())
    return 0 if report.check_ok else 1


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``urc`` console script; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "replay":
        return _replay(args)
    parser.print_help(sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
