"""``urc replay`` end to end: synthetic workloads, handwritten Mooncake traces, the real trace.

Exact hit-rate checks run with ``concurrency=1`` (requests in trace order, each one finished
before the next matches), which is what the ideal oracle assumes.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
from trace_paths import conversation_trace, requires_conversation_trace

import urc.apps.replay.driver as replay_driver
from hicache.config import StorageConfig
from hicache.storage.file import FileStorage
from hicache.storage.keys import PageKey
from urc.apps.cli import main
from urc.apps.replay import (
    Capacity,
    ModelProfile,
    ReplayConfig,
    ReplayReport,
    output_token_ids,
    run_replay,
)
from urc.apps.workloads import (
    WorkloadKind,
    default_config,
    ideal_block_hits,
    ideal_token_hits,
    iter_mooncake_records,
    synthetic_workload,
)
from urc.errors import ConfigError
from urc.host_protocol import WritePolicy
from urc.node import Tier

TIMEOUT = 60
REAL_TRACE = conversation_trace()

# Blocks of 4 tokens.  Hand-computed hits (page 1, unbounded, one request at a time):
#   r0 [1,2]    8 tokens: 0
#   r1 [1,2,3] 10 tokens: blocks 1 and 2 were seen -> 8
#   r2 [1,4]    6 tokens: block 1 -> 4
#   r3 [1]      3 tokens: the first 3 tokens of block 1 -> 3
#   r4 [1,2,3] 10 tokens: all of r1 -> 10
# total 25 of 37 prompt tokens.  With a 10-token device pool (no host tier), r2's tail needs
# the 2 slots of r1's partial block 3 (the only unlocked leaf) and r4's tail evicts r2's
# block 4, so r4 hits only blocks 1 and 2: 8, total 23.  With page 2, r3 hits one page: 2.
TINY_TRACE = [
    {"timestamp": 0, "input_length": 8, "output_length": 2, "hash_ids": [1, 2]},
    {"timestamp": 1, "input_length": 10, "output_length": 1, "hash_ids": [1, 2, 3]},
    {"timestamp": 2, "input_length": 6, "output_length": 3, "hash_ids": [1, 4]},
    {"timestamp": 3, "input_length": 3, "output_length": 1, "hash_ids": [1]},
    {"timestamp": 5, "input_length": 10, "output_length": 2, "hash_ids": [1, 2, 3]},
]


def write_trace(path: Path, records: list[dict[str, object]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def run_cli(tmp_path: Path, *args: str) -> tuple[int, dict[str, Any]]:
    out = tmp_path / "report.json"
    rc = main(["replay", "--no-progress", "--json", str(out), *args])
    return rc, json.loads(out.read_text())


async def replay(config: ReplayConfig, **kwargs: Any) -> ReplayReport:
    with anyio.fail_after(TIMEOUT):
        return await run_replay(config, **kwargs)


# ---------------------------------------------------------------------- handwritten trace
@pytest.mark.parametrize(
    ("page", "device", "extra", "hits"),
    [
        ("1", "1000", (), 25),
        ("1", "1000", ("--prefill-only",), 25),
        ("2", "1000", ("--prefill-only",), 24),
        ("1", "10", ("--prefill-only",), 23),
        ("1", "1000", ("--speed", "100"), 25),  # paced arrivals (timestamps / 100)
    ],
)
def test_tiny_trace_hit_rate_is_the_hand_computed_value(
    tmp_path: Path, page: str, device: str, extra: tuple[str, ...], hits: int
) -> None:
    trace = write_trace(tmp_path / "tiny.jsonl", TINY_TRACE)
    rc, rep = run_cli(
        tmp_path,
        "--trace", str(trace), "--block-size", "4", "--page-size", page,
        "--chunk-size", "4", "--concurrency", "1", "--device-tokens", device,
        "--host-tokens", "0", *extra,
    )  # fmt: skip
    assert rc == 0
    assert rep["requests"] == {"total": 5, "done": 5, "rejected": 0}
    tokens = rep["tokens"]
    assert isinstance(tokens, dict)
    assert tokens["input"] == 37
    assert tokens["hit"] == {"device": hits, "host": 0, "storage": 0}
    assert tokens["output"] == (0 if "--prefill-only" in extra else 9)
    hit_rate = rep["hit_rate"]
    assert isinstance(hit_rate, dict)
    assert hit_rate["overall"] == pytest.approx(hits / 37)
    assert rep["check"] == {"ok": True, "error": None}


def test_tiny_trace_with_host_tier_and_concurrency(tmp_path: Path) -> None:
    """The same trace, HiCache on and 4 requests in flight: consistent, invariants hold."""
    records = [{**r, "timestamp": i} for i, r in enumerate(TINY_TRACE * 3)]
    trace = write_trace(tmp_path / "tiny.jsonl", records)
    rc, rep = run_cli(
        tmp_path,
        "--trace", str(trace), "--block-size", "4", "--page-size", "1", "--chunk-size", "4",
        "--concurrency", "4", "--device-tokens", "24", "--host-tokens", "64",
    )  # fmt: skip
    assert rc == 0
    assert rep["requests"] == {"total": 15, "done": 15, "rejected": 0}
    assert rep["check"] == {"ok": True, "error": None}


def test_malformed_trace_line_is_a_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "bad.jsonl"
    trace.write_text(json.dumps(TINY_TRACE[0]) + "\n\n" + '{"timestamp": 1, "input_length": "x"}\n')
    rc = main(["replay", "--no-progress", "--trace", str(trace), "--block-size", "4"])
    err = capsys.readouterr().err
    assert rc == 1
    assert "bad.jsonl:3:" in err and "input_length" in err
    assert "Traceback" not in err


def test_missing_trace_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["replay", "--no-progress", "--trace", str(tmp_path / "nope.jsonl")])
    err = capsys.readouterr().err
    assert rc == 2 and "argument --trace: " in err and "nope.jsonl" in err
    assert "Traceback" not in err


# ---------------------------------------------------------------------- synthetic workloads
def test_default_workload_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The default command on a small synthetic workload: report printed and written."""
    rc, rep = run_cli(tmp_path, "--num-requests", "150")
    text = capsys.readouterr().out
    assert rc == 0
    assert "hit rate" in text and "check      sanity_check + pool conservation: ok" in text
    assert rep["requests"] == {"total": 150, "done": 150, "rejected": 0}
    assert rep["config"]["write_policy"] == "write_back"
    hit = rep["hit_rate"]
    assert isinstance(hit, dict)
    assert 0 < hit["overall"] <= rep["workload"]["ideal_hit_rate"]
    assert hit["overall"] == pytest.approx(hit["device"] + hit["host"] + hit["storage"])
    assert rep["backed_up_tokens"] > 0
    latency = rep["timings"]["latency_us"]
    assert isinstance(latency, dict)
    for kind in ("match_req", "alloc", "cache_unfinished_req", "cache_finished_req"):
        assert latency[kind]["count"] > 0
        assert 0 < latency[kind]["p50_us"] <= latency[kind]["p99_us"]


