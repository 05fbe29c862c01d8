"""``urc replay``'s options: the parser, its help, and the checks made before anything runs.

Nothing here imports torch, asyncio, the cache or the service (:mod:`urc.apps.replay.options`
holds the rules and the choices), so ``urc replay --help`` and every usage
error answer in a fraction of a second.  :func:`check_replay_args` applies the rules of
:func:`~urc.apps.replay.options.check_options` to the parsed flags, then what only the command
line has: a ``--trace`` that can be read, ``--json`` / ``--plot`` / ``--l3-dir`` paths that
can be written, matplotlib for ``--plot``.  Every problem is one line that names the flag.
The parser, the value types and the path checks are the ones ``urc fleet`` uses
(:mod:`urc.apps._arguments`).
"""

from __future__ import annotations

import argparse
import importlib.util
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from urc.apps._arguments import (
    HelpFormatter,
    Parser,
    directory_problem,
    number,
    output_path_problem,
    positive_float,
    positive_int,
    trace_problem,
)
from urc.apps.replay.options import (
    DEFAULT_CHUNK_SIZE,
    DEFAULT_L3_BACKUP,
    DEFAULT_SEED,
    DEFAULT_SESSION_CONCURRENCY,
    DEFAULT_SWEEP,
    DEFAULT_WINDOW,
    DEFAULT_WRITE_POLICY,
    EVICTION_POLICY_VALUES,
    L3_BACKUP_VALUES,
    TRACE_BLOCK_SIZE,
    WORKLOAD_VALUES,
    WRITE_POLICY_VALUES,
    Capacity,
    ModelProfile,
    OptionError,
    check_options,
    flag_name,
)
from urc.errors import ConfigError

__all__ = [
    "DEFAULT_HOST_TOKENS",
    "REPLAY_HELP",
    "HelpFormatter",
    "Parser",
    "add_replay_parser",
    "check_replay_args",
    "host_tokens",
    "output_path_problem",
    "resolved",
]

_CAPACITY_HELP = (
    "A CAPACITY is a token count (65536) or, written with a '.', a fraction of the "
    "workload's unique prompt tokens (input tokens minus the ideal prefix hits of an "
    "unbounded cache at this page size; computed by a first pass over the trace or workload). "
    "Token counts are prompt tokens for every workload: agentic session files, cached one "
    "token per block, divide them by the block size."
)

REPLAY_HELP = "replay a request trace or a synthetic workload through the cache"

DEFAULT_HOST_TOKENS = Capacity(fraction=0.25)
"""``--host-tokens`` of a single replay; a ``--sweep`` turns the host tier off unless given."""


def _capacity(text: str) -> Capacity:
    try:
        return Capacity.parse(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _fractions(text: str) -> tuple[Capacity, ...]:
    caps = tuple(_capacity(t) for t in text.split(",") if t.strip())
    if not caps:
        raise argparse.ArgumentTypeError("give at least one capacity")
    if any(c.is_zero for c in caps):
        raise argparse.ArgumentTypeError(
            f"every capacity must be > 0 (the device pool holds every request), got {text!r}"
        )
    return caps


# ZMQ's transports (zmq_bind(3)); an address is ``transport://where``.
_ZMQ_TRANSPORTS = ("tcp", "ipc", "inproc", "pgm", "epgm", "vmci", "ws", "wss")


def _endpoint(text: str) -> str:
    transport, sep, where = text.partition("://")
    if not sep or transport not in _ZMQ_TRANSPORTS or not where:
        raise argparse.ArgumentTypeError(
            f"not a ZMQ address (tcp://127.0.0.1:5557, ipc:///tmp/kv.sock): {text!r}"
        )
    if transport == "tcp":
        _, colon, port = where.rpartition(":")
        if not colon or not (port == "*" or (port.isdigit() and int(port) <= 65535)):
            raise argparse.ArgumentTypeError(f"a tcp address needs host:port, got {text!r}")
    return text


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"port must be in 0..65535, got {value}")
    return value


