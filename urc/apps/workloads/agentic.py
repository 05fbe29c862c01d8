"""Agentic coding sessions (the kv-cache-tester session format) as a replayable workload.

A session file (``trace_NNNN.json``) holds one agent session: ``tool_tokens`` and
``system_tokens`` (the prefix every request starts with), ``block_size`` (tokens per hash
id) and ``requests`` in time order, each with ``t`` (seconds since the session started),
``type`` (``n`` main agent, ``s`` side request, ``subagent`` a nested flow with its own
``requests`` whose ``t`` counts from the sub-agent's own ``t``), ``hash_ids`` (the prompt's
blocks; ids are local to the session file), ``stop`` and ``api_time``.  A workload is a
directory of such files or a ``.tar.xz`` (``.tar``, ``.tar.gz``) of them.

What the replay assumes (:class:`AgenticConfig`; the report repeats it):

* **One cache token per block.**  A request's prompt is its ``hash_ids``, one token each
  (the tail of a prompt that fills no whole block has no hash id and is left out), so a
  replay counts blocks; multiplied by ``block_size`` they are tokens (a block-level cache
  with 64-token pages).  All 471 sessions (3.9G prompt tokens) then replay in minutes.
* **Arrivals.**  Sessions start as a Poisson process whose rate keeps ``concurrency``
  sessions running on average (Little's law: rate = concurrency / mean session length, a
  session lasting from its first request to the end of its last answer), in an order
  shuffled by ``seed``; every request keeps its recorded time within its session (think and
  model times as recorded).  The workload is the merge of all sessions by arrival time.
* **Flows.**  Main-agent and side requests are the session's flow (``session_id`` = the
  file's id); each sub-agent is a flow of its own (``<id>/<agent_id>``, the flow that
  started it in its requests' ``parent_session_id``).  Ids are local to
  the file, so a sub-agent shares blocks with its parent exactly where the file says so.
* **The shared prefix.**  The first ``(tool_tokens + system_tokens) // block_size`` blocks
  of a flow's first request are the agent's tools and system prompt: with ``share_prefix``
  they are the same blocks in every flow with the same two sizes (the same agent
  configuration), as a deployment serving one agent would see; without, every session's
  prefix is its own.
* **Subsets.**  ``subset=(k, n)`` keeps the sessions whose position in file-name order is
  ``k`` modulo ``n`` (tune on one half, report on the other).

Memory: each request is kept as its difference from its flow's previous request (the blocks
they share plus an array of new ones), so the whole set costs about its unique blocks.
"""

from __future__ import annotations

import json
import os
import random
import tarfile
from array import array
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from urc.apps.workloads.request import TraceRequest

__all__ = [
    "AgenticConfig",
    "AgenticFormatError",
    "AgenticWorkload",
    "is_session_archive",
    "load_agentic",
]

_ARCHIVE_SUFFIXES = (".tar.xz", ".txz", ".tar.gz", ".tgz", ".tar")


class AgenticFormatError(ValueError):
    """A session file does not follow the format (``path`` names it)."""

    def __init__(self, path: str, message: str) -> None:
        super().__init__(f"{path}: {message}")
        self.path = path


