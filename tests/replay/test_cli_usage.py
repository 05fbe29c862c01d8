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
    (["--sweep", "0,2"], "--sweep"),
    (["--kv-events", "garbage"], "--kv-events"),
    (["--kv-events", "tcp://127.0.0.1"], "--kv-events"),
    (["--num-requests", "0"], "--num-requests"),
    (["--json", "{tmp}/sessions"], "--json"),  # a directory, *.json files in it or not
    (["--json", "{tmp}/empty"], "--json"),
    (["--json", "{tmp}/file/x.json"], "--json"),  # a file where a directory should be
    (["--json", "/proc/urc-report.json"], "--json"),  # refused to root as well
    (["--json", "/sys/urc-report.json"], "--json"),
    (["--l3-dir", "/proc"], "--l3-dir"),
    # Flags that would have no effect (the one rule: refused).
    (["--window", "128"], "--window"),
    (["--mamba-states", "8"], "--mamba-states"),
    (["--write-policy", "write_through", "--host-tokens", "0"], "--write-policy"),
    (["--write-policy", "write_through", "--sweep", "0.5"], "--write-policy"),
    (["--l3-backup", "write_through"], "--l3-backup"),
    (["--block-size", "64"], "--block-size"),
    (["--block-size", "64", "--trace", "{tmp}/sessions"], "--block-size"),
    (["--session-concurrency", "5"], "--session-concurrency"),
    (["--session-concurrency", "5", "--trace", "{tmp}/t.jsonl"], "--session-concurrency"),
    (["--seed", "3", "--trace", "{tmp}/t.jsonl"], "--seed"),
]


def _usage_fixture(tmp: Path) -> None:
    """The files and directories USAGE_ERRORS name."""
    (tmp / "file").write_text("")
    (tmp / "t.jsonl").write_text("")
    (tmp / "sessions").mkdir(exist_ok=True)
    (tmp / "sessions" / "s.json").write_text("{}")
    (tmp / "empty").mkdir(exist_ok=True)