def _choice_option(
    group: Any, flag: str, values: Sequence[str], default: str | None, help: str
) -> None:
    """An option whose choices are ``values`` (an enum's values); ``default=None``: the
    option is not set unless given (its help text states the default that then applies)."""
    group.add_argument(flag, choices=list(values), default=default, help=help)


def add_replay_parser(sub: Any) -> None:
    """Add the ``replay`` subcommand and its options to ``sub`` (an argparse subparsers
    action).  Imports neither torch nor the cache."""
    p = sub.add_parser(
        "replay",
        help=REPLAY_HELP,
        description=(
            "Drive the async cache service the way a serving loop would: per request "
            "match (loading host hits back), chunked prefill with cache_unfinished_req, "
            "output slots, cache_finished_req; many requests in flight; HiCache backup "
            "running. Ends with a report (hit rate by tier, evictions, backups, load-backs, "
            "latency percentiles, invariant check). The same flags give the same report "
            "(timings aside) unless --realtime, --speed or --l3-dir is used."
        ),
        formatter_class=HelpFormatter,
    )
    src = p.add_argument_group("workload")
    excl = src.add_mutually_exclusive_group()
    excl.add_argument(
        "--trace",
        metavar="PATH",
        type=Path,
        help="a Mooncake-format trace (JSON lines: timestamp, input_length, output_length, "
        "hash_ids), read streaming; e.g. the traces in Mooncake's FAST25-release/traces/; or "
        "agentic sessions: a directory or .tar.xz of session files (one cache token per "
        "block; use --page-size 1)",
    )
    _choice_option(
        excl,
        "--workload",
        WORKLOAD_VALUES,
        WORKLOAD_VALUES[0],
        "built-in synthetic workload (used when no --trace is given)",
    )
    src.add_argument(
        "--num-requests",
        metavar="N",
        type=positive_int,
        default=None,
        help="requests to replay (a trace: the first N; synthetic: its size, default 2000)",
    )
    src.add_argument(
        "--seed",
        metavar="N",
        type=int,
        default=None,
        help="seed of the synthetic workload, or of the agentic sessions' order and gaps "
        f"(default: {DEFAULT_SEED})",
    )
    src.add_argument(
        "--session-concurrency",
        metavar="N",
        type=positive_float,
        default=None,
        help="agentic sessions (--trace DIR or .tar.xz): Poisson session arrivals at this "
        f"mean number running (default: {DEFAULT_SESSION_CONCURRENCY:g})",
    )
    src.add_argument(
        "--block-size",
        metavar="TOKENS",
        type=positive_int,
        default=None,
        help=f"tokens per hash id of a Mooncake-format --trace (default: {TRACE_BLOCK_SIZE})",
    )

    cache = p.add_argument_group("cache", _CAPACITY_HELP)
    _choice_option(
        cache,
        "--model",
        [m.value for m in ModelProfile],
        ModelProfile.FULL.value,
        "full attention, hybrid sliding-window (SWA) or hybrid Mamba",
    )
    cache.add_argument(
        "--window",
        metavar="TOKENS",
        type=positive_int,
        default=None,
        help=f"SWA window (tokens; --model swa; default: {DEFAULT_WINDOW})",
    )
    cache.add_argument(
        "--swa-tokens",
        metavar="CAPACITY",
        type=_capacity,
        default=None,
        help="SWA KV pool size (--model swa; default: the device pool's size)",
    )
    cache.add_argument(
        "--mamba-states",
        metavar="N",
        type=positive_int,
        default=None,
        help="Mamba state slots (--model mamba; default: device tokens / chunk size + "
        "2 x concurrency)",
    )
    cache.add_argument(
        "--device-tokens",
        metavar="CAPACITY",
        type=_capacity,
        default=Capacity(fraction=0.25),
        help="device KV pool size (the tokens the GPU holds)",
    )
    cache.add_argument(
        "--host-tokens",
        metavar="CAPACITY",
        type=_capacity,
        default=None,
        help=f"host tier (HiCache, in RAM) size; 0 turns it off (default: {DEFAULT_HOST_TOKENS}; "
        "with --sweep, 0: the curve of the device tier alone)",
    )
    _choice_option(
        cache,
        "--write-policy",
        WRITE_POLICY_VALUES,
        None,
        "when device KV is copied to the host tier (needs one): write_back (default) "
        "copies a device leaf when it is evicted (device + host then act like one cache of "
        "their combined size); write_through copies a node after its first hit (selective: "
        "second), so KV evicted before it was hit again is lost",
    )
    _choice_option(
        cache,
        "--eviction-policy",
        EVICTION_POLICY_VALUES,
        "lru",
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
        metavar="DIR",
        type=Path,
        default=None,
        help="add the L3 storage tier: page files in this directory (kept between runs, so "
        "a second run can hit pages the first one wrote); --model full only",
    )
    _choice_option(
        cache,
        "--l3-backup",
        L3_BACKUP_VALUES,
        None,
        f"with --l3-dir: when host pages are written to L3 (default: {DEFAULT_L3_BACKUP})",
    )
    cache.add_argument(
        "--page-size",
        metavar="TOKENS",
        type=positive_int,
        default=16,
        help="tree page (a power of two)",
    )

    loop = p.add_argument_group("serving loop")
    loop.add_argument(
        "--concurrency",
        metavar="N",
        type=positive_int,
        default=8,
        help="requests in flight at once",
    )
    loop.add_argument(
        "--chunk-size",
        metavar="TOKENS",
        type=positive_int,
        default=DEFAULT_CHUNK_SIZE,
        help="prefill chunk (tokens, a multiple of --page-size; SGLang's "
        "--chunked-prefill-size). A chunk's cache_unfinished_req resumes the insert where the "
        "last one stopped, so a prompt costs time linear in its length at any chunk size",
    )
    loop.add_argument(
        "--prefill-only",
        action="store_true",
        help="cache the prompts only (no output tokens): comparable with trace-level "
        "simulations and the ideal hit rate",
    )
    loop.add_argument(
        "--speed",
        metavar="X",
        type=number,
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
        "--json",
        metavar="PATH",
        type=Path,
        default=None,
        help="also write the report as JSON here ('-': stdout)",
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
        "the other flags stay as given, except the host tier: off unless --host-tokens "
        "is given",
    )
    out.add_argument(
        "--plot",
        metavar="PATH",
        type=Path,
        default=None,
        help="with --sweep: also save the curve as a PNG here (needs matplotlib; checked "
        "before the run)",
    )
    out.add_argument(
        "--metrics-port",
        metavar="PORT",
        type=_port,
        default=None,
        help="serve Prometheus /metrics on 127.0.0.1:PORT during the run (0: any free port)",
    )
    out.add_argument(
        "--kv-events",
        metavar="ENDPOINT",
        type=_endpoint,
        default=None,
        help="publish KV events (SGLang 0.5.23's ZMQ format) on this PUB address during the "
        "run, e.g. tcp://127.0.0.1:5557 (needs pyzmq and msgspec)",
    )
    out.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress bar (it is also off when stderr is not a terminal)",
    )


