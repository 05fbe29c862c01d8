"""``urc replay``'s first contact: usage errors that name the flag (one line, exit 2, before
torch is imported), help without repeated defaults, checks made before a run, Ctrl-C."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import select
import signal
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path
from time import perf_counter

import pytest

from urc.apps.cli import build_parser, main
from urc.apps.replay import ReplayConfig
from urc.apps.replay.options import (
    EVICTION_POLICY_VALUES,
    L3_BACKUP_VALUES,
    TRACE_BLOCK_SIZE,
    WORKLOAD_VALUES,
    WRITE_POLICY_VALUES,
    OptionError,
)

# (flags, the flag the error must name): argparse's own checks, then the rules of
# urc.apps.replay.options, then what only the command line checks (paths, matplotlib).
USAGE_ERRORS = [
    (["--window", "x"], "--window"),
    (["--device-tokens", "lots"], "--device-tokens"),
    (["--host-tokens", "-1"], "--host-tokens"),
    (["--model", "transformer"], "--model"),
    (["--workload", "nope"], "--workload"),
    (["--concurrency", "0"], "--concurrency"),
    (["--concurrency"], "--concurrency"),
    (["--metrics-port", "70000"], "--metrics-port"),
    (["--num-requests", "-3"], "--num-requests"),
    (["--speed", "fast"], "--speed"),
    (["--trace", "x.jsonl", "--workload", "agent-loop"], "--workload"),
    (["--no-such-flag"], "--no-such-flag"),
    (["--device-tokens", "0"], "--device-tokens"),
    (["--page-size", "16", "--chunk-size", "100"], "--chunk-size"),
    (["--page-size", "3"], "--page-size"),
    (["--speed", "-1"], "--speed"),
    (["--speed", "nan"], "--speed"),
    (["--swa-tokens", "4096"], "--swa-tokens"),
    (["--model", "swa", "--swa-tokens", "0"], "--swa-tokens"),
    (["--model", "mamba", "--l3-dir", "{tmp}/l3"], "--l3-dir"),
    (["--host-tokens", "0", "--l3-dir", "{tmp}/l3"], "--l3-dir"),
    (["--l3-dir", "/proc/no-such-dir"], "--l3-dir"),
    (["--l3-dir", "{tmp}/file"], "--l3-dir"),
    (["--trace", "{tmp}/missing.jsonl"], "--trace"),
    (["--trace", "{tmp}"], "--trace"),
    (["--json", "{tmp}/missing/r.json"], "--json"),
    (["--json", "{tmp}"], "--json"),
    (["--plot", "{tmp}/c.png"], "--plot"),
    (["--sweep", "0.5,x"], "--sweep"),
]


def _run_main(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as exc:  # argparse's own errors exit from parse_args
        return int(exc.code or 0)


@pytest.mark.parametrize(("args", "flag"), USAGE_ERRORS, ids=lambda v: " ".join(v))
def test_every_usage_error_is_one_line_naming_the_flag_with_exit_2(
    args: list[str], flag: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "file").write_text("")
    argv = ["replay", "--no-progress", *(a.format(tmp=tmp_path) for a in args)]
    assert _run_main(argv) == 2
    out, err = capsys.readouterr()
    assert out == ""  # nothing ran
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("urc replay: error: ")
    # The flag as the command line spells it; never a Python field name.
    assert f"argument {flag}" in lines[0] or f"arguments: {flag}" in lines[0], lines[0]
    assert "_" not in lines[0].split("error: ", 1)[1].split(":")[0]


def test_option_errors_name_fields_for_python_callers_and_flags_for_the_cli() -> None:
    with pytest.raises(OptionError) as exc:
        ReplayConfig(page_size=16, chunk_size=100)
    assert exc.value.field == "chunk_size"
    assert str(exc.value) == "chunk_size: must be a positive multiple of page_size (16), got 100"


# What ``urc`` imports before it answers (a fresh interpreter each time).
_PROBE = """
import sys
import urc.apps.cli
try:
    status = urc.apps.cli.main({argv!r})
except SystemExit as exc:
    status = exc.code