def _run_main(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as exc:  # argparse's own errors exit from parse_args
        return int(exc.code or 0)


@pytest.mark.parametrize(("args", "flag"), USAGE_ERRORS, ids=lambda v: " ".join(v))
def test_every_usage_error_is_one_line_naming_the_flag_with_exit_2(
    args: list[str], flag: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _usage_fixture(tmp_path)
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


# (flags, the flag at issue): each is accepted where it has an effect (the counterpart of
# the refusals above).
FLAGS_WITH_AN_EFFECT = [
    (["--window", "128", "--model", "swa"], "--window"),
    (["--mamba-states", "8", "--model", "mamba"], "--mamba-states"),
    (["--write-policy", "write_through"], "--write-policy"),
    (["--write-policy", "write_through", "--sweep", "0.5", "--host-tokens", "0.1"], "--sweep"),
    (["--l3-backup", "write_through", "--l3-dir", "{tmp}/l3"], "--l3-backup"),
    (["--block-size", "64", "--trace", "{tmp}/t.jsonl"], "--block-size"),
    (["--session-concurrency", "5", "--trace", "{tmp}/sessions"], "--session-concurrency"),
    (["--seed", "3"], "--seed"),
    (["--seed", "3", "--trace", "{tmp}/sessions"], "--seed"),
]


@pytest.mark.parametrize(("args", "flag"), FLAGS_WITH_AN_EFFECT, ids=lambda v: " ".join(v))
def test_a_flag_is_accepted_where_it_has_an_effect(
    args: list[str], flag: str, tmp_path: Path
) -> None:
    from urc.apps.replay.arguments import check_replay_args

    _usage_fixture(tmp_path)
    parsed = build_parser().parse_args(["replay", *(a.format(tmp=tmp_path) for a in args)])
    assert check_replay_args(parsed) is None, flag


def test_flags_left_out_take_the_defaults_replay_config_has() -> None:
    from urc.apps.cli import _config

    parsed = build_parser().parse_args(["replay"])
    assert _config(parsed) == ReplayConfig()


def test_kv_events_without_pyzmq_is_a_usage_error(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "zmq", None)  # not importable
    assert _run_main(["replay", "--kv-events", "tcp://127.0.0.1:0"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1
    assert "argument --kv-events: needs pyzmq and msgspec (zmq not installed" in err


# ``python -m urc.apps.replay.agentic_sweep``: (arguments, what the line names).
SWEEP_USAGE_ERRORS = [
    ([], "SESSIONS"),
    (["{tmp}/missing"], "argument SESSIONS"),
    (["{tmp}/empty"], "argument SESSIONS"),
    (["{tmp}/t.jsonl"], "argument SESSIONS"),
    (["{tmp}/sessions", "--capacities", "1X"], "argument --capacities"),
    (["{tmp}/sessions", "--capacities", "0"], "argument --capacities"),
    (["{tmp}/sessions", "--policies", "lru,nope"], "argument --policies"),
    (["{tmp}/sessions", "--subset", "2/2"], "argument --subset"),
    (["{tmp}/sessions", "--concurrency", "0"], "argument --concurrency"),
]


@pytest.mark.parametrize(("args", "names"), SWEEP_USAGE_ERRORS, ids=lambda v: " ".join(v))
def test_agentic_sweep_usage_errors_are_one_line_with_exit_2(
    args: list[str], names: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from urc.apps.replay import agentic_sweep

    _usage_fixture(tmp_path)
    with pytest.raises(SystemExit) as exc:
        agentic_sweep.main([a.format(tmp=tmp_path) for a in args])
    assert exc.value.code == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1, err
    assert err.startswith("python -m urc.apps.replay.agentic_sweep: error: ") and names in err


# Every usage error above, in one fresh interpreter whose ``torch`` cannot be imported: each
# must answer (one line, exit 2) without importing it.
_POISONED = """
import contextlib, io, json, sys
import urc.apps.cli
from urc.apps.replay import agentic_sweep
answers = []
for prog, argv in json.loads(sys.argv[1]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            status = (urc.apps.cli.main if prog == "urc" else agentic_sweep.main)(argv)
        except SystemExit as exc:
            status = exc.code
    answers.append([status, err.getvalue()])
print(json.dumps(answers))
"""


def test_every_usage_error_answers_without_importing_torch(tmp_path: Path) -> None:
    import json as json_

    _usage_fixture(tmp_path)
    poison = tmp_path / "poison"
    poison.mkdir()
    (poison / "torch.py").write_text("raise ImportError('urc imported torch before answering')\n")
    cases = [
        ["urc", ["replay", *(a.format(tmp=tmp_path) for a in args)]] for args, _ in USAGE_ERRORS
    ] + [["sweep", [a.format(tmp=tmp_path) for a in args]] for args, _ in SWEEP_USAGE_ERRORS]
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run(
        [sys.executable, "-c", _POISONED, json_.dumps(cases)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": f"{poison}{os.pathsep}{root}"},
        check=True,
    )
    answers = json_.loads(proc.stdout.splitlines()[-1])
    for (_, argv), (status, err) in zip(cases, answers, strict=True):
        assert status == 2 and len(err.splitlines()) == 1, (argv, status, err)
        assert "imported torch" not in err, argv


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
    from urc.host_protocol import WritePolicy

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


def _sigint_default() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


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
        # A terminal's Ctrl-C reaches a program whose SIGINT is at its default.  A test run
        # started in the background of a script (``pytest &``) ignores SIGINT, its children
        # inherit that, and Python then leaves it ignored (as ``nohup`` intends).
        preexec_fn=_sigint_default,
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


def test_plot_writes_the_curve_as_a_png_with_the_plot_extra(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip(
        "matplotlib", reason='the plot extra is not installed: pip install -e ".[plot]"'
    )
    png = tmp_path / "curve.png"
    argv = ["replay", "--no-progress", "--num-requests", "40", "--sweep", "0.5,1.0", "--plot"]
    assert main([*argv, str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert str(png) in capsys.readouterr().err
