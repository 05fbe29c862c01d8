"""``urc replay`` as a benchmark: reproducible reports, honest timings and ideal, failures that
say so, and the sweep and chunk-cost tools."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest
from trace_paths import TRACE_DIR_ENV, conversation_trace, requires_conversation_trace, trace_dir

from urc.apps.bench.chunk import format_costs, measure
from urc.apps.cli import main
from urc.apps.replay import Capacity, ModelProfile, ReplayConfig, ReplayReport, run_replay
from urc.specs import SlidingWindowSpec

TIMEOUT = 60


def write_trace(path: Path, records: list[dict[str, object]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def cli_json(tmp_path: Path, name: str, *args: str) -> tuple[int, dict[str, Any]]:
    out = tmp_path / f"{name}.json"
    rc = main(["replay", "--no-progress", "--json", str(out), *args])
    return rc, json.loads(out.read_text())


async def replay(config: ReplayConfig, **kwargs: Any) -> ReplayReport:
    with anyio.fail_after(TIMEOUT):
        return await run_replay(config, **kwargs)


# ---------------------------------------------------------------------- determinism
RACY = (
    # A small device and a host tier with write-through: backups, evictions and load-backs
    # interleave on every request (the case that raced in worker threads).
    "--num-requests", "300", "--device-tokens", "0.05", "--host-tokens", "0.1",
    "--write-policy", "write_through", "--concurrency", "16",
)  # fmt: skip


def without_timings(doc: dict[str, Any]) -> str:
    rest = {k: v for k, v in doc.items() if k != "timings"}
    return json.dumps(rest, sort_keys=True)


def test_same_seed_and_flags_give_byte_identical_reports_minus_timings(tmp_path: Path) -> None:
    rc1, first = cli_json(tmp_path, "a", *RACY, "--seed", "3")
    rc2, second = cli_json(tmp_path, "b", *RACY, "--seed", "3")
    assert rc1 == rc2 == 0
    assert first["config"]["deterministic"] is True
    assert first["backed_up_tokens"] > 0 and first["loaded_back_tokens"] > 0
    for part in ("tokens", "evicted", "backed_up_tokens", "loaded_back_tokens"):
        assert first[part] == second[part], part  # raced in worker threads before
    assert without_timings(first) == without_timings(second)
    assert set(first["timings"]) == {
        "startup_s", "setup_s", "replay_s", "flush_s", "total_s", "latency_us",
    }  # fmt: skip


@requires_conversation_trace
def test_conversation_trace_prefix_replays_identically(tmp_path: Path) -> None:
    args = (
        "--trace", str(conversation_trace()), "--num-requests", "150", "--prefill-only",
        "--device-tokens", "0.1", "--host-tokens", "0.2", "--write-policy", "write_through",
        "--chunk-size", "2048",
    )  # fmt: skip
    _, first = cli_json(tmp_path, "a", *args)
    _, second = cli_json(tmp_path, "b", *args)
    assert without_timings(first) == without_timings(second)


def test_realtime_runs_are_reported_as_not_deterministic(tmp_path: Path) -> None:
    rc, rep = cli_json(tmp_path, "rt", "--num-requests", "60", "--realtime")
    assert rc == 0 and rep["config"]["deterministic"] is False


# ---------------------------------------------------------------------- failures that say so
@pytest.mark.parametrize("where", ["missing-dir", "a-directory"])
def test_unwritable_json_path_fails_before_the_run(
    tmp_path: Path, where: str, capsys: pytest.CaptureFixture[str]
) -> None:
    target = tmp_path / "nope" / "r.json" if where == "missing-dir" else tmp_path
    rc = main(["replay", "--no-progress", "--num-requests", "20", "--json", str(target)])
    out, err = capsys.readouterr()
    assert rc == 2
    assert "--json" in err and "Traceback" not in err
    assert "hit rate" not in out  # nothing ran


def test_empty_trace_is_an_error_not_a_clean_report(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "empty.jsonl"
    trace.write_text("")
    rc = main(["replay", "--no-progress", "--trace", str(trace)])
    out, err = capsys.readouterr()
    assert rc == 1
    assert "no request" in err and "check ok" not in out


def test_zero_requests_is_refused_before_the_run(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:  # argparse's type check
        main(["replay", "--no-progress", "--num-requests", "0"])
    assert exc.value.code == 2
    assert "argument --num-requests: must be > 0, got 0" in capsys.readouterr().err


def test_run_that_rejects_every_request_warns_and_fails(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["replay", "--no-progress", "--num-requests", "50", "--device-tokens", "16"])
    out, err = capsys.readouterr()
    assert rc == 1
    assert "WARNING    every request was rejected" in out
    assert "warning: every request was rejected" in err
    assert "no request was served" in err


# ---------------------------------------------------------------------- timings
# (the L3 flush: tests/replay/test_replay.py::test_l3_storage_tier_serves_a_second_run)
def test_cli_report_includes_start_up_in_the_total(tmp_path: Path) -> None:
    rc, rep = cli_json(tmp_path, "t", "--num-requests", "30")
    t = rep["timings"]
    assert rc == 0 and t["startup_s"] is not None and t["startup_s"] > 0


# ---------------------------------------------------------------------- the ideal
@pytest.mark.asyncio
async def test_ideal_says_what_it_is_and_non_full_models_note_it() -> None:
    full = await replay(ReplayConfig(num_requests=60))
    assert full.to_dict()["workload"]["ideal_scope"].startswith("unbounded full-attention")
    assert "ideal" in full.format() and "empty at start" in full.format()
    assert not any("full-attention one" in n for n in full.notes)
    mamba = await replay(ReplayConfig(num_requests=60, model=ModelProfile.MAMBA))
    assert any("the ideal is the full-attention one" in n for n in mamba.notes)


# ---------------------------------------------------------------------- header, policies
@pytest.mark.asyncio
async def test_report_header_names_swa_window_pool_and_eviction_policy() -> None:
    config = ReplayConfig(
        num_requests=40, model=ModelProfile.SWA, window=256, swa_tokens=Capacity(tokens=9000)
    )
    rep = await replay(config)
    assert rep.check_ok, rep.check_error
    assert rep.swa_window == 256 and rep.swa_tokens == 9008  # whole pages
    head = rep.format().splitlines()[1:3]
    assert "window 256" in head[0] and "SWA pool 9,008 tokens" in head[0]
    assert "(lru)" in head[1]
    cfg = rep.to_dict()["config"]
    assert (cfg["swa_window"], cfg["swa_tokens"], cfg["eviction_policy"]) == (256, 9008, "lru")


def test_swa_tokens_sizes_the_swa_pool_and_only_for_swa() -> None:
    from urc.errors import ConfigError

    config = ReplayConfig(model=ModelProfile.SWA, swa_tokens=Capacity(fraction=0.5))
    assert config.swa_pool_tokens(4096, 1000) == 512
    assert config.cache_config(4096, 100, 512).spec(SlidingWindowSpec).kv_size == 512
    assert ReplayConfig(model=ModelProfile.SWA).swa_pool_tokens(4096, 1000) == 4096
    with pytest.raises(ConfigError, match="swa"):
        ReplayConfig(swa_tokens=Capacity(tokens=64))


def test_default_write_back_report_shows_what_the_host_tier_added(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc, rep = cli_json(tmp_path, "wb", "--num-requests", "150", "--device-tokens", "0.1")
    out = capsys.readouterr().out
    assert rc == 0 and rep["config"]["write_policy"] == "write_back"
    assert rep["hit_rate"]["host"] > 0
    assert f"host tier  +{rep['hit_rate']['host'] * 100:.2f} points" in out


# ---------------------------------------------------------------------- sweep
def test_sweep_prints_the_hit_rate_curve_as_a_table_and_ascii_chart(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_json = tmp_path / "sweep.json"
    rc = main([
        "replay", "--no-progress", "--num-requests", "120", "--host-tokens", "0",
        "--sweep", "0.05,0.2,1.0", "--json", str(out_json),
    ])  # fmt: skip
    out = capsys.readouterr().out
    assert rc == 0
    doc = json.loads(out_json.read_text())
    curve = doc["curve"]
    assert [p["capacity"] for p in curve] == ["0.05", "0.2", "1"]
    assert curve[0]["device_tokens"] < curve[1]["device_tokens"] < curve[2]["device_tokens"]
    assert curve[-1]["hit_rate"] >= curve[0]["hit_rate"]
    chart = [line for line in out.splitlines() if "#" in line or "|" in line]
    assert len(chart) >= 3
    assert "hit rate against device capacity (no host tier: the device tier alone" in out


def test_plot_needs_sweep(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["replay", "--plot", "x.png"]) == 2
    assert "argument --plot: has no effect without --sweep" in capsys.readouterr().err


# ---------------------------------------------------------------------- chunk-cost benchmark
def test_chunk_bench_prints_time_per_token_for_each_length() -> None:
    costs = measure([1024, 4096], chunk_size=512, repeat=1)
    assert [c.length for c in costs] == [1024, 4096]
    assert [c.chunks for c in costs] == [2, 8]
    table = format_costs(costs, 512).splitlines()
    assert "us/token" in table[1] and len(table) == 4


def test_chunk_bench_module_runs() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "urc.apps.bench.chunk", "--lengths", "1024", "--repeat", "1"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert "us/token" in proc.stdout


# ---------------------------------------------------------------------- trace location
def test_trace_dir_follows_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(TRACE_DIR_ENV, str(tmp_path))
    assert trace_dir() == tmp_path
    assert conversation_trace() == tmp_path / "conversation_trace.jsonl"
    monkeypatch.delenv(TRACE_DIR_ENV)
    assert trace_dir().parts[-2:] == ("shared", "traces")


@pytest.mark.parametrize(
    ("test_file", "selector"),
    [
        ("test_replay.py", "conversation_trace_prefix"),
        ("test_workloads_trace.py", "real_conversation_trace_parses"),
    ],
)
def test_trace_dir_env_reaches_the_trace_tests(
    tmp_path: Path, test_file: str, selector: str
) -> None:
    """A pytest run with URC_TRACE_DIR pointing at a (tiny) trace runs each test that reads
    the conversation trace instead of skipping it."""
    records = [
        {"timestamp": i, "input_length": 1024, "output_length": 1, "hash_ids": [1, 2 + i]}
        for i in range(4)
    ]
    write_trace(tmp_path / "conversation_trace.jsonl", records)
    proc = subprocess.run(
        [
            sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
            str(Path(__file__).parent / test_file), "-k", selector,
        ],
        capture_output=True, text=True, timeout=300, check=False,
        env={**__import__("os").environ, TRACE_DIR_ENV: str(tmp_path)},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "1 passed" in proc.stdout


def test_latency_table_says_that_it_includes_queueing(capsys: pytest.CaptureFixture[str]) -> None:
    note = "each call waits behind the commands of the other 3 requests in flight"
    assert main(["replay", "--no-progress", "--num-requests", "30", "--concurrency", "4"]) == 0
    assert note in capsys.readouterr().out
    assert main(["replay", "--no-progress", "--num-requests", "30", "--concurrency", "1"]) == 0
    assert "waits behind" not in capsys.readouterr().out


def test_the_first_pass_progress_bar_ends_at_its_total(capsys: pytest.CaptureFixture[str]) -> None:
    """600 requests: the bar moves every 256 (a checkpoint), and its last state is 600/600."""

    from urc.apps.replay.source import summarize

    summary = anyio.run(lambda: summarize(ReplayConfig(num_requests=600), progress=True))
    assert summary.requests == 600
    final = capsys.readouterr().err.rsplit("\r", 1)[-1]
    assert "600/600" in final and "100%" in final, final
