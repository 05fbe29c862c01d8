"""``urc fleet``'s flags and the checks made before anything heavy is imported.

Standard library only: ``urc fleet --help`` and every usage error (one line naming the flag,
exit status 2) answer before torch, the cache or the service are imported.  The parser, the
value types and the path checks are ``urc replay``'s (:mod:`urc.apps._arguments`).
"""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

from urc.apps._arguments import (
    HelpFormatter,
    Parser,
    directory_problem,
    non_negative_float,
    output_path_problem,
    positive_float,
    positive_int,
    trace_problem,
)

__all__ = [
    "FLEET_HELP",
    "POLICIES",
    "HelpFormatter",
    "PROG",
    "Parser",
    "build_parser",
    "check_args",
    "is_sessions",
    "parse_tokens",
]

PROG = "urc fleet"
FLEET_HELP = "replay a trace through N replicas behind a KV-event router (shared L3 optional)"
POLICIES = ("round-robin", "least-loaded", "session-affinity", "kv-aware", "random")
_L3_KINDS = ("none", "file", "valkey", "mooncake")
_BACKUPS = ("write_through", "on_host_eviction")
_WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
_SESSION_SUFFIXES = (".tar.xz", ".txz", ".tar.gz", ".tgz", ".tar")


def parse_tokens(text: str) -> int:
    """``"1M"`` (2**20), ``"512k"`` (2**19), ``"65536"`` -> tokens.  Raises ``ValueError``."""
    t = text.strip().upper().replace("_", "")
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(t[-1:], 1)
    if scale != 1:
        t = t[:-1]
    value = float(t)
    if not value >= 0 or value != value or value == float("inf"):
        raise ValueError(text)
    return round(value * scale)


def _tokens(text: str) -> int:
    try:
        return parse_tokens(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"not a token count (1048576, 1M, 512k): {text!r}"
        ) from None


def _replica_counts(text: str) -> tuple[int, ...]:
    try:
        counts = tuple(int(p) for p in text.split(","))
    except ValueError:
        counts = ()
    if not counts or any(n < 1 for n in counts):
        raise argparse.ArgumentTypeError(f"must be replica counts >= 1 (4,8), got {text!r}")
    return counts


def _policies(text: str) -> tuple[str, ...]:
    names = tuple(p.strip() for p in text.split(",") if p.strip())
    bad = [p for p in names if p not in POLICIES]
    if not names or bad:
        raise argparse.ArgumentTypeError(
            f"unknown policy {bad[0] if bad else text!r} (choose from {', '.join(POLICIES)})"
        )
    return names


def _rate(text: str) -> float:
    value = non_negative_float(text)
    if value >= 1:
        raise argparse.ArgumentTypeError(f"must be a share in [0, 1), got {text!r}")
    return value


def _subset(text: str) -> tuple[int, int]:
    try:
        k, n = (int(p) for p in text.split("/"))
    except ValueError:
        k, n = -1, 0
    if not 0 <= k < n:
        raise argparse.ArgumentTypeError(f"must be k/n with 0 <= k < n, got {text!r}")
    return k, n


def _addresses(text: str) -> tuple[tuple[str, int], ...]:
    out = []
    for part in text.split(","):
        host, sep, port = part.strip().rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise argparse.ArgumentTypeError(f"not host:port[,host:port...]: {text!r}")
        out.append((host, int(port)))
    return tuple(out)


def _address(text: str) -> str:
    _addresses(text)
    if "," in text:
        raise argparse.ArgumentTypeError(f"must be one host:port, got {text!r}")
    return text.strip()


