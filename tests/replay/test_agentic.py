"""Agentic session workloads (``urc.apps.workloads.agentic``) and their replay.

Small session files are written by the tests themselves; the real sessions in
``../shared/traces/agentic`` are read only by the last test, which skips without them.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import tarfile
from pathlib import Path
from typing import Any

import anyio
import pytest
from trace_paths import trace_dir

from urc.apps.replay import Capacity, ReplayConfig, run_replay
from urc.apps.replay.agentic_sweep import parse_tokens, sweep, table
from urc.apps.replay.driver import _hint
from urc.apps.workloads.agentic import (
    AgenticConfig,
    AgenticFormatError,
    is_session_archive,
    load_agentic,
)
from urc.eviction_policy import EvictionPolicy

BS = 64


def _req(t: float, ids: list[int], stop: str = "tool_use", kind: str = "n") -> dict[str, Any]:
    return {"t": t, "type": kind, "in": len(ids) * BS, "out": 10, "hash_ids": ids,
            "stop": stop, "api_time": 2.0, "think_time": 1.0}  # fmt: skip


def _session(sid: str, n_turns: int, head: int = 2, sub: bool = False) -> dict[str, Any]:
    """A session whose prompt grows by two blocks a turn, starting with ``head`` blocks of
    tools+system (local ids 1..head); optionally a sub-agent after the first turn."""
    reqs: list[dict[str, Any]] = []
    ids = list(range(1, head + 1))
    for k in range(n_turns):
        ids = [*ids, 100 + 2 * k, 101 + 2 * k]
        reqs.append(_req(10.0 * k, ids, "end_turn" if k == n_turns - 1 else "tool_use"))
        if sub and k == 0:
            reqs.append({"t": 5.0, "type": "subagent", "agent_id": "agent_001",
                         "tool_tokens": BS, "system_tokens": 0,
                         "requests": [_req(0.0, [1, 900]), _req(3.0, [1, 900, 901])]})  # fmt: skip
    return {"id": sid, "block_size": BS, "hash_id_scope": "local",
            "tool_tokens": head * BS, "system_tokens": 0, "requests": reqs}  # fmt: skip


def _write(dir_: Path, sessions: list[dict[str, Any]]) -> Path:
    dir_.mkdir(parents=True, exist_ok=True)
    for s in sessions:
        (dir_ / f"{s['id']}.json").write_text(json.dumps(s))
    return dir_


def test_sessions_become_flows_with_a_shared_prefix_and_seeded_arrivals(tmp_path: Path) -> None:
    d = _write(tmp_path / "s", [_session("trace_0001", 3, sub=True), _session("trace_0002", 2)])
    assert is_session_archive(d) and not is_session_archive(tmp_path / "x.jsonl")
    wl = load_agentic(AgenticConfig(d, concurrency=2, seed=1))
    reqs = list(wl)
    assert (wl.sessions, wl.flows, wl.requests) == (2, 3, 7)
    assert [r.index for r in reqs] == list(range(7))
    assert all(a.timestamp_ms <= b.timestamp_ms for a, b in itertools.pairwise(reqs))
    assert {r.session_id for r in reqs} == {"trace_0001", "trace_0002", "trace_0001/agent_001"}
    mains = {sid: [r for r in reqs if r.session_id == sid] for sid in ("trace_0001", "trace_0002")}
    # Same agent (equal tool and system sizes): the two sessions share their two head blocks,
    # and nothing after them.
    a, b = mains["trace_0001"][0].input_ids, mains["trace_0002"][0].input_ids
    assert a[:2] == b[:2] and a[2] != b[2]
    # A flow's turns extend each other; the stop reasons and model times are kept.
    t1 = mains["trace_0001"]
    assert t1[1].input_ids[: len(t1[0].input_ids)] == t1[0].input_ids
    assert [r.stop for r in t1] == ["tool_use", "tool_use", "end_turn"]
    assert all(r.model_time_ms == 2000 for r in reqs)
    # The sub-agent reuses its parent's block 1 (same local id), not the other session's.
    sub = [r for r in reqs if r.session_id == "trace_0001/agent_001"]
    assert sub[0].input_ids[0] == a[0] and len(sub) == 2
    # Its requests name the flow that started it (the hint's parent_id); the others none.
    assert {r.parent_session_id for r in sub} == {"trace_0001"}
    assert {r.parent_session_id for r in reqs if r not in sub} == {None}
    # The replay's hints carry it.
    flows = {(h.session_id, h.parent_id) for h in map(_hint, reqs) if h is not None}
    sub_flow = ("trace_0001/agent_001", "trace_0001")
    assert flows == {("trace_0001", None), ("trace_0002", None), sub_flow}
    # The same seed gives the same workload; another seed other arrival times.
    assert [r.timestamp_ms for r in load_agentic(AgenticConfig(d, concurrency=2, seed=1))] == [
        r.timestamp_ms for r in reqs
    ]
    other = [r.timestamp_ms for r in load_agentic(AgenticConfig(d, concurrency=2, seed=2))]
    assert other != [r.timestamp_ms for r in reqs]


def test_without_prefix_sharing_sessions_share_nothing(tmp_path: Path) -> None:
    d = _write(tmp_path / "s", [_session("trace_0001", 1), _session("trace_0002", 1)])
    a, b = load_agentic(AgenticConfig(d, share_prefix=False))
    assert not set(a.input_ids) & set(b.input_ids)


def test_subsets_split_the_sessions(tmp_path: Path) -> None:
    d = _write(tmp_path / "s", [_session(f"trace_{i:04d}", 1) for i in range(5)])
    halves = [{r.session_id for r in load_agentic(AgenticConfig(d, subset=(k, 2)))} for k in (0, 1)]
    assert halves[0] == {"trace_0000", "trace_0002", "trace_0004"}
    assert halves[1] == {"trace_0001", "trace_0003"}
    assert load_agentic(AgenticConfig(d, max_sessions=2)).sessions == 2


def test_a_tar_xz_reads_like_the_directory(tmp_path: Path) -> None:
    d = _write(tmp_path / "s", [_session("trace_0001", 2), _session("trace_0002", 2)])
    archive = tmp_path / "sessions.tar.xz"
    with tarfile.open(archive, "w:xz") as tar:
        tar.add(d, arcname="sessions")
    assert is_session_archive(archive)
    from_dir = [(r.timestamp_ms, r.input_ids) for r in load_agentic(AgenticConfig(d))]
    assert [(r.timestamp_ms, r.input_ids) for r in load_agentic(AgenticConfig(archive))] == from_dir


@pytest.mark.parametrize(
    "content",
    [
        "not json",
        json.dumps([1]),
        json.dumps({"block_size": 0, "requests": []}),
        json.dumps({"block_size": 64, "requests": [{"t": 0}]}),
    ],
)
def test_malformed_session_files_are_named(tmp_path: Path, content: str) -> None:
    d = tmp_path / "s"
    d.mkdir()
    (d / "trace_bad.json").write_text(content)
    with pytest.raises(AgenticFormatError, match=r"trace_bad\.json"):
        load_agentic(AgenticConfig(d))


@pytest.mark.parametrize("bad", [{"concurrency": 0}, {"subset": (2, 2)}, {"max_sessions": 0}])
def test_bad_layouts_are_refused(tmp_path: Path, bad: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        AgenticConfig(tmp_path, **bad)


def _replay(d: Path, policy: EvictionPolicy, blocks: int) -> Any:
    cfg = ReplayConfig(
        trace=d, page_size=1, chunk_size=64, concurrency=1, prefill_only=True,
        device_tokens=Capacity(tokens=blocks * BS), host_tokens=Capacity(tokens=0),
        eviction_policy=policy, session_concurrency=3,
    )  # fmt: skip
    return anyio.run(run_replay, cfg)


def test_replay_caches_sessions_with_hints_under_every_policy(tmp_path: Path) -> None:
    d = _write(tmp_path / "s", [_session(f"trace_{i:04d}", 6, sub=i == 0) for i in range(6)])
    rates = {}
    for policy in (EvictionPolicy.LRU, EvictionPolicy.SESSION_AWARE, EvictionPolicy.BELADY):
        rep = _replay(d, policy, 40)
        assert rep.check_ok, rep.check_error
        # Capacities are tokens: 40 blocks' worth of tokens is a pool of 40 cache tokens.
        assert (rep.device_tokens, rep.token_unit) == (40, BS)
        assert f"40 blocks of {BS} tokens ({40 * BS:,} tokens)" in rep.format()
        assert rep.requests_total == rep.requests_done == 38
        assert rep.recomputed_p50 <= rep.recomputed_p99
        assert any("Poisson" in n for n in rep.notes)
        rates[policy] = rep.hit_rate
    assert rates[EvictionPolicy.BELADY] >= max(rates.values()) - 1e-9
    big = _replay(d, EvictionPolicy.SESSION_AWARE, 4096)
    assert big.hit_rate == pytest.approx(big.ideal_hit_rate)


def test_sweep_table_reports_the_gap_share(tmp_path: Path) -> None:
    d = _write(tmp_path / "s", [_session(f"trace_{i:04d}", 5) for i in range(5)])
    assert parse_tokens("0.5M") == 1 << 19 and parse_tokens("2k") == 2048
    rows = sweep(
        d, [EvictionPolicy.LRU, EvictionPolicy.SESSION_AWARE, EvictionPolicy.BELADY],
        [8 * BS], concurrency=3, echo=False,
    )  # fmt: skip
    assert all(r.check_ok for r in rows) and len(rows) == 3
    assert rows[0].hit_rate <= rows[2].hit_rate
    text = table(rows)
    assert "| 0.5k | lru |" in text and "| 0.5k | belady |" in text


_REAL = trace_dir() / "agentic" / "claude-code-dev.tar.xz"


@pytest.mark.skipif(not _REAL.is_file(), reason=f"{_REAL} not found")
def test_real_sessions_replay_with_hints_and_invariants(tmp_path: Path) -> None:
    # Three of the real sessions (the archive is read whole: ~10 s), at a tight capacity.
    wl = load_agentic(AgenticConfig(_REAL, max_sessions=3))
    assert wl.sessions == 3 and wl.block_size == 64 and wl.requests > 0
    stops = {r.stop for r in wl}
    assert "tool_use" in stops
    d = tmp_path / "real"
    d.mkdir()
    with tarfile.open(_REAL) as tar:
        names = sorted(m.name for m in tar.getmembers() if m.name.endswith(".json"))[:3]
        for name in names:
            f = tar.extractfile(name)
            assert f is not None
            (d / Path(name).name).write_bytes(f.read())
    rep = _replay(d, EvictionPolicy.SESSION_AWARE, 8192)
    assert rep.check_ok and rep.requests_total == wl.requests
    lru = _replay(d, EvictionPolicy.LRU, 8192)
    assert rep.input_tokens == lru.input_tokens
    assert dataclasses.asdict(rep)["hit_tokens"]  # counted per tier
