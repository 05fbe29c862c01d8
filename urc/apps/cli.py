"""The ``urc`` command line.  One subcommand so far: ``urc replay`` (see :mod:`urc.apps.replay`).

Examples::

    urc replay                                   # built-in multi-turn chat, HiCache on
    urc replay --workload agent-loop --model mamba --device-tokens 0.1
    urc replay --trace conversation_trace.jsonl --prefill-only --json report.json
    urc replay --trace conversation_trace.jsonl --prefill-only --host-tokens 0 --sweep

Exit status: 0 on success; 1 when the run failed (malformed or empty trace, no request
served, or the final invariant check failed); 2 on a usage error: one line on stderr that
names the flag as the command line spells it (``urc replay: error: argument --chunk-size:
...``), for a bad value, options that do not fit together (the rules of
:mod:`urc.apps.replay.options`), a ``--trace`` that cannot be read, a ``--json`` / ``--plot`` /
``--l3-dir`` path that cannot be written, or ``--plot`` without matplotlib, all checked
before the run; 130 when interrupted (Ctrl-C), at any point.

Start-up stays cheap: parsing and checking the flags imports the standard library and
:mod:`urc.apps.replay.options` / :mod:`urc.apps.replay.arguments` only, so ``--help`` and
every usage error answer before torch, asyncio, the cache and the service are imported by
the command that runs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from time import perf_counter
from typing import TYPE_CHECKING, Any

from urc.apps._arguments import usage_error
from urc.apps.fleet.arguments import FLEET_HELP
from urc.apps.replay.arguments import (
    REPLAY_HELP,
    Parser,
    add_replay_parser,
    check_replay_args,
    host_tokens,
    resolved,
)

if TYPE_CHECKING:
    from urc.apps.replay import ReplayConfig, ReplayReport
    from urc.apps.replay.sweep import SweepResult

if sys.version_info < (3, 11):  # pragma: no cover
    from exceptiongroup import BaseExceptionGroup

__all__ = ["DISTRIBUTION", "build_parser", "main", "version"]

DISTRIBUTION = "unified-radix-cache"
"""The package's distribution name (what ``urc --version`` reports the version of)."""

_PROG = "urc replay"
_INTERRUPTED = 130  # the shell's status for SIGINT