def build_parser() -> Parser:
    """The ``urc fleet`` parser (imports nothing beyond the standard library)."""
    p = Parser(
        prog=PROG,
        description=FLEET_HELP + ". Prints a Markdown table per run: hit rate by tier, "
        "load max/mean, the router's accuracy and event lag, with the one-big-cache bound "
        "and the random-routing floor for each N.",
        formatter_class=HelpFormatter,
    )
    w = p.add_argument_group("workload")
    w.add_argument(
        "--trace",
        type=Path,
        default=None,
        help="agentic sessions (a directory or .tar.xz of session files) or a Mooncake "
        "JSON-lines trace; none: the built-in multi-turn chat workload",
    )
    w.add_argument("--num-requests", type=positive_int, default=None, help="cap the workload")
    w.add_argument(
        "--session-concurrency",
        type=positive_float,
        default=4.0,
        help="agentic sessions running on average PER REPLICA: N replicas serve N times as many",
    )
    w.add_argument(
        "--subset", type=_subset, default=None, help="agentic: every n-th session from the k-th"
    )
    w.add_argument("--block-size", type=positive_int, default=512, help="Mooncake tokens per id")
    w.add_argument("--seed", type=int, default=0, help="arrivals, random routing, event drops")
    f = p.add_argument_group("fleet")
    f.add_argument("--replicas", type=_replica_counts, default="4", help="N, or a list: 4,8")
    f.add_argument(
        "--policies",
        type=_policies,
        default="round-robin,least-loaded,session-affinity,kv-aware",
        help=f"routing policies, comma list of {', '.join(POLICIES)}",
    )
    f.add_argument(
        "--no-references",
        action="store_true",
        help="skip the bound (one cache, N x capacity) and floor (random routing) runs",
    )
    f.add_argument(
        "--overlap-weight",
        type=non_negative_float,
        default=1.0,
        help="kv-aware: weight of tokens to prefill against the load (Dynamo's)",
    )
    f.add_argument(
        "--load-window-s",
        type=positive_float,
        default=30.0,
        help="seconds of the trace's clock a routed prompt counts as a replica's load",
    )
    f.add_argument(
        "--no-causal",
        action="store_true",
        help="route a session's request without waiting for its previous one and for the "
        "router to apply the events published by then (compressed time: a staler view "
        "than a real router's)",
    )
    f.add_argument(
        "--drop-events",
        type=_rate,
        default=0.0,
        help="share of live event batches the router loses (recovered by replay)",
    )
    c = p.add_argument_group("each replica")
    c.add_argument(
        "--device-tokens",
        type=_tokens,
        default="1M",
        help="device KV tokens per replica, in model tokens (agentic sessions: divided by "
        "the 64-token block into cache blocks)",
    )
    c.add_argument(
        "--host-tokens", type=_tokens, default="0", help="host tier tokens per replica (0: none)"
    )
    c.add_argument(
        "--write-policy", choices=_WRITE_POLICIES, default="write_through", help="host backups"
    )
    c.add_argument(
        "--page-size",
        type=positive_int,
        default=None,
        help="cache page in cache tokens (default: 1 for agentic blocks, 16 otherwise)",
    )
    s = p.add_argument_group("shared L3")
    s.add_argument("--l3", choices=_L3_KINDS, default="none", help="the fleet's shared store")
    s.add_argument("--l3-dir", type=Path, default=None, help="--l3 file: directory (temp)")
    s.add_argument("--valkey", type=_addresses, default=None, help="--l3 valkey: host:port,...")
    s.add_argument("--mooncake-master", type=_address, default=None, help="--l3 mooncake")
    s.add_argument(
        "--l3-backup", choices=_BACKUPS, default="write_through", help="when pages go to L3"
    )
    o = p.add_argument_group("output")
    o.add_argument("--json", type=Path, default=None, help="write the runs as JSON ('-': stdout)")
    o.add_argument("--plot", type=Path, default=None, help="write a PNG (needs matplotlib)")
    return p


def is_sessions(path: Path) -> bool:
    """Whether ``path`` names agentic session files rather than a Mooncake trace."""
    return path.is_dir() or path.name.endswith(_SESSION_SUFFIXES)


def check_args(args: argparse.Namespace) -> tuple[str, str] | None:
    """The first flag that does not fit, as ``(flag, problem)``; ``None`` when all do."""
    if args.trace is not None and (problem := trace_problem(args.trace)):
        return "--trace", problem
    if args.subset is not None and (args.trace is None or not is_sessions(args.trace)):
        return "--subset", "applies to agentic session traces only"
    if args.device_tokens < 1:
        return "--device-tokens", "a replica needs at least one device token"
    if args.l3 != "none" and args.host_tokens == 0:
        return "--l3", "a shared L3 store goes through a host tier: give --host-tokens > 0"
    if args.l3_dir is not None and args.l3 != "file":
        return "--l3-dir", "applies to --l3 file only"
    if args.valkey is not None and args.l3 != "valkey":
        return "--valkey", "applies to --l3 valkey only"
    if args.mooncake_master is not None and args.l3 != "mooncake":
        return "--mooncake-master", "applies to --l3 mooncake only"
    if args.l3 == "mooncake" and args.mooncake_master is None:
        return "--l3", "mooncake needs --mooncake-master host:port"
    for flag, path in (("--json", args.json), ("--plot", args.plot)):
        if path is not None and (problem := output_path_problem(path)):
            return flag, problem
    if args.plot is not None and importlib.util.find_spec("matplotlib") is None:
        return "--plot", "needs matplotlib (pip install matplotlib)"
    if args.no_references and not args.policies:
        return "--policies", "nothing to run"
    if args.l3_dir is not None and (problem := directory_problem(args.l3_dir)):
        return "--l3-dir", problem
    return None