print("STATUS", status, "TORCH", "torch" in sys.modules, "ANYIO", "anyio" in sys.modules)
"""


@pytest.mark.parametrize(
    "argv",
    [
        ["replay", "--help"],
        ["replay", "--window", "x"],
        ["replay", "--chunk-size", "100"],
        ["replay", "--trace", "missing.jsonl"],
        ["--version"],
    ],
    ids=" ".join,
)
def test_help_and_usage_errors_answer_before_torch_is_imported(
    argv: list[str], tmp_path: Path
) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE.format(argv=argv)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
        check=True,
    )
    status = "0" if argv[-1] in ("--help", "--version") else "2"
    assert proc.stdout.splitlines()[-1] == f"STATUS {status} TORCH False ANYIO False"


def test_help_states_each_default_once_and_never_none(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["replay", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "(default: None)" not in text and "(default: False)" not in text
    parser = build_parser()
    replay = parser._subparsers._group_actions[0].choices["replay"]  # type: ignore[union-attr]
    formatter = replay._get_formatter()
    for action in replay._actions:
        shown = formatter._expand_help(action) if action.help else ""
        assert shown.count("default") <= 1, (action.option_strings, shown)
    assert "(default: 8192)" in text and "(default: 0)" in text  # --chunk-size, --seed
    assert "linear in its length" in text and "O(length^2)" not in text


def test_parser_choices_are_the_enums_values() -> None:
    from hicache.config import StorageBackupPolicy
    from urc.apps.workloads import DEFAULT_BLOCK_SIZE, WorkloadKind
    from urc.eviction_policy import EvictionPolicy
    from urc.host.protocol import WritePolicy

    assert tuple(p.value for p in EvictionPolicy) == EVICTION_POLICY_VALUES
    assert tuple(p.value for p in WritePolicy) == WRITE_POLICY_VALUES
    assert (
        tuple(p.value for p in StorageBackupPolicy if p is not StorageBackupPolicy.OFF)
        == L3_BACKUP_VALUES
    )
    assert tuple(w.value for w in WorkloadKind) == WORKLOAD_VALUES
    assert TRACE_BLOCK_SIZE == DEFAULT_BLOCK_SIZE


def test_plot_without_matplotlib_fails_before_the_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # not importable
    png = tmp_path / "curve.png"
    argv = ["replay", "--no-progress", "--num-requests", "40", "--sweep", "0.5", "--plot", str(png)]
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and "argument --plot: needs matplotlib" in err
    assert not png.exists()


def test_sweep_turns_the_host_tier_off_unless_asked(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    common = ["replay", "--no-progress", "--num-requests", "60", "--sweep", "0.2"]
    assert main([*common, "--json", str(tmp_path / "a.json")]) == 0
    out = capsys.readouterr().out
    doc = json.loads((tmp_path / "a.json").read_text())
    assert doc["reports"][0]["config"]["host_tokens"] == 0
    assert "no host tier" in out
    assert main([*common, "--host-tokens", "0.25", "--json", str(tmp_path / "b.json")]) == 0
    doc = json.loads((tmp_path / "b.json").read_text())
    assert doc["reports"][0]["config"]["host_tokens"] > 0
    # A single replay keeps its host tier by default.
    assert build_parser().parse_args(["replay"]).host_tokens is None


def test_start_up_is_measured_from_the_command_not_the_process(tmp_path: Path) -> None:
    """``startup_s`` is the time from ``main`` to the start of setup (imports), never the
    age of the process (the pytest process here, or a shell that exec'd ``urc``)."""
    out = tmp_path / "r.json"
    t0 = perf_counter()
    assert main(["replay", "--no-progress", "--num-requests", "20", "--json", str(out)]) == 0
    elapsed = perf_counter() - t0
    startup = json.loads(out.read_text())["timings"]["startup_s"]
    assert 0 <= startup <= elapsed


def _read_until(fd: int, needle: bytes, deadline: float) -> bytes:
    seen = b""
    while needle not in seen:
        left = deadline - time.monotonic()
        assert left > 0, seen[-500:]
        ready, _, _ = select.select([fd], [], [], left)
        if ready:
            try:
                chunk = os.read(fd, 4096)
            except OSError:  # the child closed its end
                break
            seen += chunk
    return seen


def test_ctrl_c_during_setup_exits_promptly_with_status_130(tmp_path: Path) -> None:
    """SIGINT while the first pass reads a million synthetic requests (minutes of setup):
    the progress bar shows the first pass, and the process exits with 130 at once."""
    master, slave = pty.openpty()  # stderr a terminal: the progress bars are on
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # 100 columns
    proc = subprocess.Popen(
        [sys.executable, "-m", "urc.apps.cli", "replay", "--num-requests", "1000000"],
        stdout=subprocess.DEVNULL,
        stderr=slave,
        cwd=Path(__file__).resolve().parents[2],
    )
    os.close(slave)
    try:
        _read_until(master, b"first pass", time.monotonic() + 120)
        proc.send_signal(signal.SIGINT)
        # Setup alone would take minutes; without prompt interrupts this times out.
        proc.wait(timeout=15)
        rest = _read_until(master, b"interrupted", time.monotonic() + 5)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(master)
    assert proc.returncode == 130
    assert b"Traceback" not in rest