def is_session_archive(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` names a set of session files (a directory or a tar archive) rather
    than a Mooncake JSON-lines trace."""
    p = Path(path)
    return p.is_dir() or p.name.endswith(_ARCHIVE_SUFFIXES)


@dataclass(frozen=True, slots=True)
class AgenticConfig:
    """How sessions become a workload (see the module docstring).

    Raises:
        ValueError: a non-positive ``concurrency``, a bad ``subset`` or ``max_sessions``.
    """

    path: Path
    concurrency: float = 100.0
    seed: int = 0
    share_prefix: bool = True
    subset: tuple[int, int] | None = None
    max_sessions: int | None = None

    def __post_init__(self) -> None:
        if not self.concurrency > 0:
            raise ValueError(f"concurrency must be positive, got {self.concurrency}")
        if self.subset is not None:
            k, n = self.subset
            if not 0 <= k < n:
                raise ValueError(f"subset must be (k, n) with 0 <= k < n, got {self.subset}")
        if self.max_sessions is not None and self.max_sessions <= 0:
            raise ValueError(f"max_sessions must be positive, got {self.max_sessions}")


@dataclass(slots=True)
class _Flow:
    flow_id: str
    ops: list[tuple[int, int, str, int, array[int]]]  # (t_ms, common, stop, model_ms, new)
    parent: str | None = None  # a sub-agent's: the flow that started it


@dataclass(frozen=True, slots=True)
class _Event:
    time_ms: int
    flow: int
    op: int


class AgenticWorkload:
    """The loaded sessions: iterate it for the requests in arrival order (each time anew).

    ``sessions``, ``flows``, ``requests``, ``blocks`` (prompt blocks in all), ``block_size``,
    ``span_s`` (first arrival to last finish) and ``mean_session_s`` describe it.
    """

    def __init__(self, config: AgenticConfig) -> None:
        self.config = config
        self.block_size = 0
        self._flows: list[_Flow] = []
        self._events: list[_Event] = []
        self.blocks = 0
        self.sessions = 0
        self.mean_session_s = 0.0
        self.span_s = 0.0

    @property
    def flows(self) -> int:
        return len(self._flows)

    @property
    def requests(self) -> int:
        return len(self._events)

    def __iter__(self) -> Iterator[TraceRequest]:
        last: dict[int, tuple[int, ...]] = {}
        remaining = [len(f.ops) for f in self._flows]
        for index, ev in enumerate(self._events):
            flow = self._flows[ev.flow]
            _t, common, stop, model_ms, new = flow.ops[ev.op]
            prev = last.get(ev.flow, ())
            ids = prev[:common] + tuple(new)
            remaining[ev.flow] -= 1
            if remaining[ev.flow]:
                last[ev.flow] = ids
            else:
                last.pop(ev.flow, None)
            yield TraceRequest(
                index=index,
                timestamp_ms=ev.time_ms,
                input_ids=ids,
                output_length=0,
                input_length=len(ids),
                session_id=flow.flow_id,
                stop=stop,
                model_time_ms=model_ms,
                parent_session_id=flow.parent,
            )


class _Loader:
    """Reads session files into flows, naming blocks globally as it goes."""

    def __init__(self, config: AgenticConfig) -> None:
        self.config = config
        self.shared: dict[tuple[int, int, int], int] = {}
        self.next_id = 0
        self.block_size = 0

    def _new_id(self) -> int:
        self.next_id += 1
        return self.next_id

    def session(self, name: str, data: Any) -> tuple[list[_Flow], float]:
        """The flows of one session file (each op's time in ms since the session started,
        never before the flow's previous op) and the session's length in seconds."""
        if not isinstance(data, dict) or not isinstance(data.get("requests"), list):
            raise AgenticFormatError(name, "expected an object with a 'requests' list")
        bs = data.get("block_size")
        if type(bs) is not int or bs <= 0:
            raise AgenticFormatError(name, f"bad block_size {bs!r}")
        if self.block_size and bs != self.block_size:
            raise AgenticFormatError(name, f"block_size {bs} differs from {self.block_size}")
        self.block_size = bs
        sid = str(data.get("id") or Path(name).stem)
        ids: dict[int, int] = {}
        flows: list[_Flow] = []
        end = 0.0

        def add_flow(fid: str, spec: dict[str, Any], t0: float, parent: str | None) -> None:
            nonlocal end
            flow = _Flow(fid, [], parent)
            flows.append(flow)
            head = (int(spec.get("tool_tokens", 0)) + int(spec.get("system_tokens", 0))) // bs
            agent = (int(spec.get("tool_tokens", 0)), int(spec.get("system_tokens", 0)))
            prev: list[int] = []
            prev_ms = 0
            first = True
            for r in spec["requests"]:
                if not isinstance(r, dict):
                    raise AgenticFormatError(name, f"flow {fid}: a request is not an object")
                t = t0 + float(r.get("t", 0.0))
                if r.get("type") == "subagent":
                    if not isinstance(r.get("requests"), list):
                        raise AgenticFormatError(name, "a subagent without requests")
                    add_flow(f"{sid}/{r.get('agent_id', len(flows))}", r, t, fid)
                    continue
                local = r.get("hash_ids")
                if not isinstance(local, list):
                    raise AgenticFormatError(name, f"flow {fid}: a request without hash_ids")
                if first and self.config.share_prefix:
                    for i, h in enumerate(local[:head]):
                        ids.setdefault(h, self._shared(agent, i))
                first = False
                glob = [ids[h] if h in ids else ids.setdefault(h, self._new_id()) for h in local]
                common = 0
                for a, b in zip(prev, glob, strict=False):
                    if a != b:
                        break
                    common += 1
                model_s = float(r.get("api_time") or 0.0)
                end = max(end, t + model_s)
                stop = r.get("stop") or ""
                prev_ms = max(prev_ms, round(t * 1000))
                flow.ops.append(
                    (prev_ms, common, str(stop), round(model_s * 1000), array("q", glob[common:]))
                )
                prev = glob

        add_flow(sid, data, 0.0, None)
        return [f for f in flows if f.ops], end

    def _shared(self, agent: tuple[int, int], i: int) -> int:
        key = (agent[0], agent[1], i)
        got = self.shared.get(key)
        if got is None:
            got = self.shared[key] = self._new_id()
        return got


def _session_files(path: Path) -> Iterator[tuple[str, bytes]]:
    """(name, bytes) of each ``*.json`` session file, in name order."""
    if path.is_dir():
        for p in sorted(path.glob("*.json")):
            yield p.name, p.read_bytes()
        return
    with tarfile.open(path, "r:*") as tar:
        members = sorted(
            (m for m in tar.getmembers() if m.isfile() and m.name.endswith(".json")),
            key=lambda m: m.name,
        )
        for m in members:
            f = tar.extractfile(m)
            assert f is not None, f"tar member {m.name} has no data"
            with f:
                yield os.path.basename(m.name), f.read()


def load_agentic(config: AgenticConfig) -> AgenticWorkload:
    """Read ``config.path`` and lay its sessions out in time (see the module docstring).

    Raises:
        AgenticFormatError: a session file is malformed (or not JSON).
        OSError: the path cannot be read.
    """
    loader = _Loader(config)
    sessions: list[tuple[list[_Flow], float]] = []
    for i, (name, raw) in enumerate(_session_files(config.path)):
        if config.subset is not None and i % config.subset[1] != config.subset[0]:
            continue
        if config.max_sessions is not None and len(sessions) >= config.max_sessions:
            break
        try:
            data = json.loads(raw)
        except ValueError as exc:
            raise AgenticFormatError(name, f"invalid JSON: {exc}") from exc
        flows, length = loader.session(name, data)
        if flows:
            sessions.append((flows, length))
    wl = AgenticWorkload(config)
    wl.block_size = loader.block_size
    wl.sessions = len(sessions)
    if not sessions:
        return wl
    mean = sum(length for _, length in sessions) / len(sessions)
    wl.mean_session_s = mean
    rng = random.Random(config.seed)
    order = list(range(len(sessions)))
    rng.shuffle(order)
    mean_gap = max(mean, 1.0) / config.concurrency
    start = 0.0
    events: list[tuple[int, int, int]] = []
    for n, k in enumerate(order):
        if n:
            start += rng.expovariate(1.0 / mean_gap)
        flows, length = sessions[k]
        wl.span_s = max(wl.span_s, start + length)
        base = round(start * 1000)
        for flow in flows:
            fi = len(wl._flows)
            wl._flows.append(flow)
            for j, op in enumerate(flow.ops):
                events.append((base + op[0], fi, j))
                wl.blocks += op[1] + len(op[4])
    events.sort()
    wl._events = [_Event(t, f, j) for t, f, j in events]
    return wl