@pytest.mark.parametrize("kind", list(WorkloadKind))
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.asyncio
async def test_unbounded_prefill_only_equals_the_ideal(kind: WorkloadKind, page_size: int) -> None:
    n = 100
    workload = list(synthetic_workload(replace(default_config(kind), num_requests=n, seed=7)))
    ideal = ideal_token_hits(workload, page_size)
    total = sum(r.input_length for r in workload)
    config = ReplayConfig(
        workload=kind,
        num_requests=n,
        seed=7,
        page_size=page_size,
        prefill_only=True,
        concurrency=1,
        device_tokens=Capacity(tokens=2 * total),
        host_tokens=Capacity(tokens=0),
    )
    rep = await replay(config)
    assert rep.requests_done == n and rep.requests_rejected == 0
    assert rep.input_tokens == ideal.input_tokens
    assert rep.hit_tokens == {Tier.DEVICE: ideal.hit_tokens, Tier.HOST: 0, Tier.STORAGE: 0}
    assert rep.hit_rate == pytest.approx(ideal.hit_rate)
    assert rep.ideal_hit_rate == pytest.approx(ideal.hit_rate)
    assert not any(rep.evicted.values())
    assert rep.check_ok, rep.check_error


@pytest.mark.parametrize("policy", list(WritePolicy))
@pytest.mark.asyncio
async def test_small_device_uses_the_host_tier(policy: WritePolicy) -> None:
    """A device pool far smaller than the working set: evictions, backups and host hits."""
    config = ReplayConfig(
        num_requests=300,
        device_tokens=Capacity(fraction=0.05),
        host_tokens=Capacity(fraction=1.0),
        write_policy=policy,
        concurrency=4,
    )
    rep = await replay(config)
    assert rep.check_ok, rep.check_error
    assert rep.requests_done + rep.requests_rejected == 300
    assert rep.evicted.get("full/device", 0) > 0
    assert rep.backed_up_tokens > 0
    assert rep.loaded_back_tokens > 0
    assert rep.hit_tokens[Tier.HOST] > 0