def version() -> str:
    """The installed distribution's version (``"unknown"`` when it is not installed)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version(DISTRIBUTION)
    except PackageNotFoundError:
        return "unknown"


class _VersionAction(argparse.Action):
    """``--version``: looks the version up only when asked (importlib.metadata is slow)."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, help="show the version and exit")

    def __call__(self, parser: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> None:
        print(f"{parser.prog} {version()}")
        parser.exit()


def build_parser(*, with_replay_options: bool = True) -> argparse.ArgumentParser:
    """The ``urc`` argument parser.  ``with_replay_options=False`` builds only the top level
    (what ``urc --help`` and ``urc --version`` need).  Neither imports torch."""
    parser = Parser(prog="urc", description="Unified Radix Cache tools (see 'urc replay --help').")
    parser.add_argument("--version", action=_VersionAction)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    if not with_replay_options:
        sub.add_parser("replay", help=REPLAY_HELP)
        sub.add_parser("fleet", help=FLEET_HELP)  # its own parser: urc.apps.fleet.cli
        return parser
    add_replay_parser(sub)
    return parser


def _subparser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices[command]  # type: ignore[no-any-return]
    return parser


def _config(args: argparse.Namespace) -> ReplayConfig:
    """The parsed flags as a ReplayConfig (imports torch: after every check has passed)."""
    from hicache.config import StorageBackupPolicy
    from urc.apps.replay import ModelProfile, ReplayConfig
    from urc.apps.workloads import WorkloadKind
    from urc.eviction_policy import EvictionPolicy
    from urc.host_protocol import WritePolicy

    return ReplayConfig(
        trace=args.trace,
        workload=WorkloadKind(args.workload),
        num_requests=args.num_requests,
        seed=resolved(args, "seed"),
        block_size=resolved(args, "block_size"),
        session_concurrency=resolved(args, "session_concurrency"),
        model=ModelProfile(args.model),
        window=resolved(args, "window"),
        swa_tokens=args.swa_tokens,
        mamba_states=args.mamba_states,
        device_tokens=args.device_tokens,
        host_tokens=host_tokens(args),
        write_policy=WritePolicy(resolved(args, "write_policy")),
        eviction_policy=EvictionPolicy(args.eviction_policy),
        partial_leaf_eviction=args.partial_leaf_eviction,
        l3_dir=args.l3_dir,
        l3_backup=StorageBackupPolicy(resolved(args, "l3_backup")),
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


def _usage_error(flag: str, problem: str) -> int:
    return usage_error(_PROG, flag, problem)


def _failure_status(exc: BaseException) -> int | None:
    """Print a one-line error for an expected failure and return its exit status."""
    if isinstance(exc, KeyboardInterrupt):  # first: the imports below may be what it broke
        print(f"{_PROG}: interrupted", file=sys.stderr)
        return _INTERRUPTED
    from urc.apps.replay.options import OptionError, flag_name
    from urc.apps.replay.source import EmptyWorkloadError
    from urc.apps.workloads import TraceFormatError
    from urc.errors import ConfigError

    prog = _PROG
    if isinstance(exc, TraceFormatError):
        print(f"{prog}: error: malformed trace: {exc}", file=sys.stderr)
        return 1
    if isinstance(exc, OptionError):
        return _usage_error(flag_name(exc.field), exc.describe(flag_name))
    if isinstance(exc, ConfigError):  # sizes the workload's first pass made impossible
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    if isinstance(exc, EmptyWorkloadError):
        print(f"{prog}: error: {exc}: nothing to replay", file=sys.stderr)
        return 1
    if isinstance(exc, OSError):
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 1
    return None


def _write_json(path: Path, doc: dict[str, Any]) -> None:
    text = json.dumps(doc, indent=2)
    if str(path) == "-":
        print(text)
    else:
        path.write_text(text + "\n")


def _run_once(
    args: argparse.Namespace, config: ReplayConfig, progress: bool, started: float
) -> ReplayReport:
    import dataclasses

    import anyio

    from urc.apps.replay import run_replay

    startup = perf_counter() - started

    async def announce(url: str) -> None:
        print(f"urc replay: serving metrics at {url}", file=sys.stderr, flush=True)

    publisher = None
    if args.kv_events is not None:
        from urc.service import KVEventPublisher, KVEventsConfig

        publisher = KVEventPublisher(KVEventsConfig(endpoint=args.kv_events))
    report = anyio.run(
        lambda: run_replay(
            config,
            progress=progress,
            metrics_port=args.metrics_port,
            on_metrics=announce,
            kv_publisher=publisher,
        )
    )
    if publisher is not None:
        print(f"urc replay: KV events on {publisher.endpoint}: {publisher.stats}", file=sys.stderr)
    return dataclasses.replace(report, startup_time_s=startup)


def _run_sweep(args: argparse.Namespace, config: ReplayConfig, progress: bool) -> SweepResult:
    import anyio

    from urc.apps.replay.sweep import run_sweep

    return anyio.run(lambda: run_sweep(config, args.sweep, progress=progress))


def _replay(args: argparse.Namespace, started: float) -> int:
    problem = check_replay_args(args)
    if problem is not None:
        return _usage_error(*problem)
    progress = not args.no_progress and sys.stderr.isatty()
    to_stdout = args.json is not None and str(args.json) == "-"
    try:
        config = _config(args)
        if args.sweep is not None:
            sweep = _run_sweep(args, config, progress)
        else:
            report = _run_once(args, config, progress, started)
    except BaseException as raised:
        status = _failure_status(_leaf(raised))
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
            print(f"{_PROG}: {note}", file=sys.stderr)
        return 0 if sweep.ok else 1
    if args.json is not None:
        _write_json(args.json, report.to_dict())
    if not to_stdout:
        print(report.format())
    for warning in report.warnings:
        print(f"{_PROG}: warning: {warning}", file=sys.stderr)
    if report.served_nothing:
        print(f"{_PROG}: error: no request was served", file=sys.stderr)
        return 1
    return 0 if report.check_ok else 1


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``urc`` console script; returns the exit status (130 on Ctrl-C,
    wherever it lands: parsing, imports, setup, the replay).

    Run as the program (``argv`` is ``None``), an interrupted run exits at once, skipping the
    interpreter's teardown: freeing a large workload's objects one by one took 2.5 s after a
    Ctrl-C in the first pass of ``--num-requests 100000``."""
    started = perf_counter()
    args_in = list(sys.argv[1:] if argv is None else argv)
    status = _main(args_in, started)
    if status == _INTERRUPTED and argv is None:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    return status


def _main(args_in: list[str], started: float) -> int:
    if args_in[:1] == ["fleet"]:
        from urc.apps.fleet.cli import main as fleet_main

        return fleet_main(args_in[1:])
    try:
        parser = build_parser(with_replay_options=bool(args_in) and args_in[0] == "replay")
        args, extra = parser.parse_known_args(args_in)
        if extra:  # named by the subcommand's parser (argparse would name ``urc``)
            sub = parser if args.command is None else _subparser(parser, args.command)
            sub.error(f"unrecognized arguments: {' '.join(extra)}")
        if args.command == "replay":
            return _replay(args, started)
        parser.print_help(sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{_PROG if args_in[:1] == ['replay'] else 'urc'}: interrupted", file=sys.stderr)
        return _INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
