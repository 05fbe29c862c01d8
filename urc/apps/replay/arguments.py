"""``urc replay``'s options: the parser, its help, and the checks made before anything runs.

Nothing here imports torch, asyncio, the cache or the service (:mod:`urc.apps.replay.options`
holds the rules and the choices), so ``urc replay --help`` and every usage
error answer in a fraction of a second.  :func:`check_replay_args` applies the rules of
:func:`~urc.apps.replay.options.check_options` to the parsed flags, then what only the command
line has: a ``--trace`` that can be read, ``--json`` / ``--plot`` / ``--l3-dir`` paths that
can be written, matplotlib for ``--plot``.  Every problem is one line that names the flag.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from urc.apps.replay.options import (
    DEFAULT_CHUNK_SIZE,
    DEFAULT_SWEEP,
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
]

_CAPACITY_HELP = (
    "A CAPACITY is a token count (65536) or, written with a '.', a fraction of the "
    "workload's unique prompt tokens (input tokens minus the ideal prefix hits of an "
    "unbounded cache at this page size; computed by a first pass over the trace or workload)."
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
    return caps


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _speed(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"port must be in 0..65535, got {value}")
    return value


class Parser(argparse.ArgumentParser):
    """argparse with one-line usage errors: ``<prog>: error: argument --flag: problem``."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows ``(default: X)`` only where the help text does not already say the default and
    there is one to show (not ``None`` or a switch's ``False``)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if "default" in text or default is None or default is False or default == argparse.SUPPRESS:
            return text
        return super()._get_help_string(action)


def _choice_option(group: Any, flag: str, values: Sequence[str], default: str, help: str) -> None:
    """An option whose choices are ``values`` (an enum's values)."""
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
        type=_count,
        default=None,
        help="requests to replay (a trace: the first N; synthetic: its size, default 2000)",
    )
    src.add_argument(
        "--seed", metavar="N", type=int, default=0, help="seed of the synthetic workload"
    )
    src.add_argument(
        "--session-concurrency",
        metavar="N",
        type=float,
        default=100.0,
        help="agentic sessions: Poisson session arrivals at this mean number running",
    )
    src.add_argument(
        "--block-size",
        metavar="TOKENS",
        type=_positive_int,
        default=TRACE_BLOCK_SIZE,
        help="tokens per trace hash id",
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
        type=_positive_int,
        default=4096,
        help="SWA window (tokens; --model swa)",
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
        type=_positive_int,
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
        "write_back",
        "when device KV is copied to host: write_back copies a device leaf when it is "
        "evicted (device + host then act like one cache of their combined size); "
        "write_through copies a node after its first hit (selective: second), so KV "
        "evicted before it was hit again is lost",
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
        "on_host_eviction",
        "when host pages are written to L3",
    )
    cache.add_argument(
        "--page-size",
        metavar="TOKENS",
        type=_positive_int,
        default=16,
        help="tree page (a power of two)",
    )

    loop = p.add_argument_group("serving loop")
    loop.add_argument(
        "--concurrency",
        metavar="N",
        type=_positive_int,
        default=8,
        help="requests in flight at once",
    )
    loop.add_argument(
        "--chunk-size",
        metavar="TOKENS",
        type=_positive_int,
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
        type=_speed,
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
        default=None,
        help="publish KV events (SGLang 0.5.23's ZMQ format) on this PUB address during the "
        "run, e.g. tcp://127.0.0.1:5557 (needs pyzmq and msgspec)",
    )
    out.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress bar (it is also off when stderr is not a terminal)",
    )


def output_path_problem(path: Path) -> str | None:
    """Why ``path`` cannot receive an output file, or ``None`` when it can (``-``: stdout).

    Checked before a run starts, so a finished run is never lost to a bad path."""
    if str(path) == "-":
        return None
    if path.is_dir():
        if not any(path.glob("*.json")):
            return f"{path} is a directory without session files (*.json)"
        return None
    parent = path.parent
    if not parent.is_dir():
        return f"directory {parent} does not exist"
    if path.exists():
        if not os.access(path, os.W_OK):
            return f"{path} is not writable"
    elif not os.access(parent, os.W_OK | os.X_OK):
        return f"directory {parent} is not writable"
    return None


def host_tokens(args: argparse.Namespace) -> Capacity:
    """``--host-tokens`` as given, else the default: :data:`DEFAULT_HOST_TOKENS` for one
    replay, 0 for a ``--sweep`` (its curve is then the device tier's alone, which the
    capacities on its x axis describe; give ``--host-tokens`` for a HiCache curve)."""
    if args.host_tokens is not None:
        return args.host_tokens  # type: ignore[no-any-return]
    return Capacity(tokens=0) if args.sweep is not None else DEFAULT_HOST_TOKENS


def _trace_problem(path: Path) -> str | None:
    if not path.exists():
        return f"{path}: no such file"
    if path.is_dir():
        if not any(path.glob("*.json")):
            return f"{path} is a directory without session files (*.json)"
        return None
    if not os.access(path, os.R_OK):
        return f"{path} is not readable"
    return None


def _l3_dir_problem(path: Path) -> str | None:
    """Creates the directory (the run would) so that a path that cannot be one fails now."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        return f"{path} exists and is not a directory"
    except OSError as exc:
        return f"cannot create directory {path}: {exc.strerror or exc}"
    if not os.access(path, os.W_OK | os.X_OK):
        return f"directory {path} is not writable"
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
            block_size=args.block_size,
            window=args.window,
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
    if args.plot is not None:
        if args.sweep is None:
            return "--plot", "needs --sweep"
        if importlib.util.find_spec("matplotlib") is None:
            return "--plot", "needs matplotlib, which is not installed (pip install matplotlib)"
    if args.trace is not None and (problem := _trace_problem(args.trace)) is not None:
        return "--trace", problem
    for flag, path in (("--json", args.json), ("--plot", args.plot)):
        if path is not None and (problem := output_path_problem(path)) is not None:
            return flag, problem
    if args.l3_dir is not None and (problem := _l3_dir_problem(args.l3_dir)) is not None:
        return "--l3-dir", problem
    return None