@pytest.mark.parametrize(
    ("model", "extra"),
    [
        (ModelProfile.SWA, {"window": 128}),
        (ModelProfile.MAMBA, {}),
    ],
)
@pytest.mark.asyncio
async def test_hybrid_models(model: ModelProfile, extra: dict[str, int]) -> None:
    config = ReplayConfig(
        workload=WorkloadKind.AGENT_LOOP,
        num_requests=120,
        model=model,
        device_tokens=Capacity(fraction=0.2),
        chunk_size=256,
        **extra,  # type: ignore[arg-type]
    )
    rep = await replay(config)
    assert rep.check_ok, rep.check_error
    # Under this memory pressure a request may (rarely, depending on how background copies
    # interleave) find every other request waiting for memory and be rejected, never lost.
    assert rep.requests_done + rep.requests_rejected == 120
    assert rep.requests_done >= 110
    assert rep.hit_rate > 0
    # A hybrid model can hit less than full attention (Mamba: only at checkpoints).
    assert rep.hit_rate <= rep.ideal_hit_rate + 1e-9


@pytest.mark.asyncio
async def test_memory_pressure_rejects_instead_of_crashing() -> None:
    """Requests that cannot fit (or deadlock waiting) are rejected; the rest are served."""
    config = ReplayConfig(
        num_requests=80,
        device_tokens=Capacity(tokens=1536),
        host_tokens=Capacity(tokens=0),
        concurrency=8,
        chunk_size=256,
    )
    rep = await replay(config)
    assert rep.check_ok, rep.check_error
    assert rep.requests_total == 80
    assert rep.requests_rejected > 0 and rep.requests_done > 0


