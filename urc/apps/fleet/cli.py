"""``urc fleet``: the command line of :mod:`urc.apps.fleet`.

Exit status: 0 on success; 1 when a run failed (a replica's invariant check, a malformed or
empty trace, a store that could not be reached); 2 on a usage error (one line on stderr
naming the flag, before anything heavy is imported); 130 when interrupted.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from urc.apps._arguments import usage_error
from urc.apps.fleet.arguments import PROG, build_parser, check_args, is_sessions

if sys.version_info < (3, 11):  # pragma: no cover
    from exceptiongroup import BaseExceptionGroup

if TYPE_CHECKING:
    from urc.apps.fleet.report import FleetSweep
    from urc.apps.fleet.run import FleetConfig

__all__ = ["main"]

_INTERRUPTED = 130
_CHUNK = 1 << 20  # one prefill chunk per prompt: chunking changes no hit in a prefill-only run


def _base_config(args: argparse.Namespace) -> FleetConfig:
    """The flags as a FleetConfig (imports torch and the cache: after the checks)."""
    from hicache.config import StorageBackupPolicy
    from urc.apps.fleet.policy import RouterPolicy, RoutingParams
    from urc.apps.fleet.run import FleetConfig
    from urc.apps.fleet.store import L3Kind, SharedStoreConfig
    from urc.apps.replay.config import ReplayConfig
    from urc.apps.replay.options import Capacity
    from urc.host_protocol import WritePolicy

    agentic = args.trace is not None and is_sessions(args.trace)
    page = args.page_size or (1 if agentic else 16)
    unit = 1
    if agentic:
        from urc.apps.replay.source import agentic_workload

        # The layout of the first N: the sweep's first pass then reuses the loaded sessions.
        probe = ReplayConfig(
            trace=args.trace,
            session_subset=args.subset,
            page_size=page,
            session_concurrency=args.session_concurrency * args.replicas[0],
            seed=args.seed,
        )
        unit = agentic_workload(probe).block_size or 1
    replay = ReplayConfig(
        trace=args.trace,
        num_requests=args.num_requests,
        seed=args.seed,
        block_size=args.block_size,
        device_tokens=Capacity(tokens=max(page, args.device_tokens // unit)),
        host_tokens=Capacity(tokens=args.host_tokens // unit),
        write_policy=WritePolicy(args.write_policy),
        page_size=page,
        chunk_size=_CHUNK,
        concurrency=1,
        prefill_only=True,
        session_concurrency=args.session_concurrency,
        session_subset=args.subset,
    )
    return FleetConfig(
        replay=replay,
        replicas=args.replicas[0],
        policy=RouterPolicy(args.policies[0]),
        routing=RoutingParams(args.overlap_weight, args.load_window_s, args.seed),
        store=SharedStoreConfig(
            kind=L3Kind(args.l3),
            directory=args.l3_dir,
            valkey=args.valkey or (),
            mooncake_master=args.mooncake_master,
        ),
        l3_backup=StorageBackupPolicy(args.l3_backup),
        drop_rate=args.drop_events,
        causal=not args.no_causal,
    )


def _run(args: argparse.Namespace) -> FleetSweep:
    import asyncio

    from urc.apps.fleet.policy import RouterPolicy
    from urc.apps.fleet.sweep import echo_run, run_sweep

    base = _base_config(args)
    return asyncio.run(
        run_sweep(
            base,
            args.replicas,
            [RouterPolicy(p) for p in args.policies],
            session_concurrency_per_replica=args.session_concurrency,
            references=not args.no_references,
            echo=echo_run,
        )
    )


def _failure(exc: BaseException) -> int | None:
    """A one-line message and the status for an expected failure (``None``: unexpected)."""
    from hicache.storage.errors import StorageError
    from urc.apps.replay.source import EmptyWorkloadError
    from urc.apps.workloads import TraceFormatError
    from urc.errors import ConfigError

    if isinstance(exc, TraceFormatError):
        print(f"{PROG}: error: malformed trace: {exc}", file=sys.stderr)
        return 1
    if isinstance(exc, EmptyWorkloadError):
        print(f"{PROG}: error: {exc}: nothing to replay", file=sys.stderr)
        return 1
    if isinstance(exc, ConfigError):
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    if isinstance(exc, (StorageError, OSError)):
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 1
    return None


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``urc fleet`` with ``argv`` (the arguments after ``fleet``); returns the status."""
    parser = build_parser()
    try:
        args = parser.parse_args(list(sys.argv[2:] if argv is None else argv))
        problem = check_args(args)
        if problem is not None:
            return usage_error(PROG, *problem)
        try:
            sweep = _run(args)
        except Exception as raised:
            leaf: BaseException = raised
            while isinstance(leaf, BaseExceptionGroup) and leaf.exceptions:
                leaf = leaf.exceptions[0]
            status = _failure(leaf)
            if status is None:
                raise
            return status
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return _INTERRUPTED
    doc = sweep.to_dict()
    if args.json is not None:
        text = json.dumps(doc, indent=2)
        if str(args.json) == "-":
            print(text)
        else:
            args.json.write_text(text + "\n")
    if args.json is None or str(args.json) != "-":
        print(sweep.format())
    if args.plot is not None:
        print(f"{PROG}: {sweep.write_png(args.plot)}", file=sys.stderr)
    return 0 if sweep.ok else 1