_DEFAULTS: dict[str, object] = {
    "seed": DEFAULT_SEED,
    "session_concurrency": DEFAULT_SESSION_CONCURRENCY,
    "block_size": TRACE_BLOCK_SIZE,
    "window": DEFAULT_WINDOW,
    "write_policy": DEFAULT_WRITE_POLICY,
    "l3_backup": DEFAULT_L3_BACKUP,
}
"""The options parsed with ``default=None`` (so that a flag given where it has no effect can be
told from one left out) and the value that applies when they are left out."""


def resolved(args: argparse.Namespace, name: str) -> Any:
    """The value of option ``name`` that applies: as given, else its default."""
    value = getattr(args, name)
    return _DEFAULTS[name] if value is None and name in _DEFAULTS else value


def host_tokens(args: argparse.Namespace) -> Capacity:
    """``--host-tokens`` as given, else the default: :data:`DEFAULT_HOST_TOKENS` for one
    replay, 0 for a ``--sweep`` (its curve is then the device tier's alone, which the
    capacities on its x axis describe; give ``--host-tokens`` for a HiCache curve)."""
    if args.host_tokens is not None:
        return args.host_tokens  # type: ignore[no-any-return]
    return Capacity(tokens=0) if args.sweep is not None else DEFAULT_HOST_TOKENS