@pytest.mark.asyncio
async def test_metrics_are_served_during_the_run() -> None:
    seen: list[bytes] = []

    async def scrape(url: str) -> None:
        assert url.startswith("http://127.0.0.1:")
        port = int(url.rsplit(":", 1)[1].split("/")[0])
        async with await anyio.connect_tcp("127.0.0.1", port) as stream:
            await stream.send(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            chunks = []
            try:
                while True:
                    chunks.append(await stream.receive())
            except anyio.EndOfStream:
                pass
        seen.append(b"".join(chunks))

    rep = await replay(ReplayConfig(num_requests=20), metrics_port=0, on_metrics=scrape)
    assert rep.check_ok
    assert seen and seen[0].startswith(b"HTTP/1.1 200")
    assert b"urc_command_duration_seconds" in seen[0]


def test_output_token_ids_are_deterministic_and_disjoint_from_prompts() -> None:
    a = output_token_ids(3, 5)
    assert a == output_token_ids(3, 5) and len(a) == 5
    assert not set(a) & set(output_token_ids(4, 5))
    assert min(a) >= 1 << 31


# ---------------------------------------------------------------------- the real trace
@requires_conversation_trace
@pytest.mark.asyncio
async def test_conversation_trace_prefix_equals_the_block_ideal() -> None:
    """The first 300 requests of the conversation trace, unbounded, prefill-only: the replay's
    hit tokens equal the hash-id oracle's (computed here, independently of the replay)."""
    n, page = 300, 64
    records = []
    for rec in iter_mooncake_records(REAL_TRACE):
        if len(records) == n:
            break
        records.append(rec)
    ideal = ideal_block_hits(records, block_size=512, page_size=page)
    total = sum(r.input_length for r in records)
    config = ReplayConfig(
        trace=REAL_TRACE,
        num_requests=n,
        page_size=page,
        chunk_size=4096,
        prefill_only=True,
        concurrency=1,
        device_tokens=Capacity(tokens=total + 4096),
        host_tokens=Capacity(tokens=0),
    )
    rep = await replay(config)
    assert rep.check_ok, rep.check_error
    assert rep.input_tokens == ideal.input_tokens
    assert rep.hit_tokens[Tier.DEVICE] == ideal.hit_tokens


def _l3_replay(tmp_path: Path, write_policy: WritePolicy = WritePolicy.WRITE_BACK) -> ReplayConfig:
    """A short replay whose pages fall out of host into an L3 directory under ``tmp_path``.

    Write-back (replay's default) at page 16: a second run over the same directory loads
    L3-prefetched host pages back into a device pool too small for them, so some
    load-backs fail.  Such a failure once left the pinned host leaf outside the host heap
    ("host leaf ... is not in the host heap"; ``urc.host.transfers.start_load_back``): this
    run tripped it in 8 of 10 tries; the deterministic check is
    ``tests/hicache/test_hicache_core.py::test_failed_load_back_leaves_the_host_leaf_evictable``.
    """
    return ReplayConfig(
        num_requests=150,
        page_size=16,
        device_tokens=Capacity(fraction=0.05),
        host_tokens=Capacity(fraction=0.1),
        write_policy=write_policy,
        l3_dir=tmp_path / "l3",
    )


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "write_policy", [WritePolicy.WRITE_BACK, WritePolicy.WRITE_THROUGH], ids=lambda p: p.value
)
async def test_l3_storage_tier_serves_a_second_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], write_policy: WritePolicy
) -> None:
    """Pages that fell out of host are written to the L3 directory; a second run with the
    same directory (a fresh cache) hits them from storage, under either write policy."""
    config = _l3_replay(tmp_path, write_policy)
    first = await replay(config, progress=True)
    assert first.check_ok, first.check_error
    assert first.storage_stats["pages_written"] > 0
    # The flush of queued writes has its own progress bar and time, inside the total.
    assert "L3 flush" in capsys.readouterr().err
    t = first.to_dict()["timings"]
    assert t["total_s"] >= t["setup_s"] + t["replay_s"] + t["flush_s"]
    assert "L3 flush" in first.format() and first.deterministic is False
    second = await replay(config)
    assert second.check_ok, second.check_error
    assert second.hit_tokens[Tier.STORAGE] > 0
    assert second.to_dict()["config"]["l3"].endswith("(on_host_eviction)")
    if second.hit_rate > second.ideal_hit_rate:
        assert any("above the cold-start ideal" in n for n in second.notes)


class _StalledDisk(FileStorage):
    """A real file store on a disk that stalls: each write waits until it is given up on
    (the storage worker's flush deadline, then the service's close cancels it)."""

    async def _put(self, keys: Sequence[PageKey], buffers: Sequence[torch.Tensor]) -> int:
        await anyio.sleep_forever()
        raise AssertionError("unreachable")


@pytest.mark.asyncio
async def test_l3_flush_that_hits_its_deadline_warns_with_the_writes_it_dropped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Writes still queued when the L3 flush's deadline passes are dropped; the report says
    so (a later run over the same directory finds fewer pages), with how many."""
    monkeypatch.setattr(replay_driver, "FileStorage", _StalledDisk)
    monkeypatch.setattr(
        replay_driver, "StorageConfig", functools.partial(StorageConfig, flush_timeout_s=0.2)
    )
    config = _l3_replay(tmp_path)
    rep = await replay(config)
    assert rep.check_ok, rep.check_error
    dropped = rep.storage_stats["dropped_writes"]
    assert rep.storage_stats["pages_written"] == 0 and dropped > 0
    (warning,) = [w for w in rep.warnings if "L3 flush" in w]
    assert "0.2 s deadline" in warning and f"dropped {dropped:,} queued writes" in warning
    assert "WARNING    the L3 flush hit its 0.2 s deadline" in rep.format()


def test_l3_needs_full_attention_and_a_host_tier(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="l3_dir: the L3 storage tier supports model full"):
        ReplayConfig(model=ModelProfile.MAMBA, l3_dir=tmp_path)
    with pytest.raises(ConfigError, match="host tier"):
        ReplayConfig(host_tokens=Capacity(tokens=0), l3_dir=tmp_path)
