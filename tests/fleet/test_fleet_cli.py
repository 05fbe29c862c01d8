"""``urc fleet`` as a user types it: usage errors (one line naming the flag, status 2,
before torch is imported), a small run end to end with its JSON, and the traces of
``../shared`` when they are there (skipped otherwise)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("zmq")
pytest.importorskip("msgspec")

from trace_paths import conversation_trace, requires_conversation_trace, trace_dir

from urc.apps.cli import main

_PROBE = """
import sys
import urc.apps.cli
try:
    status = urc.apps.cli.main({argv!r})
except SystemExit as exc:
    status = exc.code
print("STATUS", status, "TORCH", "torch" in sys.modules, "ANYIO", "anyio" in sys.modules)
"""

SESSIONS = trace_dir() / "agentic" / "claude-code-dev.tar.xz"


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--replicas", "0"], "--replicas"),
        (["--replicas", "4,x"], "--replicas"),
        (["--policies", "kv-aware,best"], "--policies"),
        (["--device-tokens", "lots"], "--device-tokens"),
        (["--drop-events", "1.5"], "--drop-events"),
        (["--trace", "missing.jsonl"], "--trace"),
        (["--subset", "0/4"], "--subset"),
        (["--l3", "file"], "--l3"),
        (["--l3", "mooncake", "--host-tokens", "1M"], "--l3"),
        (["--valkey", "127.0.0.1:6379"], "--valkey"),
        (["--valkey", "nope"], "--valkey"),
        (["--l3-dir", "x"], "--l3-dir"),
        (["--json", "no/such/dir/out.json"], "--json"),
    ],
    ids=lambda v: " ".join(v) if isinstance(v, list) else v,
)
def test_a_usage_error_is_one_line_naming_the_flag_before_torch_is_imported(
    argv: list[str], flag: str, tmp_path: Path
) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE.format(argv=["fleet", *argv])],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
        check=True,
    )
    assert proc.stdout.splitlines()[-1] == "STATUS 2 TORCH False ANYIO False"
    (line,) = proc.stderr.splitlines()
    assert line.startswith(f"urc fleet: error: argument {flag}: "), line


@pytest.mark.parametrize(
    ("flag", "value", "problem"),
    [
        ("--num-requests", "0", "must be > 0, got 0"),
        ("--num-requests", "x", "not an integer: 'x'"),
        ("--session-concurrency", "0", "must be a finite number > 0, got '0'"),
        ("--session-concurrency", "inf", "must be a finite number > 0, got 'inf'"),
        ("--trace", "missing.jsonl", "missing.jsonl: no such file or directory"),
        ("--json", "no/such/dir/out.json", "directory no/such/dir does not exist"),
    ],
)
def test_a_flag_both_commands_take_is_refused_in_the_same_words(
    flag: str,
    value: str,
    problem: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.chdir(tmp_path)
    lines = []
    for command in ("replay", "fleet"):
        try:
            status = main([command, flag, value])
        except SystemExit as exc:  # argparse's own type errors exit
            status = exc.code
        assert status == 2
        (line,) = capsys.readouterr().err.splitlines()
        lines.append(line)
    assert lines == [
        f"urc {command}: error: argument {flag}: {problem} (see 'urc {command} --help')"
        for command in ("replay", "fleet")
    ]


def test_help_answers_before_torch_and_shows_no_empty_default(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE.format(argv=["fleet", "--help"])],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
        check=True,
    )
    assert proc.stdout.splitlines()[-1] == "STATUS 0 TORCH False ANYIO False"
    assert "(default: None)" not in proc.stdout and "kv-aware" in proc.stdout


def _json_runs(path: Path) -> list[dict[str, object]]:
    doc = json.loads(path.read_text())
    runs: list[dict[str, object]] = doc["runs"]
    return runs


def test_a_small_run_prints_the_table_and_writes_the_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "fleet.json"
    argv = ["fleet", "--replicas", "2", "--num-requests", "40", "--policies", "kv-aware"]
    assert main([*argv, "--device-tokens", "8000", "--json", str(out)]) == 0
    table = capsys.readouterr().out
    assert "| N | policy | hit |" in table and "| 2 | kv-aware |" in table
    runs = _json_runs(out)
    assert [r["label"] for r in runs] == ["bound", "floor", "kv-aware"]
    assert all(r["requests"] == 40 and r["check_errors"] == [] for r in runs)


@requires_conversation_trace
def test_the_conversation_trace_runs_in_model_tokens(tmp_path: Path) -> None:
    out = tmp_path / "fleet.json"
    argv = ["fleet", "--trace", str(conversation_trace()), "--num-requests", "30"]
    argv += ["--replicas", "2", "--policies", "kv-aware", "--no-references"]
    assert main([*argv, "--device-tokens", "256k", "--json", str(out)]) == 0
    (run,) = _json_runs(out)
    assert run["device_tokens"] == 256 * 1024 and run["token_unit"] == 1


@pytest.mark.skipif(not SESSIONS.is_file(), reason=f"{SESSIONS} not found")
def test_agentic_device_tokens_are_model_tokens_divided_into_blocks(tmp_path: Path) -> None:
    out = tmp_path / "fleet.json"
    argv = ["fleet", "--trace", str(SESSIONS), "--subset", "0/64", "--num-requests", "200"]
    argv += ["--replicas", "2", "--policies", "session-affinity", "--no-references"]
    assert main([*argv, "--device-tokens", "1M", "--json", str(out)]) == 0
    (run,) = _json_runs(out)
    assert run["token_unit"] == 64 and run["device_tokens"] == (1 << 20) // 64