def _no_effect_problem(args: argparse.Namespace) -> tuple[str, str] | None:
    """A flag given where it would change nothing, as ``(flag, problem)``.

    One rule for every such flag: it is refused (a flag that silently does nothing hides a
    mistake in the command line), naming the flag and what it needs."""
    model = ModelProfile(args.model)
    sessions = mooncake = False
    if args.trace is not None:
        from urc.apps.workloads.agentic import is_session_archive  # asyncio, no torch

        sessions = is_session_archive(args.trace)
        mooncake = not sessions
    needs = [
        ("--window", args.window, model is ModelProfile.SWA, "without --model swa"),
        (
            "--write-policy",
            args.write_policy,
            not host_tokens(args).is_zero,
            "without the host tier (--host-tokens is 0"
            + (", the default with --sweep)" if args.sweep is not None else ")"),
        ),
        ("--l3-backup", args.l3_backup, args.l3_dir is not None, "without --l3-dir"),
        (
            "--block-size",
            args.block_size,
            mooncake,
            "without a Mooncake-format --trace (session files carry their own)",
        ),
        (
            "--session-concurrency",
            args.session_concurrency,
            sessions,
            "without agentic session files (--trace DIR or .tar.xz)",
        ),
        (
            "--seed",
            args.seed,
            not mooncake,
            "with a Mooncake-format --trace (replayed as recorded)",
        ),
    ]
    for flag, value, applies, problem in needs:
        if value is not None and not applies:
            return flag, f"has no effect {problem}"
    return None


def check_replay_args(args: argparse.Namespace) -> tuple[str, str] | None:
    """The first problem with the parsed ``replay`` flags as ``(flag, problem)``, or ``None``.

    Applies :func:`~urc.apps.replay.options.check_options` (the rules of ``ReplayConfig``), then
    the checks of the paths and of matplotlib described in the module docstring; creates the
    ``--l3-dir`` directory when it is missing.  Imports no torch."""
    try:
        check_options(
            model=ModelProfile(args.model),
            num_requests=args.num_requests,
            block_size=resolved(args, "block_size"),
            window=resolved(args, "window"),
            swa_tokens=args.swa_tokens,
            mamba_states=args.mamba_states,
            device_tokens=args.device_tokens,
            host_tokens=host_tokens(args),
            l3_dir=args.l3_dir,
            page_size=args.page_size,
            chunk_size=args.chunk_size,
            concurrency=args.concurrency,
            speed=args.speed,
        )
    except OptionError as exc:
        return flag_name(exc.field), exc.describe(flag_name)
    if (no_effect := _no_effect_problem(args)) is not None:
        return no_effect
    if args.plot is not None:
        if args.sweep is None:
            return "--plot", "has no effect without --sweep"
        if importlib.util.find_spec("matplotlib") is None:
            return "--plot", 'needs matplotlib, which is not installed (pip install -e ".[plot]")'
    if args.trace is not None and (problem := trace_problem(args.trace)) is not None:
        return "--trace", problem
    for flag, path in (("--json", args.json), ("--plot", args.plot)):
        if path is not None and (problem := output_path_problem(path)) is not None:
            return flag, problem
    if args.kv_events is not None:
        missing = [m for m in ("zmq", "msgspec") if importlib.util.find_spec(m) is None]
        if missing:
            return "--kv-events", (
                f"needs pyzmq and msgspec ({', '.join(missing)} not installed: "
                'pip install -e ".[events]")'
            )
    if args.l3_dir is not None and (problem := directory_problem(args.l3_dir)) is not None:
        return "--l3-dir", problem
    return None
